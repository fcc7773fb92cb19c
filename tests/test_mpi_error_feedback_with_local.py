"""Top-k with error feedback beside FedBN / FedPer (``model.local``): each client keeps its residual of what top-k
did not send and its own local tensors in one vector on the rank that hosts it (the residual chunk by chunk, then
the local tensors and their mark); the local tensors never travel, and only the shared ones are compressed. With
every value sent it is FedPer, bitwise; with 5% sent, the same bits on any number of ranks, on a device replica and
across a resume on another number of ranks."""
from __future__ import annotations

import numpy as np
import yaml
from conftest import run_mpi, stopped_and_resumed, write_config
from reference import personal_reference
from results import assert_bitwise, run_result
from test_mpi_personal import CONFIG as PERSONAL

from mpifl.cli.plan import estimate
from mpifl.config import load_config
from mpifl.planning.memory import client_state_elements

# FedPer's setup (tests/test_mpi_personal.py: the MLP's 64 -> 9 layer shared, its head 3.* local) under top-k
SETTINGS = {**yaml.safe_load(PERSONAL), "compression": {"method": "topk", "fraction": 0.05},
            "transport": {"chunk_mb": 0.001}, "checkpoint": {"every": 1}}
CONFIG = yaml.safe_dump(SETTINGS)
SHARED, HEAD = 64 * 9 + 9, 9 * 10 + 10  # elements: the first layer's weight and bias; the head's


def run(tmp_path, name: str, ranks: int, *overrides: str):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / name), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_result(tmp_path / name)


def residuals_and_heads(vectors: dict[int, np.ndarray]) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Each client's vector split into its residual and its head; every one carries the mark of a kept head."""
    assert all(v.shape == (SHARED + HEAD + 1,) and v[-1] == 1 for v in vectors.values())
    return {c: v[:SHARED] for c, v in vectors.items()}, {c: v[SHARED:-1] for c, v in vectors.items()}


def test_with_every_value_sent_it_is_fedper_bitwise_and_no_residual_is_left(tmp_path):
    shared, vectors = run(tmp_path, "run", 3, "compression.fraction=1.0")
    want_shared, want_heads = personal_reference(load_config(None, data=yaml.safe_load(PERSONAL)))
    residuals, heads = residuals_and_heads(vectors)
    assert_bitwise(shared, want_shared)
    assert_bitwise(heads, want_heads)
    assert all(not r.any() for r in residuals.values())


def test_with_five_percent_sent_the_same_bits_on_any_number_of_ranks_on_a_replica_and_resumed(tmp_path):
    two = run(tmp_path, "two", 3)
    # on disk, and trained on a device replica (the GPU path's copies, on the CPU): the head loaded there
    four = run(tmp_path, "four", 5, "compression.residual_ram_mb=0", "model.local_ram_mb=0", "train.device_copy=true")
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    rest = stopped_and_resumed(tmp_path, cfg)  # stopped on 2 client ranks after round 2, resumed on 3
    assert "resume: error-feedback residuals and local tensors (model.local) of" in rest.stderr
    for other in (four, run_result(tmp_path / "split")):
        assert_bitwise(other[0], two[0])
        assert_bitwise(other[1], two[1])
    residuals, heads = residuals_and_heads(two[1])
    assert all(r.any() for r in residuals.values())  # what top-k held back, kept per client
    assert not np.array_equal(heads[min(heads)], heads[max(heads)])  # heads of their own
    assert sorted(p.name for p in (tmp_path / "four" / "residuals").iterdir()) == [
        "rank00001.h5", "rank00002.h5", "rank00003.h5", "rank00004.h5"]


def test_the_plan_counts_one_vector_per_client_holding_both():
    cfg = load_config(None, data=yaml.safe_load(CONFIG))
    size, _ = estimate(cfg, nranks=3, ranks_per_node=3, server_alone=False)
    # the exchanged buffer's elements (with its 64-byte padding: an upper bound), then the head and its mark
    assert client_state_elements(cfg, size) == size.exchanged // 4 + HEAD + 1 >= SHARED + HEAD + 1
    assert cfg.client_state().what == "error-feedback residuals and local tensors (model.local)"
