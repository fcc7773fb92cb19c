"""When to save a round's model, saving it, pruning, and ``model.h5``: the save policy of a run.

The checkpoint files of a run directory (``storage.rundir`` owns the directory itself, choosing
the checkpoint to resume from and rewinding ``metrics.jsonl``)::

    checkpoints/ckpt-r<round>.h5   the newest ``checkpoint.keep`` checkpoints (format: storage.hdf5)
    checkpoints/ckpt-r<round>.residuals/rank<rank>.h5   with error feedback: each client rank's residuals
                           at that checkpoint (storage.residuals); the checkpoint lists them
    model.h5               the final checkpoint (a hard link where possible)

The round loop only says "this round ended" (``Checkpointer.round_ended``) or "this
round was aborted"; the checkpointer decides whether to save, asks the store to publish,
and prunes.

With error feedback a checkpoint is two-phase: before publishing round r's model, the
checkpointer calls the ``persist`` it was built with, which has every client rank publish its
residuals into ``ckpt-r<round>.residuals/`` and waits for each to acknowledge (roles.residuals);
only then is the model published, naming those files in its attribute ``residual_files``. A
checkpoint whose listed files are missing is incomplete: a resume skips it, loudly.

A client rank silent past ``timeouts.first_update`` in phase 1 ends the job (``StateWithheld``). After the run's
last round the trained model is published all the same, naming the silent ranks in its attribute
``state_withheld``, so that ``model.h5`` and every round are on disk before the job fails: such a checkpoint is
incomplete too, and a longer run never resumes from it (the silent ranks' clients' state is nowhere).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from mpifl.config import CheckpointConfig, Config, ConfigError, dump_config, load_config
from mpifl.errors import CheckpointError, JobFailure
from mpifl.logs import env_rank, log
from mpifl.plugins import is_import_path
from mpifl.storage.hdf5 import Checkpoint
from mpifl.storage.integrity import metadata_problem

if TYPE_CHECKING:  # the store's type alone: it holds torch tensors, and status and inspect need no torch
    from mpifl.storage.stores import GlobalStore

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
FINAL_MODEL = "model.h5"
_NAME = re.compile(r"^ckpt-r(\d{6,})\.h5$")
_RESIDUALS = re.compile(r"^ckpt-r(\d{6,})\.residuals$")
Persist = Callable[[int, Path], list[str]]  # (round, folder): the client ranks' residual files, published there
WITHHELD = "state_withheld"  # the client ranks (JSON list) silent when a checkpoint collected per-client state


class StateWithheld(JobFailure):
    """Client ranks that stayed silent while a checkpoint collected their per-client state (a ``Persist`` raises
    it once every other rank has answered): ``files``, what the others published; ``ranks``, the silent ones."""

    def __init__(self, message: str, files: list[str], ranks: list[int]):
        super().__init__(message)
        self.files, self.ranks = files, ranks


class RunDirectoryError(ValueError):
    """A run directory that cannot be used as asked, with the reason."""


def checkpoint_name(round_: int) -> str:
    """File name of the checkpoint after ``round_``."""
    return f"ckpt-r{round_:06d}.h5"


def residuals_dir(checkpoint: Path) -> Path:
    """The folder of a checkpoint's error-feedback residuals (``model.h5``'s are its checkpoint's)."""
    name = checkpoint.name[:-len(".h5")] + ".residuals"
    if checkpoint.name == FINAL_MODEL:
        with Checkpoint(checkpoint) as ckpt:
            return checkpoint.parent / CHECKPOINTS / (checkpoint_name(ckpt.round)[:-len(".h5")] + ".residuals")
    return checkpoint.with_name(name)


def residual_files(ckpt: Checkpoint) -> list[Path] | None:
    """The residual files a checkpoint lists (None: it was written without error feedback)."""
    listed = ckpt.file.attrs.get("residual_files")
    if listed is None:
        return None
    folder = residuals_dir(ckpt.path)
    return [folder / name for name in json.loads(listed)]


# Plug-ins (``module:attr``) that a config names but that never decide what a run keeps per client: a checkpoint
# read where they cannot be imported (another machine, another environment) still says what its clients kept.
PLUGINS_BESIDE_STATE = (("model", "name"), ("data", "dataset"), ("data", "partition"), ("train", "trainer"))


def without_plugins(raw: dict) -> dict:
    """``raw`` with the plug-ins of ``PLUGINS_BESIDE_STATE`` taken out (their defaults in their place)."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in raw.items()}
    for section, key in PLUGINS_BESIDE_STATE:
        values = out.get(section)
        if isinstance(values, dict) and is_import_path(values.get(key, "")):
            values.pop(key)
            values.pop("kwargs", None)
    return out


def kept_per_client(ckpt: Checkpoint) -> str:
    """What the checkpoint's run kept per logical client, as the logs name it (read from its config, without the
    plug-ins that do not decide it when they cannot be imported here)."""
    try:
        raw = yaml.safe_load(ckpt.config) or {}
    except yaml.YAMLError:
        return "per-client state"
    for attempt in (raw, without_plugins(raw)):
        try:
            state = load_config(None, data=attempt).client_state()
        except ConfigError:  # a plug-in not importable here, or a config this version cannot read
            continue
        if state is None:
            return "per-client state"
        names = [name for name, _ in state.vectors]  # a plug-in trainer's, in its vector's order
        return state.what + (f" ({', '.join(names)})" if names else "")
    return "per-client state (of plug-ins not importable here: put them on PYTHONPATH to have the kinds named)"


def withheld_ranks(ckpt: Checkpoint) -> list[int]:
    """The client ranks whose per-client state the checkpoint lacks, silent when it was collected (none: whole)."""
    listed = ckpt.file.attrs.get(WITHHELD)
    return [int(rank) for rank in json.loads(listed)] if listed else []


def missing_residuals(ckpt: Checkpoint) -> str | None:
    """Why a checkpoint cannot resume a run that keeps per-client state (error-feedback residuals, control
    variates, local tensors, personal models), or None (round 0 has none yet)."""
    silent = withheld_ranks(ckpt)
    if silent:
        ranks = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}"
        return (f"{ckpt.path}: {ranks} stayed silent past timeouts.first_update while it was saved, so it lacks the "
                f"{kept_per_client(ckpt)} of {ranks}'s clients (its model is whole: model.init_from=PATH starts a "
                "new run from it)")
    files = residual_files(ckpt)
    if files is None:
        return None if ckpt.round == 0 else f"{ckpt.path}: no {kept_per_client(ckpt)} were saved with it"
    missing = [str(p) for p in files if not p.is_file()]
    return f"{ckpt.path}: its {kept_per_client(ckpt)} files {missing} are missing" if missing else None


IN_FLIGHT = "in_flight_versions"  # asynchronous FL: the versions (JSON list) the clients in flight trained on


def missing_versions(ckpt: Checkpoint, folder: Path) -> str | None:
    """Why an asynchronous run's checkpoint cannot be resumed from with the checkpoints in ``folder`` (the run's
    ``checkpoints/``): a resume retrains the clients in flight after its step from the versions they trained on
    (attribute ``in_flight_versions``), and some of those are gone. None when all are there, and for a checkpoint
    that records none (synchronous, or written before 2026-12-01: then the job itself names a missing one)."""
    listed = ckpt.file.attrs.get(IN_FLIGHT)
    gone = [v for v in json.loads(listed) if not (folder / checkpoint_name(v)).is_file()] if listed else []
    if not gone:
        return None
    versions = f"version {gone[0]}" if len(gone) == 1 else f"versions {', '.join(map(str, gone))}"
    return (f"{ckpt.path}: clients in flight after step {ckpt.round} trained on {versions}, and a resume retrains "
            f"them from there, but {', '.join(checkpoint_name(v) for v in gone)} "
            f"{'is' if len(gone) == 1 else 'are'} not in {folder}")


def list_checkpoints(directory: Path) -> list[Path]:
    """Published checkpoints in a directory, oldest round first (``.tmp`` files ignored)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def budget_spent(records: list[dict]) -> bool:
    """Whether the last of ``records`` is the round after which ``privacy.epsilon_budget`` is spent (the server
    marks it so, in metrics.jsonl and the checkpoint's copy): the run is complete there."""
    return bool(records and records[-1].get("privacy", {}).get("budget_spent"))


def ends_run(ckpt: Checkpoint, rounds: int | None) -> bool:
    """Whether ``ckpt`` ends a run of ``rounds`` (its last round or later, or the round after which the privacy
    budget is spent): a resume from it trains nothing more, so it needs no per-client state."""
    return rounds is not None and (ckpt.round >= rounds or budget_spent(ckpt.metrics()))


def latest_checkpoint(directory: Path, feedback: bool = False, rounds: int | None = None) -> Checkpoint | None:
    """The newest checkpoint that opens and validates (and, with ``feedback``, has its residuals, unless it ends a
    run of ``rounds``); broken newer files are skipped loudly."""
    for path in reversed(list_checkpoints(directory)):
        try:
            ckpt = Checkpoint(path)
        except CheckpointError as err:
            _say(f"mpifl: skipping unusable checkpoint: {err}")
            continue
        untrusted = metadata_problem(ckpt)
        problem = untrusted or (missing_residuals(ckpt) if feedback and not ends_run(ckpt, rounds) else None)
        if problem is None:
            return ckpt
        ckpt.close()
        _say(f"mpifl: skipping {'unusable' if untrusted else 'incomplete'} checkpoint: {problem}")
    return None


def _say(message: str) -> None:
    if env_rank() in (0, None):  # every rank looks before MPI starts: one says it
        log(message)


def prune_checkpoints(directory: Path, keep: int, needed: Iterable[int] = ()) -> None:
    """Delete all but the newest ``keep`` checkpoints and those of the ``needed`` rounds."""
    spared = {checkpoint_name(r) for r in needed}
    for path in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        if path.name not in spared:
            path.unlink(missing_ok=True)
            shutil.rmtree(residuals_dir(path), ignore_errors=True)
    kept = list_checkpoints(directory)
    newest = -1
    if kept:
        named = _NAME.match(kept[-1].name)
        assert named is not None  # list_checkpoints returns only names that _NAME matches
        newest = int(named.group(1))
    for folder in directory.iterdir() if directory.is_dir() else []:
        found = _RESIDUALS.match(folder.name)  # left by a crash between the two phases, or mid-pruning
        if found and int(found.group(1)) < newest and not folder.with_name(folder.name[:-10] + ".h5").exists():
            shutil.rmtree(folder, ignore_errors=True)


def versions() -> dict[str, str]:
    """Library versions recorded with every checkpoint."""
    import h5py
    import torch
    from mpi4py import MPI

    out = {"torch": str(torch.__version__), "h5py": h5py.__version__,
           "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split())}
    try:
        out["mpifl"] = importlib.metadata.version("mpifl")
    except importlib.metadata.PackageNotFoundError:
        out["mpifl"] = "unknown"
    return out


def checkpoint_attrs(cfg: Config) -> dict:
    """The attributes every checkpoint of this run carries (the round is added per file)."""
    return {"config": dump_config(cfg), "seed": cfg.seed, "strategy": cfg.strategy.name,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **{f"version_{k}": v for k, v in versions().items()}}


def retired_by_next(published: list[Path], keep: int, spared: set[str]) -> list[Path]:
    """Of the ``published`` checkpoints (oldest first), those that publishing one more retires under
    ``checkpoint.keep``: all but the newest ``keep - 1``, and never the newest (the current model), less the
    ``spared`` names. Fewer published than that retires none."""
    survivors = max(keep - 1, 1)
    return [p for p in published[:max(len(published) - survivors, 0)] if p.name not in spared]


class Checkpointer:
    """Decides when a round's model is saved, has the store publish it, prunes, links ``model.h5``."""

    def __init__(self, store: GlobalStore, directory: Path | None, cfg: CheckpointConfig, rounds: int, attrs: dict,
                 needed: Callable[[int], set[int]] | None = None, persist: Persist | None = None,
                 persisted: str = "per-client state"):
        self.store, self.directory, self.cfg, self.rounds, self.attrs = store, directory, cfg, rounds, attrs
        self.needed = needed  # asynchronous FL: every version is saved; those a resume would retrain from are kept
        self.persist = persist  # per-client state: publishes the client ranks' vectors of a round (phase 1)
        self.persisted = persisted  # what those vectors are, as the logs name them ("SCAFFOLD control variates")
        # why the last round's checkpoint lacks some client ranks' state: the job fails with it once wrapped up
        self.withheld: str | None = None

    def path(self, round_: int) -> Path:
        """Where the checkpoint after ``round_`` is published."""
        if self.directory is None:
            raise RunDirectoryError("this run has no run directory to write checkpoints to")
        return self.directory / checkpoint_name(round_)

    def due(self, round_: int, stopping: bool) -> bool:
        """Save after the last round, on SIGTERM, and every ``checkpoint.every`` rounds."""
        every = self.cfg.every
        return round_ == self.rounds or stopping or bool(every and round_ % every == 0) or self.needed is not None

    def recyclable(self, round_: int) -> Path | None:
        """A published checkpoint that publishing ``round_`` would prune, for a durable store to overwrite in
        place: never the newest (the current model), a needed version, or a file linked elsewhere (``model.h5``)."""
        if self.directory is None or not self.store.durable:
            return None
        spared = {checkpoint_name(r) for r in (self.needed(round_) if self.needed else ())}
        for path in retired_by_next(list_checkpoints(self.directory), self.cfg.keep, spared):
            try:
                if path.stat().st_nlink == 1:
                    shutil.rmtree(residuals_dir(path), ignore_errors=True)
                    return path
            except OSError:
                continue
        return None

    def attrs_of(self, round_: int) -> dict:
        """Round ``round_``'s checkpoint attributes: the run's, the round, and with asynchronous FL the versions the
        clients in flight after it trained on, which a resume retrains from (``missing_versions`` checks them
        before MPI starts)."""
        attrs = {**self.attrs, "round": round_}
        if self.needed is not None:
            attrs[IN_FLIGHT] = json.dumps(sorted(self.needed(round_)))
        return attrs

    def round_ended(self, round_: int, history: list[dict], stopping: bool) -> Path | None:
        """The round's model is final: publish it if due (a durable store always publishes)."""
        save = self.due(round_, stopping) and self.directory is not None
        attrs = self.attrs_of(round_)
        try:
            if self.persist is not None and round_ > 0 and (save or self.store.durable):  # phase 1: the residuals
                # (round 0, the initial model, has none yet)
                attrs.update(self._persisted(round_, history))
            path = self.store.end_round(round_, attrs, history, save)
        except OSError as err:  # full disk, quota, I/O error: the message names the file
            newest = list_checkpoints(self.directory) if self.directory is not None else []
            kept = f"; the newest complete checkpoint is still {newest[-1]}" if newest else ""
            raise JobFailure(f"round {round_}: {err}{kept}") from None
        if path is not None:
            # published: either save (which needs a directory) or a durable store, never made without one (runner)
            assert self.directory is not None
            prune_checkpoints(self.directory, self.cfg.keep, self.needed(round_) if self.needed else ())
        return path

    def _persisted(self, round_: int, history: list[dict]) -> dict[str, str]:
        """Phase 1: have the client ranks publish their state of ``round_``; the checkpoint's attributes naming it.
        A rank silent through it ends the job, except after the run's last round: the trained model is worth more
        than the state that only a longer run would need, so it is published without the silent ranks' state,
        marked so (``WITHHELD``), and the job fails once the run is wrapped up (``withheld``)."""
        assert self.persist is not None  # round_ended calls this only with error feedback
        folder = residuals_dir(self.path(round_))
        shutil.rmtree(folder, ignore_errors=True)  # a crash's leftovers, perhaps from other rank counts
        folder.mkdir(parents=True)
        try:
            return {"residual_files": json.dumps(self.persist(round_, folder))}
        except StateWithheld as silent:
            if round_ != self.rounds and not budget_spent(history):
                raise
            ranks = f"rank {silent.ranks[0]}'s" if len(silent.ranks) == 1 else f"ranks {silent.ranks}'"
            self.withheld = (f"{silent}; every round and the trained model are on disk ({self.path(round_)}), "
                             f"without {ranks} per-client state, so a longer run cannot resume from it")
            log(f"{silent}: publishing round {round_}'s model without {ranks} per-client state; the job fails "
                "once the run is wrapped up", rank=0)
            return {"residual_files": json.dumps(silent.files), WITHHELD: json.dumps(silent.ranks)}

    def round_aborted(self, round_: int, history: list[dict], model_intact: bool = True) -> Path | None:
        """The round is not applied: make sure the model after the previous round is on disk; return where."""
        self.store.abandon_round()
        if self.store.durable:  # every round's model is already a checkpoint
            assert self.directory is not None  # the out-of-core store is never made without a run directory (runner)
            newest = list_checkpoints(self.directory)
            return newest[-1] if newest else None
        if not model_intact or round_ == 1 or self.directory is None or self.persist is not None:
            if self.persist is not None and model_intact:
                log(f"round {round_} aborted: the model before it is not saved again, since the per-client state it "
                    f"would be saved with ({self.persisted}) may have moved on in the round; a resume starts from the "
                    "newest checkpoint on disk, which holds its own", rank=0)
            if not model_intact:
                log(f"round {round_} was partly applied in memory: the newest checkpoint on disk is the model to "
                    "resume from", rank=0)
            newest = list_checkpoints(self.directory) if self.directory is not None else []
            return newest[-1] if newest else None
        if self.path(round_ - 1).exists():  # saved already (checkpoint.every)
            return self.path(round_ - 1)
        path = self.store.end_round(round_ - 1, self.attrs_of(round_ - 1), history, save=True)
        prune_checkpoints(self.directory, self.cfg.keep)
        log(f"round {round_} aborted; the global model after round {round_ - 1} is saved in {path}", rank=0)
        return path

    def link_final_model(self, run_dir: Path, round_: int | None = None) -> None:
        """``model.h5`` is the final checkpoint, of round ``round_`` (default: the last, ``rounds``; earlier when a
        spent privacy budget ended the run), as a hard link where possible: no second copy on disk."""
        final, model_file = self.path(self.rounds if round_ is None else round_), run_dir / FINAL_MODEL
        tmp = model_file.with_name(model_file.name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(final, tmp)
        except OSError:
            shutil.copyfile(final, tmp)
        os.replace(tmp, model_file)
