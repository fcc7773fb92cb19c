"""The memory model is the run's own arithmetic: for several configs, the receive pool ``mpifl plan``
predicts (planning.memory) is the pool the server allocates in a real run, to the byte, once a
round has filled every sending rank."""
from __future__ import annotations

import json

import pytest
from conftest import run_mpi, write_config

from mpifl.cli.plan import estimate
from mpifl.config import load_config

BASE = ("rounds: 2\nclients: {num_clients: 4}\ndata: {dataset: synthetic, kwargs: {num_samples: 200}}\n"
        "model: {name: mlp, kwargs: {hidden: [40]}}\ntrain: {local_epochs: 1}\noutput: {progress: false}\n"
        "eval: {every: 0}\ntransport: {chunk_mb: 0.004}\n")


@pytest.mark.parametrize("overrides", [
    (),  # FedAvg: a running sum, window of accumulators
    ("strategy.name=median",),  # one participant per rank: the receive slots hold the stack
    ("clients.groups=2", "clients.per_round=4"),  # groups: fp32 partial sums, two per rank, one after the other
    # out of core: the configured budget, not a quarter model
    ("server.state=disk", "clients.per_round=2", "transport.pool_mb=0.05"),
], ids=["fedavg", "median-held", "groups", "out-of-core"])
def test_the_planned_receive_pool_is_what_the_server_allocates(tmp_path, overrides):
    config = write_config(tmp_path / "plan.yaml", BASE)
    run_dir = tmp_path / "run"
    done = run_mpi(3, "run", str(config), "--run-dir", str(run_dir), *overrides)
    assert done.returncode == 0, done.stderr
    allocated = [json.loads(line)["server_pool_bytes"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    _, planned = estimate(load_config(config, list(overrides)), nranks=3, ranks_per_node=3, server_alone=False)
    # the pool grows to the fullest round and stays: the plan is that round (a sample may fill fewer ranks)
    assert max(allocated) == planned.server_pool_bytes and allocated == sorted(allocated)
