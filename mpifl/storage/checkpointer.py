"""One owner for a run's checkpoints: names, when to save, saving, resuming, pruning, ``model.h5``.

A run directory holds::

    config.yaml            the resolved config
    metrics.jsonl          one JSON line per finished round (rewound to the checkpoint on resume)
    checkpoints/ckpt-r<round>.h5   the newest ``checkpoint.keep`` checkpoints (format: storage.hdf5)
    checkpoints/ckpt-r<round>.residuals/rank<rank>.h5   with error feedback: each client rank's residuals
                           at that checkpoint (storage.residuals); the checkpoint lists them
    residuals/rank<rank>.h5   with error feedback on disk: each client rank's working residuals
    model.h5               the final checkpoint (a hard link where possible)

The round loop only says "this round ended" (:meth:`Checkpointer.round_ended`) or "this
round was aborted"; the checkpointer decides whether to save, asks the store to publish,
and prunes. Before MPI starts, :func:`find_resume` picks the checkpoint to continue from
and :func:`prepare_run_dir` readies the directory.

With error feedback a checkpoint is two-phase: before publishing round r's model, the
checkpointer has the server ask every client rank to publish its residuals into
``ckpt-r<round>.residuals/`` and waits for each to acknowledge (``persist``); only then is
the model published, naming those files in its attribute ``residual_files``. A checkpoint
whose listed files are missing is incomplete: a resume skips it, loudly.
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

import yaml

from mpifl.config import CheckpointConfig, Config, ConfigError, dump_config, resume_conflict
from mpifl.errors import CheckpointError, JobFailure
from mpifl.logs import env_rank, log
from mpifl.storage.hdf5 import Checkpoint
from mpifl.storage.stores import GlobalStore

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
FINAL_MODEL = "model.h5"
_NAME = re.compile(r"^ckpt-r(\d{6,})\.h5$")
_RESIDUALS = re.compile(r"^ckpt-r(\d{6,})\.residuals$")
Persist = Callable[[int, Path], list[str]]  # (round, folder): the client ranks' residual files, published there


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


def missing_residuals(ckpt: Checkpoint) -> str | None:
    """Why a checkpoint cannot resume a run with error feedback, or None (round 0 has no residuals yet)."""
    files = residual_files(ckpt)
    if files is None:
        return None if ckpt.round == 0 else f"{ckpt.path}: no error-feedback residuals were saved with it"
    missing = [str(p) for p in files if not p.is_file()]
    return f"{ckpt.path}: its error-feedback residuals {missing} are missing" if missing else None


def list_checkpoints(directory: Path) -> list[Path]:
    """Published checkpoints in a directory, oldest round first (``.tmp`` files ignored)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: Path, feedback: bool = False) -> Checkpoint | None:
    """The newest checkpoint that opens and validates (and, with ``feedback``, has its residuals); broken newer
    files are skipped loudly."""
    for path in reversed(list_checkpoints(directory)):
        try:
            ckpt = Checkpoint(path)
        except CheckpointError as err:
            _say(f"mpifl: skipping unusable checkpoint: {err}")
            continue
        problem = missing_residuals(ckpt) if feedback else None
        if problem is None:
            return ckpt
        ckpt.close()
        _say(f"mpifl: skipping incomplete checkpoint: {problem}")
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
    newest = int(_NAME.match(kept[-1].name).group(1)) if kept else -1
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


class Checkpointer:
    """Decides when a round's model is saved, has the store publish it, prunes, links ``model.h5``."""

    def __init__(self, store: GlobalStore, directory: Path | None, cfg: CheckpointConfig, rounds: int, attrs: dict,
                 needed: Callable[[int], set[int]] | None = None, persist: Persist | None = None):
        self.store, self.directory, self.cfg, self.rounds, self.attrs = store, directory, cfg, rounds, attrs
        self.needed = needed  # asynchronous FL: every version is saved; those a resume would retrain from are kept
        self.persist = persist  # error feedback: publishes the client ranks' residuals of a round (phase 1)

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
        kept = list_checkpoints(self.directory)
        doomed = [p for p in kept[:len(kept) - max(self.cfg.keep - 1, 1)] if p.name not in spared]
        for path in doomed:
            try:
                if path.stat().st_nlink == 1:
                    shutil.rmtree(residuals_dir(path), ignore_errors=True)
                    return path
            except OSError:
                continue
        return None

    def round_ended(self, round_: int, history: list[dict], stopping: bool) -> Path | None:
        """The round's model is final: publish it if due (a durable store always publishes)."""
        save = self.due(round_, stopping) and self.directory is not None
        attrs = {**self.attrs, "round": round_}
        try:
            if self.persist is not None and round_ > 0 and (save or self.store.durable):  # phase 1: the residuals
                # (round 0, the initial model, has none yet)
                folder = residuals_dir(self.path(round_))
                shutil.rmtree(folder, ignore_errors=True)  # a crash's leftovers, perhaps from other rank counts
                folder.mkdir(parents=True)
                attrs["residual_files"] = json.dumps(self.persist(round_, folder))
            path = self.store.end_round(round_, attrs, history, save)
        except OSError as err:  # full disk, quota, I/O error: the message names the file
            newest = list_checkpoints(self.directory) if self.directory is not None else []
            kept = f"; the newest complete checkpoint is still {newest[-1]}" if newest else ""
            raise JobFailure(f"round {round_}: {err}{kept}") from None
        if path is not None:
            prune_checkpoints(self.directory, self.cfg.keep, self.needed(round_) if self.needed else ())
        return path

    def round_aborted(self, round_: int, history: list[dict], model_intact: bool = True) -> Path | None:
        """The round is not applied: make sure the model after the previous round is on disk; return where."""
        self.store.abandon_round()
        if self.store.durable:  # every round's model is already a checkpoint
            newest = list_checkpoints(self.directory)
            return newest[-1] if newest else None
        if not model_intact or round_ == 1 or self.directory is None or self.persist is not None:
            if self.persist is not None and model_intact:
                log(f"round {round_} aborted after the clients' error-feedback residuals moved on: the newest "
                    "checkpoint on disk, with its residuals, is the one to resume from", rank=0)
            if not model_intact:
                log(f"round {round_} was partly applied in memory: the newest checkpoint on disk is the model to "
                    "resume from", rank=0)
            newest = list_checkpoints(self.directory) if self.directory is not None else []
            return newest[-1] if newest else None
        if self.path(round_ - 1).exists():  # saved already (checkpoint.every)
            return self.path(round_ - 1)
        path = self.store.end_round(round_ - 1, {**self.attrs, "round": round_ - 1}, history, save=True)
        prune_checkpoints(self.directory, self.cfg.keep)
        log(f"round {round_} aborted; the global model after round {round_ - 1} is saved in {path}", rank=0)
        return path

    def link_final_model(self, run_dir: Path) -> None:
        """``model.h5`` is the final checkpoint (a hard link where possible: no second copy on disk)."""
        final, model_file = self.path(self.rounds), run_dir / FINAL_MODEL
        tmp = model_file.with_name(model_file.name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(final, tmp)
        except OSError:
            shutil.copyfile(final, tmp)
        os.replace(tmp, model_file)


def run_directory(cfg: Config, run_dir_arg: str | None) -> Path:
    """``--run-dir``, else ``output.dir``, else ``runs/<name>-<time>``."""
    return Path(run_dir_arg or cfg.output.dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")


class RunComplete(Exception):
    """The run directory already holds the final round: there is nothing left to do."""


def find_resume(cfg: Config, run_dir_arg: str | None, which: str) -> Path | None:
    """The checkpoint to resume from (``latest`` or a path), checked against the config before any MPI work.

    None means there is nothing to resume (a run killed before its first checkpoint): it starts
    fresh. A run at its last round raises :class:`RunComplete`.
    """
    if which == "latest":
        run_dir = run_dir_arg or cfg.output.dir
        if not run_dir:
            raise ConfigError("--resume without a checkpoint path needs --run-dir (or output.dir) of the run")
        ckpt = latest_checkpoint(Path(run_dir) / CHECKPOINTS, _feedback(cfg))
        if ckpt is None:
            return None
    else:
        ckpt = Checkpoint(which)
        problem = missing_residuals(ckpt) if _feedback(cfg) else None
        if problem:
            ckpt.close()
            raise ConfigError(f"cannot resume: {problem}")
    with ckpt:
        conflict = resume_conflict(yaml.safe_load(ckpt.config) or {}, cfg.to_dict())
        if conflict:
            raise ConfigError(f"cannot resume from {ckpt.path}: {conflict} (only "
                              "rounds, checkpoint.*, output.*, eval.*, transport.*, server.*, timeouts.* may change)")
        if ckpt.round == cfg.rounds:
            raise RunComplete(f"run already complete: {ckpt.path} holds round {ckpt.round} of rounds={cfg.rounds}; "
                              "nothing to do (raise rounds to continue)")
        if ckpt.round > cfg.rounds:
            raise ConfigError(f"{ckpt.path} is already at round {ckpt.round} > rounds={cfg.rounds}; "
                              "raise rounds to continue")
        return ckpt.path


def _feedback(cfg: Config) -> bool:
    """Whether the run's clients keep error-feedback residuals that a checkpoint must carry."""
    return cfg.compression.method == "topk" and cfg.compression.error_feedback


def verified_resume(resume: Path, latest: bool, feedback: bool = False) -> Path | None:
    """``resume`` if its checksums hold; for ``--resume`` (latest), else the newest older one that does, loudly."""
    candidates = [resume]
    if latest:
        candidates += [p for p in reversed(list_checkpoints(resume.parent)) if p.name < resume.name]
    for path in candidates:
        try:
            with Checkpoint(path) as ckpt:
                ckpt.verify()
                problem = missing_residuals(ckpt) if feedback else None
                if problem:
                    raise CheckpointError(problem)
            if path != resume:
                log(f"resuming from {path.name} instead (the newer checkpoints above failed verification)", rank=0)
            return path
        except CheckpointError as err:
            if not latest:
                raise
            log(f"mpifl: unusable checkpoint, falling back to the one before: {err}", rank=0)
    return None


def prepare_run_dir(cfg: Config, run_dir_arg: str | None, resume: Path | None,
                    resume_asked: str | None = None) -> tuple[Path, Path | None]:
    """Ready the run directory (never over another run) and pick the verified checkpoint to resume from.

    Returns (run directory, checkpoint or None for a fresh start). On a fresh start after
    ``--resume``, an earlier ``metrics.jsonl`` is kept aside, never overwritten.
    """
    path = run_directory(cfg, run_dir_arg)
    if resume is not None:
        resume = verified_resume(resume, latest=resume_asked == "latest", feedback=_feedback(cfg))
    if resume is not None:
        rewind_metrics(path / METRICS, resume)
    elif (path / METRICS).exists() and resume_asked:
        aside = path / f"{METRICS}.before-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(path / METRICS, aside)
        log(f"--resume: no usable checkpoint in {path / CHECKPOINTS}: starting fresh (earlier metrics kept "
            f"as {aside.name})", rank=0)
    elif resume_asked:
        log(f"--resume: nothing to resume in {path} yet: starting a new run", rank=0)
    elif (path / METRICS).exists():
        raise RunDirectoryError(f"run directory {str(path)!r} already holds a run ({METRICS}); "
                                "choose another --run-dir, or add --resume to continue it")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(dump_config(cfg))
    return path, resume


def read_metrics(metrics: Path) -> list[dict] | None:
    """The records of a metrics.jsonl, or None when a line is torn or not JSON (a crash mid-write)."""
    records = []
    for number, line in enumerate(metrics.read_text().splitlines() if metrics.exists() else [], 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log(f"{metrics}: line {number} is torn or not JSON; rebuilding the file from the checkpoint's copy",
                rank=0)
            return None
    return records


def rewind_metrics(metrics: Path, resume: Path) -> None:
    """Keep the metrics records up to the checkpoint's round (atomically): no duplicated, missing or torn rounds."""
    with Checkpoint(resume) as ckpt:
        saved, upto = ckpt.metrics(), ckpt.round
    records = read_metrics(metrics)
    kept = [r for r in records or [] if r.get("round", upto + 1) <= upto]
    if records is None or [r["round"] for r in kept] != list(range(1, upto + 1)):
        kept = saved  # the file lost or tore lines: the checkpoint's copy is complete
    metrics.parent.mkdir(parents=True, exist_ok=True)
    tmp = metrics.with_name(metrics.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, metrics)
