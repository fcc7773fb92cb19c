"""The GPU check (profiling/gpu_check.py, `make gpu-check`) in its CPU form: the same steps as on a GPU node, the
device being a separate replica on the CPU and the group's backend gloo; every step passes and the table has a
row for each (device tests, the quick start against host training, two ranks per client,
the same run bitwise equal on 2 and 3 ranks, batched clients within rounding of one at a time and bitwise equal on
2 and 3 ranks, client updates per second for the MLP and the CNN one at a time and batched; the full form adds
two ranks per client on a CNN with BatchNorm, which tests/test_mpi_ranks_per_client.py covers on the CPU, and
the quick start with reduction groups and with per-client state against host training, which
tests/test_mpi_device.py, tests/test_mpi_ditto.py and others cover in the job pool). The
device tests themselves run in the suite already (tests/test_mpi_device.py), so the check's first step runs only
their in-process one here: that the step runs and reports. Its mpifl jobs run in the suite's job pool; on a GPU
node each is a fresh mpiexec, which one test starts here."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_mpi

sys.path.insert(0, str(ROOT / "profiling"))
import gpu_check

DEVICE_TEST = "tests/test_mpi_device.py::test_the_replica_is_not_aliased_and_resets_from_its_own_global_copy"


def pooled(ranks: int, args, timeout: int) -> tuple[int, str]:
    """The check's jobs in this worker's job pool: the same ranks' code without a fresh interpreter each."""
    done = run_mpi(ranks, *args, timeout=timeout)
    return done.returncode, done.stderr


@pytest.mark.timeout(900)  # about a dozen mpifl jobs in the job pool, and the device test under pytest
def test_the_gpu_checks_cpu_form_runs_every_step_and_passes(tmp_path, capsys):
    out = tmp_path / "rows.json"
    status = gpu_check.main(["--device", "cpu", "--quick", "--tests", DEVICE_TEST, "--json", str(out),
                             "--timeout", "300"], launch=pooled)
    printed = capsys.readouterr()
    assert status == 0, printed.out[-3000:] + printed.err[-3000:]
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == ["device tests", "quick start: replica vs host", "ranks_per_client=2: mlp",
                                         "bitwise across ranks: mlp", "batched clients: mlp", "throughput mlp",
                                         "throughput mlp", "throughput cnn", "throughput cnn"]
    assert all(r["passed"] for r in rows), rows
    assert rows[1]["result"] == "bitwise equal"
    assert rows[3]["result"].startswith("bitwise equal")
    assert "2 and 3 ranks bitwise equal" in rows[4]["result"]
    assert "train.batched_clients=20" in rows[-1]["setting"]  # the CNN's round of 20 clients as one batch
    assert "client updates/s per CPU rank" in rows[-1]["result"] and "peak RSS" in rows[-1]["result"]
    assert "ranks_per_client=2" in printed.out.splitlines()[3]  # one table, a line per step under its header


def test_a_launch_failure_names_the_command_and_its_error(tmp_path):
    check = gpu_check.Check("cpu", 1, 3, Path(sys.executable).parent, tmp_path, 60,
                            launch=lambda ranks, args, timeout: (1, "ConfigError: clients.per_round: 0 < 1"))
    with pytest.raises(RuntimeError, match=r"mpiexec -n 3 mpifl run .* exited 1:\nConfigError: clients.per_round"):
        gpu_check.run_mpifl(check, "bad", 3, ROOT / "configs" / "quickstart.yaml", "clients.per_round=0")


def test_on_a_gpu_node_each_job_is_a_fresh_mpiexec_that_finds_the_benchmarks_plug_ins(tmp_path):
    check = gpu_check.Check("cpu", 1, 3, Path(sys.executable).parent, tmp_path, 120)
    status, stderr = gpu_check.fresh_mpiexec(check)(1, ["validate", str(gpu_check.cnn_config(check))], 120)
    assert status == 0, stderr  # the CNN config's cross_device:leaf_cnn resolves from profiling/


def test_a_step_that_raises_is_a_failed_row_and_the_check_goes_on(tmp_path):
    check = gpu_check.Check("cpu", 1, 3, Path(sys.executable).parent, tmp_path, 60)

    def bitwise_across_ranks(check, model):
        raise RuntimeError(f"mpiexec -n 3 mpifl run exited 1:\nTraceback ...\nJobFailure: rank 2: {model} diverged")

    row = gpu_check.run_step(check, bitwise_across_ranks, "cnn")
    assert row == gpu_check.Row("bitwise across ranks", "cnn", "raised: JobFailure: rank 2: cnn diverged", False)
    assert "FAIL" in gpu_check.table([row])
