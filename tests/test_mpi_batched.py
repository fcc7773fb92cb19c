"""train.batched_clients: K: a rank's logical clients trained K at a time as lanes of one batched model. For a
fixed K the run is bitwise equal on any number of ranks, with reduction groups, with SCAFFOLD, and after a kill -9
and a resume on another number of ranks; it is within float rounding of clients trained one at a time; and the
model a lane cannot train is refused by validate and, before round 1, by the run, naming the key and the module."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import killed_and_resumed, mpifl_here, run_mpi, write_config
from results import assert_bitwise, final_model, recorded, relative_l2

CONFIG = """
seed: 3
rounds: 3
clients: {num_clients: 12, per_round: 9}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [16]}}
train: {lr: 0.05, momentum: 0.5, batch_size: 16, local_epochs: 1, device: cpu, batched_clients: 4}
eval: {every: 0}
output: {progress: false}
"""
# One round of clients trained as lanes against one at a time: the same steps summed in another order. Measured at
# 1e-7 of the weights' norm; the pure tests (tests/test_batched.py) bound each lane's update more tightly.
TOLERANCE = 1e-5


def run(tmp_path: Path, name: str, ranks: int, *overrides: str) -> Path:
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / name), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / name


@pytest.mark.parametrize("overrides", [
    (),
    ("clients.groups=4",),
    ("strategy.name=scaffold", "strategy.update=delta"),
    ("train.prox_mu=0.1", "train.optimizer=adam", "train.lr=0.01"),
], ids=["fedavg", "reduction-groups", "scaffold", "fedprox-adam"])
def test_batched_clients_give_the_same_model_bitwise_on_two_or_four_client_ranks(tmp_path, overrides):
    two, four = run(tmp_path, "two", 3, *overrides), run(tmp_path, "four", 5, *overrides)
    assert_bitwise(final_model(four), final_model(two))
    losses = lambda run_dir: [r["train_loss"] for r in recorded(run_dir)]  # noqa: E731
    assert losses(four) == losses(two)  # the clients' losses too, to the last digit


def test_batched_clients_train_within_rounding_of_clients_trained_one_at_a_time(tmp_path):
    batched = run(tmp_path, "batched", 3, "rounds=1")
    alone = run(tmp_path, "alone", 3, "rounds=1", "train.batched_clients=0")
    distance = relative_l2(final_model(batched), final_model(alone))
    assert distance < TOLERANCE
    assert recorded(batched)[0]["train_loss"] == pytest.approx(recorded(alone)[0]["train_loss"], rel=1e-5)


def test_killed_with_sigkill_and_resumed_on_another_number_of_ranks_it_ends_bitwise_as_run_whole(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    run_dir, longer = tmp_path / "killed", ("rounds=8", "checkpoint.every=1", "strategy.name=scaffold",
                                            "strategy.update=delta")
    killed_and_resumed(cfg, run_dir, 5, 3, *longer)
    assert_bitwise(final_model(run_dir), final_model(run(tmp_path, "whole", 4, *longer)))


def test_a_model_that_keeps_running_statistics_is_refused_by_validate_and_before_round_1_naming_the_module(tmp_path):
    """A config error, found by validate before a job queues, and by the run's client ranks on the model they built,
    agreed on with it: every rank leaves with the one line and a config error's exit status, no abort and no
    record."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace("model: {name: mlp, kwargs: {hidden: [16]}}",
                                                           "model: {name: 'fl_helpers:bn_mlp'}"))
    said = "train.batched_clients: module '2' (BatchNorm1d) keeps running statistics"
    checked = mpifl_here("validate", str(cfg))
    assert checked.returncode == 2 and f"config error: {said}" in checked.stderr, checked.stderr
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "MPI_Abort" not in result.stderr
    assert result.stderr.count(f"[rank 0] mpifl: rank 1: {said}") == 1, result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_with_an_out_of_core_server_the_client_ranks_refuse_the_model_before_round_1_naming_rank_and_module(tmp_path):
    """The out-of-core server builds no model to check: the client ranks find it as they build theirs, and the
    ranks agree on it with the model, so every rank still leaves with one line and exit status 2."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace("model: {name: mlp, kwargs: {hidden: [16]}}",
                                                           "model: {name: 'fl_helpers:bn_mlp'}"))
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), "server.state=disk", "clients.groups=2")
    assert result.returncode == 2 and "MPI_Abort" not in result.stderr
    said = "rank 1: train.batched_clients: module '2' (BatchNorm1d) keeps running statistics"
    assert result.stderr.count(f"[rank 0] mpifl: {said}") == 1, result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
