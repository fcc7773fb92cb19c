"""Under mpiexec (each launch with a timeout, via test_mpi_strategies.run): the GPU path's copies (a device
replica, reset from a device copy of the global model, one copy back per update or group sum), run on the
CPU with a separate, non-aliased replica.

No GPU is available here: these tests run the same code with device "cpu" and train.device_copy,
and check that it changes nothing, bitwise; and what train.deterministic switches on for a GPU rank."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_mpi_strategies import assert_bitwise, run

from mpifl.learning.device import CUBLAS_WORKSPACE, DeviceReplica, deterministic_hint
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
