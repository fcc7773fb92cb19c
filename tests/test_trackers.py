"""output.trackers: rank 0 logs every round's record to TensorBoard, MLflow and W&B (offline), the same values
metrics.jsonl holds; a resume appends to the same runs; a tracker that is not installed stops the job before
MPI starts, naming the key and the install line; importing mpifl imports none of their libraries."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import MPI_TIMEOUT, ROOT, run_mpi

from mpifl.cli.preflight import check_plugins
from mpifl.config import ConfigError, load_config
from mpifl.trackers import (
    Trackers,
    flat_params,
    open_trackers,
    scalars,
    tracker_problem,
    wandb_log_records,
)

# --- what a round's record becomes --------------------------------------------------------------------------------

RECORD = {
    "round": 7,
    "participants": [0, 3, 5],
    "dropped": [{"client": 5, "rank": 2, "reason": "NaN"}],
    "train_loss": 0.25,
    "num_samples": 480,
    "bytes_sent": 1000,
    "bytes_received": 2000,
    "server_rss_bytes": 300,
    "server_peak_rss_bytes": 400,
    "client_peak_rss_bytes": 500,
    "client_train_seconds": 1.5,
    "ranks": {"1": {"clients": 2, "train_seconds": 1.0}, "2": {"clients": 1, "train_seconds": 0.5}},
    "time": {"dispatch": 0.1, "client_train": 1.5, "return": 0.2, "aggregate": 0.05, "round": 2.0},
    "eval": {"accuracy": 0.9, "loss": 0.3},
    "federated_eval": {"accuracy": 0.8, "clients": 3, "samples": 60},
    "privacy": {"epsilon": 1.25, "delta": 1e-5, "clip": 1.0},
    "memory_warning": [{"rank": "server", "signal": "server_rss_bytes", "from_round": 1, "to_round": 6,
                        "rises": 5, "growth_bytes": 100, "growth_fraction": 0.5, "per_round_bytes": 20}],
}


def test_a_record_flattens_to_scalars_keyed_by_path_with_the_round_as_step():
    flat = scalars(RECORD)
    assert "round" not in flat  # the step, not a scalar
    assert flat["train_loss"] == 0.25 and flat["num_samples"] == 480.0
    assert flat["eval/accuracy"] == 0.9 and flat["federated_eval/samples"] == 60.0
    assert flat["time/dispatch"] == 0.1 and flat["time/round"] == 2.0
    assert flat["ranks/1/clients"] == 2.0 and flat["ranks/2/train_seconds"] == 0.5
    assert flat["server_peak_rss_bytes"] == 400.0 and flat["client_peak_rss_bytes"] == 500.0
    assert flat["privacy/epsilon"] == 1.25
    assert flat["participants"] == 3.0 and flat["dropped"] == 1.0  # lists count their items
    assert flat["memory_warning/server_rss_bytes/growth_bytes"] == 100.0  # keyed by the reading that grew
    assert not any(k.endswith(("/signal", "/rank")) for k in flat)  # text is left out


def test_a_client_ranks_rss_and_gpu_warnings_in_one_round_both_reach_the_trackers():
    warning = {"rank": "client", "from_round": 1, "to_round": 6, "rises": 5, "growth_fraction": 0.5,
               "per_round_bytes": 20}
    flat = scalars({"round": 6, "memory_warning": [{**warning, "signal": "client_peak_rss_bytes", "growth_bytes": 100},
                                                   {**warning, "signal": "client_peak_device_bytes",
                                                    "growth_bytes": 300}]})
    assert flat["memory_warning/client_peak_rss_bytes/growth_bytes"] == 100.0
    assert flat["memory_warning/client_peak_device_bytes/growth_bytes"] == 300.0
    assert all(isinstance(v, float) for v in flat.values())


def test_a_round_without_a_training_loss_leaves_it_out():
    assert "train_loss" not in scalars({"round": 1, "train_loss": None, "num_samples": 0})


def test_the_config_flattens_to_dotted_hyperparameters():
    params = flat_params({"seed": 0, "train": {"lr": 0.1, "max_grad_norm": None},
                          "model": {"kwargs": {"hidden": [128, 64]}, "trainable": []}, "data": {"kwargs": {}}})
    assert params == {"seed": 0, "train.lr": 0.1, "train.max_grad_norm": "null", "model.kwargs.hidden": "[128, 64]",
                      "model.trainable": "[]", "data.kwargs": "{}"}


# --- the key --------------------------------------------------------------------------------------------------

def test_no_trackers_by_default():
    assert load_config(None).output.trackers == []


@pytest.mark.parametrize("value, message", [
    ("[tensorboard, comet]", "output.trackers: 'comet' is not allowed; choose from 'tensorboard', 'mlflow', 'wandb'"),
    ("[wandb, wandb]", "output.trackers: 'wandb' is listed twice"),
    ("wandb", "output.trackers: expected list"),
])
def test_a_bad_tracker_value_is_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [f"output.trackers={value}"])


def test_a_tracker_without_its_library_is_refused_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec finds nothing
    cfg = load_config(None, ["output.trackers=[wandb]", "rounds=1"])
    with pytest.raises(ConfigError, match=r"output.trackers: 'wandb' needs the wandb package.*"
                                          r"pip install 'mpifl\[wandb\]'"):
        check_plugins(cfg)
    assert tracker_problem(["wandb"]) is not None and tracker_problem([]) is None


def test_importing_mpifl_imports_no_tracker_library():
    code = ("import sys, mpifl, mpifl.config, mpifl.trackers, mpifl.cli; "
            "print(sorted(m for m in ('tensorboardX', 'tensorboard', 'mlflow', 'wandb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


# --- the sink ---------------------------------------------------------------------------------------------------

class Fake:
    def __init__(self, fail: bool = False):
        self.fail, self.logged, self.closed = fail, [], None

    def log(self, step, values, notes):
        if self.fail:
            raise OSError("disk full")
        self.logged.append((step, dict(values), dict(notes)))

    def close(self, failed):
        self.closed = failed


def test_a_tracker_that_fails_is_closed_with_a_warning_and_the_others_go_on():
    good, bad, warnings = Fake(), Fake(fail=True), []
    sink = Trackers({"tensorboard": good, "wandb": bad}, notes=lambda r: {"memory_warning": ["growing"]},
                    warn=warnings.append)
    sink.write(RECORD)
    sink.write({**RECORD, "round": 8})
    sink.close()
    assert [step for step, _, _ in good.logged] == [7, 8] and good.logged[0][2] == {"memory_warning": ["growing"]}
    assert good.closed is False and bad.closed is True  # closed once, as failed, after its first failure
    assert len(warnings) == 1 and "wandb failed at round 7 (OSError: disk full)" in warnings[0]


# --- each library, read back with its own reader ----------------------------------------------------------------

def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag -> {step: value}, as TensorBoard shows it (steps an interrupted attempt logged past a
    resume's checkpoint are purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_hparams(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    out = {}
    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                out[key] = getattr(value, value.WhichOneof("kind"))
    return out


def mlflow_client(run_dir: Path):
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 reads its file store only on request
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    ids = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert ids["tracking_uri"] == (run_dir / "mlruns").resolve().as_uri()
    return MlflowClient(tracking_uri=ids["tracking_uri"]), ids["run_id"]


def wandb_run(run_dir: Path) -> tuple[list[dict], list[dict], list[str]]:
    """An offline run's history rows and config updates, over every offline attempt with the run id kept in
    trackers.json (oldest first), and those attempts' folder names."""
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    folders = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    rows, configs = [], []
    for folder in folders:
        for record in wandb_log_records(folder / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            elif kind in ("run", "config"):  # the config comes with the run record, later changes on their own
                updates = record.run.config.update if kind == "run" else record.config.update
                configs.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in updates})
    return rows, configs, [f.name for f in folders]


def f32(x: float) -> float:
    return float(np.float32(x))


FAULT = "faults[0] 'raise' on logical client 7 (rank 2): an injected exception in round 7; dropped"


def one_record(tmp_path: Path, tracker: str) -> Path:
    """RECORD (round 7, with a memory warning and an injected fault's note) written to one tracker, then closed."""
    pytest.importorskip(tracker)
    sink = open_trackers([tracker], tmp_path, "unit", {"train": {"lr": 0.1}},
                         notes=lambda r: {"memory_warning": [f"warning: {w['rank']} memory grows"
                                                             for w in r.get("memory_warning", ())],
                                          "faults": [FAULT], "empty": []})
    sink.write(RECORD)
    sink.close()
    return tmp_path


def test_tensorboard_reads_back_a_record_in_float32_and_its_warning_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = one_record(tmp_path, "tensorboard")
    assert tensorboard_scalars(run_dir) == {k: {7: f32(v)} for k, v in scalars(RECORD).items()}
    assert tensorboard_hparams(run_dir) == {"train.lr": 0.1}
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    [text] = acc.Tensors("memory_warning/text_summary")
    assert text.step == 7 and text.tensor_proto.string_val == [b"warning: server memory grows"]
    [fault] = acc.Tensors("faults/text_summary")  # each kind of note under its own tag
    assert fault.step == 7 and fault.tensor_proto.string_val == [FAULT.encode()]
    assert sorted(acc.Tags()["tensors"]) == ["faults/text_summary", "memory_warning/text_summary"]


def test_mlflow_reads_back_a_record_exactly_and_its_warning_as_a_tag(tmp_path):
    client, run_id = mlflow_client(one_record(tmp_path, "mlflow"))
    run = client.get_run(run_id)
    assert run.data.metrics == scalars(RECORD) and run.data.params == {"train.lr": "0.1"}
    assert run.data.tags["memory_warning"] == "warning: server memory grows" and run.info.status == "FINISHED"
    assert run.data.tags["faults"] == FAULT and "empty" not in run.data.tags
    assert [m.step for m in client.get_metric_history(run_id, "eval/accuracy")] == [7]


def test_wandb_reads_back_a_record_exactly_and_its_warning_as_text(tmp_path):
    rows, configs, _ = wandb_run(one_record(tmp_path, "wandb"))
    assert len(rows) == 1 and rows[0]["_step"] == 7 and rows[0]["memory_warning"] == "warning: server memory grows"
    assert rows[0]["faults"] == FAULT and "empty" not in rows[0]
    assert {k: v for k, v in rows[0].items() if not k.startswith("_") and k not in ("memory_warning", "faults")} == \
        scalars(RECORD)
    assert configs[0]["train"] == {"lr": 0.1}


def test_without_tensorboardx_torch_writes_the_same_event_files(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if only the tensorboard package were installed
    assert tracker_problem(["tensorboard"]) is None
    sink = open_trackers(["tensorboard"], tmp_path, "unit", {"train": {"lr": 0.1}})
    sink.write(RECORD)
    sink.close()
    assert tensorboard_scalars(tmp_path) == {k: {7: f32(v)} for k, v in scalars(RECORD).items()}
    assert tensorboard_hparams(tmp_path) == {"train.lr": 0.1}


# --- a real run under mpiexec, resumed ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Three rounds with every tracker installed here, then a resume from round 2's checkpoint to round 4: round 3
    runs twice."""
    names = [name for name in ("tensorboard", "mlflow", "wandb") if importlib.util.find_spec(name)]
    if not names:
        pytest.skip("no tracker library installed: pip install 'mpifl[trackers]' tensorboard")
    run_dir = tmp_path_factory.mktemp("trackers") / "run"
    config = str(ROOT / "configs" / "quickstart.yaml")
    overrides = ("name=tracked", "checkpoint.every=1", "eval.every=1", "data.val_fraction=0.2",
                 "eval.federated_every=2", f"output.trackers=[{', '.join(names)}]")
    first = run_mpi(3, "run", config, "--run-dir", str(run_dir), "rounds=3", *overrides, timeout=MPI_TIMEOUT)
    assert first.returncode == 0, first.stderr
    again = run_mpi(3, "run", config, "--run-dir", str(run_dir), "--resume",
                    str(run_dir / "checkpoints" / "ckpt-r000002.h5"), "rounds=4", *overrides, timeout=MPI_TIMEOUT)
    assert again.returncode == 0, again.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    return run_dir, records


def by_key(records: list[dict]) -> dict[str, dict[int, float]]:
    """metrics.jsonl as tag -> {round: value}."""
    out: dict[str, dict[int, float]] = {}
    for record in records:
        for key, value in scalars(record).items():
            out.setdefault(key, {})[record["round"]] = value
    return out


def test_tensorboard_holds_every_round_of_metrics_jsonl_in_float32(tracked):
    pytest.importorskip("tensorboard")
    run_dir, records = tracked
    expected = by_key(records)
    assert tensorboard_scalars(run_dir) == {k: {r: f32(v) for r, v in steps.items()} for k, steps in expected.items()}
    for key in ("train_loss", "eval/accuracy", "federated_eval/accuracy", "num_samples", "bytes_sent",
                "time/dispatch", "time/aggregate", "time/checkpoint", "server_peak_rss_bytes",
                "client_peak_rss_bytes", "ranks/1/train_seconds"):
        assert key in expected, key
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the resume's own file
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    hparams = tensorboard_hparams(run_dir)
    assert hparams["train.lr"] == cfg["train"]["lr"] and hparams["name"] == "tracked"


def test_mlflow_continues_one_run_rewound_to_the_checkpoint_as_metrics_jsonl_is(tracked):
    pytest.importorskip("mlflow")
    run_dir, records = tracked
    client, run_id = mlflow_client(run_dir)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "tracked"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the resume continued it
    assert run.data.params["train.lr"] == "0.1" and run.data.params["rounds"] == "3"  # params keep their first value
    assert run.data.tags["resume.r2.rounds"] == "4"  # what the resume changed
    for key, steps in by_key(records).items():
        history = client.get_metric_history(run_id, key)
        assert {m.step: m.value for m in history} == steps, key  # exact: MLflow keeps float64
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [1, 2, 3, 4]  # round 3 once


def test_wandb_keeps_one_offline_run_id_across_the_resume_with_every_round(tracked):
    pytest.importorskip("wandb")
    run_dir, records = tracked
    rows, configs, folders = wandb_run(run_dir)
    assert len(folders) == 2  # one offline attempt per launch, the same id: `wandb sync` appends them
    assert [row["_step"] for row in rows] == [1, 2, 3, 3, 4]
    last = {row["_step"]: {k: v for k, v in row.items() if not k.startswith("_")} for row in rows}
    assert last == {r["round"]: scalars(r) for r in records}  # exact: the rows are JSON
    assert configs[0]["train"]["lr"] == 0.1 and configs[0]["name"] == "tracked"


def test_a_missing_tracker_library_stops_every_rank_before_mpi_starts(tmp_path, monkeypatch):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None  # as if not installed\n")
    monkeypatch.setenv("PYTHONPATH", str(hide))  # every rank's interpreter runs it first
    run_dir = tmp_path / "run"
    result = run_mpi(3, "run", str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(run_dir),
                     "output.trackers=[wandb]", timeout=MPI_TIMEOUT)
    assert result.returncode == 2, result.stderr
    assert "config error: output.trackers: 'wandb' needs the wandb package" in result.stderr
    assert "pip install 'mpifl[wandb]'" in result.stderr
    assert not run_dir.exists()  # nothing started: no run directory, no round


def test_a_wandb_launch_waits_out_the_second_of_an_earlier_launch_of_the_same_run(tmp_path):
    """W&B names an offline run's folder by the second it starts and the run id: a resume within that second would
    write into the earlier launch's folder (the job pool once resumed a 3-round quick start that fast)."""
    import time

    from mpifl.trackers import wait_for_a_fresh_second

    now = time.strftime("%Y%m%d_%H%M%S")
    (tmp_path / f"offline-run-{now}-abc").mkdir()
    began = time.monotonic()
    wait_for_a_fresh_second(tmp_path, "abc")
    assert time.strftime("%Y%m%d_%H%M%S") != now and time.monotonic() - began < 1.5
    began = time.monotonic()
    wait_for_a_fresh_second(tmp_path, "another-run")  # another run's folder: no wait
    assert time.monotonic() - began < 0.1


# --- W&B after a job killed hard ---------------------------------------------------------------------------------

def rounds_record(r: int) -> dict:
    """RECORD as round ``r``, its training loss a number no other value's text contains."""
    return {**RECORD, "round": r, "train_loss": 1000 + r + 0.0625, "memory_warning": []}


@pytest.mark.parametrize("cut", ["to the header", "inside the log"])
def test_a_resume_logs_again_the_rounds_a_hard_kill_kept_from_the_wandb_log(tmp_path, cut):
    """W&B writes its offline log in 32 KiB blocks: a job killed hard (SIGKILL) leaves the file without the rounds
    still in memory, at worst only its 7-byte header. The resume, from the checkpoint of round 3, logs again from
    metrics.jsonl the rounds after the last one on disk, so that every round is there once."""
    pytest.importorskip("wandb")
    first = open_trackers(["wandb"], tmp_path, "unit", {"train": {"lr": 0.1}})
    for r in (1, 2, 3):
        first.write(rounds_record(r))
    first.close()
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]["id"]
    [log_file] = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    data = log_file.read_bytes()
    if cut == "to the header":
        log_file.write_bytes(data[:7])
    else:  # inside round 2's row: the reader stops at round 1's, the last whole record
        second = data.index(json.dumps(1002.0625).encode())
        log_file.write_bytes(data[:second])
    told: list[str] = []
    kept = [rounds_record(r) for r in (1, 2, 3)]
    again = open_trackers(["wandb"], tmp_path, "unit", {"train": {"lr": 0.1}}, start_round=3, resumed=True,
                          warn=told.append, kept=kept)
    again.write(rounds_record(4))
    again.close()
    rows, _, folders = wandb_run(tmp_path)
    assert len(folders) == 2 and [row["_step"] for row in rows] == [1, 2, 3, 4]
    assert [row["train_loss"] for row in rows] == [1001.0625, 1002.0625, 1003.0625, 1004.0625]
    lost = "1-3" if cut == "to the header" else "2-3"
    assert told == [f"output.trackers: wandb: round(s) {lost} were not in the offline log on disk (a job killed hard "
                    "loses what W&B had not written yet); logged again from metrics.jsonl"]


def test_a_resume_after_a_clean_stop_logs_nothing_again(tmp_path):
    pytest.importorskip("wandb")
    first = open_trackers(["wandb"], tmp_path, "unit", {})
    for r in (1, 2):
        first.write(rounds_record(r))
    first.close()
    told: list[str] = []
    again = open_trackers(["wandb"], tmp_path, "unit", {}, start_round=2, resumed=True, warn=told.append,
                          kept=[rounds_record(1), rounds_record(2)])
    again.close()
    assert told == [] and [row["_step"] for row in wandb_run(tmp_path)[0]] == [1, 2]


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow"])
def test_a_tracker_added_on_a_resume_gets_every_round_before_it(tmp_path, tracker):
    pytest.importorskip(tracker)
    kept = [rounds_record(r) for r in (1, 2, 3)]
    again = open_trackers([tracker], tmp_path, "unit", {}, start_round=3, resumed=True, kept=kept)
    again.write(rounds_record(4))
    again.close()
    assert logged_losses(tmp_path, tracker) == {r: rounds_record(r)["train_loss"] for r in (1, 2, 3, 4)}


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow"])
def test_a_resume_logs_the_checkpoints_round_that_a_kill_before_its_record_lost(tmp_path, tracker):
    """Killed after saving round 2's checkpoint and before logging its record: the resume from round 2 logs it."""
    pytest.importorskip(tracker)
    first = open_trackers([tracker], tmp_path, "unit", {})
    first.write(rounds_record(1))
    first.close()
    again = open_trackers([tracker], tmp_path, "unit", {}, start_round=2, resumed=True,
                          kept=[rounds_record(1), rounds_record(2)])
    again.write(rounds_record(3))
    again.close()
    assert logged_losses(tmp_path, tracker) == {r: rounds_record(r)["train_loss"] for r in (1, 2, 3)}
    if tracker == "mlflow":
        client, run_id = mlflow_client(tmp_path)
        assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [1, 2, 3]  # each round once


def logged_losses(run_dir: Path, tracker: str) -> dict[int, float]:
    """train_loss by round as the tracker's own reader shows it (TensorBoard's in float32)."""
    if tracker == "tensorboard":
        return {step: value for step, value in tensorboard_scalars(run_dir)["train_loss"].items()}
    client, run_id = mlflow_client(run_dir)
    return {m.step: m.value for m in client.get_metric_history(run_id, "train_loss")}


def test_rounds_are_said_as_ranges():
    from mpifl.units import range_list

    assert range_list([5, 1, 2, 3, 7, 8], ", ") == "1-3, 5, 7-8" and range_list([4], ", ") == "4"
