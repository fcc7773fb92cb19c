"""Stalls and slowdowns under a virtual clock: they lengthen the struck task's virtual duration by exactly their
amount, no rank sleeps, and the run stays a function of the config and the seed on any number of ranks."""
from __future__ import annotations

import json
import math
import time

import pytest
import yaml
from conftest import MPI_TIMEOUT, run_mpi, same_model, write_config

from mpifl.clock.availability import Availability
from mpifl.clock.schedule import SyncClock
from mpifl.config import ConfigError, load_config
from mpifl.planning.faults import FaultPlan, Strike, delay_seconds
from mpifl.planning.federation import RoundAssignment
from mpifl.roles.records import fault_entries, round_strikes

# every client trains 5 steps of 8 samples at 0.01 virtual s each: 0.4 s of compute, the same for all
STEPS, BATCH, PER_SAMPLE = 5, 8, 0.01
COMPUTE = STEPS * BATCH * PER_SAMPLE
DEADLINE = 10_000.0
STALL = 3600.0  # slept, it would outlast the test's timeout many times over
FACTOR = 1000.0
BASE = f"""
seed: 3
rounds: 3
clients: {{num_clients: 8, per_round: 4}}
data: {{dataset: synthetic, kwargs: {{num_samples: 480, num_features: 8, num_classes: 4}}}}
model: {{name: mlp, kwargs: {{hidden: [8]}}}}
train: {{lr: 0.1, batch_size: {BATCH}, local_steps: {STEPS}}}
eval: {{every: 0}}
output: {{progress: false}}
clock: {{mode: sync, seconds_per_sample: {PER_SAMPLE}, speed_sigma: 0.0, bandwidth_sigma: 0.0, deadline: {DEADLINE}}}
"""


def config(text: str = BASE, faults: str = "[]", **clock):
    data = yaml.safe_load(text)
    data["clock"].update(clock)
    return load_config(None, data={**data, "faults": yaml.safe_load(faults)})


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_slowdown_multiplies_the_training_and_a_stall_adds_its_seconds_for_ever_being_infinite():
    plan = FaultPlan(config(faults="[{kind: slowdown, clients: [1], factor: 4}, {kind: stall, clients: [1], "
                                   "seconds: 7, stage: send}, {kind: stall, clients: [2]}]"))
    slow, stall = plan.strikes(1, 1, rank=1)
    assert delay_seconds(slow, 2.5) == 2.5 * 3 and delay_seconds(stall, 2.5) == 7.0
    assert plan.virtual_delay(1, 1, 1, compute_seconds=2.5) == 2.5 * 3 + 7.0
    assert plan.virtual_delay(1, 2, 1, compute_seconds=2.5) == math.inf
    assert plan.virtual_delay(1, 3, 1, compute_seconds=2.5) == 0.0
    assert all(plan.delays_virtually(s) for s in (slow, stall))
    assert not FaultPlan(config(faults="[{kind: stall, clients: [1], seconds: 7}]", mode="off")).virtual


@pytest.mark.parametrize("clock,message", [
    ({"deadline": None}, "faults[0].seconds: a stall for ever (0) never arrives in virtual time, so a round waits"),
    ({"mode": "fedbuff", "concurrency": 4, "buffer": 2}, "faults[0].seconds: a stall for ever (0) never ends in "
                                                         "virtual time, and clock.mode 'fedbuff' would keep"),
])
def test_a_stall_for_ever_is_refused_where_virtual_time_could_never_close_a_round_without_it(clock, message):
    text = BASE.replace("eval:", "strategy: {update: delta}\neval:") if clock.get("mode") == "fedbuff" else BASE
    with pytest.raises(ConfigError) as err:
        config(text, "[{kind: stall, clients: [1]}]", **clock)
    assert message in str(err.value)


def test_a_task_that_never_arrives_is_a_straggler_and_the_round_closes_at_the_deadline():
    cfg = config()
    clock = SyncClock(0, 4, Availability(cfg.clock, 4, 0), lambda r, c: math.inf if c == 2 else 1.0 + c, 9.0, 0.0)
    planned = clock.round(1)
    assert planned.selected == (0, 1, 2, 3) and planned.kept == (0, 1, 3) and planned.stragglers == (2,)
    assert planned.end == 9.0 and planned.wasted_seconds == 9.0  # it worked until the round closed


def test_a_straggler_made_late_by_a_stall_is_recorded_with_the_strike_and_its_rank_is_not_blamed():
    plan = FaultPlan(config(faults="[{kind: stall, clients: [3], seconds: 50}, {kind: raise, clients: [3]}]"))
    assignment = RoundAssignment(round=1, participants=(1, 5), train={2: [1, 5]}, streams={2: [1, 5]},
                                 clock={"stragglers": [3]})
    strikes = round_strikes(plan, assignment, home=lambda c: 2)
    assert strikes == [Strike(0, plan.faults[0], 1, 3, 2)]  # the raise never acted: client 3 never trained
    (entry,) = fault_entries(strikes, assignment, {})
    assert entry["outcome"] == "straggler" and "rank_clients_dropped" not in entry


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The run without faults, on 2 client ranks: its records say who trains in each round."""
    path = tmp_path_factory.mktemp("clean")
    cfg = write_config(path / "clean.yaml", BASE)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(path / "run"), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    return records(path / "run")


def faulted(tmp_path, clean, ranks: int):
    """Round 1: a slowdown on one participant; round 2: a stall at send on another; round 3: a stall for ever."""
    slowed, stalled, hung = clean[0]["participants"][0], clean[1]["participants"][1], clean[2]["participants"][2]
    faults = (f"\nfaults:\n  - {{kind: slowdown, clients: [{slowed}], factor: {FACTOR}, rounds: [1]}}\n"
              f"  - {{kind: stall, clients: [{stalled}], seconds: {STALL}, stage: send, rounds: [2]}}\n"
              f"  - {{kind: stall, clients: [{hung}], rounds: [3]}}\n")
    cfg = write_config(tmp_path / f"faulted{ranks}.yaml", BASE + faults)
    run_dir = tmp_path / f"faulted{ranks}"
    started = time.perf_counter()
    result = run_mpi(ranks + 1, "run", str(cfg), "--run-dir", str(run_dir), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, time.perf_counter() - started, result.stderr, (slowed, stalled, hung)


def test_stalls_and_slowdowns_move_only_virtual_time_by_their_amount_the_same_on_any_number_of_ranks(tmp_path, clean):
    two, seconds, err, (slowed, stalled, hung) = faulted(tmp_path, clean, 2)
    got = records(two)
    assert seconds < STALL / 10 and "injecting" not in err  # no rank slept: the clock took the delays
    # every task takes the same time here, so a round takes its slowest task's: the clean one's plus the delay
    assert got[0]["virtual_round_seconds"] == pytest.approx(clean[0]["virtual_round_seconds"]
                                                            + COMPUTE * (FACTOR - 1), abs=1e-9)
    assert got[1]["virtual_round_seconds"] == pytest.approx(clean[1]["virtual_round_seconds"] + STALL, abs=1e-9)
    assert got[2]["virtual_round_seconds"] == pytest.approx(DEADLINE, abs=1e-9)  # the hung task never arrives
    assert [r["participants"] for r in got[:2]] == [r["participants"] for r in clean[:2]]
    assert got[2]["participants"] == [c for c in clean[2]["participants"] if c != hung]
    assert [r["stragglers"] for r in got] == [[], [], [hung]] and all(not r["dropped"] for r in got)
    assert [[(f["client"], f["kind"], f["outcome"]) for f in r["faults"]] for r in got] == [
        [(slowed, "slowdown", "folded")], [(stalled, "stall", "folded")], [(hung, "stall", "straggler")]]
    three, _, _, _ = faulted(tmp_path, clean, 3)
    assert same_model(two / "model.h5", three / "model.h5")
    keys = ("participants", "virtual_time", "virtual_round_seconds", "stragglers", "wasted_seconds")
    assert [{k: r[k] for k in keys} for r in records(three)] == [{k: r[k] for k in keys} for r in got]
    assert [[{k: v for k, v in f.items() if k != "rank"} for f in r["faults"]] for r in records(three)] == \
        [[{k: v for k, v in f.items() if k != "rank"} for f in r["faults"]] for r in got]
