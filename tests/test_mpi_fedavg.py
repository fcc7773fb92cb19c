"""Under mpiexec: the streamed FedAvg equals a plain whole-model numpy reference, bitwise."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MPI_TIMEOUT, run_mpi, write_config
from reference import fp32_to_bf16_bits, reference_run
from results import recorded

from mpifl.config import load_config
from mpifl.storage.hdf5 import load_tensors

CONFIG = """
seed: 3
rounds: 3
clients: {{num_clients: 8, per_round: 6}}
data: {{dataset: digits, partition: dirichlet, alpha: 0.5}}
model: {{name: "fl_helpers:tiny_mlp", dtype: {dtype}}}
train: {{trainer: "fl_helpers:NoiseTrainer", lr: 0.01}}
strategy: {{weighting: {weighting}}}
transport: {{chunk_mb: {chunk_mb}}}
eval: {{every: 0}}
output: {{progress: false}}
"""


def bits(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Raw bit patterns of fp32 arrays, as the model dtype stores them."""
    return {n: fp32_to_bf16_bits(x).view(np.int16) if dtype == "bfloat16" else x.view(np.int32)
            for n, x in tensors.items()}


def run_bits(tmp_path, ranks: int, name: str, **params) -> dict[str, np.ndarray]:
    cfg_path = write_config(tmp_path / f"{name}.yaml", CONFIG.format(**params))
    run = run_mpi(ranks, "run", str(cfg_path), "--run-dir", str(tmp_path / name), timeout=MPI_TIMEOUT)
    assert run.returncode == 0, run.stderr
    tensors = load_tensors(tmp_path / name / "model.h5")
    return {n: t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy() for n, t in tensors.items()}


@pytest.mark.parametrize("ranks,dtype,chunk_bytes,weighting", [
    (2, "float32", 3, "samples"),      # 1 client rank hosting all 8 clients; 1-element chunks
    (3, "bfloat16", 10, "samples"),    # bf16 travels as raw bytes; chunks of 5 elements
    (6, "float32", 1000, "equal"),     # 5 client ranks, chunk size dividing nothing
    (3, "float32", 16 * 2**20, "samples"),  # one chunk per segment
])
def test_streamed_fedavg_equals_whole_model_reference_bitwise(tmp_path, ranks, dtype, chunk_bytes, weighting):
    params = dict(dtype=dtype, chunk_mb=chunk_bytes / 2**20, weighting=weighting)
    got = run_bits(tmp_path, ranks, "run", **params)
    cfg = load_config(None, data=__import__("yaml").safe_load(CONFIG.format(**params)))
    expected = bits(reference_run(cfg), dtype)
    assert got.keys() == expected.keys()
    for name in expected:
        assert np.array_equal(got[name], expected[name]), f"{name} differs from the reference"


def test_same_config_twice_gives_identical_models_on_any_rank_count(tmp_path):
    """Two jobs of the same config, one on 2 client ranks and one on 4, end bitwise equal. Nothing in a job could
    make it differ from itself run again and still match a job that places its clients on other ranks."""
    params = dict(dtype="float32", chunk_mb=64 / 2**20, weighting="samples")
    first = run_bits(tmp_path, 3, "a", **params)
    second = run_bits(tmp_path, 5, "b", **params)
    for name in first:
        assert np.array_equal(first[name], second[name]), name


@pytest.mark.parametrize("ranks", [3, 5, 9])
def test_a_broadcast_tree_dispatch_gives_the_reference_model_and_the_server_sends_fanout_copies(tmp_path, ranks):
    params = dict(dtype="float32", chunk_mb=100 / 2**20, weighting="samples")
    cfg_path = write_config(tmp_path / "tree.yaml", CONFIG.format(**params))
    run = run_mpi(ranks, "run", str(cfg_path), "--run-dir", str(tmp_path / "tree"), "transport.dispatch_fanout=2",
                  timeout=MPI_TIMEOUT)
    assert run.returncode == 0, run.stderr
    got = {n: t.view(torch.int32).numpy() for n, t in load_tensors(tmp_path / "tree" / "model.h5").items()}
    expected = bits(reference_run(load_config(None, data=__import__("yaml").safe_load(CONFIG.format(**params)))),
                    "float32")
    for name in expected:
        assert np.array_equal(got[name], expected[name]), f"{name} differs from the reference"
    records = [json.loads(line) for line in (tmp_path / "tree" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        trained = len(record["ranks"])  # client ranks that trained this round: each got the model once
        per_rank = record["bytes_sent"] // min(2, trained)
        assert record["bytes_sent"] == min(2, trained) * per_rank
        assert record["bytes_received"] == len(record["participants"]) * per_rank  # p2p return: one per client


def test_a_run_in_the_job_pool_equals_the_same_run_in_its_own_mpiexec(tmp_path):
    """The suite's job pool (tests/mpi_pool.py) runs most jobs on a sub-communicator of ranks that already ran
    others. It must not change what a test sees: the same model bitwise, the same exit status, the same log, and
    the same metrics.jsonl but for what it measured of the machine (wall times, memory): identical runs can be
    checked for reproducibility by diffing their records."""
    params = dict(dtype="float32", chunk_mb=64 / 2**20, weighting="samples")
    cfg_path = write_config(tmp_path / "c.yaml", CONFIG.format(**params))
    runs = {}
    for how, fresh in (("pooled", False), ("own", True), ("pooled-again", False)):
        runs[how] = run_mpi(3, "run", str(cfg_path), "--run-dir", str(tmp_path / how), fresh=fresh)
        assert runs[how].returncode == 0, runs[how].stderr
    own = load_tensors(tmp_path / "own" / "model.h5")
    for how in ("pooled", "pooled-again"):
        pooled = load_tensors(tmp_path / how / "model.h5")
        assert all(torch.equal(pooled[n].view(torch.int32), own[n].view(torch.int32)) for n in own), how
        assert log(runs[how].stderr, tmp_path / how) == log(runs["own"].stderr, tmp_path / "own")
        assert recorded(tmp_path / how) == recorded(tmp_path / "own")


def log(stderr: str, run_dir: Path) -> list[str]:
    """A run's log lines, less those naming processes (PIDs; how the launcher numbered the node's ranks), the
    floor probe's measured rates and the run's measured cost."""
    return [line.replace(str(run_dir), "RUN") for line in stderr.splitlines()
            if not line.startswith(("[rank 0] ranks:", "[rank 0] binding:", "[rank 0] exchange floor",
                                    "[rank 0] cost:"))]
