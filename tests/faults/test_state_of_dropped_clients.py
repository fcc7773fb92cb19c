"""Under clients.accept_failures with SCAFFOLD or FedDyn: a rank past its deadline is dropped from the round like
any other, and the clients it was still training end as if they had not been sampled.

A dropped rank cannot tell while it trains, so it folds those clients' deltas into their c_i or g_i; the server
never sums them into c or h. Its next header names the dropped clients (Header.dropped), and the rank puts
their vectors back as they were before the round (storage.residuals.UndoJournal)."""
from __future__ import annotations

import json
import shutil
from collections import deque
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_mpi, write_config
from reference import feddyn_reference, scaffold_reference
from results import assert_bitwise, reference_controls_numbered, run_controls_numbered

from mpifl.config import load_config
from mpifl.storage.checkpointer import checkpoint_name, list_checkpoints, residuals_dir
from mpifl.storage.residuals import RamResiduals, UndoJournal
from mpifl.wire.late import DroppedClients, OwedStream

CONFIG = """
seed: 5
rounds: 4
clients: {num_clients: 8, per_round: 6, accept_failures: true}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: "fl_helpers:SlowOnOneRank"}
train: {lr: 0.05, batch_size: 16, local_epochs: 1, device: cpu}
strategy: {name: scaffold, update: delta}
timeouts: {straggler: 4}
checkpoint: {every: 1, keep: 5}
eval: {every: 0}
output: {progress: false}
"""
def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def drops(history: list[dict]) -> dict[int, set[int]]:
    """The clients dropped in each round that dropped any."""
    return {r["round"]: {d["client"] for d in r["dropped"]} for r in history if r["dropped"]}


SLOW = {"FL_HELPERS_SLOW_RANK": "2", "FL_HELPERS_SLOW_CALLS": "3", "FL_HELPERS_SLOW_FORWARD": "0.6"}  # ~12 passes: 7 s


def test_the_journal_puts_back_only_the_dropped_clients_vectors_and_forgets_each_round():
    store = RamResiduals([0, 3])
    journal = UndoJournal(store)
    journal.write(4, 0, torch.tensor([1.0, 2.0, 3.0]))  # round 1
    assert journal.settle([]) == []  # round 1's header named nobody: its writes stand
    own = journal.read(4, 0)  # round 2: the rules update a RAM store's vector in place, then write it back
    own.add_(4.0)
    journal.write(4, 0, own)
    journal.write(4, 0, torch.tensor([6.0, 6.0, 6.0]))  # and again
    journal.write(6, 0, torch.tensor([7.0, 7.0, 7.0]))
    assert journal.settle([4, 9]) == [4]  # 4 was dropped; 9 was not trained here
    assert torch.equal(store.read(4, 0), torch.tensor([1.0, 2.0, 3.0]))  # as before round 2
    assert torch.equal(store.read(6, 0), torch.tensor([7.0, 7.0, 7.0]))
    assert journal.settle([6]) == []  # round 2's writes are settled: a later header cannot undo them
    assert torch.equal(store.read(6, 0), torch.tensor([7.0, 7.0, 7.0]))


def test_the_server_names_each_ranks_dropped_clients_in_its_next_header_once():
    dropped = DroppedClients()
    dropped.note(OwedStream(2, 5, (7, 3), 1, deque()))
    dropped.note(OwedStream(2, 5, (11,), 1, deque()))
    assert dropped.take(1) == ()
    assert dropped.take(2) == (3, 7, 11)
    assert dropped.take(2) == ()


@pytest.mark.parametrize("strategy,placement", [("scaffold", "round_robin"), ("feddyn", "round_robin"),
                                                ("scaffold", "per_round")])
def test_a_straggler_under_a_strategy_with_client_state_is_dropped_and_its_clients_end_as_if_never_sampled(
        tmp_path, strategy, placement):
    """Under per_round placement a client's vector is lent by its home rank to the rank that trains it and comes
    home as the round ends: the home rank puts it back, from the copy it kept when lending it."""
    text = CONFIG if strategy == "scaffold" else CONFIG.replace("{name: scaffold, update: delta}",
                                                                "{name: feddyn, update: delta, weighting: equal}")
    text = text.replace("accept_failures: true}", f"accept_failures: true, placement: {placement}}}")
    cfg = write_config(tmp_path / "c.yaml", text)
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"), env=SLOW, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    history = records(tmp_path / "run")
    dropped = drops(history)
    slow = [r["round"] for r in history if any(d["rank"] == 2 and "straggler deadline" in d["reason"]
                                               for d in r["dropped"])]
    assert slow, dropped  # rank 2's third client is slow: its round loses what rank 2 had left of it
    # (a loaded machine may drop more: the reference takes whatever was dropped)
    trained_again = {c for r, clients in dropped.items() for c in clients
                     if any(c in later["participants"] for later in history[r:])}
    assert trained_again, "a dropped client must train again later, or its put-back state is never read"
    state = "c_i" if strategy == "scaffold" else "g_i"
    assert f"each one's {state} is put back as it was before it trained" in result.stderr
    if placement == "per_round":  # some dropped client was trained away from home, so its home put it back
        assert any(d["rank"] != 1 + d["client"] % 3 for r in history for d in r["dropped"]), history
    reference = scaffold_reference if strategy == "scaffold" else feddyn_reference
    want = reference_controls_numbered(reference(load_config(None, data=yaml.safe_load(text)), dropped_in=dropped))
    assert_bitwise(run_controls_numbered(tmp_path / "run"), want)
    if strategy == "feddyn" or placement == "per_round":
        return
    # the checkpoint of the round with the drop holds the put-back c_i: a job that died right after it resumes,
    # on another number of ranks, to the same bits
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed)
    (resumed / "model.h5").unlink()
    for later in list_checkpoints(resumed / "checkpoints"):
        if later.name > checkpoint_name(slow[0]):
            shutil.rmtree(residuals_dir(later))
            later.unlink()
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(resumed), "--resume", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    again = drops(records(resumed))  # its own rounds' drops after the resumed one, if a loaded machine made any
    assert {r: c for r, c in again.items() if r <= slow[0]} == {r: c for r, c in dropped.items() if r <= slow[0]}
    if again != dropped:
        want = reference_controls_numbered(reference(load_config(None, data=yaml.safe_load(text)), dropped_in=again))
    assert_bitwise(run_controls_numbered(resumed), want)


def test_the_plan_counts_a_copy_of_c_i_for_each_client_a_rank_trains_in_a_round():
    from mpifl.cli.plan import estimate

    def client_bytes(*overrides: str) -> tuple[int, int]:
        size, plan = estimate(load_config(None, list(overrides), data=yaml.safe_load(CONFIG)), nranks=4,
                              ranks_per_node=4, server_alone=False)
        return plan.client_bytes, size.control

    journaled, control = client_bytes()
    waited, _ = client_bytes("clients.accept_failures=false")
    # round robin puts 3, 3 and 2 of the 8 clients on the 3 client ranks, and a round of 6 may draw all 3 of one's
    assert journaled - waited == 3 * control
    journaled, _ = client_bytes("clients.placement=per_round")
    waited, _ = client_bytes("clients.placement=per_round", "clients.accept_failures=false")
    assert journaled - waited == 2 * control  # per_round deals the 6 over the 3 ranks: 2 copies of c_i each


@pytest.mark.parametrize("placement", ["round_robin", "per_round"])
def test_a_dropped_clients_plugin_vectors_are_put_back_as_if_it_had_not_trained(tmp_path, placement):
    """A plug-in trainer's declared vectors get the built-ins' put-back: each client counts its trainings in one, and
    after a run with a straggler dropped, every count is the rounds the client took part in less those it was dropped
    from, on its home rank too when it was trained elsewhere (per_round)."""
    text = CONFIG.replace("{name: scaffold, update: delta}", "{name: fedavg}").replace(
        "device: cpu}", "device: cpu, trainer: 'plugin_helpers:TrainingCounter'}").replace(
        "accept_failures: true}", f"accept_failures: true, placement: {placement}}}")
    cfg = write_config(tmp_path / "c.yaml", text)
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"), env=SLOW, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    history = records(tmp_path / "run")
    dropped = drops(history)
    assert any(d["rank"] == 2 and "straggler deadline" in d["reason"] for r in history for d in r["dropped"])
    assert "each one's trainer state is put back as it was before it trained" in result.stderr
    from results import client_vectors

    counts = {c: int(v[0]) for c, v in client_vectors(tmp_path / "run").items()}
    trained = {c: sum(c in r["participants"] and c not in dropped.get(r["round"], ()) for r in history)
               for c in range(8)}
    assert {c: n for c, n in counts.items() if n} == {c: n for c, n in trained.items() if n}
