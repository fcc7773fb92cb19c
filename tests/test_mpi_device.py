"""Under mpiexec (each launch with a timeout, via test_mpi_strategies.run): the GPU path's copies (a device
replica, reset from a device copy of the global model, one copy back per update or group sum), run on the
CPU with a separate, non-aliased replica; and the server's evaluation copy on its GPU (``eval.device``).

No GPU is available here: these tests run the same code with device "cpu" and train.device_copy,
and check that it changes nothing, bitwise; and what train.deterministic switches on for a GPU rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import run_mpi, write_config
from test_mpi_strategies import CONFIG, assert_bitwise, run

from mpifl.learning.device import CUBLAS_WORKSPACE, DeviceReplica, EvaluationCopy, deterministic_hint
from mpifl.wire.flat import FlatModel

TRAINING = ("train.trainer=torch", "train.optimizer=sgd", "train.momentum=0.9", "train.lr=0.05", "train.local_steps=3")


@pytest.mark.parametrize("overrides", [
    TRAINING,                                                   # every update travels
    (*TRAINING, "clients.groups=2", "strategy.update=delta"),   # deltas formed and group sums folded on the "device"
    (*TRAINING, "strategy.update=delta", "model.dtype=bfloat16"),
], ids=["plain", "groups-delta", "delta-bf16"])
def test_training_on_a_separate_replica_changes_nothing_bitwise(tmp_path, overrides):
    in_place = run(tmp_path, "in-place", 3, *overrides, "train.device=cpu")
    replica = run(tmp_path, "replica", 3, *overrides, "train.device=cpu", "train.device_copy=true")
    assert_bitwise(replica, in_place)


def test_the_replica_is_not_aliased_and_resets_from_its_own_global_copy():
    torch.manual_seed(0)
    host = FlatModel(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)))
    replica = DeviceReplica(host, torch.device("cpu"), trainable_only=False)
    assert replica.flat.buffer.data_ptr() != host.buffer.data_ptr()
    replica.load_global()
    with torch.no_grad():
        next(replica.flat.module.parameters()).add_(1.0)  # "training"
    assert not torch.equal(replica.flat.buffer, host.buffer)
    replica.reset()
    assert torch.equal(replica.flat.buffer, host.buffer)
    with torch.no_grad():
        next(replica.flat.module.parameters()).add_(1.0)
    replica.to_host()
    assert torch.equal(replica.flat.buffer, host.buffer)


def test_the_servers_evaluation_copy_holds_the_global_model_after_each_refresh():
    torch.manual_seed(0)
    host = FlatModel(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)))
    copy = EvaluationCopy(host, torch.device("cpu"), trainable_only=False)
    assert copy.flat.buffer.data_ptr() != host.buffer.data_ptr()
    host.buffer.copy_(torch.randint(0, 255, host.buffer.shape, dtype=host.buffer.dtype))  # a round's new model
    module = copy.refreshed()
    for mine, hosts in zip(module.state_dict().values(), host.module.state_dict().values()):
        assert torch.equal(mine, hosts)


def test_evaluating_on_a_gpu_the_server_rank_lacks_ends_the_job_naming_eval_device(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), "eval.device=cuda", "eval.every=1")
    assert result.returncode == 2 and "MPI_Abort" not in result.stderr  # found before round 1, left by every rank
    assert result.stderr.count("[rank 0] mpifl: eval.device='cuda' but this rank sees no GPU") == 1, result.stderr


def test_training_on_a_gpu_the_client_ranks_lack_ends_the_job_before_round_1_naming_train_device(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), "train.device=cuda")
    assert result.returncode == 2 and "MPI_Abort" not in result.stderr, result.stderr  # left by every rank
    assert result.stderr.count("[rank 0] mpifl: rank 1: train.device='cuda' but this rank sees no GPU") == 1, \
        result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_server_evaluates_on_its_gpu_as_on_the_cpu_up_to_rounding(tmp_path):
    scores = {}
    for device in ("cpu", "cuda"):
        cfg = write_config(tmp_path / "c.yaml", CONFIG)
        run_dir = tmp_path / device
        result = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), f"eval.device={device}", "eval.every=1",
                         "train.device=cpu")
        assert result.returncode == 0, result.stderr[-3000:]
        scores[device] = [json.loads(line)["eval"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert_bitwise(run(tmp_path, "again-cpu", 3, "eval.device=cpu", "train.device=cpu"),
                   run(tmp_path, "again-cuda", 3, "eval.device=cuda", "train.device=cpu"))  # the model: untouched
    for on_cpu, on_gpu in zip(scores["cpu"], scores["cuda"]):
        assert on_gpu["accuracy"] == pytest.approx(on_cpu["accuracy"], abs=0.01)
        assert on_gpu["loss"] == pytest.approx(on_cpu["loss"], rel=1e-3)


def _deterministic_settings(env: dict[str, str]) -> list[str]:
    """What use_deterministic_kernels leaves set, read in a fresh interpreter (the settings are process-wide)."""
    code = ("import os, torch; from mpifl.learning.device import use_deterministic_kernels; "
            "use_deterministic_kernels(); print(torch.are_deterministic_algorithms_enabled(), "
            "torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, "
            "os.environ['CUBLAS_WORKSPACE_CONFIG'])")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_deterministic_kernels_switch_torch_cudnn_and_cublas_to_their_reproducible_modes():
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    assert _deterministic_settings(env) == ["True", "True", "False", CUBLAS_WORKSPACE]
    # a workspace the user chose is kept
    assert _deterministic_settings({**env, "CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == ["True", "True", "False", ":16:8"]


def test_an_operation_without_a_deterministic_kernel_names_the_setting_that_allows_it():
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError) as raised:  # put_ has no deterministic kernel, even on the CPU
            torch.zeros(3).put_(torch.tensor([0, 0]), torch.ones(2))
    finally:
        torch.use_deterministic_algorithms(False)
    assert "train.deterministic: false allows this operation" in deterministic_hint(raised.value)
    assert deterministic_hint(RuntimeError("CUDA out of memory")) == ""
