"""train.reuse_freed_memory: a client rank's glibc malloc keeps what a training step frees for the next step, so a
client's training page-faults in no fresh memory, and nothing about the results changes."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest
from conftest import MPI_TIMEOUT, run_mpi, write_config
from results import assert_bitwise, final_model

from mpifl.wire import memory

# Train clients of a model whose largest gradient (48 MiB) is above glibc's largest mmap threshold (32 MiB), so that
# glibc maps it afresh at every step unless freed memory is reused; print the median minor page faults per client
# after the first two (a busy machine now and then adds a burst to one client: the median is the steady state).
CLIENT_FAULTS = """
import json, resource, statistics, sys
import torch
from torch import nn
from mpifl.config import TrainConfig
from mpifl.learning.datasets import ClientData
from mpifl.learning.trainers import TorchTrainer
from mpifl.wire.memory import reuse_freed_memory
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(784, 16384), nn.ReLU(), nn.Linear(16384, 10))
trainer = TorchTrainer(TrainConfig(optimizer="sgd", lr=0.05, batch_size=5, local_epochs=1))
applied = reuse_freed_memory() if sys.argv[1] == "reuse" else None
faults = []
for client in range(7):
    data = ClientData(torch.randn(10, 1, 28, 28), torch.randint(0, 10, (10,)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    trainer.train(model, data, client)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": statistics.median(faults[2:]), "each": faults}))
"""


def client_faults(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CLIENT_FAULTS, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_clients_training_page_faults_in_no_fresh_memory_once_freed_memory_is_reused():
    """Medians over clients 3-7 of each process."""
    returned, reused = client_faults("return"), client_faults("reuse")
    if not reused["applied"]:
        pytest.skip("no glibc mallopt here: the setting is a no-op")
    # two steps of a 16,384-wide layer: its 48 MiB gradient alone is 12,288 pages of 4 KiB each time it is mapped
    # afresh (fewer where the kernel backs it with huge pages)
    assert reused["faults"] < max(1, returned["faults"] // 10), (returned, reused)


def test_where_the_c_library_has_no_mallopt_it_changes_nothing_and_says_so(monkeypatch):
    def no_c_library(name):
        raise OSError("not glibc")
    monkeypatch.setattr(ctypes, "CDLL", no_c_library)
    assert memory.reuse_freed_memory() is False


CONFIG = """
seed: 3
rounds: 2
clients: {num_clients: 6, per_round: 5, groups: 2}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [64]}}
train: {lr: 0.05, momentum: 0.5, batch_size: 16, local_epochs: 1, device: cpu}
eval: {every: 0}
output: {progress: false}
"""


def test_a_run_that_reuses_freed_memory_ends_bitwise_where_one_that_returns_it_does(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    # the setting stays with the process once applied: the run that returns freed memory is a job of its own, while
    # the one that reuses it may run in the suite's job pool, whose ranks' default (true) already applies it
    for reuse in ("true", "false"):
        result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / reuse), f"train.reuse_freed_memory={reuse}",
                         timeout=MPI_TIMEOUT, fresh=reuse == "false")
        assert result.returncode == 0, result.stderr[-3000:]
    assert_bitwise(final_model(tmp_path / "true"), final_model(tmp_path / "false"))
