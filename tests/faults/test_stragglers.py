"""Under mpiexec, with clients.accept_failures: a rank past its deadline is dropped from the round, bitwise.

Streams are tagged by round (protocol.round_tag), so what a dropped rank still sends can never be
taken for the next round's updates; rank 0 drains it meanwhile and the rank rejoins at the next round.
"""
from __future__ import annotations

import json
import re
import signal
import time

import numpy as np
import pytest
import yaml
from conftest import MPI_TIMEOUT, finish, mpifl_here, run_mpi, spawn_mpi, wait_for, write_config
from reference import reference_run

from mpifl.config import load_config
from mpifl.storage.checkpointer import missing_residuals
from mpifl.storage.hdf5 import Checkpoint, load_tensors
from mpifl.wire import protocol
from mpifl.wire.watchdog import STRAGGLER_FACTOR, STRAGGLER_FLOOR_SECONDS, StragglerRule

STRAGGLING = """
seed: 3
rounds: 3
clients: {num_clients: 6, per_round: 6, accept_failures: true}
data: {dataset: digits, partition: iid}
model: {name: "fl_helpers:tiny_mlp"}
train: {trainer: "fl_helpers:Straggling", lr: 0.02}
timeouts: {straggler: 2}
eval: {every: 0}
output: {progress: false}
"""


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


STALL_SECONDS = 3.0  # rank 2's first client of round 2: many rounds' worth, twice a 1.5 s straggler deadline


def drops(history: list[dict]) -> dict[int, set[int]]:
    """The clients dropped in each round that dropped any."""
    return {r["round"]: {d["client"] for d in r["dropped"]} for r in history if r["dropped"]}


@pytest.mark.parametrize("overrides", [(), ("clients.groups=3",), ("clients.placement=per_round",)],
                         ids=["per-client streams", "reduction groups", "placed per round"])
def test_a_rank_that_stays_slow_is_dropped_then_not_waited_for_until_it_rejoins_bitwise(tmp_path, overrides):
    """Rank 2 stalls for many rounds' worth in round 2. It is dropped from round 2 at the straggler deadline; each
    later round it is still training leaves it out (its clients as if not sampled, or, placed per round, dealt to
    the ready ranks) instead of waiting; it rejoins at the newest round once its late updates are in. The result
    equals the reference that leaves out exactly the dropped clients."""
    # 30 rounds of at least 2 clients x 0.05 s on each client rank: 3 s or more, past what the stall has left once
    # rank 2 is dropped (3 - 1.5 s), so it rejoins before the end
    text = STRAGGLING.replace("rounds: 3", "rounds: 30").replace("straggler: 2", "straggler: 1.5")
    cfg = write_config(tmp_path / "s.yaml", text)
    env = {"FL_HELPERS_CLIENT_SECONDS": "0.05", "FL_HELPERS_SLOW_RANK": "2", "FL_HELPERS_SLOW_CALLS": "3",
           "FL_HELPERS_SLOW_FACTOR": str(STALL_SECONDS / 0.05)}
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    history = records(tmp_path / "run")
    by_round = {r["round"]: r for r in history}
    dropped = drops(history)  # on a loaded machine other ranks may be dropped too: the reference follows the record
    per_round = "clients.placement=per_round" in overrides
    stalled = [d for d in by_round[2]["dropped"] if d["rank"] == 2]
    assert stalled and (per_round or {d["client"] for d in stalled} == {1, 4})  # rank 2 hosts 1 and 4 unless per round
    assert all("past the straggler deadline of 1.5 s (timeouts.straggler)" in d["reason"] for d in stalled)
    if per_round:  # round 3 is dealt to the ready ranks: nobody waits for rank 2, nobody is left out for it
        assert "2" not in by_round[3]["ranks"] and len(by_round[3]["participants"]) == 6
        assert not any("left out of this round as if not sampled" in d["reason"] for r in history for d in r["dropped"])
    else:  # round 3 leaves rank 2's clients out instead of waiting for it
        busy = [r["round"] for r in history if any("rank 2 was still training round 2" in d["reason"]
                                                    for d in r["dropped"])]
        assert busy and busy[0] == 3, busy
        assert {d["client"] for d in by_round[3]["dropped"] if d["rank"] == 2} == {1, 4}
        assert "round 3: rank 2 is still training round 2" in result.stderr
    assert "2" in history[-1]["ranks"]  # it rejoined
    # what rank 2 spent on round 2 is counted where its discarded header landed, not lost from the totals
    assert sum(r["cost"].get("late_cpu_seconds", 0.0) for r in history) > 0
    assert "round 2: rank 2's late updates of logical clients" in result.stderr
    want = reference_run(load_config(None, list(overrides), data=yaml.safe_load(text)), dropped_in=dropped)
    got = load_tensors(tmp_path / "run" / "model.h5")
    for name, value in want.items():
        assert np.array_equal(got[name].float().numpy(), value), name


def test_a_straggler_that_cannot_be_dropped_for_clients_min_participants_is_waited_for_and_the_log_says_so(tmp_path):
    """Both client ranks stall past the 1.5 s straggler deadline in round 2: rank 1 is dropped, and dropping rank 2
    too would leave no usable update, so it is waited for, said once for the round and rank, not silently."""
    text = STRAGGLING.replace("rounds: 3", "rounds: 2").replace("straggler: 2", "straggler: 1.5").replace(
        'train: {trainer: "fl_helpers:Straggling", lr: 0.02}', "train: {lr: 0.02}") + (
        "faults: [{kind: stall, clients: [0], seconds: 2.5, rounds: [2]}, "
        "{kind: stall, clients: [1], seconds: 4, rounds: [2]}]\n")
    cfg = write_config(tmp_path / "s.yaml", text)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    waited = re.findall(r"round 2: rank 2 was still training after [0-9.]+ s, past the straggler deadline of 1.5 s "
                        r"\(timeouts.straggler\); waited for, not dropped: dropping logical clients 1,3,5 would leave "
                        r"0 usable updates, fewer than clients.min_participants=1", result.stderr)
    assert len(waited) == 1, result.stderr[-3000:]
    assert {d["client"] for d in records(tmp_path / "run")[1]["dropped"]} >= {0, 2, 4}


def test_without_accept_failures_nobody_is_dropped_for_being_slow(tmp_path):
    cfg = write_config(tmp_path / "s.yaml", STRAGGLING.replace("accept_failures: true", "accept_failures: false"))
    env = {"FL_HELPERS_CLIENT_SECONDS": "0.05", "FL_HELPERS_SLOW_RANK": "2", "FL_HELPERS_SLOW_CALLS": "3,4"}
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"), "timeouts.straggler=0.2", env=env,
                     timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(r["dropped"] == [] for r in records(tmp_path / "run"))
    want = reference_run(load_config(None, data=yaml.safe_load(STRAGGLING)))
    got = load_tensors(tmp_path / "run" / "model.h5")
    assert all(np.array_equal(got[name].float().numpy(), value) for name, value in want.items())


def test_round_tags_never_meet_each_other_or_the_fixed_tags_and_fit_every_mpi():
    kinds = (protocol.MODEL, protocol.META, protocol.UPDATE, protocol.REDUCE_META, protocol.REDUCE)
    fixed = {protocol.HEADER, protocol.INIT, protocol.RESIDUALS, protocol.STARTUP, protocol.PROGRESS}
    tags = [protocol.round_tag(k, r) for r in range(protocol.ROUND_TAG_CYCLE) for k in kinds]
    assert len(set(tags)) == len(tags)
    assert not fixed & set(tags)
    assert max(tags) <= 32767  # the least MPI_TAG_UB the standard allows
    assert protocol.round_tag(protocol.UPDATE, 7) != protocol.round_tag(protocol.UPDATE, 8)


@pytest.mark.parametrize("fixed,finished,ranks,limit", [
    (5.0, [], 4, 5.0),  # timeouts.straggler: that, from the start
    (None, [], 4, None),  # derived: nothing measured yet
    (None, [1.0], 4, None),  # fewer than half the ranks have finished
    (None, [1.0, 2.0], 4, STRAGGLER_FLOOR_SECONDS),  # half have: 3x the slowest, but never under the floor
    (None, [100.0, 30.0], 3, STRAGGLER_FACTOR * 100.0),
])
def test_the_straggler_deadline_is_set_or_derived_from_the_ranks_that_finished(fixed, finished, ranks, limit):
    assert StragglerRule(fixed).limit(finished, ranks) == limit


def test_under_virtual_time_a_rank_slow_on_this_machine_is_not_dropped_and_the_result_does_not_change(tmp_path):
    """Under a virtual clock.mode the virtual clock alone decides who is a straggler: a rank slow in real time (here
    3 s in round 2, past the 1.5 s wall-clock straggler deadline that drops it in real time) is waited for, so the
    records and the model equal those of a run where nobody is slow, and the straggler setting is warned of."""
    text = STRAGGLING.replace("straggler: 2", "straggler: 1.5") + "clock: {mode: sync, seconds_per_sample: 0.01}\n"
    cfg = write_config(tmp_path / "s.yaml", text)
    fast = {"FL_HELPERS_CLIENT_SECONDS": "0.05"}
    slow = {**fast, "FL_HELPERS_SLOW_RANK": "2", "FL_HELPERS_SLOW_CALLS": "3",
            "FL_HELPERS_SLOW_FACTOR": str(STALL_SECONDS / 0.05)}
    runs = {}
    for name, env in (("fast", fast), ("slow", slow)):
        result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / name), env=env, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = records(tmp_path / name)
    assert "timeouts.straggler: a wall-clock straggler deadline is not applied under virtual time" in result.stderr
    assert not drops(runs["slow"]) and not any(r["stragglers"] for r in runs["slow"])
    assert [r["virtual_time"] for r in runs["slow"]] == [r["virtual_time"] for r in runs["fast"]]
    fast_model, slow_model = (load_tensors(tmp_path / name / "model.h5") for name in ("fast", "slow"))
    assert all(np.array_equal(fast_model[k].numpy(), slow_model[k].numpy()) for k in fast_model)


def test_a_checkpoint_waits_for_a_dropped_rank_still_sending_its_late_update_and_the_run_completes(tmp_path):
    """FedDyn keeps per-client state, so round 3's checkpoint asks every client rank for its clients' vectors. Rank 2,
    dropped from round 3 while stalled, then sends that round's late update before it reads the checkpoint's order,
    and its send may wait for the server to take it up (the home rank of the state it borrowed, placed per round,
    waits for it in turn). The server drains late updates while it waits, so the rank answers and the run completes;
    it used to wait for the answer alone and end the job after timeouts.first_update, naming the rank, in about one
    run of two (found by a new user with a plug-in's state)."""
    text = """
seed: 0
rounds: 4
clients: {num_clients: 8, per_round: 4, accept_failures: true, placement: per_round}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [32]}}
train: {lr: 0.1}
strategy: {name: feddyn}
checkpoint: {every: 1}
timeouts: {straggler: 3, first_update: 15}
eval: {every: 0}
faults: [{kind: stall, clients: [2], rounds: [3], seconds: 6}]
output: {progress: false}
"""
    cfg = write_config(tmp_path / "c.yaml", text)
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "made no progress" not in result.stderr
    history = records(tmp_path / "run")
    assert [r["round"] for r in history] == [1, 2, 3, 4] and drops(history)[3] == {2}
    assert "round 3: rank 2's late updates of logical clients [2] arrived" in result.stderr


def slow_last_round(factor: int, sigterm_grace: float | None = None) -> str:
    """A 2-round run whose client 1 (rank 2) is slowed ``factor`` times in round 2, the last, while it reports
    progress (each client trains FL_HELPERS_CLIENT_SECONDS): dropped at the 1 s straggler deadline, it still owes
    that round's update when the rounds are done."""
    grace = f", sigterm_grace: {sigterm_grace:g}" if sigterm_grace is not None else ""
    return f"""
seed: 0
rounds: 2
clients: {{num_clients: 4, per_round: 4, accept_failures: true}}
data: {{dataset: digits, partition: iid}}
model: {{name: "fl_helpers:tiny_mlp"}}
train: {{trainer: "fl_helpers:Straggling", lr: 0.02}}
timeouts: {{straggler: 1, first_update: 3{grace}}}
eval: {{every: 0}}
faults: [{{kind: slowdown, clients: [1], rounds: [2], factor: {factor}}}]
output: {{progress: false}}
"""


def test_the_end_of_the_run_waits_for_a_rank_dropped_from_the_last_round_while_it_keeps_reporting_progress(
        tmp_path):
    """A ``slowdown`` on rank 2 in round 2, the last, makes it train about 8 s while it reports progress. Dropped at
    the straggler deadline (1 s), it owes round 2's late update when the rounds are done, and the end of the run
    waits for it as long as it reports, well past timeouts.first_update (3 s), then the job ends 0. The end of the
    run used to count only late chunks, not progress reports, and ended the job after 3 s, naming rank 2 as silent
    (found by a new user with a slowdown in the last round, 4 times in 4; a checkpoint's wait counted them)."""
    text = slow_last_round(factor=161)
    cfg, run_dir = write_config(tmp_path / "c.yaml", text), tmp_path / "run"
    # each client trains 0.05 s, so the slowdown adds 160 x 0.05 = 8 s to client 1's (on rank 2)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), env={"FL_HELPERS_CLIENT_SECONDS": "0.05"},
                     timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "has sent nothing" not in result.stderr
    assert [r["round"] for r in records(run_dir)] == [1, 2] and 1 in drops(records(run_dir))[2]
    late = re.search(r"round 2: rank 2's late updates of logical clients \[[\d, ]+\] arrived (\d+\.\d) s after it "
                     r"was dropped", result.stderr)
    assert late and float(late.group(1)) > 3 + 1, result.stderr[-3000:]  # past first_update, with a margin
    assert (run_dir / "model.h5").is_file()


def test_a_sigterm_while_the_end_of_the_run_waits_on_a_reporting_rank_ends_the_job_within_the_grace(tmp_path):
    """As above, but rank 2's slowdown in the last round lasts about 60 s, and a SIGTERM (what PBS sends before the
    walltime) arrives while the end of the run waits for it. What it still owes would be discarded and every
    round is on disk, so the wait lasts timeouts.sigterm_grace more and the job ends as stopped on request (exit
    3), not at the walltime; status says the run is complete."""
    text = slow_last_round(factor=1201, sigterm_grace=2)
    cfg, run_dir = write_config(tmp_path / "c.yaml", text), tmp_path / "run"
    proc = spawn_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), env={"FL_HELPERS_CLIENT_SECONDS": "0.05"})
    wait_for(lambda: (run_dir / "model.h5").exists(), proc, "the last round's model.h5")
    time.sleep(1.0)  # the end of the run now waits for rank 2, which reports progress for about a minute more
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc, timeout=60)
    assert code == 3 and "SIGTERM arrived while rank 2 still owed the late updates" in err, err[-3000:]
    assert time.monotonic() - sent < 2 + 15
    assert [r["round"] for r in records(run_dir)] == [1, 2]
    status = mpifl_here("status", str(run_dir))  # a job script's resubmission then stops: the run is complete
    assert status.returncode == 0 and re.search(r"^complete; the job then failed: JobFailure: SIGTERM arrived",
                                                status.stdout, re.M), status.stdout


def test_a_rank_silent_through_the_last_checkpoint_still_leaves_the_trained_model_and_the_job_fails_naming_it(
        tmp_path):
    """FedDyn keeps per-client state and checkpoint.every is 0, so the last round's checkpoint is the run's only one,
    and it asks every client rank for its clients' vectors. Rank 2 stalls silently in round 2 (the last): dropped
    at the straggler deadline, it stays silent past timeouts.first_update while the checkpoint waits for it. The
    trained model is published all the same (model.h5, every round's metrics) and the job then ends non-zero
    naming the rank, the round and the deadline, as a rank silent at the end of the run does; the checkpoint,
    which lacks rank 2's clients' state, says so, and cannot resume a longer run. It used to end the job with no
    checkpoint at all: the whole run lost (found by a new user with FedDyn and a 4 s first_update)."""
    text = """
seed: 0
rounds: 2
clients: {num_clients: 4, per_round: 4, accept_failures: true}
data: {dataset: digits, partition: iid}
model: {name: mlp, kwargs: {hidden: [16]}}
train: {lr: 0.1}
strategy: {name: feddyn}
checkpoint: {every: 0}
timeouts: {straggler: 1, first_update: 2}
eval: {every: 0}
faults: [{kind: stall, clients: [1], rounds: [2], seconds: 8}]
output: {progress: false}
"""
    cfg, run_dir = write_config(tmp_path / "c.yaml", text), tmp_path / "run"
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), timeout=120)
    assert result.returncode != 0
    assert re.search(r"round 2: rank 2 \(its per-client state for the checkpoint of round 2\) made no progress for "
                     r"2\.\d s at stage 'first update', past its deadline of 2 s \(timeouts.first_update\)",
                     result.stderr), result.stderr[-3000:]
    assert [r["round"] for r in records(run_dir)] == [1, 2] and drops(records(run_dir))[2] == {1, 3}
    model = load_tensors(run_dir / "model.h5")
    assert model and all(np.isfinite(t.float().numpy()).all() for t in model.values())
    status = run_mpi(1, "status", str(run_dir))
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(r"^complete; the job then failed: JobFailure: round 2: rank 2 ", status.stdout, re.M), \
        status.stdout
    with Checkpoint(run_dir / "model.h5") as ckpt:  # the model is whole; rank 2's clients' state is not in it
        assert ckpt.round == 2 and "rank 2" in (missing_residuals(ckpt) or "")
    longer = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), "--resume", str(run_dir / "model.h5"),
                     "rounds=3", timeout=60)
    assert longer.returncode == 2, longer.stdout + longer.stderr
    assert "cannot resume" in longer.stderr and "rank 2 stayed silent" in longer.stderr, longer.stderr
    again = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), "--resume", timeout=60)  # a job script's next
    assert again.returncode == 0 and "run already complete" in again.stdout + again.stderr, again.stderr
    finished = (run_dir / "model.h5").read_bytes()
    raised = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), "--resume", "rounds=3", timeout=60)
    assert raised.returncode == 2, raised.stdout + raised.stderr  # not a fresh start over the finished model
    assert "holds a finished run (model.h5) but no checkpoint that a run of 3 rounds can go on from" in raised.stderr
    assert (run_dir / "model.h5").read_bytes() == finished and [r["round"] for r in records(run_dir)] == [1, 2]


def test_a_rank_that_trained_in_time_while_the_round_waited_on_another_is_not_dropped_as_a_straggler(tmp_path):
    """Both client ranks are dropped from round 2 (one stalls 2.5 s, the other 6 s, past a 1.5 s deadline), so
    round 3 waits for them to finish round 2 before it can send them its model. Rank 1 takes up round 3's model
    long before the server, still sending to rank 2, begins taking up updates, and trains its clients in time:
    the time it then waits for the server is not training. It is dropped from no later round (it was dropped from
    round 3 as 'still training after 1.9 s', and so left out of round 4 too)."""
    text = STRAGGLING.replace("rounds: 3", "rounds: 4").replace("straggler: 2", "straggler: 1.5").replace(
        'train: {trainer: "fl_helpers:Straggling", lr: 0.02}', "train: {lr: 0.02}").replace(
        "num_clients: 6, per_round: 6", "num_clients: 10, per_round: 10")
    text += ("faults: [{kind: stall, clients: [8], seconds: 2.5, rounds: [2]}, "
             "{kind: stall, clients: [1], seconds: 6, rounds: [2]}]\n")
    cfg = write_config(tmp_path / "s.yaml", text)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "round 3: ranks 1-2 are still training rounds they were dropped from" in result.stderr  # it waited
    assert drops(records(tmp_path / "run")) == {2: {1, 3, 5, 7, 8, 9}}, result.stderr[-3000:]
