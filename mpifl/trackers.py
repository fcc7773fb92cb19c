"""Experiment trackers (``output.trackers``): TensorBoard, MLflow and Weights & Biases, fed from rank 0's
per-round records, the same ones ``metrics.jsonl`` holds.

Each tracker writes into the run directory and never to the network: TensorBoard event files in
``<run dir>/tensorboard``, an MLflow file store in ``<run dir>/mlruns``, an offline W&B run in
``<run dir>/wandb``. Their libraries are optional (the extras ``tensorboard``, ``mlflow``, ``wandb``)
and imported only when a run names them; ``tracker_problem`` says, before MPI starts, that one is
missing and how to install it. A resumed run appends to the same runs (their ids are kept in
``<run dir>/trackers.json``). A tracker that fails in the middle of a run is closed with a warning: the
run goes on, and ``metrics.jsonl`` has every round. A job killed hard (SIGKILL, a node lost) can leave W&B's
offline log without its last rounds; the resume logs them again from ``metrics.jsonl``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from mpifl.errors import JobFailure
from mpifl.units import range_list

# output.trackers' names, each with the modules that can write it (the first one importable is used).
LIBRARIES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboardX", "tensorboard"),  # tensorboardX, else torch.utils.tensorboard (needs tensorboard)
    "mlflow": ("mlflow",),  # mlflow-skinny or mlflow
    "wandb": ("wandb",),
}
TRACKERS = tuple(LIBRARIES)
IDS = "trackers.json"  # in the run directory: the MLflow and W&B run ids a resume continues
MLFLOW_BATCH = 100  # MLflow takes at most 100 params in one log_batch
MLFLOW_VALUE_CHARS = 6000  # the longest param value MLflow stores
MLFLOW_TAG_CHARS = 8000  # the longest tag value
WANDB_BLOCK = 32768  # W&B's offline log is written in blocks of this many bytes (LevelDB's log format)
WANDB_HEADER = 7  # the file's header (":W&B", a version), and each record fragment's (CRC-32C, length, type)


def tracker_problem(names: Sequence[str]) -> str | None:
    """The first tracker in ``names`` whose library is not installed, said with the install line; or None."""
    for name in names:
        if not any(importlib.util.find_spec(module) for module in LIBRARIES[name]):
            needs = " or ".join(LIBRARIES[name])
            return (f"output.trackers: {name!r} needs the {needs} package, which is not installed here; "
                    f"install it with pip install 'mpifl[{name}]' (or remove {name!r} from output.trackers)")
    return None


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A round's record as flat scalars keyed by path (``eval/accuracy``, ``time/dispatch``, ``ranks/1/clients``,
    ``privacy/epsilon``). The round is the step, not a scalar; text and None are left out; a list counts its
    items (``participants``, ``dropped``), except the memory warnings, keyed by the reading that grew
    (``memory_warning/client_peak_rss_bytes/growth_bytes``): a client rank's RSS and its GPU memory may both warn.
    Per-client values (``federated_eval/accuracy_per_client``) stay in metrics.jsonl: one tag per client ever
    sampled would bury a tracker's dashboard at cross-device scale."""
    out: dict[str, float] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif isinstance(value, Mapping) and not key.endswith("_per_client"):
            for inner, item in value.items():
                walk(item, f"{key}/{inner}")
        elif isinstance(value, (list, tuple)) and key == "memory_warning":
            for warning in value:
                walk({k: v for k, v in warning.items() if k not in ("rank", "signal")}, f"{key}/{warning['signal']}")
        elif isinstance(value, (list, tuple)):
            out[key] = float(len(value))

    for key, value in record.items():
        if key != "round":
            walk(value, key)
    return out


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """The config as hyperparameters: dotted keys (``train.lr``); None, lists and empty mappings as YAML-like text."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        elif isinstance(value, (str, int, float, bool)):
            out[prefix + key] = value
        else:
            out[prefix + key] = json.dumps(value, default=str)
    return out


Notes = Mapping[str, Sequence[str]]  # a round's notes as text lines, by the key a tracker logs them under
NotesOf = Callable[[dict], Notes]  # a record's notes


class Tracker(Protocol):
    """One tracker's run: scalars and notes per round, closed once."""

    def log(self, step: int, values: Mapping[str, float], notes: Notes) -> None:
        """Record one round's scalars, and its notes as text under their own keys, at step ``step``."""

    def close(self, failed: bool) -> None:
        """Finish the run (``failed``: the job is ending on an error)."""


class TensorBoardTracker:
    """Event files in ``<run dir>/tensorboard``; a resume adds a new file there and hides the steps after the
    checkpoint that an interrupted attempt logged (TensorBoard's purge step). Scalars are stored in float32."""

    def __init__(self, logdir: Path, params: Mapping[str, Any], start_round: int, purge_from: int | None = None):
        """``purge_from``: the first step this launch writes, hiding what earlier event files hold from there on
        (default: the round after ``start_round``)."""
        try:
            from tensorboardX import SummaryWriter
            from tensorboardX.summary import hparams
        except ImportError:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        self.logdir = logdir
        # the file is named by the second it opens and the host: a launch within the second of the one before would
        # write over that launch's file, and TensorBoard reads the files in name order, so the suffix keeps launches
        # in order
        self.writer = SummaryWriter(str(logdir), purge_step=start_round + 1 if purge_from is None else purge_from,
                                    filename_suffix=f".{time.time_ns():020d}")
        for summary in hparams(dict(params), {}):  # the HParams dashboard's experiment, session start and end
            self.writer.file_writer.add_summary(summary, start_round)

    def log(self, step: int, values: Mapping[str, float], notes: Notes) -> None:
        """One scalar per key, then each kind of note as text; flushed, so a killed job keeps every finished
        round."""
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        for key, lines in notes.items():
            if lines:
                self.writer.add_text(key, "\n\n".join(lines), step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        """Flush and close the event file."""
        self.writer.close()


class MlflowTracker:
    """An MLflow run in the file store ``<run dir>/mlruns`` (experiment: the config's name; run: the run directory's
    name), its params the flattened config. A resume continues the same run, rewound to the checkpoint's round as
    metrics.jsonl is; a param a resume changed keeps its first value, the new one goes to the tag
    ``resume.r<round>.<key>``. Metrics are stored exactly (float64)."""

    def __init__(self, store: Path, experiment: str, run_name: str, params: Mapping[str, Any], start_round: int,
                 run_id: str | None, keep_through: int | None = None):
        """``keep_through``: the last round of a continued run's metrics kept (default ``start_round``); the
        caller logs the rounds after it again."""
        # mlflow 3 keeps the file store only on request; and it must not phone home from a compute node
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.store = store.resolve()
        self.uri = self.store.as_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        values = {key: str(value)[:MLFLOW_VALUE_CHARS] for key, value in params.items()}
        run = self._kept_run(run_id) if run_id is not None else None
        self.continued = run is not None  # False: a new run, which has none of the rounds before this launch
        if run is not None:
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self._rewind(run.info.experiment_id, start_round if keep_through is None else keep_through)
            before = run.data.params
            for key, value in values.items():
                if key in before and before[key] != value:
                    self.client.set_tag(self.run_id, f"resume.r{start_round}.{key}", value)
            values = {key: value for key, value in values.items() if key not in before}
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name,
                                                 tags={"mpifl.run_dir": str(store.parent.resolve())}).info.run_id
        items = [Param(key, value) for key, value in values.items()]
        for first in range(0, len(items), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=items[first:first + MLFLOW_BATCH])

    def _kept_run(self, run_id: str) -> Any:
        """The run a resume continues, or None when the store no longer has it (then a new run starts)."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id)
        except MlflowException:
            return None

    def _rewind(self, experiment_id: str, last_round: int) -> None:
        """Drop what an interrupted attempt logged after round ``last_round``, the one the run resumes from (MLflow
        has no call for it: its file store keeps each metric as lines 'timestamp value step [dataset digest]')."""
        for path in sorted((self.store / experiment_id / self.run_id / "metrics").rglob("*")):
            if not path.is_file():
                continue
            lines = path.read_text().splitlines()
            kept = [line for line in lines if len(line.split()) < 3 or int(line.split()[2]) <= last_round]
            if len(kept) == len(lines):
                continue
            if not kept:
                path.unlink()
                continue
            partial = self.store.parent / "mlruns-rewind.partial"  # outside the store: never read as a metric
            partial.write_text("".join(line + "\n" for line in kept))
            os.replace(partial, path)

    def log(self, step: int, values: Mapping[str, float], notes: Notes) -> None:
        """The round's scalars as one batch of metrics at ``step``; each kind of note as a tag of its key."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])
        for key, lines in notes.items():
            if lines:
                self.client.set_tag(self.run_id, key, "\n".join(lines)[:MLFLOW_TAG_CHARS])

    def close(self, failed: bool) -> None:
        """Mark the run FINISHED (FAILED when the job is ending on an error)."""
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class WandbTracker:
    """An offline W&B run in ``<run dir>/wandb`` (project: the config's name; name: the run directory's), its
    config the run's: nothing goes to the network and nothing asks for a login; ``wandb sync`` uploads it later.
    A resume opens a new offline run with the same id, and ``wandb sync`` appends it."""

    def __init__(self, run_dir: Path, project: str, config: Mapping[str, Any], run_id: str):
        for var, value in (("WANDB_SILENT", "true"), ("WANDB_DISABLE_GIT", "true"), ("WANDB_DISABLE_CODE", "true"),
                           ("WANDB_ERROR_REPORTING", "false")):
            os.environ.setdefault(var, value)
        import wandb

        self.run_id = run_id
        wait_for_a_fresh_second(run_dir / "wandb", run_id)
        settings = wandb.Settings(mode="offline", silent=True, console="off", disable_git=True, disable_code=True,
                                  save_code=False, disable_job_creation=True, x_disable_stats=True,
                                  x_disable_meta=True, x_disable_machine_info=True, x_save_requirements=False)
        self.run = wandb.init(mode="offline", dir=str(run_dir), project=project, name=run_dir.name, id=run_id,
                              resume="allow", config=dict(config), settings=settings)

    def log(self, step: int, values: Mapping[str, float], notes: Notes) -> None:
        """The round's scalars as one history row at ``step``; each kind of note as text under its key."""
        row: dict[str, Any] = dict(values)
        row.update((key, "\n".join(lines)) for key, lines in notes.items() if lines)
        self.run.log(row, step=step, commit=True)  # committed now: a row with an explicit step is otherwise held
        # until a later step or finish() flushes it, and a CI run once finished without it

    def close(self, failed: bool) -> None:
        """Finish the offline run (exit code 1 when the job is ending on an error), and wait for W&B's service
        to write it out: ``finish`` may return while the service still holds the last rows, and a job script's
        next line (``wandb sync``, or a test reading the file) must find them on disk."""
        import wandb

        exit_code = 1 if failed else 0
        self.run.finish(exit_code=exit_code)
        wandb.teardown(exit_code=exit_code)


def wandb_log_records(path: Path) -> Iterator[Any]:
    """The protobuf records one offline ``.wandb`` file holds on disk, oldest first. The file is W&B's transaction
    log in LevelDB's log format: a 7-byte header, then 32 KiB blocks of record fragments, each with a 7-byte header
    (CRC-32C, length, type: 1 whole, 2 first, 3 middle, 4 last); a block's tail shorter than a header is padding.
    W&B writes whole blocks, so a job killed hard leaves the file cut at a block boundary, or inside a record: the
    reading stops at the last whole record. wandb ships no reader for this file since its Go core replaced the
    Python writer."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B offline log (it does not start with ':W&B')")
    pos, pending = WANDB_HEADER, b""
    while pos + WANDB_HEADER <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < WANDB_HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + WANDB_HEADER])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        end = pos + WANDB_HEADER + length
        if end > len(data) or length > left - WANDB_HEADER:
            return  # cut inside a fragment
        pending += data[pos + WANDB_HEADER:end]
        pos = end
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated protobuf class
            try:
                record.ParseFromString(pending)
            except Exception:  # noqa: BLE001 - protobuf's DecodeError: a damaged record ends what can be read
                return
            pending = b""
            yield record


def wandb_logged_steps(run_dir: Path, run_id: str) -> set[int]:
    """The steps (rounds) of every history row that the offline runs of ``run_id`` in ``<run dir>/wandb`` hold on
    disk, over all the launches so far."""
    steps: set[int] = set()
    for folder in sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}")):
        log_file = folder / f"run-{run_id}.wandb"
        if not log_file.is_file():
            continue
        try:
            for record in wandb_log_records(log_file):
                if record.WhichOneof("record_type") == "history":
                    steps.update(int(json.loads(item.value_json)) for item in record.history.item
                                 if (item.key or "/".join(item.nested_key)) == "_step")  # W&B writes either form
        except ValueError:  # not W&B's log: nothing of this run in it
            continue
    return steps


def replayed(kept: Sequence[dict], start_round: int, continued: bool) -> list[dict]:
    """The kept records (``metrics.jsonl``'s, up to the checkpoint a resume starts from) that a resumed TensorBoard
    or MLflow tracker logs again before its first round: every one for a tracker this run had not written to before
    (added to output.trackers on the resume, or its files gone); else the checkpoint's own round, which a job killed
    between saving the checkpoint and writing the record never logged (it replaces whatever was logged there)."""
    if not continued:
        return list(kept)
    return [record for record in kept if int(record["round"]) == start_round]


def log_records(tracker: Tracker, records: Sequence[dict], notes: NotesOf | None) -> None:
    """Log ``records`` to ``tracker`` as the rounds themselves were."""
    for record in records:
        tracker.log(int(record["round"]), scalars(record), notes(record) if notes else {})


def rounds_to_log_again(kept: Sequence[dict], logged: set[int]) -> list[dict]:
    """The kept records (``metrics.jsonl``'s, up to the checkpoint a resume starts from) that an offline W&B run
    lacks: those after the last round any earlier launch has on disk. Only those: ``wandb sync`` appends a launch's
    rows to the run, and W&B drops a row whose step is below the run's current one."""
    last = max(logged, default=0)
    return [record for record in kept if int(record["round"]) > last]


def wait_for_a_fresh_second(folder: Path, run_id: str) -> None:
    """W&B names an offline run's folder by the local second it starts and the run's id
    (``offline-run-YYYYmmdd_HHMMSS-<id>``): a resume that starts within the second of the launch before it would
    write into that launch's folder, over its rows. Then wait for the next second (at most one)."""
    while (folder / f"offline-run-{time.strftime('%Y%m%d_%H%M%S')}-{run_id}").exists():
        time.sleep(0.05)


class Trackers:
    """The record sink of a run's trackers: each round's ``scalars`` (and ``notes``' text for it) to every
    tracker, at step = the round. A tracker that fails is closed with a warning and the others go on."""

    def __init__(self, trackers: Mapping[str, Tracker], notes: NotesOf | None = None,
                 warn: Callable[[str], None] | None = None):
        self.trackers = dict(trackers)
        self.notes = notes
        self.warn = warn or _stderr

    def write(self, record: dict) -> None:
        """Give one round's record to every tracker still open."""
        step, values = int(record["round"]), scalars(record)
        notes = self.notes(record) if self.notes else {}
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(step, values, notes)
            except Exception as err:  # noqa: BLE001 - a tracker is never worth the run
                self.warn(f"warning: output.trackers: {name} failed at round {step} ({type(err).__name__}: {err}); "
                          "it is closed, the run goes on, and metrics.jsonl has every round")
                self._close(name, failed=True)

    def close(self) -> None:
        """Close every tracker (as failed when an exception is ending the job)."""
        failed = sys.exc_info()[0] is not None
        for name in list(self.trackers):
            self._close(name, failed)

    def _close(self, name: str, failed: bool) -> None:
        tracker = self.trackers.pop(name)
        try:
            tracker.close(failed)
        except Exception as err:  # noqa: BLE001 - closing is the last thing a tracker does
            self.warn(f"warning: output.trackers: closing {name} failed ({type(err).__name__}: {err})")


def open_trackers(names: Sequence[str], run_dir: Path, name: str, config: Mapping[str, Any], start_round: int = 0,  # noqa: PLR0913 - keyword options of one call site
                  resumed: bool = False, notes: NotesOf | None = None,
                  warn: Callable[[str], None] | None = None, kept: Sequence[dict] = ()) -> Trackers:
    """Open each tracker in ``names`` for the run in ``run_dir`` (rank 0, before the first round). ``resumed``:
    continue the MLflow and W&B runs whose ids ``<run dir>/trackers.json`` keeps; else start new ones (and keep
    their ids there). A tracker that cannot start ends the job, naming it, before any round runs. ``notes``: a
    record's notes as text lines by the key they are logged under (``memory_warning``, ``faults``); ``warn``:
    where a tracker's failure is told (default: stderr). ``kept``: on a resume, the records up to its checkpoint
    (``metrics.jsonl``'s), from which W&B gets back the rounds that a job killed hard never wrote to its offline
    log (TensorBoard's and MLflow's files are written round by round)."""
    ids_path = run_dir / IDS
    ids = _read_ids(ids_path) if resumed else {}
    params = flat_params(config)
    opened: dict[str, Tracker] = {}
    for tracker in names:
        try:
            if tracker == "tensorboard":
                logdir = run_dir / "tensorboard"
                earlier = any(logdir.glob("events.out.tfevents.*"))
                replay = replayed(kept, start_round, continued=earlier)
                opened[tracker] = TensorBoardTracker(logdir, params, start_round,
                                                     int(replay[0]["round"]) if replay else None)
                log_records(opened[tracker], replay, notes)
            elif tracker == "mlflow":
                last = replayed(kept, start_round, continued=True)
                mlflow = MlflowTracker(run_dir / "mlruns", name, run_dir.name, params, start_round,
                                       ids.get("mlflow", {}).get("run_id"),
                                       keep_through=int(last[0]["round"]) - 1 if last else None)
                opened[tracker], ids["mlflow"] = mlflow, {"run_id": mlflow.run_id, "tracking_uri": mlflow.uri}
                log_records(mlflow, last if mlflow.continued else list(kept), notes)
            elif tracker == "wandb":
                known = ids.get("wandb", {})  # a resume keeps the run's id and project (the config's name may change)
                run_id, project = known.get("id") or secrets.token_hex(6), known.get("project") or name
                missing = rounds_to_log_again(kept, wandb_logged_steps(run_dir, run_id)) if known else []
                opened[tracker] = WandbTracker(run_dir, project, config, run_id)
                ids["wandb"] = {"id": run_id, "project": project}
                log_records(opened[tracker], missing, notes)
                if missing:
                    rounds = range_list((int(r["round"]) for r in missing), ", ")
                    (warn or _stderr)(f"output.trackers: wandb: round(s) {rounds} were not in the offline log on disk "
                                      "(a job killed hard loses what W&B had not written yet); logged again from "
                                      "metrics.jsonl")
        except Exception as err:  # any library's failure, named, before a round is lost
            Trackers(opened, warn=warn).close()
            problem = tracker_problem([tracker])
            raise JobFailure(problem or f"output.trackers: {tracker} could not start ({type(err).__name__}: "
                             f"{err})") from err
    if ids:
        partial = ids_path.with_suffix(".json.partial")
        partial.write_text(json.dumps(ids, indent=1, sort_keys=True) + "\n")
        os.replace(partial, ids_path)
    return Trackers(opened, notes, warn)


def _stderr(message: str) -> None:
    sys.stderr.write(message + "\n")


def _read_ids(path: Path) -> dict[str, dict[str, str]]:
    """The tracker run ids an earlier attempt kept (none when the file is missing or unreadable)."""
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}
