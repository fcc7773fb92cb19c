"""Under mpiexec (each launch with a timeout, via test_mpi_strategies.run): the GPU path's copies (a device
replica, reset from a device copy of the global model, one copy back per update or group sum), run on the
CPU with a separate, non-aliased replica.

No GPU is available here: these tests run the same code with device "cpu" and train.device_copy,
and check that it changes nothing, bitwise."""
from __future__ import annotations

import pytest
import torch
from test_mpi_strategies import assert_bitwise, run

from mpifl.learning.device import DeviceReplica
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
