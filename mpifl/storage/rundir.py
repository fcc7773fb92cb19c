"""One owner for a run directory and for resuming: where a run writes, which checkpoint it continues from,
and the metrics rewound to that checkpoint.

A run directory holds::

    config.yaml            the resolved config
    metrics.jsonl          one JSON line per finished round (rewound to the checkpoint on resume)
    checkpoints/           the checkpoints (storage.checkpointer decides when, and prunes)
    residuals/rank<rank>.h5   with error feedback on disk: each client rank's working residuals
    model.h5               the final checkpoint
    partition.csv, ranks.txt   the partition table and where each rank ran
    tokenizer.json         a text dataset's tokenizer (mpifl export writes it beside the weights)

Before MPI starts, every rank runs ``find_resume`` (which checkpoint, and may it resume this
config?). Then rank 0 alone runs ``prepare_run_dir``, which verifies the checkpoint's
checksums and reads, in that same pass, everything later steps need of it into a small
``ResumePoint``; the roles get that value, not the file, except the store, which reads the
model's tensors once.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from mpifl.config import Config, ConfigError, TransportConfig, dump_config, resumable_keys, resume_conflict
from mpifl.errors import IN_A_NEW_RUN, RESUME_FAILS_THE_SAME_WAY, CheckpointError
from mpifl.logs import log
from mpifl.metrics import json_line, read_records
from mpifl.storage.checkpointer import (
    CHECKPOINTS,
    FINAL_MODEL,
    METRICS,
    RunDirectoryError,
    budget_spent,
    ends_run,
    latest_checkpoint,
    list_checkpoints,
    missing_residuals,
    missing_versions,
    residual_files,
)
from mpifl.storage.hdf5 import Checkpoint, fsync_dir
from mpifl.storage.integrity import metadata_problem
from mpifl.storage.lock import LOCK_FILE, lock_holder, lock_run_dir, release_run_dir
from mpifl.storage.notes import FAULTS_STRUCK, RANK_NOTES, read_rank_notes, struck_records, unwritten_notes


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from, read once: its path, round, metrics history and residual files."""

    path: Path
    round: int
    metrics: list[dict]  # the records of rounds 1..round, as the checkpoint saved them
    residual_files: list[Path] | None  # error feedback: each client rank's residuals at this checkpoint
    # the rounds metrics.jsonl recorded after this checkpoint (the job ended before the next one was written):
    # dropped from the file by ``rewind_metrics``, trained again
    redone: tuple[int, ...] = ()

    @classmethod
    def read(cls, ckpt: Checkpoint) -> ResumePoint:
        """What the rest of the run needs of an open checkpoint."""
        return cls(ckpt.path, ckpt.round, ckpt.metrics(), residual_files(ckpt))


class RunComplete(Exception):
    """The run directory already holds the final round, or the round after which its privacy budget is spent:
    there is nothing left to do."""


BUDGET_SPENT = "privacy.epsilon_budget"  # what ended a complete run early, in rank 0's note (``stopped``)


def budget_line(config: dict, records: list[dict], rounds: int) -> str:
    """'privacy.epsilon_budget B spent after round R of N (epsilon E)', from a run's config and records."""
    budget = ((config or {}).get("privacy") or {}).get("epsilon_budget")
    reached = records[-1]["round"] if records else 0
    epsilon = records[-1].get("privacy", {}).get("epsilon") if records else None
    return (f"{BUDGET_SPENT}{f' {budget:g}' if budget is not None else ''} spent after round {reached} of {rounds}"
            + (f" (epsilon {epsilon:.3f})" if epsilon is not None else ""))


def run_directory(cfg: Config, run_dir_arg: str | None) -> Path:
    """``--run-dir``, else ``output.dir``, else ``runs/<name>-<time>``."""
    return Path(run_dir_arg or cfg.output.dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def keeps_residuals(cfg: Config) -> bool:
    """Whether the run's clients keep per-client state (error-feedback residuals, SCAFFOLD's control variates)
    that a checkpoint must carry."""
    return cfg.client_state() is not None


def find_resume(cfg: Config, run_dir_arg: str | None, which: str) -> Path | None:
    """The checkpoint to resume from (``latest`` or a path), checked against the config before any MPI work.

    None means there is nothing to resume (a run killed before its first checkpoint): it starts
    fresh. A run at its last round raises ``RunComplete``.
    """
    if which == "latest":
        run_dir = run_dir_arg or cfg.output.dir
        if not run_dir:
            raise ConfigError("--resume without a checkpoint path needs --run-dir (or output.dir) of the run")
        ckpt = latest_checkpoint(Path(run_dir) / CHECKPOINTS, keeps_residuals(cfg), cfg.rounds)
        if ckpt is None:
            return None
    else:
        ckpt = Checkpoint(which)
        untrusted = metadata_problem(ckpt)
        state = keeps_residuals(cfg) and not untrusted and not ends_run(ckpt, cfg.rounds)
        problem = untrusted or (missing_residuals(ckpt) if state else None)
        if problem:
            ckpt.close()
            raise ConfigError(f"cannot resume: {problem}")
    with ckpt:
        conflict = resume_conflict(yaml.safe_load(ckpt.config) or {}, cfg.to_dict(), Config().to_dict())
        if conflict:
            raise ConfigError(f"cannot resume from {ckpt.path}: {conflict} (only {resumable_keys()} may change; "
                              f"to change it, start {IN_A_NEW_RUN.removeprefix('in ')})")
        history = ckpt.metrics()
        if budget_spent(history) and ckpt.round < cfg.rounds:  # privacy is not resumable: the budget stays spent
            raise RunComplete(f"run already complete: {budget_line(cfg.to_dict(), history, cfg.rounds)} "
                              f"({ckpt.path}); nothing to run, as the privacy budget is spent")
        if ckpt.round == cfg.rounds:
            raise RunComplete(f"run already complete: {ckpt.path} holds round {ckpt.round} of rounds={cfg.rounds}; "
                              "nothing to do (raise rounds to continue)")
        if ckpt.round > cfg.rounds:
            raise ConfigError(f"{ckpt.path} is already at round {ckpt.round} > rounds={cfg.rounds}; "
                              "raise rounds to continue")
        gone = missing_versions(ckpt, run_directory(cfg, run_dir_arg) / CHECKPOINTS)
        if gone:  # else the job would start, build everything, and fail as it resends them (roles.server)
            raise ConfigError(f"cannot resume: {gone}; {VERSIONS_GONE}")
        return ckpt.path


def resume_warnings(cfg: Config, resume: Path) -> list[str]:
    """What this resume changes that a resume may change, but that changes the result all the same: a compressed
    run's chunk size (quantization blocks and top-k selections restart at chunk boundaries, so the rounds from here
    differ from the uninterrupted run's; every other transport setting leaves the numbers as they are)."""
    if cfg.compression.method == "none":
        return []
    with Checkpoint(resume) as ckpt:
        saved = (yaml.safe_load(ckpt.config) or {}).get("transport") or {}
    try:
        before = TransportConfig(**saved)
    except (TypeError, ValueError, ConfigError):  # a section this version cannot read: nothing to compare
        return []
    if before.chunk_bytes == cfg.transport.chunk_bytes:
        return []
    return [f"transport.chunk_mb: {cfg.transport.chunk_mb:g} ({cfg.transport.chunk_bytes}-byte chunks) where "
            f"{resume.name}'s run had {before.chunk_mb:g} ({before.chunk_bytes}-byte chunks): compression.method "
            f"{cfg.compression.method!r} {CHUNKED_COMPRESSION.get(cfg.compression.method, 'encodes each chunk')}, so "
            "the rounds from here differ from the uninterrupted run's (unless both chunks hold the whole model); "
            f"resume with transport.chunk_mb={before.chunk_mb:g} to keep its result"]


# How each compression method depends on the chunking (docs/explanation/determinism.md: compressed runs).
CHUNKED_COMPRESSION = {"int8": "quantizes each chunk in blocks of its own", "int4": "quantizes each chunk in "
                       "blocks of its own", "topk": "selects the largest elements within each chunk"}


VERSIONS_GONE = ("restore the missing checkpoint files, resume from an older checkpoint that has its versions "
                 "(--resume PATH), or go on from this model in a new run (model.init_from=PATH, another --run-dir)")


def verified_resume(resume: Path, latest: bool, feedback: bool = False) -> ResumePoint | None:
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
                point = ResumePoint.read(ckpt)
            if path != resume:
                log(f"resuming from {path.name} instead (the newer checkpoints above failed verification)", rank=0)
            return point
        except CheckpointError as err:
            if not latest:
                raise
            log(f"mpifl: unusable checkpoint, falling back to the one before: {err}", rank=0)
    return None


def resume_line(run_dir: Path, point: ResumePoint, rounds: int) -> str:
    """What a resumed job's log says first: the run it continues, the checkpoint, and the rounds left. A chain of
    batch jobs is read from its logs, so each must say where it started."""
    left = rounds - point.round
    rest = {0: "no rounds left to train", 1: f"round {rounds} to go"}.get(left, f"rounds {point.round + 1}..{rounds} "
                                                                           "to go")
    line = f"resuming run {run_dir} from {point.path.name} (round {point.round} of {rounds} done; {rest})"
    if point.redone:
        first, last = point.redone[0], point.redone[-1]
        which = f"round {first}" if first == last else f"rounds {first}..{last}"
        line += (f"; {which}, recorded in metrics.jsonl after that checkpoint, dropped from it and trained again")
    return line


def prepare_run_dir(cfg: Config, run_dir_arg: str | None, resume: Path | None,
                    resume_asked: str | None = None) -> tuple[Path, ResumePoint | None]:
    """Ready the run directory (never over another run, nor while another job runs there: its lock,
    mpifl.storage.lock, is this process's from here until ``release_run_dir``) and pick the verified checkpoint to
    resume from.

    Returns (run directory, resume point or None for a fresh start). On a fresh start after
    ``--resume``, an earlier ``metrics.jsonl`` is kept aside, never overwritten. A refusal drops the lock again.
    """
    path = run_directory(cfg, run_dir_arg)
    try:
        return _prepared(cfg, path, resume, resume_asked)
    except BaseException:
        release_run_dir(path)
        raise


def _prepared(cfg: Config, path: Path, resume: Path | None,
              resume_asked: str | None) -> tuple[Path, ResumePoint | None]:
    """``prepare_run_dir``'s work, in ``path``."""
    if path.is_dir():  # before anything in it is read or changed: a job still running there refuses this one
        lock_run_dir(path)
    point = None
    if resume is not None:
        point = verified_resume(resume, latest=resume_asked == "latest", feedback=keeps_residuals(cfg))
    if point is not None:
        point = rewind_metrics(path / METRICS, point)
        log(resume_line(path, point, cfg.rounds), rank=0)
    elif (path / METRICS).exists() and resume_asked:
        if (path / FINAL_MODEL).exists():
            raise RunDirectoryError(finished_without_checkpoint(path, cfg.rounds))
        aside = path / f"{METRICS}.before-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(path / METRICS, aside)
        log(f"--resume: no usable checkpoint in {path / CHECKPOINTS}: starting fresh (earlier metrics kept "
            f"as {aside.name})", rank=0)
    elif resume_asked:
        log(f"--resume: nothing to resume in {path} yet: starting a new run", rank=0)
    elif (path / METRICS).exists():
        raise RunDirectoryError(already_holds_a_run(path))
    if not resume_asked:  # a new run: the faults an earlier attempt here spent strike again
        shutil.rmtree(path / FAULTS_STRUCK, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    lock_run_dir(path)  # a new directory: taken before this job writes into it
    (path / "config.yaml").write_text(dump_config(cfg))
    shutil.rmtree(path / RANK_NOTES, ignore_errors=True)  # an earlier job's notes (perhaps of other ranks)
    return path, point


def already_holds_a_run(path: Path) -> str:
    """Why a new run will not start in ``path``: another run's records are there. One that recorded no round and
    left no checkpoint failed while it started (or is starting now: two jobs in one directory would write over each
    other, so it is still refused); ``--resume`` then starts it over, keeping the empty record aside."""
    if (path / METRICS).stat().st_size == 0 and not list_checkpoints(path / CHECKPOINTS):
        return (f"run directory {str(path)!r} already holds a run that recorded no round ({METRICS} is empty, no "
                "checkpoint): if no job is running there, add --resume to start it over, or choose another "
                "--run-dir")
    return (f"run directory {str(path)!r} already holds a run ({METRICS}); choose another --run-dir, or add "
            "--resume to continue it")


def finished_without_checkpoint(path: Path, rounds: int) -> str:
    """Why ``--resume`` refuses to start over in a run directory that holds a finished run's model but no checkpoint
    a run of ``rounds`` can go on from (one saved without a silent rank's per-client state, or a pruned one):
    starting fresh would replace that model, which is the run's result. Saying so costs the user one command;
    starting over would cost them the run."""
    return (f"--resume: {path} holds a finished run ({FINAL_MODEL}) but no checkpoint that a run of {rounds} rounds "
            f"can go on from (the reasons are above); starting over would replace its {FINAL_MODEL}. Start a new run "
            f"from its model instead (model.init_from={path / FINAL_MODEL} --run-dir NEW), or remove {path} to start "
            "over")


def read_metrics(metrics: Path) -> list[dict] | None:
    """The records of a metrics.jsonl, or None when a line is torn or not JSON (a crash mid-write)."""
    read = read_records(metrics)
    if read.bad_line is not None:
        log(f"{metrics}: line {read.bad_line} is torn or not JSON; rebuilding the file from the checkpoint's copy",
            rank=0)
        return None
    return read.records


def rewind_metrics(metrics: Path, point: ResumePoint) -> ResumePoint:
    """Keep the metrics records up to the checkpoint's round (atomically): no duplicated, missing or torn rounds.
    Returns the point the run goes on from, whose last record's cost is the file's (``with_saved_cost``)."""
    upto = point.round
    records = read_metrics(metrics)
    kept = [r for r in records or [] if r.get("round", upto + 1) <= upto]
    if records is None or [r["round"] for r in kept] != list(range(1, upto + 1)):
        kept = point.metrics  # the file lost or tore lines: the checkpoint's copy is complete
    metrics.parent.mkdir(parents=True, exist_ok=True)
    tmp = metrics.with_name(metrics.name + ".tmp")
    tmp.write_text("".join(json_line(r) + "\n" for r in kept))
    os.replace(tmp, metrics)
    redone = tuple(sorted(r["round"] for r in records or [] if isinstance(r.get("round"), int) and r["round"] > upto))
    return replace(point, metrics=with_saved_cost(point.metrics, kept), redone=redone)


COST_KEYS = ("cost", "cost_to_date")


def with_saved_cost(saved: list[dict], recorded: list[dict]) -> list[dict]:
    """The checkpoint's records (``saved``) with the last one's ``cost`` and ``cost_to_date`` as ``metrics.jsonl``
    recorded that round (``recorded``). Why: the checkpoint copies its round's record before it is written, and the
    JSON line, written after, adds what writing it cost; a resume that carried on from the copy would leave that
    out, and the file's totals would stop adding up at the round it resumed from."""
    if not saved or not recorded or recorded[-1].get("round") != saved[-1].get("round"):
        return saved
    last = {**saved[-1], **{key: recorded[-1][key] for key in COST_KEYS if key in recorded[-1]}}
    return [*saved[:-1], last]


TOKENIZER = "tokenizer.json"  # <run dir>/tokenizer.json: the tokenizer that made a text dataset's token ids


def note_fault_struck(run_dir: Path | None, index: int, round_: int, kind: str = "", client: int = -1,
                      rank: int = -1) -> None:
    """Record, durably and before it ends the job, that ``faults[index]`` (a kill, an exit, or a corruption that
    made the global model non-finite) strikes in ``round_``, of ``kind``, on logical ``client`` trained by ``rank``:
    a resume of this run then goes past it (mpifl.planning.faults.FaultPlan's ``spent``), and a rank's supervisor
    and ``mpifl status`` name it."""
    if run_dir is None:
        return
    folder = run_dir / FAULTS_STRUCK
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f"{index}-r{round_}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps({"kind": kind, "client": client, "rank": rank}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(folder)


def faults_struck(run_dir: Path | None) -> dict[tuple[int, int], tuple[int, int] | None]:
    """(fault index, round) of every strike that ended an earlier attempt of the run (``note_fault_struck``), each
    with the (logical client, rank) it struck then, or None where the record does not say."""
    out: dict[tuple[int, int], tuple[int, int] | None] = {}
    for key, record in struck_records(run_dir).items():
        client, rank = record.get("client", -1), record.get("rank", -1)
        out[key] = (client, rank) if isinstance(client, int) and isinstance(rank, int) and client >= 0 else None
    return out


# how a rank's note begins or reads where the job ended before round 1 on its input, not on a fault or a crash: a
# problem every rank finds alike (roles.launch.SetupError: the data, the config, the rank count), or a client rank's
# own clients' data or split refused as it read them (roles.data)
SETUP_REFUSALS = ("SetupError: ", "cannot read its clients' data: ", "cannot partition the data: ")


def setup_refusal(notes: dict[int, dict]) -> int | None:
    """The first rank whose note says the job ended before round 1 refusing its input (``SETUP_REFUSALS``), if any:
    a resume with the same input would be refused the same way."""
    return next((rank for rank, note in sorted(notes.items()) if note.get("state") == "failed"
                 and note.get("round", 0) == 0 and any(s in note.get("reason", "") for s in SETUP_REFUSALS)), None)


def post_mortem(run_dir: Path) -> tuple[bool, list[str]]:
    """Whether the run in ``run_dir`` is complete, and lines that say how far it got and which ranks did not
    finish, with when each was last heard of: what a job's epilogue prints after a launcher killed it."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    rounds = int((config or {}).get("rounds", 0))
    read = read_records(run_dir / METRICS)
    records, torn = read.records, read.bad_line
    reached = records[-1]["round"] if records else 0
    newest, unusable, refused = newest_checkpoint(run_dir)
    lines = [f"{run_dir}: {reached} of {rounds} rounds recorded"
             + (f" (line {torn} of {METRICS} is torn or not JSON: the rounds before it)" if torn else "")
             + (f"; newest checkpoint {newest.name}" if newest else "; no checkpoint")
             + (f" (unusable, so a resume starts from the one before: {unusable})" if unusable else "")]
    advice = f"a --resume would be refused: {refused}; {VERSIONS_GONE}" if refused else "continue with --resume"
    notes = read_rank_notes(run_dir)
    server = notes.get(0, {})
    if server.get("state") == "failed" and "config error: " in server.get("reason", ""):
        advice = "fix the config first: a --resume with this one fails the same way"
    elif not records and (refusal := setup_refusal(notes)) is not None:
        advice = f"fix what rank {refusal} names first (the data, the config or the launch): a --resume as it " \
            "stands fails the same way"
    elif (again := faults_again(notes)) is not None:
        advice = f"change the config (its faults section{again}) {IN_A_NEW_RUN}: {RESUME_FAILS_THE_SAME_WAY}"
    spent = reached < rounds and (budget_spent(records) or server.get("stopped") == BUDGET_SPENT)
    complete = (reached == rounds or spent) and server.get("state", "finished") == "finished"  # before notes: rounds
    if complete:
        after = f"; the job then failed: {server['then_failed']}" if server.get("then_failed") else ""
        why = f": {budget_line(config or {}, records, rounds)}" if spent else ""
        return True, [*lines, "complete" + why + after]
    unwritten = unwritten_notes(run_dir)
    for rank in sorted({*notes, *unwritten}):
        lines.append(f"  rank {rank}: {_note_line(notes.get(rank), rank in unwritten)}")
    alive = ranks_still_running(run_dir, notes)
    if alive:  # a job still at it: a --resume now would start a second one on the same directory
        pids = ", ".join(f"rank {rank} PID {pid}" for rank, pid in alive)
        lines.append(f"not complete: still running ({pids} alive on this host): wait for the job to end, then ask "
                     "again; do not --resume a run that is running")
        return False, lines
    ended = any(n.get("state") in ("failed", "interrupted") for n in notes.values())
    holder = None if ended else lock_holder(run_dir)
    if holder is not None:  # its rank 0 on another node (mpifl.storage.lock): a --resume would be refused
        lines.append(f"not complete: still running (its job holds {run_dir / LOCK_FILE}: {holder}): wait for the job "
                     "to end, then ask again; a --resume now is refused")
        return False, lines
    if server.get("state") == "interrupted":  # SIGTERM (by hand, or a scheduler's before its walltime): no failure
        lines.append(f"not complete: stopped on request after round {server['round']} (SIGTERM: by hand, or a "
                     f"scheduler's signal before its time limit), as the rounds on disk show; {advice}")
        return False, lines
    unfinished = {r: n for r, n in sorted(notes.items()) if n["state"] != "finished"}
    struck = struck_lines(run_dir, config or {}, reached)
    silent = sorted({*unfinished, *(r for r in unwritten if r not in notes)})
    cause = f"ranks {silent} did not finish; " if silent else ""
    if struck:
        cause += "; ".join(struck)
    elif any(n["state"] == "failed" for n in unfinished.values()) or (unfinished and not unwritten):
        cause += _first_quiet(unfinished)
    elif unwritten:
        cause += _incomplete_notes(unwritten)
    else:
        cause = "every rank finished, but not every round is on disk"
    lines.append(f"not complete: {cause}; {advice}")
    return False, lines


ENDED_STATES = ("finished", "failed", "interrupted")  # a rank's last note once its part of the run is over


TEARDOWN_GRACE_S = 5.0  # how long a job that a rank's failure ends may take to be gone once its launcher returned


def ranks_still_running(run_dir: Path, notes: dict[int, dict]) -> list[tuple[int, int]]:
    """(rank, pid) of the ranks still running on this host whose note does not say their part ended. Where another
    rank's note says it failed, the job is being torn down: a launcher returns once it has signalled the ranks, not
    once they are gone, so a status asked at once (a job's epilogue, a test) waits up to ``TEARDOWN_GRACE_S`` for
    them to go rather than call a dying job running."""
    def alive() -> list[tuple[int, int]]:
        return [(rank, pid) for rank, pid in running_ranks(run_dir)
                if notes.get(rank, {}).get("state") not in ENDED_STATES]
    found, deadline = alive(), time.monotonic() + TEARDOWN_GRACE_S
    while found and any(n.get("state") == "failed" for n in notes.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        found = alive()
    return found


def running_ranks(run_dir: Path) -> list[tuple[int, int]]:
    """(rank, pid) of the run's ranks that still run on this host, by ``ranks.txt`` (where each rank ran): its pid
    alive and running mpifl, so that a pid the system has given another program since is not taken for it. Ranks
    on other hosts cannot be seen from here."""
    table = run_dir / "ranks.txt"  # rank host pid local_rank cores gpu threads
    if not table.is_file():
        return []
    host = socket.gethostname()
    alive = []
    for row in (line.split() for line in table.read_text().splitlines()[1:]):
        if len(row) > 2 and row[0].isdigit() and row[2].isdigit() and row[1] == host and _runs_mpifl(int(row[2])):
            alive.append((int(row[0]), int(row[2])))
    return alive


def _runs_mpifl(pid: int) -> bool:
    """Whether process ``pid`` is alive and its command line names mpifl (Linux's /proc; elsewhere, alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's: not this run's ranks
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        return b"mpifl" in cmdline.read_bytes() if Path("/proc/self").exists() else True
    except OSError:
        return False


def faults_again(notes: dict[int, dict]) -> str | None:
    """Where a rank's failure says the config's faults ended the job and strike again on a resume (the server's
    or a client rank's message, ``RESUME_FAILS_THE_SAME_WAY``): the faults it names, as ``: faults[0]``; else None."""
    reasons = [n.get("reason", "") for _, n in sorted(notes.items()) if n.get("state") == "failed"]
    again = [r for r in reasons if RESUME_FAILS_THE_SAME_WAY in r]
    if not again:
        return None
    named = dict.fromkeys(m for r in again for m in re.findall(r"faults\[\d+\]", r))
    return f": {', '.join(named)}" if named else ""


def newest_checkpoint(run_dir: Path) -> tuple[Path | None, str | None, str | None]:
    """The run's newest checkpoint file; why a resume would skip it (it does not open, or its metadata fail their
    checksum), or None; and why a resume from it would be refused (``find_resume``: versions its clients in flight
    trained on are gone), or None. Cheap: attributes are read, no tensor, so ``mpifl status`` stays quick."""
    published = list_checkpoints(run_dir / CHECKPOINTS)
    if not published:
        return None, None, None
    try:
        with Checkpoint(published[-1]) as ckpt:
            unusable = metadata_problem(ckpt)
            return ckpt.path, unusable, None if unusable else missing_versions(ckpt, run_dir / CHECKPOINTS)
    except CheckpointError as err:
        return published[-1], str(err), None


def _note_line(note: dict | None, unwritten: bool) -> str:
    """One rank's line of ``mpifl status``: when it was last heard of, in which state and round, and why it failed;
    and whether a newer note was lost."""
    lost = "a newer note could not be written" if unwritten else ""
    if note is None:
        return "no note could be written"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(note["time"]))
    reason = f": {note['reason']}" if note.get("reason") else ""
    return (f"last heard of at {when}, state '{note['state']}' in round {note['round']}{reason}"
            + (f" ({lost})" if lost else ""))


def _incomplete_notes(ranks: list[int]) -> str:
    """Why the notes cannot name a cause: ``ranks`` could not write their last (a full disk, most often, which is
    what ended the job), so the job's log, which has the error in one line, is what to read."""
    which = f"rank {ranks[0]} could not write its" if len(ranks) == 1 else f"ranks {ranks} could not write their"
    return (f"{which} last note (a full disk?), so the notes are incomplete: the job's log says what ended it, "
            "in the line 'failed, aborting the job'")


def struck_lines(run_dir: Path, config: dict, reached: int) -> list[str]:
    """The config's faults that ended an attempt after round ``reached`` (``faults-struck``), each as what ended it:
    the launcher's own message names only a PID, and the rank notes of a killed rank say nothing."""
    faults = config.get("faults") or []
    out = []
    for index, round_ in sorted(faults_struck(run_dir)):
        if round_ <= reached:
            continue  # an earlier attempt's, which a resume went past
        kind = faults[index].get("kind", "?") if index < len(faults) and isinstance(faults[index], dict) else "?"
        out.append(f"faults[{index}] ({kind!r}, asked for in config.yaml) ended the job in round {round_} "
                   f"({FAULTS_STRUCK}/{index}-r{round_}); a resume goes past it")
    return out


def _first_quiet(unfinished: dict[int, dict]) -> str:
    """Which rank went quiet first, when the notes can tell (a rank killed by a signal, or one that failed, says
    why; otherwise one rank behind the others by a round, or by more than 2 s); else that they stopped together."""
    # a rank killed by a signal (noted by its supervisor) first: the others' failures often follow from its death
    failed = sorted((r for r, n in unfinished.items() if n["state"] == "failed"),
                    key=lambda r: not unfinished[r].get("signal"))
    if failed:
        killed = unfinished[failed[0]].get("signal")
        return f"rank {failed[0]} " + (f"was killed by {killed} (reason above)" if killed else "failed (reason above)")
    earliest = min(unfinished, key=lambda r: (unfinished[r]["round"], unfinished[r]["time"]))
    first, others = unfinished[earliest], [n for r, n in unfinished.items() if r != earliest]
    if others and all(first["round"] < n["round"] or first["time"] < n["time"] - 2.0 for n in others):
        return f"rank {earliest} went quiet first (its host and pid are in ranks.txt)"
    return ("they stopped together, so the launcher ended the job: its log, or the ranks' own output, names the "
            "first to fail")
