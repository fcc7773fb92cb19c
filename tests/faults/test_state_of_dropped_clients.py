"""Under clients.accept_failures with SCAFFOLD or FedDyn: a rank past its deadline is dropped from the round like
any other, and the clients it was still training end as if they had not been sampled.

A dropped rank cannot tell while it trains, so it folds those clients' deltas into their c_i or g_i; the server
never sums them into c or h. Its next header names the dropped clients (Header.dropped), and the rank puts
their vectors back as they were before the round (storage.residuals.UndoJournal). Under a virtual clock, a round
left with too few usable updates names its usable clients the same way, and is left out for them too. A client whose
update is refused (NaN/Inf) or failed is named the same way: a rule may have kept its vector before the update's
check refused it."""
from __future__ import annotations

import json
import shutil
from collections import deque
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml
from conftest import MPI_TIMEOUT, run_mpi, same_model, write_config
from reference import ditto_reference, feddyn_reference, personal_reference, scaffold_reference
from results import assert_bitwise, client_vectors, reference_controls_numbered, run_controls_numbered, run_result

from mpifl.config import load_config
from mpifl.planning.federation import sample_clients
from mpifl.storage.checkpointer import checkpoint_name, list_checkpoints, residuals_dir
from mpifl.storage.residuals import RamResiduals, UndoJournal
from mpifl.units import range_list
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
    assert f" {state} is put back as it was before it trained" in result.stderr
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
    assert " trainer state is put back as it was before it trained" in result.stderr

    counts = {c: int(v[0]) for c, v in client_vectors(tmp_path / "run").items()}
    trained = {c: sum(c in r["participants"] and c not in dropped.get(r["round"], ()) for r in history)
               for c in range(8)}
    assert {c: n for c, n in counts.items() if n} == {c: n for c, n in trained.items() if n}


UNAPPLIED = """
seed: 4
rounds: {rounds}
clients: {{num_clients: 8, per_round: 6, accept_failures: true, min_participants: 5}}
data: {{dataset: synthetic, kwargs: {{num_samples: 480, num_features: 8, num_classes: 4}}}}
model: {{name: mlp, kwargs: {{hidden: [8]}}}}
train: {{lr: 0.1, batch_size: 8, device: cpu}}
strategy: {{name: scaffold, update: delta}}
clock: {{mode: sync}}
faults: [{{kind: raise, clients: {struck}, rounds: [2]}}]
checkpoint: {{every: 1, keep: 5}}
eval: {{every: 0}}
output: {{progress: false}}
"""


def checkpoint_vectors(run_dir: Path, round_: int) -> dict[int, np.ndarray]:
    """Every client's per-client vector in the per-rank files of round ``round_``'s checkpoint."""
    vectors = {}
    for path in residuals_dir(run_dir / "checkpoints" / checkpoint_name(round_)).glob("rank*.h5"):
        with h5py.File(path, "r") as f:
            vectors.update({int(c): f["clients"][c][()] for c in f["clients"]})
    return vectors


def same_vectors(got: dict[int, np.ndarray], want: dict[int, np.ndarray]) -> None:
    """The same vector, bitwise, for each client of ``want``; every other client of ``got`` all zeros (a client
    first trained in a round it was put back from keeps a zero vector, as one never trained reads)."""
    for client, vector in got.items():
        expected = want.get(client, np.zeros_like(vector))
        assert np.array_equal(vector.view(np.uint32), expected.view(np.uint32)), client
    assert set(want) <= set(got)


@pytest.mark.parametrize("ranks,rounds", [(3, 4), (4, 4), (3, 2)])
def test_a_virtual_round_with_too_few_usable_updates_under_scaffold_is_left_out_with_every_c_i_put_back(
        tmp_path, ranks, rounds):
    """clock.mode sync, clients.accept_failures: round 2 keeps 6 clients, 2 of which raise, leaving 4 usable
    updates, fewer than clients.min_participants=5. The round is left out: the model and c stay as they were, the
    4 usable clients (the record's state_put_back) have their c_i put back before the next header (round 2's
    checkpoint, the next round, or the stop when round 2 is the last), and the run goes on. The final model, c and
    every c_i equal, bitwise, the reference that never trains round 2's clients; on 2 and 3 client ranks. (A virtual
    clock refuses clients.placement: per_round.)"""
    sampled = sample_clients(4, 2, 8, 6)
    struck = sampled[:2]
    text = UNAPPLIED.format(rounds=rounds, struck=struck)
    cfg = write_config(tmp_path / "c.yaml", text)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    history = records(tmp_path / "run")
    assert [r["round"] for r in history] == list(range(1, rounds + 1))
    assert ["unapplied" in r for r in history] == [r["round"] == 2 for r in history]
    second = history[1]
    assert second["participants"] == sampled and {d["client"] for d in second["dropped"]} == set(struck)
    usable = [c for c in sampled if c not in struck]
    assert second["state_put_back"] == usable
    assert "only 4 of 6 participants sent a usable update, fewer than clients.min_participants=5" in \
        second["unapplied"]
    assert "sent usable updates to a round not applied; put back as if not sampled: SCAFFOLD control variates" \
        in result.stderr
    assert " c_i is put back as it was before it trained" in result.stderr
    if rounds > 2:  # a put-back c_i is read again
        assert any(c in later["participants"] for later in history[2:] for c in usable)
    saved = tmp_path / "run" / "checkpoints"
    assert same_model(saved / checkpoint_name(1), saved / checkpoint_name(2))  # the model and its control section c
    same_vectors(checkpoint_vectors(tmp_path / "run", 2), checkpoint_vectors(tmp_path / "run", 1))
    want = scaffold_reference(load_config(cfg), dropped_in={2: set(sampled)}, controls=True)
    clients = {int(k.removeprefix("client.")): want.pop(k) for k in [k for k in want if k.startswith("client.")]}
    assert_bitwise(run_controls_numbered(tmp_path / "run"), reference_controls_numbered(want))
    same_vectors(client_vectors(tmp_path / "run"), clients)


def test_a_virtual_round_left_out_by_a_robust_strategy_puts_back_the_usable_clients_declared_vectors(tmp_path):
    """The median finishes each chunk from the participants' receive slots (held stacks, one participant per rank):
    a round left with too few usable updates commits every chunk unchanged there too, and the usable clients'
    declared vectors are put back. Each client's training count ends as the rounds whose updates were applied."""
    text = UNAPPLIED.format(rounds=4, struck=[0]).replace(
        "num_clients: 8, per_round: 6, accept_failures: true, min_participants: 5",
        "num_clients: 3, per_round: 3, accept_failures: true, min_participants: 3").replace(
        "{name: scaffold, update: delta}", "{name: median}").replace(
        "device: cpu}", "device: cpu, trainer: 'plugin_helpers:TrainingCounter'}")
    cfg = write_config(tmp_path / "c.yaml", text)
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    history = records(tmp_path / "run")
    assert ["unapplied" in r for r in history] == [False, True, False, False]
    assert history[1]["state_put_back"] == [1, 2] and [d["client"] for d in history[1]["dropped"]] == [0]
    assert " trainer state is put back as it was before it trained" in result.stderr
    saved = tmp_path / "run" / "checkpoints"
    assert same_model(saved / checkpoint_name(1), saved / checkpoint_name(2))
    assert not same_model(saved / checkpoint_name(2), saved / checkpoint_name(3))
    assert {c: int(v[0]) for c, v in client_vectors(tmp_path / "run").items()} == {0: 3, 1: 3, 2: 3}


@pytest.mark.parametrize("kind", ["ditto", "fedper"])
def test_a_virtual_round_left_out_leaves_the_usable_clients_personal_models_and_local_tensors_as_they_trained(
        tmp_path, kind):
    """Ditto's personal models and ``model.local`` tensors are each client's own: under a virtual clock a round with
    too few usable updates is left out (the model unchanged), and its usable clients keep what their training made
    of them, as a client dropped past its deadline does (the record's ``state_kept``), while the 2 that raised keep
    theirs as before the round. The final model and every client's vector equal, bitwise, the reference that
    trains round 2's usable clients and does not apply the round; on 2 and 3 client ranks alike."""
    sampled = sample_clients(4, 2, 8, 6)
    struck = sampled[:2]
    text = UNAPPLIED.format(rounds=3, struck=struck).replace("{name: scaffold, update: delta}", "{name: fedavg}")
    text = text.replace("device: cpu}", "device: cpu, ditto_lambda: 0.1}") if kind == "ditto" else \
        text.replace("hidden: [8]}}", "hidden: [8]}, local: ['3.*']}")
    cfg = write_config(tmp_path / "c.yaml", text)
    reference = ditto_reference if kind == "ditto" else personal_reference
    want_final, want_vectors = reference(load_config(cfg), dropped_in={2: set(struck)}, unapplied=frozenset({2}))
    for ranks in (3, 4):
        run = tmp_path / f"run{ranks}"
        result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(run), timeout=MPI_TIMEOUT)
        assert result.returncode == 0, result.stderr[-3000:]
        history = records(run)
        assert ["unapplied" in r for r in history] == [False, True, False]
        usable = [c for c in sampled if c not in struck]
        assert history[1]["state_kept"] == usable and "state_put_back" not in history[1]
        what = "Ditto personal models" if kind == "ditto" else "local tensors (model.local)"
        assert f"round 2: logical clients {range_list(usable)} sent usable updates to a round not applied; kept as " \
            f"this round's training left them, as a client's dropped past its deadline are: {what}" in result.stderr
        saved = run / "checkpoints"
        assert same_model(saved / checkpoint_name(1), saved / checkpoint_name(2))
        final, vectors = run_result(run)
        assert_bitwise(final, want_final)
        assert_bitwise(vectors, want_vectors)
    assert not same_model(tmp_path / "run3" / "checkpoints" / checkpoint_name(2),
                          tmp_path / "run3" / "checkpoints" / checkpoint_name(3))


def test_a_virtual_round_left_out_under_top_k_keeps_each_usable_clients_residual_the_same_on_any_ranks(tmp_path):
    """Top-k's error-feedback residuals are the client's own too: a left-out round's usable clients keep what their
    training left in them (what they sent is lost with the round, as a dropped client's is), a plug-in trainer's
    declared vectors are put back beside them (each client's count of its trainings leaves the round out), the run
    goes on, and 2 and 3 client ranks end with the same bits (model and every client's vector)."""
    sampled = sample_clients(4, 2, 8, 6)
    text = UNAPPLIED.format(rounds=3, struck=sampled[:2]).replace("{name: scaffold, update: delta}", "{name: fedavg}")
    text = text.replace("device: cpu}", "device: cpu, trainer: 'plugin_helpers:TrainingCounter'}") + \
        "compression: {method: topk, fraction: 0.3}\n"
    cfg = write_config(tmp_path / "c.yaml", text)
    runs = []
    for ranks in (3, 4):
        run = tmp_path / f"run{ranks}"
        result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(run), timeout=MPI_TIMEOUT)
        assert result.returncode == 0, result.stderr[-3000:]
        second = records(run)[1]
        usable = [c for c in sampled if c not in sampled[:2]]
        assert "unapplied" in second and second["state_put_back"] == usable == second["state_kept"]
        assert "put back as if not sampled: the trainer's per-client vectors; kept as this round's training left " \
            "them, as a client's dropped past its deadline are: error-feedback residuals" in result.stderr
        runs.append(run)
    assert same_model(runs[0] / "model.h5", runs[1] / "model.h5")
    same_vectors(client_vectors(runs[0]), client_vectors(runs[1]))
    counts = {c: int(v[-2]) for c, v in client_vectors(runs[0]).items()}  # each vector ends with the count, its mark
    assert counts == {c: sum(c in sample_clients(4, r, 8, 6) for r in (1, 3)) for c in counts}
    after, before = checkpoint_vectors(runs[0], 2), checkpoint_vectors(runs[0], 1)
    assert all(not np.array_equal(after[c], before.get(c, np.zeros_like(after[c]))) for c in usable)  # residuals


REFUSED = """
seed: 4
rounds: 4
clients: {num_clients: 8, per_round: 6, accept_failures: true}
data: {dataset: synthetic, kwargs: {num_samples: 480, num_features: 8, num_classes: 4}}
model: {name: "fl_helpers:ExplodingBeforeNorm"}
train: {lr: 0.1, batch_size: 8, device: cpu}
strategy: {name: scaffold, update: delta}
checkpoint: {every: 1, keep: 5}
eval: {every: 0}
output: {progress: false}
"""
# on 2 client ranks, rank 2 trains clients 1, 5 and 7 in rounds 1 and 2: client 1 is its 4th training, in round 2
EXPLODING = {"FL_HELPERS_EXPLODE_RANK": "2", "FL_HELPERS_EXPLODE_CALLS": "4"}


@pytest.mark.parametrize("case", ["scaffold-diverged", "feddyn-diverged", "scaffold-local-nan"])
def test_a_client_whose_update_is_refused_as_non_finite_ends_the_round_as_if_never_sampled(tmp_path, case):
    """Client 1, trained again in every later round, has its round-2 update refused: its training diverged in its
    BatchNorm's running variance only (Inf), so SCAFFOLD's control delta or FedDyn's g_i update, which read the
    parameters alone, were finite and kept; or a ``nan`` fault struck its shared layer while its ``model.local`` head
    stayed finite. Its c_i, g_i and local tensors are put back as before round 2, and the final model, c and every
    client's vector equal, bitwise, the reference that never trains client 1 in round 2."""
    text, env = REFUSED, EXPLODING
    if case == "feddyn-diverged":
        text = text.replace("{name: scaffold, update: delta}", "{name: feddyn, update: delta, weighting: equal}")
    if case == "scaffold-local-nan":
        text = text.replace('{name: "fl_helpers:ExplodingBeforeNorm"}', "{name: mlp, kwargs: {hidden: [8]}, "
                            "local: ['3.*']}") + "faults: [{kind: nan, clients: [1], rounds: [2]}]\n"
        env = {}
    cfg = write_config(tmp_path / "c.yaml", text)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), env=env, timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    history = records(tmp_path / "run")
    assert drops(history) == {2: {1}} and "NaN/Inf" in history[1]["dropped"][0]["reason"]
    assert all(1 in r["participants"] for r in history)  # its put-back state is read again
    state = "g_i" if case.startswith("feddyn") else "c_i"
    assert f"logical client 1 was dropped from the round it trained (past its deadline, its update refused or " \
        f"failed, or the round not applied): its {state} is put back" in result.stderr
    if case.startswith("feddyn"):
        want = feddyn_reference(load_config(cfg), dropped_in={2: {1}})
        assert_bitwise(run_controls_numbered(tmp_path / "run"), reference_controls_numbered(want))
        return
    want = scaffold_reference(load_config(cfg), dropped_in={2: {1}}, controls=True)
    clients = {int(k.removeprefix("client.")): want.pop(k) for k in [k for k in want if k.startswith("client.")]}
    assert_bitwise(run_controls_numbered(tmp_path / "run"), reference_controls_numbered(want))
    same_vectors(client_vectors(tmp_path / "run"), clients)  # c_i, then the local head and its mark
