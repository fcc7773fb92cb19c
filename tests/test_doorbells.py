"""Doorbells (mpifl.wire.doorbell): a rank that sends to a rank of its node wakes it at once instead of leaving the
message to its next poll. They change when a rank looks, never what it finds: a run with them equals the run
without them bitwise, and neither leaves anything on disk."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from conftest import MPI_TIMEOUT, mpiexec, run_mpi, write_config
from reference import reference_run
from results import assert_bitwise, final_model

from mpifl.config import load_config

TESTS = Path(__file__).resolve().parent

CONFIG = """
seed: 5
rounds: 3
clients: {num_clients: 9, per_round: 7}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: "fl_helpers:tiny_mlp"}
train: {trainer: "fl_helpers:NoiseTrainer", lr: 0.01}
transport: {chunk_mb: 0.0000067}
eval: {every: 0}
output: {progress: false}
"""


def test_a_rung_rank_wakes_at_once_and_no_pipe_is_left_on_disk():
    done = subprocess.run([mpiexec(), "-n", "3", sys.executable, str(TESTS / "doorbell_ranks.py")],
                          capture_output=True, text=True, timeout=MPI_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": ok, 3 ranks on the node") == 3, done.stdout


def test_runs_with_and_without_doorbells_both_equal_the_reference_bitwise(tmp_path):
    """7-byte chunks, so every update is many messages and every one of them rings; 3 and 5 ranks."""
    cfg_path = write_config(tmp_path / "c.yaml", CONFIG)
    expected = {n: x.view("int32") for n, x in reference_run(load_config(None, data=yaml.safe_load(CONFIG))).items()}
    for ranks, doorbells in ((3, "true"), (5, "true"), (3, "false")):
        run_dir = tmp_path / f"{ranks}-{doorbells}"
        run = run_mpi(ranks, "run", str(cfg_path), "--run-dir", str(run_dir), f"transport.doorbells={doorbells}")
        assert run.returncode == 0, run.stderr
        assert_bitwise({n: x.view("int32") for n, x in final_model(run_dir).items()}, expected)
