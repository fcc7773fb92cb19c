"""Under mpiexec: Krum, Multi-Krum, Bulyan and the geometric median, streamed chunk by chunk, equal the papers' rules
computed on whole updates, on any rank count and chunk size, in memory or out of core, and resist an attack."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import MPI_TIMEOUT, run_mpi, write_config
from reference import reference_run
from results import assert_bitwise

from mpifl.config import load_config
from mpifl.storage.hdf5 import load_tensors

CONFIG = """
seed: 5
rounds: 3
clients: {num_clients: 8, per_round: 7}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: "fl_helpers:tiny_mlp"}
train: {trainer: "fl_helpers:NoiseTrainer", lr: 0.02}
eval: {every: 0}
output: {progress: false}
"""
ATTACK = """
faults:
  - {kind: scale, clients: [0, 1], factor: -10}
"""


def run(tmp_path, name: str, ranks: int, *overrides: str, config: str = CONFIG) -> dict[str, np.ndarray]:
    """Run the config with overrides; the final model's tensors as fp32 arrays."""
    cfg_path = write_config(tmp_path / f"{name}.yaml", config)
    result = run_mpi(ranks, "run", str(cfg_path), "--run-dir", str(tmp_path / name), *overrides, timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    return {n: t.float().numpy() for n, t in load_tensors(tmp_path / name / "model.h5").items()}


def expected(*overrides: str) -> dict[str, np.ndarray]:
    return reference_run(load_config(None, overrides, data=yaml.safe_load(CONFIG)))


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("ranks,overrides", [
    # 3 client ranks for 7 participants, 250-element chunks: Krum keeps one update, bit for bit
    (4, ("strategy.name=krum", "strategy.byzantine_clients=2", "transport.chunk_mb=0.00095")),
    # one participant per rank, deltas on a bf16 wire, 5-element chunks: the mean of the n - f best
    (8, ("strategy.name=multi_krum", "strategy.byzantine_clients=1", "strategy.update=delta",
         "strategy.wire_dtype=bfloat16", "transport.chunk_mb=0.0000095")),
    # equal weights, m set: the mean of the 3 best-scored
    (3, ("strategy.name=multi_krum", "strategy.krum_keep=3", "strategy.weighting=equal")),
    # Bulyan, f = 1 of 7: 5 selected one at a time, the mean of the 3 values nearest each coordinate's median
    (4, ("strategy.name=bulyan", "strategy.byzantine_clients=1", "transport.chunk_mb=0.00095")),
    (8, ("strategy.name=bulyan", "strategy.byzantine_clients=1", "strategy.update=delta",
         "strategy.wire_dtype=bfloat16", "transport.chunk_mb=0.0000095")),
])
def test_krum_multi_krum_and_bulyan_equal_the_papers_rules_on_whole_updates_bitwise(tmp_path, ranks, overrides):
    assert_bitwise(run(tmp_path, "run", ranks, *overrides), expected(*overrides))


def test_the_geometric_median_equals_weiszfeld_on_whole_updates_and_no_rank_count_or_chunk_size_changes_it(
        tmp_path):
    rule = ("strategy.name=geometric_median", "strategy.update=delta")
    three = run(tmp_path, "three", 4, *rule, "transport.chunk_mb=0.00095")
    seven = run(tmp_path, "seven", 8, *rule, "transport.chunk_mb=0.0000095")
    assert_bitwise(seven, three)
    want = expected(*rule)
    for name in want:  # the reference's explicit distances against mpifl's Gram matrix: float64 apart
        np.testing.assert_allclose(three[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_an_out_of_core_server_keeps_the_updates_in_a_file_and_finishes_bitwise_the_in_memory_one(tmp_path):
    rule = ("strategy.name=multi_krum", "strategy.byzantine_clients=2", "transport.chunk_mb=0.00095")
    memory = run(tmp_path, "memory", 8, *rule)  # the out-of-core server takes one participant per client rank
    disk = run(tmp_path, "disk", 8, *rule, "server.state=disk", "checkpoint.every=1")
    assert_bitwise(disk, memory)


def test_krum_rejects_the_sign_flipping_clients_in_every_round_and_records_it(tmp_path):
    config = CONFIG.replace("per_round: 7", "per_round: 8") + ATTACK
    overrides = ("strategy.name=multi_krum", "strategy.byzantine_clients=2", "strategy.update=delta")
    cfg_path = write_config(tmp_path / "attacked.yaml", config)
    result = run_mpi(3, "run", str(cfg_path), "--run-dir", str(tmp_path / "krum"), *overrides, timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("multi_krum kept logical clients 2-7, rejected 0-1") == 3
    assert [r["strategy_metrics"] for r in records(tmp_path / "krum")] == [{"kept": 6.0, "rejected": 2.0}] * 3
    assert [r["rejected"] for r in records(tmp_path / "krum")] == [[0, 1]] * 3
    assert {f["outcome"] for r in records(tmp_path / "krum") for f in r["faults"]} == {"rejected"}
    krum = {n: t.float().numpy() for n, t in load_tensors(tmp_path / "krum" / "model.h5").items()}
    # it equals FedAvg over the six honest clients (0 and 1 raising, dropped), float64 against fp32 sums apart
    honest = run(tmp_path, "honest", 3, "strategy.update=delta", "clients.accept_failures=true",
                 config=config.replace("kind: scale", "kind: raise").replace(", factor: -10", ""))
    attacked = run(tmp_path, "fedavg", 3, "strategy.update=delta", config=config)
    for name in honest:
        np.testing.assert_allclose(krum[name], honest[name], rtol=1e-5, atol=1e-7, err_msg=name)
        assert np.abs(attacked[name] - honest[name]).max() > 1e-3, name  # FedAvg itself is thrown off
