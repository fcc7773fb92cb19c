"""Under mpiexec: a plug-in trainer that leaves a declared vector in another shape or dtype than it declared fails
that client, as a raise would. Under clients.accept_failures the client is dropped from the round, its old vectors
kept, on any number of ranks; without it the job ends with one line naming the round, the client, its rank, the
trainer, the vector and both shapes or dtypes (tests/plugin_helpers.py: VectorBreaker, which breaks client 3's
one-element count from round 2 on). A vector left NaN fails its client the same way, as a diverged update does. A
train() that returns something other than a TrainResult (a tuple, a dict) fails its client the same way too."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import MPI_TIMEOUT, run_mpi, write_config
from reference import reference_run
from results import client_vectors, final_model
from stateful_plugins import assert_same_run

from mpifl.config import load_config

CONFIG = """
seed: 5
rounds: 3
clients: {num_clients: 6, per_round: 6, accept_failures: true}
data: {dataset: digits, partition: iid}
model: {name: "fl_helpers:tiny_mlp"}
train: {trainer: "plugin_helpers:VectorBreaker", lr: 0.02}
checkpoint: {every: 1, keep: 1}
eval: {every: 0}
output: {progress: false}
"""
SHAPE = "trainer plugin_helpers.VectorBreaker left client vector 'count' with shape (5,) where (1,) was declared"
DTYPE = "trainer plugin_helpers.VectorBreaker left client vector 'count' with dtype float64 where float32 was declared"
BROKEN = {"shape": ("train.kwargs={size: 5}", SHAPE), "dtype": ("train.kwargs={dtype: float64}", DTYPE)}
RETURNED = ("trainer plugin_helpers.VectorBreaker: train() returned {} "  # then what it returned, abridged
            "; it must return mpifl.api.TrainResult(num_samples, metrics, local_steps)")


def run(folder: Path, ranks: int, *overrides: str):
    """Run CONFIG with ``overrides`` on ``ranks`` ranks into ``folder/run`` (a job of its own when it is to abort:
    an abort would end the suite's pool)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = write_config(folder / "c.yaml", CONFIG)
    aborts = "clients.accept_failures=false" in overrides
    return run_mpi(ranks, "run", str(cfg), "--run-dir", str(folder / "run"), *overrides, timeout=MPI_TIMEOUT,
                   fresh=aborts)


def dropped(run_dir: Path) -> dict[int, dict[int, str]]:
    """Each round's dropped clients and why."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["round"]: {d["client"]: d["reason"] for d in r["dropped"]} for r in records}


def reference_dropping(dropped_in: dict[int, set[int]]) -> dict[str, np.ndarray]:
    """The final model of CONFIG trained by the built-in torch trainer (which the counter wraps), in one process on
    one thread as each rank trains, without the clients ``dropped_in`` each round."""
    settings = yaml.safe_load(CONFIG)
    settings["train"] = {"trainer": "torch", "lr": 0.02}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_run(load_config(None, data=settings), dropped_in=dropped_in)
    finally:
        torch.set_num_threads(threads)


def assert_as_if_client_3_never_trained_after_round_1(run_dir: Path) -> None:
    """Client 3, dropped in rounds 2 and 3, kept its count as round 1 left it, and the model is the reference's
    without it in those rounds."""
    counts = {c: float(v[0]) for c, v in client_vectors(run_dir).items()}
    assert counts == {0: 3.0, 1: 3.0, 2: 3.0, 3: 1.0, 4: 3.0, 5: 3.0}
    want, got = reference_dropping({2: {3}, 3: {3}}), final_model(run_dir)
    for name, value in want.items():
        assert np.array_equal(got[name], value), name


@pytest.mark.parametrize("broken", ["shape", "dtype"])
def test_under_accept_failures_a_vector_not_as_declared_drops_its_client_and_keeps_its_old_vectors(tmp_path, broken):
    override, message = BROKEN[broken]
    result = run(tmp_path / "3", 3, override)
    assert result.returncode == 0, result.stderr[-3000:]
    assert dropped(tmp_path / "3" / "run") == {1: {}, 2: {3: message}, 3: {3: message}}
    assert f"round 2: dropped logical client 3 (rank 2): {message}" in result.stderr  # 2 client ranks: 1 + 3 % 2
    assert_as_if_client_3_never_trained_after_round_1(tmp_path / "3" / "run")
    if broken == "shape":  # the same client dropped on any number of ranks: the same bits
        other = run(tmp_path / "4", 4, override)
        assert other.returncode == 0, other.stderr[-3000:]
        assert f"round 2: dropped logical client 3 (rank 1): {message}" in other.stderr  # 3 client ranks: 1 + 3 % 3
        assert_same_run(tmp_path / "4" / "run", tmp_path / "3" / "run")


@pytest.mark.parametrize("broken", ["shape", "dtype"])
def test_without_accept_failures_a_vector_not_as_declared_ends_the_job_in_one_line(tmp_path, broken):
    override, message = BROKEN[broken]
    result = run(tmp_path, 3, override, "clients.accept_failures=false")
    assert result.returncode != 0
    line = f"round 2: logical client 3 (rank 2): {message} (clients.accept_failures=false)"
    assert [ln for ln in result.stderr.splitlines() if line in ln], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_a_vector_left_nan_fails_its_client_so_under_accept_failures_its_update_is_not_folded_either(tmp_path):
    """A diverged vector and the update beside it stand or fall together: folding the update while keeping the old
    vector would break what the two halves keep in step (a server mean of the clients' vectors)."""
    result = run(tmp_path, 3, "train.kwargs={nan: true}")
    assert result.returncode == 0, result.stderr[-3000:]
    message = "trainer plugin_helpers.VectorBreaker left 1 NaN/Inf values in client vector 'count'"
    assert dropped(tmp_path / "run") == {1: {}, 2: {3: message}, 3: {3: message}}
    assert f"round 2: dropped logical client 3 (rank 2): {message}" in result.stderr, result.stderr[-3000:]
    assert_as_if_client_3_never_trained_after_round_1(tmp_path / "run")


def test_without_accept_failures_a_vector_left_nan_ends_the_job_in_one_line_with_the_divergence_advice(tmp_path):
    result = run(tmp_path, 3, "train.kwargs={nan: true}", "clients.accept_failures=false")
    assert result.returncode != 0
    line = ("round 2: logical client 3 (rank 2): trainer plugin_helpers.VectorBreaker left 1 NaN/Inf values in client "
            "vector 'count' (clients.accept_failures=false); if its training diverged, lower train.lr or set "
            "train.max_grad_norm, or drop such clients")
    assert [ln for ln in result.stderr.splitlines() if line in ln], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def returned_line(kind: str, said: str) -> bool:
    """Whether ``said`` says that VectorBreaker's train returned a ``kind``, what, and what it must return."""
    head, tail = RETURNED.split(" ; ")
    return said.startswith(head.format(kind)) and said.endswith("; " + tail) and len(said) > len(head + tail) + 10


def test_under_accept_failures_a_train_that_returns_no_train_result_drops_its_client_as_any_dropped_client(tmp_path):
    result = run(tmp_path, 3, "train.kwargs={returns: tuple}")
    assert result.returncode == 0, result.stderr[-3000:]
    reasons = dropped(tmp_path / "run")
    assert reasons[1] == {} and set(reasons[2]) == {3} and set(reasons[3]) == {3}, reasons
    assert returned_line("tuple", reasons[2][3]) and returned_line("tuple", reasons[3][3]), reasons
    assert_as_if_client_3_never_trained_after_round_1(tmp_path / "run")


def test_without_accept_failures_a_train_that_returns_no_train_result_ends_the_job_in_one_line(tmp_path):
    result = run(tmp_path, 3, "train.kwargs={returns: dict}", "clients.accept_failures=false")
    assert result.returncode != 0
    head = "round 2: logical client 3 (rank 2): " + RETURNED.split(" ; ")[0].format("dict")
    lines = [ln for ln in result.stderr.splitlines() if head in ln]
    assert lines and "(clients.accept_failures=false); make every train() call return one" in lines[0], \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "AttributeError" not in result.stderr
