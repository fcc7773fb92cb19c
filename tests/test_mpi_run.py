"""Under mpiexec: the quick start learns, writes its outputs, its time split adds up, and each round's exchange
is set against the raw-MPI floor."""
from __future__ import annotations

import json
import subprocess
import sys

import h5py
import pytest
import yaml
from conftest import MPI_TIMEOUT, ROOT, mpiexec, rank_environment, run_mpi


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("qs") / "run"
    result = run_mpi(3, "run", str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(run_dir),
                     timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_quickstart_reaches_accuracy_well_above_chance(quickstart):
    run_dir, result = quickstart
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, 16))
    assert records[-1]["eval"]["accuracy"] > 0.8  # 10 classes: chance is 0.1
    assert "final round 15" in result.stderr and "accuracy" in result.stderr


def test_metrics_lines_hold_the_documented_fields(quickstart):
    run_dir, _ = quickstart
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("round", "participants", "train_loss", "bytes_sent", "bytes_received", "server_rss_bytes", "time"):
        assert key in record, key
    assert len(record["participants"]) == 4 and record["bytes_received"] == 2 * record["bytes_sent"]
    assert set(record["time"]) >= {"dispatch", "client_train", "return", "aggregate", "round"}


def test_time_split_parts_sum_to_the_round(quickstart):
    run_dir, _ = quickstart
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        t = json.loads(line)["time"]
        parts = sum(v for k, v in t.items() if k != "round")
        assert parts == pytest.approx(t["round"], rel=0.05)
        assert all(v >= 0 for v in t.values())


def test_every_round_holds_its_exchange_against_the_floor_timed_before_round_1(quickstart):
    run_dir, result = quickstart
    assert "exchange floor (raw chunked Isend/Irecv" in result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    floors = {r["exchange"]["floor_seconds"] for r in records}
    assert len(floors) == 1 and floors.pop() > 0  # every round moves the same bytes, at the same measured rates
    for record in records:
        t, exchange = record["time"], record["exchange"]
        assert exchange["seconds"] == pytest.approx(t["dispatch"] + t["return"] + t["aggregate"])
        assert exchange["ratio_to_floor"] == pytest.approx(exchange["seconds"] / exchange["floor_seconds"])
        assert exchange["dispatch_ratio_to_floor"] > 0


STALLED_PROBE = """
import time, torch
from mpi4py import MPI
from mpifl.aggregation.floor import measure_floor
from mpifl.planning.pools import FloorProbe
from mpifl.roles.launch import guarded

comm = MPI.COMM_WORLD
probe = FloorProbe(nbytes=1 << 20, itemsize=4, chunk_bytes=1 << 18, client_ranks=comm.Get_size() - 1, inflight=4)

def probe_late_on_rank_2():
    if comm.Get_rank() == 2:
        time.sleep(30)
    measure_floor(comm, probe, torch.float32, limit_seconds=2.0)

guarded(probe_late_on_rank_2)
"""


def test_a_rank_silent_in_the_floor_probe_ends_the_job_named_instead_of_hanging_it(tmp_path):
    script = tmp_path / "stalled.py"
    script.write_text(STALLED_PROBE)
    result = subprocess.run([mpiexec(), "-n", "3", sys.executable, str(script)], capture_output=True, text=True,
                            env=rank_environment(), timeout=MPI_TIMEOUT)
    assert result.returncode != 0
    assert "floor probe before round 1: rank(s) [2] made no progress for 2 s" in result.stderr


def test_no_floor_probe_leaves_the_exchange_out_of_the_records(tmp_path):
    run_dir = tmp_path / "run"
    result = run_mpi(3, "run", str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(run_dir), "rounds=2",
                     "transport.floor_probe_mb=0", timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert "exchange floor" not in result.stderr
    assert all("exchange" not in json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())


def test_resolved_config_and_model_file_are_written(quickstart):
    run_dir, _ = quickstart
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["rounds"] == 15 and cfg["model"]["name"] == "mlp"
    with h5py.File(run_dir / "model.h5") as f:
        assert set(f["model"]) == {"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}
        assert f["model/1.weight"].shape == (128, 64) and f["model/1.weight"].attrs["dtype"] == "float32"
        assert f.attrs["round"] == 15 and "version_torch" in f.attrs


def test_exchange_benchmark_reports_all_three_paths(tmp_path):
    out = tmp_path / "bench.json"
    result = run_mpi(3, "bench", "exchange", "--model-mb", "8", "--chunk-mb", "1", "--rounds", "2",
                     "--json", str(out), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["model_bytes"] == 8 * 2**20 and data["clients"] == 2
    secs = data["seconds_per_round"]
    assert all(secs[k] > 0 for k in ("mpifl", "floor", "pickle"))
    assert data["ratio_to_floor"]["mpifl"] == pytest.approx(secs["mpifl"] / secs["floor"])
    assert len(data["peak_rss_bytes"]["clients"]) == 2
    assert all(p > data["model_bytes"] for p in [data["peak_rss_bytes"]["server"], *data["peak_rss_bytes"]["clients"]])
    assert "mpifl" in result.stdout and "x floor" in result.stdout


def test_the_exchange_benchmark_skips_a_pickle_path_its_node_cannot_hold_and_says_what_it_needs():
    """The pickle path's server keeps every client's model until all have arrived: --model-mb 1000 with 4 clients
    on one node needs about 19 GiB, which ran a 24 GiB machine out of memory; the 100 MiB default needs 1.9."""
    from mpifl.cli.bench import PICKLE_SHARE, pickle_node_bytes

    gib = 2**30
    assert pickle_node_bytes(1000 * 2**20, 4, 4) / gib == pytest.approx(19 * 1000 / 1024)
    assert pickle_node_bytes(1000 * 2**20, 4, 4) > PICKLE_SHARE * 22 * gib
    assert pickle_node_bytes(100 * 2**20, 4, 4) < PICKLE_SHARE * 4 * gib
    assert pickle_node_bytes(1000 * 2**20, 4, 0) / gib == pytest.approx(7 * 1000 / 1024)  # clients on other nodes


def test_federated_evaluation_shards_and_fedprox_under_mpiexec(tmp_path):
    run_dir = tmp_path / "run"
    result = run_mpi(3, "run", str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(run_dir), "rounds=4",
                     "data.partition=shards", "data.classes_per_client=3", "data.val_fraction=0.2",
                     "eval.federated_every=2", "train.prox_mu=0.01", "eval.every=4", timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert "partition 'shards' of 1438 training samples" in result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [("federated_eval" in r) for r in records] == [False, True, False, True]
    fed = records[-1]["federated_eval"]
    assert fed["clients"] == 4 and 0.0 <= fed["accuracy"] <= 1.0 and fed["loss"] > 0
    assert fed["samples"] == pytest.approx(0.2 * 1438 / 2, rel=0.25)  # half the clients, a fifth of their data
    header, *rows = [row.split(",") for row in (run_dir / "partition.csv").read_text().splitlines()]
    assert header[:3] == ["client", "train_samples", "validation_samples"] and len(rows) == 8
    classes = [header.index(f"train_class{k}") for k in range(10)]
    assert [int(row[0]) for row in rows] == list(range(8))
    assert all(sum(int(row[k]) > 0 for k in classes) == 3 for row in rows)  # what each client trains on
    assert all(int(row[1]) == sum(int(row[k]) for k in classes) for row in rows)
    assert sum(int(row[2]) for row in rows) == pytest.approx(0.2 * 1438, rel=0.05)  # held out, not trained on


def test_a_partition_that_cannot_be_made_ends_the_job_in_a_line_and_leaves_the_run_dir_free(tmp_path):
    """A partition file is read only once MPI has started (each rank would have to read the data before it):
    the error ends the job naming the file and the client, with a config error's exit status and no abort, and
    writes no metrics, so that the same --run-dir takes the corrected run."""
    split, run_dir = tmp_path / "split.json", tmp_path / "run"
    split.write_text(json.dumps([list(range(0, 700)), list(range(700, 1437)), [1437, 99999]]))
    args = ("run", str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(run_dir), "rounds=1",
            "clients.num_clients=3", "data.partition=file", f"data.partition_file={split}", "data.alpha=0.5")
    failed = run_mpi(3, *args, timeout=MPI_TIMEOUT)
    assert failed.returncode == 2 and "MPI_Abort" not in failed.stderr
    assert (f"cannot partition the data: data.partition_file '{split}': client 2 has indices outside the 1438 "
            "training samples: 99999") in failed.stderr
    assert not (run_dir / "metrics.jsonl").exists()
    split.write_text(json.dumps([list(range(0, 700)), list(range(700, 1437)), [1437]]))
    again = run_mpi(3, *args, timeout=MPI_TIMEOUT)
    assert again.returncode == 0, again.stderr
    assert [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
