"""The config's ``faults:`` section: every kind of fault asked for in YAML, recorded, and the same bits every time."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import yaml
from conftest import MPI_TIMEOUT, mpifl_here, run_mpi, same_model, stopped_and_resumed, write_config
from reference import one_thread, reference_run
from results import recorded_on_any_rank_count

from mpifl.aggregation.kernels import count_nonfinite
from mpifl.config import ConfigError, config_warnings, load_config
from mpifl.config.sections import FaultConfig
from mpifl.errors import IN_A_NEW_RUN
from mpifl.planning.faults import FaultPlan, Strike, drawn, fault_summary
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


def test_a_scale_fault_with_factor_1_is_a_warning_so_that_a_sweep_over_the_factor_can_hold_the_clean_baseline():
    scaled = config("[{kind: scale, clients: [1], factor: 1}]")
    assert scaled.faults[0].factor == 1
    assert config_warnings(scaled) == ["faults[0].factor: a scale fault with factor 1 changes nothing: the run is the "
                                       "clean baseline; -1 flips the update's sign"]
    assert config_warnings(config("[{kind: scale, clients: [1], factor: -1}]")) == []


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
    # fraction 0 is a target that strikes nobody: a sweep's clean point (--grid faults.0.fraction=0,0.1,0.3)
    none = FaultPlan(config("[{kind: raise, fraction: 0}]"))
    assert not any(none.strikes(r, c, rank=1) for r in range(1, 5) for c in range(8))


def test_rounds_from_to_and_targets_pick_exactly_the_strikes_asked_for():
    plan = FaultPlan(config("[{kind: raise, clients: [2], rounds: [1, 3]}, "
                            "{kind: slowdown, ranks: [2], factor: 3, from_round: 2, to_round: 3}]"))
    assert [(s.index, s.round) for r in range(1, 5) for s in plan.strikes(r, 2, rank=1)] == [(0, 1), (0, 3)]
    assert [s.round for r in range(1, 5) for s in plan.strikes(r, 5, rank=2)] == [2, 3]
    assert plan.bad_ranks(client_ranks=1) == "faults[1].ranks: [2] is not client ranks of this job (ranks 1..1)"


def test_validate_says_what_each_fault_does_to_whom_and_when():
    cfg = config("[{kind: scale, clients: [0, 1, 3], factor: -5}, {kind: noise, fraction: 0.25, std: 1.5, "
                 "rounds: [3, 1]}, {kind: kill, ranks: [2], rounds: [3], stage: send}, "
                 "{kind: exit, ranks: [1, 2], from_round: 2, to_round: 3, code: 7}]")
    assert [fault_summary(f) for f in cfg.faults] == [
        "scale (factor -5) on clients 0-1,3, rounds 1-end",
        "noise (std 1.5) on 25% of trained clients, rounds 1,3",
        "kill on rank 2, round 3, at stage send",
        "exit (code 7, via sys) on ranks 1-2, rounds 2-3"]


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
    assert recorded_on_any_rank_count(three) == recorded_on_any_rank_count(four)  # but the ranks named
    strikes = [r.get("faults", []) for r in records(three)]
    sampled = [set(r["participants"]) for r in records(three)]  # 6 of 8 clients a round: a fault strikes those
    assert [(f["kind"], f["client"]) for f in strikes[0]] == [("inf", c) for c in sorted({0, 5} & sampled[0])]
    assert [(f["kind"], f["client"]) for f in strikes[1]] == [("raise", 1)] and 1 in sampled[1]
    assert all(f["outcome"] == "dropped" for round_ in strikes for f in round_)
    assert "InjectedFault: faults[0]: an injected exception in round 2" in strikes[1][0]["reason"]
    assert any(f["kind"] == "nan" for round_ in strikes[2:] for f in round_)
    poisoned = [f for round_ in strikes for f in round_ if f["kind"] in ("nan", "inf")]  # not a diverged training
    assert all(f"NaN/Inf values, put there by faults[{f['fault']}] ('{f['kind']}')" in f["reason"] for f in poisoned)
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


def test_a_struck_client_whose_usable_update_went_to_a_round_not_applied_is_recorded_unapplied_not_folded():
    """Under a virtual clock a round with too few usable updates leaves the model unchanged: a struck client that
    still sent a usable update (a slowdown) was not folded, and its entry says why the round was not applied; the
    failed one is dropped as ever."""
    slowdown = FaultConfig(kind="slowdown", clients=[1], factor=2.0)
    failure = FaultConfig(kind="raise", clients=[5], stage="train")
    plan = RoundAssignment(round=2, participants=(1, 5), train={1: [1, 5]}, streams={1: [1, 5]},
                           clock={"stragglers": []})
    metas = {1: UpdateMeta(1, 10, 0.1), 5: UpdateMeta(5, 0, 0.0, error="InjectedFault")}
    why = "round 2: only 1 of 2 participants sent a usable update, fewer than clients.min_participants=2"
    strikes = [Strike(0, slowdown, 2, 1, 1), Strike(1, failure, 2, 5, 1)]
    applied, unapplied = fault_entries(strikes, plan, metas), fault_entries(strikes, plan, metas, unapplied=why)
    assert [e["outcome"] for e in applied] == ["folded", "dropped"]
    assert [e["outcome"] for e in unapplied] == ["unapplied", "dropped"] and unapplied[0]["reason"] == why
    assert fault_line(unapplied[0]) == f"faults[0] 'slowdown' on logical client 1 (rank 1): unapplied ({why})"


def test_a_stall_for_ever_strikes_once_too_so_a_resume_of_the_job_it_ended_goes_past_it(tmp_path):
    """Rank 1 hangs in round 3; past the first-update deadline the job ends keeping round 2. Redone by a resume,
    round 3 would hang again for ever, so the stall is recorded before it acts, as a kill is."""
    text = BASE.replace("accept_failures: true", "accept_failures: false") + (
        "checkpoint: {every: 1}\ntimeouts: {first_update: 4}\n"
        "faults: [{kind: stall, ranks: [1], seconds: 0, rounds: [3]}]\n")
    cfg, run = write_config(tmp_path / "c.yaml", text), tmp_path / "run"
    first = run_mpi(3, "run", str(cfg), "--run-dir", str(run), fresh=True)
    assert first.returncode != 0 and "rank 1" in first.stderr, first.stderr[-3000:]
    assert sorted(p.name for p in (run / "faults-struck").iterdir()) == ["0-r3"]
    resumed = run_mpi(4, "run", str(cfg), "--run-dir", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = run_mpi(3, "run", str(cfg), "faults=[]", "--run-dir", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert same_model(run / "model.h5", tmp_path / "reference" / "model.h5")


POISONING = """
seed: 0
rounds: 3
clients: {num_clients: 8, fraction: 0.5}
data: {dataset: digits, partition: dirichlet, alpha: 1.0}
model: {name: mlp, kwargs: {hidden: [128, 64]}}
train: {optimizer: sgd, lr: 0.1, momentum: 0.9, local_epochs: 2, batch_size: 32}
eval: {every: 0}
output: {progress: false}
checkpoint: {every: 1}
faults:
  - {kind: corrupt, clients: [3], bits: 64, rounds: [2]}
"""


def test_a_corruption_that_makes_the_global_model_non_finite_is_never_saved_and_strikes_once(tmp_path):
    """The 64 flipped bits of client 3's update in round 2 put an Inf into the new global model: every update
    passed its client's check, so the server's check of the finished model is what stops it. A resume on other
    ranks goes past the strike, as past a kill, and ends bitwise as the run without it."""
    cfg, run = write_config(tmp_path / "poison.yaml", POISONING), tmp_path / "poisoned"
    first = run_mpi(3, "run", str(cfg), "--run-dir", str(run), fresh=True)
    assert first.returncode != 0
    assert ("round 2: the new global model has 1 NaN/Inf value, though every update passed its client's NaN/Inf "
            "check: faults[0] ('corrupt') struck logical client 3 (rank 2) this round") in first.stderr, \
        first.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-r000001.h5"]
    assert (run / "faults-struck" / "0-r2").exists()
    resumed = run_mpi(4, "run", str(cfg), "--run-dir", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("faults[0] ('corrupt' at stage 'train') ended an earlier attempt of this run in this round "
            "(faults-struck/0-r2), striking logical client 3 (rank 2) then: it strikes once, so nobody now") \
        in resumed.stderr, resumed.stderr[-3000:]
    # the rank it struck in the attempt it ended (3 ranks), not client 3's rank now (4 ranks)
    assert records(run)[1]["faults"] == [{"fault": 0, "kind": "corrupt", "stage": "train", "client": 3, "rank": 2,
                                          "bits": 64, "outcome": "ended an earlier attempt"}]
    clean = run_mpi(3, "run", str(cfg), "faults=[]", "--run-dir", str(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert same_model(run / "model.h5", tmp_path / "clean" / "model.h5")


def test_the_servers_nonfinite_count_sees_nan_and_inf_in_any_float_dtype_and_skips_integers():
    values = torch.zeros(10)
    values[[1, 4, 9]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert count_nonfinite([values]) == 3 and count_nonfinite([values.to(torch.bfloat16)]) == 3
    assert count_nonfinite([torch.arange(5)]) == 0


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
    first = run_mpi(3, "run", str(cfg), "--run-dir", str(run), fresh=True)  # fresh: each rank's supervisor
    assert first.returncode != 0
    # one kill of rank 1, logged once for the rank, and its supervisor names the fault, not the OOM killer
    struck = re.findall(r"round 3: faults\[0\] \('kill' at stage 'train'\) strikes rank 1 \(its logical clients "
                        r"([0-9,-]+) this round\) once, at the first it trains, which ends the job", first.stderr)
    assert len(struck) == 1 and "strikes logical client" not in first.stderr, first.stderr[-3000:]
    assert "killed by signal 9 (SIGKILL): the config's faults[0] ('kill' in round 3), as asked" in first.stderr
    assert "OOM" not in first.stderr
    assert sorted(p.name for p in (run / "faults-struck").iterdir()) == ["0-r3"]
    then = json.loads((run / "faults-struck" / "0-r3").read_text())
    assert then["kind"] == "kill" and then["rank"] == 1
    status = mpifl_here("status", str(run))  # the launcher's message names only a PID
    assert status.returncode == 1 and ("faults[0] ('kill', asked for in config.yaml) ended the job in round 3 "
                                       "(faults-struck/0-r3); a resume goes past it") in status.stdout, status.stdout
    resumed = run_mpi(4, "run", str(cfg), "--run-dir", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    spent = [f for r in records for f in r.get("faults", [])]  # redone round 3 says why nobody is killed now
    # once, on the client and rank it killed then: on 4 ranks rank 1 hosts other clients, never struck
    assert spent == [{"fault": 0, "kind": "kill", "stage": "train", "client": then["client"], "rank": 1,
                      "outcome": "ended an earlier attempt"}]
    assert resumed.stderr.count("ended an earlier attempt") == 1, resumed.stderr[-3000:]
    assert (f"(faults-struck/0-r3), striking logical client {then['client']} (rank 1) then: it strikes once, so "
            "nobody now") in resumed.stderr
    assert [r["round"] for r in records if r.get("faults")] == [3]
    assert "faults[0] ('kill' at stage 'train') ended an earlier attempt of this run in this round" in resumed.stderr
    reference = run_mpi(3, "run", str(cfg), "faults=[]", "--run-dir", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert same_model(run / "model.h5", tmp_path / "reference" / "model.h5")


EVERY_CLIENT_RAISES_IN_ROUND_2 = "[{kind: raise, fraction: 1.0, rounds: [2]}]\ncheckpoint: {every: 1, keep: 4}\n"


def test_a_round_whose_every_client_fails_by_the_configs_faults_ends_a_real_time_run_saying_a_resume_would_too(
        tmp_path):
    """clock.mode off: clients.min_participants ends the job; the faults strike the same clients on a resume, so the
    message and ``mpifl status`` say to change the config, not to ``--resume``."""
    cfg = write_config(tmp_path / "off.yaml", BASE + "faults: " + EVERY_CLIENT_RAISES_IN_ROUND_2)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "off"), timeout=MPI_TIMEOUT)
    assert result.returncode != 0
    assert "round 2: only 0 of 6 participants sent a usable update, fewer than clients.min_participants=1" \
        in result.stderr
    assert "faults[0] ('raise') strikes logical clients 0-1,4-7 again on a resume, so a --resume fails the same " \
        f"way: change the faults section {IN_A_NEW_RUN}" in result.stderr
    assert "continue with --resume" not in result.stderr and "Traceback" not in result.stderr
    status = mpifl_here("status", str(tmp_path / "off"))
    assert f"change the config (its faults section: faults[0]) {IN_A_NEW_RUN}: a --resume fails the same way" \
        in status.stdout
    assert "continue with --resume" not in status.stdout


def test_a_virtual_round_whose_every_client_fails_leaves_the_model_unchanged_and_the_run_goes_on(tmp_path):
    """clock.mode sync: a round whose kept clients all raise is left out as one with too few on time is: the model
    stays as it was, the record says why and names them, and the later rounds run."""
    cfg = write_config(tmp_path / "sync.yaml", BASE + "clock: {mode: sync}\nfaults: " + EVERY_CLIENT_RAISES_IN_ROUND_2)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "sync"), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = records(tmp_path / "sync")
    assert [r["round"] for r in steps] == [1, 2, 3, 4]
    assert [("unapplied" in r, len(r["dropped"])) for r in steps] == [(False, 0), (True, 6), (False, 0), (False, 0)]
    assert "fewer than clients.min_participants=1; the round is not applied" in steps[1]["unapplied"]
    assert "the model stays as it was (under a virtual clock, as when too few updates arrive in time)" in result.stderr
    saved = tmp_path / "sync" / "checkpoints"
    assert same_model(saved / "ckpt-r000001.h5", saved / "ckpt-r000002.h5")
    assert not same_model(saved / "ckpt-r000002.h5", saved / "ckpt-r000003.h5")


ATTACK = """
seed: 0
rounds: 6
clients: {num_clients: 6, per_round: 6, accept_failures: true}
data: {dataset: digits, partition: iid}
model: {name: mlp, kwargs: {hidden: [32]}}
train: {optimizer: sgd, lr: 0.1, momentum: 0.9, local_epochs: 1, batch_size: 32}
eval: {every: 1}
checkpoint: {every: 1}
output: {progress: false}
faults: [{kind: scale, clients: [0, 1], factor: -1.0e+6}]
"""


def test_an_attack_that_drives_fedavg_to_diverge_is_named_and_below_quorum_keep_runs_it_to_its_last_round(tmp_path):
    """Two clients' updates scaled by -1e6 drive FedAvg's model to overflow: in round 5 every update is NaN/Inf.
    By default that round ends the job, and the message and ``mpifl status`` name the fault, which strikes again
    on a resume, and the way to run it out; with clients.below_quorum='keep' the diverged rounds leave the model as
    it was and the run finishes, as a result (the same bits stopped and resumed on another rank count)."""
    cfg = write_config(tmp_path / "attack.yaml", ATTACK)
    aborted = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "split"), fresh=True)
    assert aborted.returncode != 0
    assert ("round 5: only 0 of 6 participants sent a usable update, fewer than clients.min_participants=1; the round "
            "is not applied; the model after round 4 is in") in aborted.stderr, aborted.stderr[-3000:]
    assert ("faults[0] ('scale') strikes logical clients 0-1 this round, and the updates it alters can drive the "
            "model to diverge (every update here is unusable); it strikes again on a resume, so a --resume fails the "
            f"same way: change the faults section {IN_A_NEW_RUN}, or set clients.below_quorum='keep' (a resume may) "
            "to let such a run go on to its last round, as a result") in aborted.stderr
    status = mpifl_here("status", str(tmp_path / "split"))
    assert "change the config (its faults section: faults[0])" in status.stdout, status.stdout
    resumed = run_mpi(4, "run", str(cfg), "clients.below_quorum=keep", "--run-dir", str(tmp_path / "split"),
                      "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the model stays as it was (clients.below_quorum='keep') and the run goes on" in resumed.stderr
    records = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if "unapplied" in r] == [5, 6]
    whole = run_mpi(3, "run", str(cfg), "clients.below_quorum=keep", "--run-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert same_model(tmp_path / "whole" / "model.h5", tmp_path / "split" / "model.h5")
