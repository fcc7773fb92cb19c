"""The config's ``faults:`` section: every kind of fault asked for in YAML, recorded, and the same bits every time."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from conftest import MPI_TIMEOUT, run_mpi, same_model, stopped_and_resumed, write_config
from reference import one_thread, reference_run

from mpifl.config import ConfigError, config_warnings, load_config
from mpifl.config.sections import FaultConfig
from mpifl.planning.faults import FaultPlan, Strike, drawn
from mpifl.planning.federation import RoundAssignment
from mpifl.roles.faults import flip_bits
from mpifl.roles.records import fault_entries, fault_line
from mpifl.storage.hdf5 import load_tensors
from mpifl.wire.protocol import UpdateMeta

BASE = """
seed: 4
rounds: 4
clients: {num_clients: 8, per_round: 6, accept_failures: true}
data: {dataset: synthetic, kwargs: {num_samples: 480, num_features: 8, num_classes: 4}}
model: {name: mlp, kwargs: {hidden: [8]}}
train: {lr: 0.1, batch_size: 8}
eval: {every: 0}
output: {progress: false}
"""


def config(faults: str):
    return load_config(None, data={**yaml.safe_load(BASE), "faults": yaml.safe_load(faults)})


@pytest.mark.parametrize("faults,message", [
    ("[{kind: raise}]", "faults[0]: name exactly one target: clients (ids), ranks (client ranks) or fraction"),
    ("[{kind: raise, clients: [1], ranks: [2]}]", "got clients, ranks"),
    ("[{kind: raise, clients: [8]}]", "faults[0].clients: [8] not below clients.num_clients=8"),
    ("[{kind: stall, clients: [1], factor: 2}]", "faults[0].factor: only a fault of kind 'slowdown' or 'scale' reads"),
    ("[{kind: nan, clients: [1], stage: send}]", "faults[0].stage: a 'nan' fault acts on the client's training"),
    ("[{kind: slowdown, ranks: [1], factor: 0.5}]", "faults[0].factor: a slowdown needs a factor above 1"),
    ("[{kind: raise, clients: [1]}, {kind: explode, clients: [1]}]", "faults[1].kind: 'explode' is not allowed"),
    ("[{kind: raise, client: [1]}]", "unknown key 'faults[0].client'; did you mean 'faults[0].clients'?"),
    ("{kind: raise, clients: [1]}", "faults: expected a list of mappings (one per item)"),
    ("[{kind: raise, clients: [a]}]", "faults[0].clients: expected a list of integers"),
    ("[{kind: exit, ranks: [1], code: 300}]", "faults[0].code: must be <= 255"),
    ("[{kind: lose, clients: [1]}]", "faults[0].stage: a 'lose' fault loses the client's update as it leaves, at stage "
                                     "'send', not 'train'"),
])
def test_a_fault_that_cannot_mean_one_thing_is_refused_naming_its_key(faults, message):
    with pytest.raises(ConfigError) as err:
        config(faults)
    assert message in str(err.value)


def test_a_fault_past_the_last_round_is_a_warning_as_a_resume_may_raise_rounds():
    assert "faults[0]: round 5 is past the run's last (rounds=4): it strikes only if a resume raises rounds" in \
        config_warnings(config("[{kind: raise, clients: [1], rounds: [5]}]"))


def test_rounds_beside_from_round_or_to_round_is_a_warning_as_the_rounds_alone_decide():
    both = config("[{kind: raise, clients: [1], rounds: [2], from_round: 3, to_round: 9}]")
    assert config_warnings(both) == ["faults[0]: rounds [2] decide when it strikes; from_round=3 and to_round=9 are "
                                     "ignored beside them: set one or the other"]  # to_round 9 > rounds: not said
    fault = both.faults[0]
    assert [r for r in range(1, 5) if fault.strikes_in(r, 4)] == [2]
    assert config_warnings(config("[{kind: raise, clients: [1], rounds: [2]}]")) == []
    assert config_warnings(config("[{kind: raise, clients: [1], from_round: 2, to_round: 3}]")) == []


def test_a_fraction_strikes_the_same_clients_on_any_rank_in_about_that_share_of_draws():
    plan = FaultPlan(config("[{kind: raise, fraction: 0.25}]"))
    struck = {(r, c) for r in range(1, 5) for c in range(8) if plan.strikes(r, c, rank=1)}
    assert struck == {(r, c) for r in range(1, 5) for c in range(8) if plan.strikes(r, c, rank=3)}
    share = np.mean([drawn(4, 0, r, c) < 0.25 for r in range(1, 201) for c in range(50)])
    assert abs(share - 0.25) < 0.01  # 10,000 independent draws


def test_rounds_from_to_and_targets_pick_exactly_the_strikes_asked_for():
    plan = FaultPlan(config("[{kind: raise, clients: [2], rounds: [1, 3]}, "
                            "{kind: slowdown, ranks: [2], factor: 3, from_round: 2, to_round: 3}]"))
    assert [(s.index, s.round) for r in range(1, 5) for s in plan.strikes(r, 2, rank=1)] == [(0, 1), (0, 3)]
    assert [s.round for r in range(1, 5) for s in plan.strikes(r, 5, rank=2)] == [2, 3]
    assert plan.bad_ranks(client_ranks=1) == "faults[1].ranks: [2] is not client ranks of this job (ranks 1..1)"


def test_a_corruption_flips_exactly_its_bits_the_same_ones_every_time():
    fault = config("[{kind: corrupt, clients: [1], bits: 5}]").faults[0]
    strike = Strike(0, fault, 2, 1, 1)
    flipped = []
    for _ in range(2):
        buffers = [torch.zeros(3, dtype=torch.float32), torch.zeros(7, dtype=torch.uint8)]
        flip_bits(buffers, 4, strike)
        bits = np.unpackbits(np.concatenate([b.view(torch.uint8).numpy().ravel() for b in buffers]))
        assert bits.sum() == 5
        flipped.append(bits)
    assert np.array_equal(*flipped)


DROPPING = """
- {kind: raise, clients: [1], rounds: [2]}
- {kind: nan, fraction: 0.25, from_round: 3}
- {kind: inf, clients: [0, 5], rounds: [1]}
- {kind: lose, fraction: 0.5, stage: send, rounds: [3]}
"""


def without_ranks(strikes: list[list[dict]]) -> list[list[dict]]:
    return [[{k: v for k, v in f.items() if k != "rank"} for f in round_] for round_ in strikes]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def faults_run(tmp_path, name: str, faults: str, ranks: int):
    cfg = write_config(tmp_path / f"{name}.yaml", BASE + "faults:" + faults)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / name), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    return cfg, tmp_path / name, result.stderr


def test_raised_nan_inf_and_lost_clients_are_dropped_as_recorded_bitwise_as_the_reference_without_them(tmp_path):
    cfg, three, err = faults_run(tmp_path, "three", DROPPING, 3)
    _, four, _ = faults_run(tmp_path, "four", DROPPING, 5)
    assert same_model(three / "model.h5", four / "model.h5")
    strikes = [r.get("faults", []) for r in records(three)]
    assert without_ranks(strikes) == without_ranks([r.get("faults", []) for r in records(four)])  # whatever rank
    sampled = [set(r["participants"]) for r in records(three)]  # 6 of 8 clients a round: a fault strikes those
    assert [(f["kind"], f["client"]) for f in strikes[0]] == [("inf", c) for c in sorted({0, 5} & sampled[0])]
    assert [(f["kind"], f["client"]) for f in strikes[1]] == [("raise", 1)] and 1 in sampled[1]
    assert all(f["outcome"] == "dropped" for round_ in strikes for f in round_)
    assert "InjectedFault: faults[0]: an injected exception in round 2" in strikes[1][0]["reason"]
    assert any(f["kind"] == "nan" for round_ in strikes[2:] for f in round_)
    lost = [f for f in strikes[2] if f["kind"] == "lose"]
    assert lost and all("LostUpdate: faults[3]: lost on its way to the server in round 3" in f["reason"] for f in lost)
    assert "round 2: faults[0] ('raise' at stage 'train') strikes logical client 1" in err
    dropped = {r["round"]: {d["client"] for d in r["dropped"]} for r in records(three)}
    assert dropped == {i + 1: {f["client"] for f in round_} for i, round_ in enumerate(strikes)}
    with one_thread():
        expected = reference_run(load_config(cfg), dropped_in=dropped)
    got = load_tensors(three / "model.h5")
    for name, value in expected.items():
        assert np.array_equal(got[name].numpy().view(np.uint32), value.view(np.uint32)), name


FOLDED = """
- {kind: corrupt, clients: [2], bits: 4, rounds: [1, 3]}
- {kind: scale, clients: [3], factor: -1}
- {kind: slowdown, ranks: [1], factor: 1.5, rounds: [2]}
- {kind: stall, clients: [4], seconds: 0.2, stage: send, rounds: [2]}
"""


def test_corrupted_scaled_slowed_and_stalled_updates_are_folded_as_recorded_the_same_bits_on_any_ranks(tmp_path):
    _, clean, _ = faults_run(tmp_path, "clean", " []\n", 3)
    _, three, _ = faults_run(tmp_path, "three", FOLDED, 3)
    _, four, _ = faults_run(tmp_path, "four", FOLDED.replace("ranks: [1]", "ranks: [4]"), 5)
    assert same_model(three / "model.h5", four / "model.h5")  # a slowdown and a stall change the time, not the bits
    assert not same_model(three / "model.h5", clean / "model.h5")
    kinds = [sorted((f["kind"], f["client"], f["outcome"]) for f in r.get("faults", [])) for r in records(three)]
    sampled = [set(r["participants"]) for r in records(three)]
    assert [[c for k, c, _ in round_ if k == "scale"] for round_ in kinds] == [[3] if 3 in s else [] for s in sampled]
    assert [[c for k, c, _ in round_ if k == "corrupt"] for round_ in kinds[::2]] == [
        [2] if 2 in s else [] for s in sampled[::2]]
    assert any(k == "slowdown" for k, _, _ in kinds[1]) and ("stall", 4, "folded") in kinds[1]
    assert all(outcome == "folded" for round_ in kinds for _, _, outcome in round_)
    assert all(not r["dropped"] for r in records(three))  # nothing checks for a scaled or corrupted value


def test_a_stall_lists_the_clients_its_rank_then_lost_to_the_deadline_beside_its_own_outcome():
    """Rank 2 trains clients 1 and 3: a stall at client 1's send lets its update arrive, and client 3 misses the
    straggler deadline; a `raise` on client 5 (rank 3) drops only itself, so it lists nobody."""
    stall = FaultConfig(kind="stall", clients=[1], seconds=8.0, stage="send")
    failure = FaultConfig(kind="raise", clients=[5], stage="train")
    plan = RoundAssignment(round=2, participants=(1, 3, 5, 7), train={2: [1, 3], 3: [5, 7]},
                           streams={2: [1, 3], 3: [5, 7]})
    late = "rank 2 was still training after 3.0 s, past the straggler deadline of 3 s (timeouts.straggler)"
    metas = {1: UpdateMeta(1, 10, 0.1), 3: UpdateMeta(3, 0, 0.0, error=late),
             5: UpdateMeta(5, 0, 0.0, error="InjectedFault"), 7: UpdateMeta(7, 0, 0.0, error=late)}
    entries = fault_entries([Strike(0, stall, 2, 1, 2), Strike(1, failure, 2, 5, 3)], plan, metas)
    assert entries[0]["outcome"] == "folded" and entries[0]["rank_clients_dropped"] == [3]
    assert entries[1]["outcome"] == "dropped" and "rank_clients_dropped" not in entries[1]
    assert fault_line(entries[0]) == ("faults[0] 'stall' on logical client 1 (rank 2): folded; the rank's logical "
                                      "client 3 then dropped past the deadline")


def test_a_run_with_faults_stopped_and_resumed_on_other_ranks_strikes_the_same_clients_and_ends_bitwise(tmp_path):
    cfg, whole, _ = faults_run(tmp_path, "whole", DROPPING, 3)
    rest = stopped_and_resumed(tmp_path, cfg, resume_ranks=4)
    assert "faults[0] ('raise' at stage 'train') strikes logical client 1" not in rest.stderr  # round 2 was done
    split = tmp_path / "split"
    assert same_model(split / "model.h5", whole / "model.h5")
    assert without_ranks([r.get("faults", []) for r in records(split)]) == \
        without_ranks([r.get("faults", []) for r in records(whole)])


def test_a_kill_strikes_once_so_a_resume_goes_past_it_and_ends_bitwise_as_a_run_without_it(tmp_path):
    """A kill (or an exit) ends the job; the round it struck is redone by the resume from the round before, which
    would be killed again for ever. The strike is recorded in the run directory before it acts, and a resume of
    that run goes past it: a node fails once. A new run in a fresh directory is struck again."""
    text = BASE.replace("accept_failures: true", "accept_failures: false") + \
        "checkpoint: {every: 1}\nfaults: [{kind: kill, ranks: [1], rounds: [3]}]\n"
    cfg = write_config(tmp_path / "c.yaml", text)
    run = tmp_path / "run"
    assert run_mpi(3, "run", str(cfg), "--run-dir", str(run)).returncode != 0
    assert sorted(p.name for p in (run / "faults-struck").iterdir()) == ["0-r3"]
    resumed = run_mpi(4, "run", str(cfg), "--run-dir", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4] and not any(r.get("faults") for r in records)
    reference = run_mpi(3, "run", str(cfg), "faults=[]", "--run-dir", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert same_model(run / "model.h5", tmp_path / "reference" / "model.h5")
