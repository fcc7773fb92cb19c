"""Per-client state under ``clients.placement: per_round``: a client trains on whichever rank the round gives it,
and its state (SCAFFOLD's cᵢ, FedDyn's gᵢ, top-k's error-feedback residual, Ditto's personal model, model.local
tensors) is lent there for the round by its home rank, 1 + c mod N, and handed back. Only bits move, so every
algorithm gives the single-process reference's bits (or balanced placement's) on any number of ranks, with the
state in RAM or on disk, with each round's groups formed by cost, and across a resume on another number of ranks."""
from __future__ import annotations

import json
import signal

import pytest
import test_mpi_control_with_local
import test_mpi_ditto
import test_mpi_error_feedback_with_local
import test_mpi_feddyn
import test_mpi_personal
import test_mpi_scaffold
import yaml
from conftest import finish, run_mpi, spawn_mpi, stopped_and_resumed, wait_for, write_config
from results import assert_bitwise, run_controls_numbered, run_result

from mpifl.cli.plan import estimate
from mpifl.config import load_config
from mpifl.planning.federation import state_home, state_loans
from mpifl.planning.memory import client_state_elements, loaned_vectors

PER_ROUND = ("clients.placement=per_round",)


def loans(run_dir) -> list[int]:
    """Each round's count of clients that trained away from their state's home (metrics.jsonl)."""
    return [json.loads(line)["state_loans"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_round_lends_each_client_trained_away_from_home_and_nothing_else():
    # 2 client ranks: homes are 1 + c mod 2; rank 1 trains 0, 3 and 4, rank 2 trains 1 and 2
    borrow, lend = state_loans({1: [0, 3, 4], 2: [1, 2]}, client_ranks=2)
    assert [state_home(c, 2) for c in range(5)] == [1, 2, 1, 2, 1]
    assert borrow == {1: [(3, 2)], 2: [(2, 1)]}  # (client, its home)
    assert lend == {2: [(3, 1)], 1: [(2, 2)]}  # (client, the rank that trains it)
    assert state_loans({1: [0, 2], 2: [1, 3]}, client_ranks=2) == ({}, {})  # every client at home: no loans


@pytest.mark.parametrize("module", [test_mpi_scaffold, test_mpi_feddyn], ids=["scaffold", "feddyn"])
def test_control_variates_and_gradient_states_follow_their_client_bitwise(tmp_path, module):
    cfg = write_config(tmp_path / "c.yaml", module.CONFIG)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *PER_ROUND)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sum(loans(tmp_path / "run")) > 0  # some clients trained on the other rank, with their state lent there
    assert_bitwise(run_controls_numbered(tmp_path / "run"), module.reference())


@pytest.mark.parametrize("module", [test_mpi_ditto, test_mpi_personal], ids=["ditto", "fedper-head"])
def test_personal_models_and_local_tensors_follow_their_client_bitwise(tmp_path, module):
    cfg = write_config(tmp_path / "c.yaml", module.CONFIG)
    # 3 client ranks, the vectors in one HDF5 file per rank: lent from and handed back into the file
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *PER_ROUND,
                     "train.personal_ram_mb=0", "model.local_ram_mb=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sum(loans(tmp_path / "run")) > 0
    (final, vectors), (want_final, want_vectors) = run_result(tmp_path / "run"), module.reference()
    assert_bitwise(final, want_final)
    assert_bitwise(vectors, want_vectors)


def test_error_feedback_residuals_and_local_heads_follow_their_client_bitwise(tmp_path):
    # top-k (5%) with error feedback beside FedPer's head: one vector per client, its residual then its head
    balanced = test_mpi_error_feedback_with_local.run(tmp_path, "balanced", 3)
    lent = test_mpi_error_feedback_with_local.run(tmp_path, "lent", 4, *PER_ROUND, "compression.residual_ram_mb=0")
    assert sum(loans(tmp_path / "lent")) > 0
    for got, want in zip(lent, balanced):
        assert_bitwise(got, want)


COST_GROUPS = ("clients.placement=per_round", "clients.groups=3", "clients.group_by=cost")


def test_scaffold_with_a_local_head_and_cost_groups_gives_the_same_bits_on_2_and_3_client_ranks(tmp_path):
    # FedPer's head beside SCAFFOLD's c_i, one vector per client, on disk; each round's groups formed by cost
    cfg = write_config(tmp_path / "c.yaml", test_mpi_control_with_local.CONFIG)
    want = test_mpi_control_with_local.reference(*COST_GROUPS)
    for ranks in (3, 4):
        run = tmp_path / f"run{ranks}"
        result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(run), *COST_GROUPS, "strategy.control_ram_mb=0",
                         "model.local_ram_mb=0")
        assert result.returncode == 0, result.stderr[-3000:]
        assert sum(loans(run)) > 0
        assert_bitwise(test_mpi_control_with_local.result(run), want)


def test_a_resumed_per_round_scaffold_run_on_another_number_of_ranks_equals_the_uninterrupted_one(tmp_path):
    config = yaml.safe_load(test_mpi_scaffold.CONFIG)
    config["clients"]["placement"] = "per_round"
    cfg = write_config(tmp_path / "c.yaml", yaml.safe_dump(config))
    rest = stopped_and_resumed(tmp_path, cfg)  # 2 client ranks, then 3: every client's home changes but one
    assert "resume: SCAFFOLD control variates of" in rest.stderr
    assert_bitwise(run_controls_numbered(tmp_path / "split"), test_mpi_scaffold.reference())
    assert sum(loans(tmp_path / "split")) > 0


def test_the_plan_counts_the_vectors_a_rank_borrows_beside_its_own():
    balanced = load_config(None, data=yaml.safe_load(test_mpi_scaffold.CONFIG))  # 8 clients, 6 per round
    per_round = load_config(None, list(PER_ROUND), data=yaml.safe_load(test_mpi_scaffold.CONFIG))
    size, home = estimate(balanced, nranks=3, ranks_per_node=3, server_alone=False)
    _, lending = estimate(per_round, nranks=3, ranks_per_node=3, server_alone=False)
    vector = 4 * client_state_elements(per_round, size)
    # each of 2 client ranks keeps its 4 home clients' c_i, and borrows at most its 3 of the 6 participants
    assert loaned_vectors(per_round, client_ranks=2, where="RAM") == 3
    assert loaned_vectors(per_round, client_ranks=2, where="HDF5") == 6  # and copies the ones it lends
    assert loaned_vectors(balanced, client_ranks=2, where="RAM") == 0
    # beside the data, which the placements map differently (planning.memory.client_data_bytes)
    assert (lending.client_bytes - lending.client_data_bytes) - (home.client_bytes - home.client_data_bytes) \
        == 3 * vector


def test_a_sigterm_mid_run_publishes_every_lent_vector_home_and_the_resume_is_bitwise(tmp_path):
    config = yaml.safe_load(test_mpi_scaffold.CONFIG) | {"rounds": 20, "checkpoint": {"every": 0}}
    config["clients"]["placement"] = "per_round"
    cfg, run = write_config(tmp_path / "c.yaml", yaml.safe_dump(config)), tmp_path / "run"
    job = spawn_mpi(4, "run", str(cfg), "--run-dir", str(run))  # 3 client ranks; checkpoints only on the signal
    wait_for(lambda: (run / "metrics.jsonl").exists() and len(loans(run)) >= 3, job, "round 3")
    job.send_signal(signal.SIGTERM)  # the hand-back of the round that ends is still posted, not complete
    code, err = finish(job)
    assert code == 3 and "SIGTERM: stopped after round" in err, err[-3000:]
    resumed = run_mpi(3, "run", str(cfg), "--run-dir", str(run), "--resume")  # on 2 client ranks: new homes
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise(run_controls_numbered(run), test_mpi_scaffold.reference("rounds=20"))


def test_clients_that_fail_while_holding_a_borrowed_vector_leave_it_as_balanced_placement_would(tmp_path):
    # FedPer's head per client; from round 2 clients 1 and 4 raise and 2 and 6 send NaN (clients.accept_failures)
    config = yaml.safe_load(test_mpi_personal.CONFIG) | {"rounds": 4}
    config["train"] = {"trainer": "fl_helpers:FailingClients", "lr": 0.02}
    config["clients"]["accept_failures"] = True
    cfg = write_config(tmp_path / "c.yaml", yaml.safe_dump(config))
    failing = {"FL_HELPERS_RAISE": "1,4", "FL_HELPERS_NAN": "2,6", "FL_HELPERS_SEED": str(config["seed"]),
               "FL_HELPERS_FROM_ROUND": "2"}
    balanced = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "balanced"), env=failing)
    lent = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "lent"), *PER_ROUND, "model.local_ram_mb=0",
                   env=failing)
    for result in (balanced, lent):
        assert result.returncode == 0, result.stderr[-3000:]
    assert sum(loans(tmp_path / "lent")) > 0
    records = [json.loads(line) for line in (tmp_path / "lent" / "metrics.jsonl").read_text().splitlines()]
    assert {d["client"] for r in records for d in r["dropped"]} == {1, 2, 4, 6}
    for got, want in zip(run_result(tmp_path / "lent"), run_result(tmp_path / "balanced")):
        assert_bitwise(got, want)
