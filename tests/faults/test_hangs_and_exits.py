"""Under mpiexec: a silent rank at any stage, or any way out of user code, ends the job, named, losing nothing."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from conftest import (
    finish,
    kill_showing_stacks,
    mpifl_here,
    rounds_logged,
    run_mpi,
    same_model,
    spawn_mpi,
    wait_for,
    write_config,
)

from mpifl.errors import IN_A_NEW_RUN
from mpifl.storage.checkpointer import latest_checkpoint
from mpifl.storage.notes import read_rank_notes

DEADLINE = 3.0
TRAINING = f"""
seed: 1
rounds: 3
clients: {{num_clients: 4}}
data: {{dataset: synthetic, kwargs: {{num_samples: 400}}}}
model: {{name: mlp, kwargs: {{hidden: [16]}}}}
train: {{trainer: "faults.injectors:Injected", lr: 0.01}}
transport: {{chunk_mb: 0.001}}
eval: {{every: 0}}
timeouts: {{model_delivered: {DEADLINE}, first_update: {DEADLINE}, update_complete: {DEADLINE}}}
output: {{progress: false}}
"""
# Model chunks above MPI's eager limit: an Isend then completes only once the receiver takes it up.
LARGE_CHUNKS = TRAINING.replace("data: {dataset: synthetic, kwargs: {num_samples: 400}}\n", "").replace(
    "model: {name: mlp, kwargs: {hidden: [16]}}", "model: {name: blob, kwargs: {size_mb: 8, tensor_mb: 2}}").replace(
    "chunk_mb: 0.001", "chunk_mb: 1")


def run_with_fault(tmp_path, text: str, fresh: bool = False, **fault: str):
    """``text`` run on 3 ranks; ``fresh``: as a job of its own, each rank under its supervisor (which names a rank
    that leaves with status 0 past Python's cleanup), not in the suite's job pool."""
    cfg = write_config(tmp_path / "c.yaml", text)
    start = time.monotonic()
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=120,
                     env={k.upper(): str(v) for k, v in fault.items()}, fresh=fresh)
    return result, time.monotonic() - start


# From the config's faults: section, each on rank 2, which hosts logical clients 1 and 3 (stall with seconds 0: a hang)
HANG_IN_TRAINING = "faults: [{kind: stall, clients: [1], rounds: [2]}]\n"
HANG_AFTER_FIRST_CHUNK = "faults: [{kind: stall, clients: [1], rounds: [2], stage: send}]\n"
HANG_BEFORE_THE_MODEL = "faults: [{kind: stall, ranks: [2], rounds: [2], stage: receive}]\n"


@pytest.mark.parametrize("text,stage,client", [
    (TRAINING + HANG_IN_TRAINING, "first update", "logical client 1"),
    (TRAINING + HANG_AFTER_FIRST_CHUNK, "update complete", "logical client 1"),
    (LARGE_CHUNKS + HANG_BEFORE_THE_MODEL, "model delivered", "logical clients [1, 3]"),
], ids=["training", "sending", "receiving"])
def test_a_silent_rank_at_each_stage_ends_the_job_naming_it_and_keeps_the_last_round(tmp_path, text, stage, client):
    stage_of = {"first update": "train", "update complete": "send", "model delivered": "receive"}
    result, seconds = run_with_fault(tmp_path, text)
    assert result.returncode != 0
    assert "[rank 2] faults[0]: injecting 'stall' into logical client" in result.stderr, result.stderr[-3000:]
    assert f"rank 2 ({client}) made no progress for" in result.stderr, result.stderr[-3000:]
    assert f"at stage '{stage}', past its deadline of {DEADLINE:g} s" in result.stderr
    assert "the model after round 1 is in" in result.stderr
    # the stall for ever is named, and recorded as struck before it acted: a resume goes past it
    assert (f"faults[0] ('stall' at stage '{stage_of[stage]}', for ever) stalls it this round, recorded as struck, "
            "so a resume goes past it") in result.stderr, result.stderr[-3000:]
    assert seconds < 45  # round 1 and start-up, then its deadline of 3 s
    with latest_checkpoint(tmp_path / "run" / "checkpoints") as ckpt:
        assert ckpt.round == 1 and len(ckpt.metrics()) == 1


def test_a_rank_blocked_on_the_fold_order_is_not_blamed_while_an_earlier_client_still_trains(tmp_path):
    # Client 0 (rank 1) trains 8 s longer than the others. Rank 2's update of client 1 (8 chunks above the eager
    # limit) fills its receive slots and waits for client 0's chunks in the fold order, so rank 2 sends nothing
    # for longer than update_complete while the server has a header receive posted for it: it waits on the
    # server, not the reverse, and the round completes. (NIID-Bench's quantity skew put a client 10x larger than
    # the rest first in the order, and FedProx's round 2 was aborted.)
    text = LARGE_CHUNKS.replace("first_update: 3.0", "first_update: 120").replace(
        "num_clients: 4", "num_clients: 6") + "faults: [{kind: stall, clients: [0], rounds: [2], seconds: 8}]\n"
    result, seconds = run_with_fault(tmp_path, text)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "made no progress" not in result.stderr
    assert rounds_logged(tmp_path / "run") == [1, 2, 3]


@pytest.mark.parametrize("fault_rank", [1, 2])
def test_a_silent_rank_in_a_chain_over_several_groups_per_rank_ends_the_job_keeping_the_last_round(tmp_path,
                                                                                                    fault_rank):
    # 4 groups on 2 client ranks: the running sum goes 1 -> 2 -> 1 -> 2 -> server; one rank goes silent in round 2
    text = TRAINING.replace("chunk_mb: 0.001", "chunk_mb: 0.001, reduce: chain").replace(
        "clients: {num_clients: 4}", "clients: {num_clients: 4, groups: 4}")
    result, seconds = run_with_fault(tmp_path, text, fault="hang", fault_call=3, fault_rank=fault_rank)
    assert result.returncode != 0
    # the server waits on the rank of the chain's last hop, 2, whatever rank stalled: it says that it may be another
    assert ("rank 2 (the last hop of the chain over reduction groups 0-3 on ranks 1-2, which waits on each of them) "
            "made no progress for") in result.stderr, result.stderr[-3000:]
    assert "the model after round 1 is in" in result.stderr
    assert seconds < 60
    with latest_checkpoint(tmp_path / "run" / "checkpoints") as ckpt:
        assert ckpt.round == 1 and len(ckpt.metrics()) == 1


def test_under_accept_failures_a_silent_rank_is_dropped_the_rounds_complete_and_the_job_still_fails_naming_it(
        tmp_path):
    text = TRAINING.replace("clients: {num_clients: 4}", "clients: {num_clients: 4, accept_failures: true}")
    result, _ = run_with_fault(tmp_path, text, fault="hang", fault_call=3)  # rank 2 (clients 1, 3) hangs in round 2
    assert result.returncode != 0
    # noticed within a poll of the deadline; a loaded machine may print 3.1 s
    assert re.search(rf"round 2: rank 2 \(logical client 1\) made no progress for 3\.\d s at stage 'first update', "
                     rf"past its deadline of {DEADLINE:g} s \(timeouts.first_update\); dropped from round 2",
                     result.stderr), result.stderr[-3000:]
    # round 3 does not wait for it again: its clients are left out as if not sampled
    assert ("round 3: rank 2 is still training round 2, from which it was dropped: logical clients 1,3 left out of it "
            "as if not sampled, not waited for") in result.stderr, result.stderr[-3000:]
    assert re.search(r"rank 2 was dropped from round 2 and has sent nothing of logical clients \[1, 3\] for 3\.\d s "
                     r"\(the limit is 3 s, timeouts.first_update\); every round is on disk", result.stderr)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(d["client"] for d in r["dropped"]) for r in records] == [[], [1, 3], [1, 3]]
    with latest_checkpoint(tmp_path / "run" / "checkpoints") as ckpt:
        assert ckpt.round == 3
    # the results are complete, and the run directory says so: the final model, and a status that a job script's
    # resubmission chain takes as done (before, no model.h5, and 'not complete; continue with --resume' for ever)
    assert (tmp_path / "run" / "model.h5").is_file()
    status = run_mpi(1, "status", str(tmp_path / "run"))
    assert status.returncode == 0, status.stdout
    assert re.search(r"^complete; the job then failed: JobFailure: rank 2 was dropped from round 2", status.stdout,
                     re.M), status.stdout


@pytest.mark.parametrize("fault,message", [
    ("{kind: exit, clients: [3], rounds: [1], code: 0}", "SystemExit(0) inside the run"),
    ("{kind: exit, clients: [3], rounds: [1], code: 3, via: os, stage: send}", "os._exit(3) called inside the run"),
    ("{kind: raise, ranks: [2], rounds: [2], stage: receive}", "InjectedFault: faults[0]: an injected exception"),
    ("{kind: kill, clients: [1], rounds: [2], stage: send}", "Killed (signal 9)"),
    ("{kind: exit, clients: [3], rounds: [1], code: 7}",
     "SystemExit(7) inside the run asked for by the config's faults[0] ('exit' in round 1)"),
    ("{kind: exit, clients: [3], rounds: [1], code: 0, via: c}",
     "left with exit status 0 before mpifl run finished (the config's faults[0] ('exit' in round 1), as asked, past "
     "Python's cleanup)"),
], ids=["sys.exit(0) in training", "os._exit(3) after a chunk", "a raise before the model", "SIGKILL after a chunk",
        "sys.exit(7) in training", "C's _exit(0) in training"])
def test_any_way_out_asked_for_in_the_faults_section_ends_the_job_with_a_message(tmp_path, fault, message):
    result, seconds = run_with_fault(tmp_path, TRAINING + f"faults: [{fault}]\n", fresh="via: c" in fault)
    assert result.returncode != 0
    if "SystemExit(7)" in message:  # a sys.exit's own code is the job's: the rank aborts every rank with it
        assert result.returncode == 7, result.stderr[-3000:]
    assert "rank 2" in result.stderr and message in result.stderr, result.stderr[-3000:]
    assert seconds < 45


def test_an_interrupt_in_user_code_ends_the_job_with_a_message(tmp_path):
    result, seconds = run_with_fault(tmp_path, TRAINING, fault="interrupt", fault_call=2)
    assert result.returncode != 0
    assert "[mpifl rank 2 on" in result.stderr and "interrupted (KeyboardInterrupt)" in result.stderr
    assert seconds < 45


def test_a_failing_trainer_is_reported_naming_its_logical_client_rank_and_round(tmp_path):
    """An injected raise strikes again on a resume: the message and ``mpifl status`` say to change the faults section
    first, naming the fault, not to ``--resume``."""
    result, _ = run_with_fault(tmp_path, TRAINING + "faults: [{kind: raise, clients: [1], rounds: [2]}]\n")
    assert result.returncode != 0
    assert ("logical client 1 on rank 2 failed in round 2: InjectedFault: faults[0]: an injected exception in round 2 "
            "(clients.accept_failures=false); faults[0] ('raise') strikes logical client 1 again on a resume, so a "
            f"--resume fails the same way: change the faults section {IN_A_NEW_RUN}") in result.stderr, \
        result.stderr[-3000:]
    status = mpifl_here("status", str(tmp_path / "run"))
    assert status.stdout.rstrip().endswith("rank 2 failed (reason above); change the config (its faults section: "
                                           f"faults[0]) {IN_A_NEW_RUN}: a --resume fails the same way"), status.stdout


def test_a_rank_stalled_past_its_deadline_by_the_configs_fault_names_it_and_says_a_resume_stalls_again(tmp_path):
    """A stall of some seconds, mid-stream of a many-chunk update, ends the job at stage 'update complete'; it is not
    a stall for ever, so a resume redoing the round is stalled again: the message names the fault and says so, and
    ``mpifl status`` advises changing the faults section, not ``--resume``."""
    result, _ = run_with_fault(
        tmp_path, TRAINING + "faults: [{kind: stall, clients: [1], rounds: [2], stage: send, seconds: 8}]\n")
    assert result.returncode != 0
    assert re.search(r"round 2: rank 2 \(logical client 1\) made no progress for [0-9.]+ s at stage 'update "
                     r"complete', past its deadline of 3 s \(timeouts.update_complete\): faults\[0\] \('stall' at "
                     r"stage 'send', 8 s\) stalls it this round; the model after round 1 is in \S+; faults\[0\] stalls "
                     "rank 2 "
                     "again on a resume, so a --resume fails the same way: change the faults section in a new run "
                     r"directory \(a resume keeps the run's config\)",
                     result.stderr), result.stderr[-3000:]
    status = mpifl_here("status", str(tmp_path / "run"))
    assert status.stdout.rstrip().endswith(f"change the config (its faults section: faults[0]) {IN_A_NEW_RUN}: a "
                                           "--resume fails the same way"), status.stdout


def test_a_stall_that_keeps_a_rank_holding_client_state_from_the_checkpoint_names_the_fault_and_its_resume(tmp_path):
    """Under accept_failures the stalled rank's clients are dropped from round 2, but the checkpoint after it needs
    that rank's per-client state (SCAFFOLD's c_i) and the rank is still stalled: the job ends, and since the stall
    strikes again on a resume, the message and ``mpifl status`` name the fault and advise a new run, not --resume."""
    text = TRAINING.replace('train: {trainer: "faults.injectors:Injected", lr: 0.01}', "train: {lr: 0.01}").replace(
        "clients: {num_clients: 4}", "clients: {num_clients: 4, accept_failures: true}")
    result, _ = run_with_fault(tmp_path, text + "strategy: {name: scaffold, update: delta}\ncheckpoint: {every: 1}\n"
                               "faults: [{kind: stall, ranks: [2], rounds: [2], seconds: 8}]\n")
    assert result.returncode != 0
    assert re.search(r"round 2: rank 2 \(its per-client state for the checkpoint of round 2\) made no progress for "
                     r"[0-9.]+ s.*: faults\[0\] \('stall' at stage 'train', 8 s\) stalls it this round; faults\[0\] "
                     r"stalls rank 2 again on a resume, so a --resume fails the same way: change the faults section "
                     r"in a new run directory", result.stderr), result.stderr[-3000:]
    status = mpifl_here("status", str(tmp_path / "run"))
    assert status.stdout.rstrip().endswith(f"change the config (its faults section: faults[0]) {IN_A_NEW_RUN}: a "
                                           "--resume fails the same way"), status.stdout


def test_the_run_directory_maps_every_pid_to_its_rank(tmp_path):
    result, _ = run_with_fault(tmp_path, TRAINING)
    assert result.returncode == 0, result.stderr
    rows = (tmp_path / "run" / "ranks.txt").read_text().splitlines()
    assert rows[0].split()[:3] == ["rank", "host", "pid"] and [r.split()[0] for r in rows[1:]] == ["0", "1", "2"]


def test_sigterm_during_a_stuck_round_saves_the_last_round_and_exits_promptly(tmp_path):
    text = TRAINING.replace(f"first_update: {DEADLINE}", "first_update: 600")
    cfg = write_config(tmp_path / "c.yaml", text)
    reference = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr
    run_dir = tmp_path / "run"
    proc = spawn_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), env={"FAULT": "hang", "FAULT_CALL": "3"})
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and rounds_logged(run_dir) == [1], proc, "round 1")
    time.sleep(1.0)  # rank 2 is now silent inside round 2's training, far from its 600 s deadline
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # what PBS sends at walltime; mpiexec forwards it to every rank
    code, err = finish(proc, timeout=60)
    # a stop on request, not a failure: exit 3 as after any stop, so a batch script resubmits it, and status says so
    assert code == 3 and "stopped on request, aborting the job" in err, err[-3000:]
    assert "SIGTERM arrived and it stayed silent 5 s more" in err, err[-3000:]
    assert time.monotonic() - sent < 5 + 10
    with latest_checkpoint(run_dir / "checkpoints") as ckpt:
        assert ckpt.round == 1
    status = mpifl_here("status", str(run_dir))
    assert "not complete: stopped on request after round 1" in status.stdout, status.stdout
    resumed = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert same_model(run_dir / "model.h5", tmp_path / "reference" / "model.h5")
    assert rounds_logged(run_dir) == [1, 2, 3]



def rank_pid(run_dir, rank: int) -> int:
    """The pid of ``rank``'s own process, from ranks.txt."""
    return int(next(r.split()[2] for r in (run_dir / "ranks.txt").read_text().splitlines()[1:]
                    if r.split()[0] == str(rank)))


def test_a_rank_killed_from_outside_is_named_with_its_signal_in_the_log_and_by_status(tmp_path):
    """``kill -9`` of rank 2's process while it trains round 2, as the kernel's OOM killer does on a cluster: its
    supervisor says which rank died, on which host, by which signal, before the job ends, and notes it, so that
    ``mpifl status`` names rank 2. Before, every rank's note said only that it was in a round, and status that
    the ranks "stopped together"."""
    cfg = write_config(tmp_path / "c.yaml", TRAINING.replace(f"first_update: {DEADLINE}", "first_update: 600"))
    run_dir = tmp_path / "run"
    proc = spawn_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), env={"FAULT": "hang", "FAULT_CALL": "3"})
    wait_for(lambda: read_rank_notes(run_dir).get(2, {}).get("round") == 2, proc, "rank 2 in round 2")
    worker = rank_pid(run_dir, 2)  # its own process, not its supervisor: hung in round 2, far from its 600 s deadline
    os.kill(worker, signal.SIGKILL)
    code, err = finish(proc, timeout=60)
    assert code != 0
    assert re.search(rf"^\[mpifl rank 2 on \S+\] its process \(pid {worker}\) was killed by signal 9 \(SIGKILL\): "
                     r"the kernel's OOM killer, or a kill -9; the job ends$", err, re.M), err[-3000:]
    status = mpifl_here("status", str(run_dir))
    assert re.search(rf"^  rank 2: last heard of at .*, state 'failed' in round 2: its process \(pid {worker}\) "
                     r"was killed by signal 9 \(SIGKILL\)", status.stdout, re.M), status.stdout
    assert "did not finish; rank 2 was killed by SIGKILL (reason above)" in status.stdout, status.stdout


def test_sigusr1_prints_where_each_rank_is_and_the_suite_shows_it_for_a_job_it_gives_up_on(tmp_path):
    """``kill -USR1 PID`` prints every thread's Python stack on that rank and leaves it running: the way to see
    where a rank that seems hung is. The suite's helpers send it to every rank before killing a job that hung."""
    text = TRAINING.replace(f"first_update: {DEADLINE}", "first_update: 600")
    cfg, run_dir, mark = write_config(tmp_path / "c.yaml", text), tmp_path / "run", tmp_path / "fault-time"
    proc = spawn_mpi(3, "run", str(cfg), "--run-dir", str(run_dir),
                     env={"FAULT": "hang", "FAULT_CALL": "3", "FAULT_MARK": str(mark)})
    wait_for(mark.exists, proc, "rank 2 stuck in round 2")
    pids = {int(row.split()[0]): int(row.split()[2]) for row in (run_dir / "ranks.txt").read_text().splitlines()[1:]}
    os.kill(pids[1], signal.SIGUSR1)
    time.sleep(1.0)
    assert proc.poll() is None  # the rank asked went on
    kill_showing_stacks(proc.pid)
    err = proc.communicate()[1]
    assert err.count("Current thread 0x") >= 4, err[-3000:]  # rank 1 asked once, then all 3 ranks
    assert re.search(r'injectors.py", line \d+ in misbehave', err), err[-3000:]  # where rank 2 hangs

# The defaults: no timeouts set, the built-in trainer; a plug-in model that hangs where the environment says.
DEFAULTS = """
seed: 1
rounds: 3
clients: {num_clients: 4}
data: {dataset: synthetic, kwargs: {num_samples: 400}}
model: {name: "faults.injectors:stalling_mlp"}
eval: {every: 0}
output: {progress: false}
"""


def test_a_rank_stuck_before_any_round_is_timed_ends_the_default_job_naming_it(tmp_path):
    """Stuck in model construction, or in the first training step. A default job's deadline there derives from
    the other ranks with a floor of 30 s; the jobs run with a floor of 3 s (FAULT_FLOOR), so that the test waits
    out the same derived deadline, not the floor's 30 s, and the two run at once."""
    from mpifl.config import TimeoutsConfig
    from mpifl.roles.launch import STARTUP_FACTOR, startup_limit
    from mpifl.wire.watchdog import FIRST_UPDATE, STALL_FACTOR, Watchdog, default_deadlines

    # the defaults the jobs run under, but for the floor: 10x the other ranks' time, at least 30 s
    assert STARTUP_FACTOR == STALL_FACTOR == 10 and startup_limit([0.2], 1 << 20) == 30 == startup_limit([0.01], 0)
    assert startup_limit([4.0], 1 << 20) == 40
    deadlines = default_deadlines(TimeoutsConfig(), chunk_bytes=1 << 20, inflight=4, slowest_train_seconds=None)
    watchdog = Watchdog(deadlines, 1, {1: [0, 2], 2: [1, 3]})
    assert deadlines.derive_first_update and watchdog.limit(FIRST_UPDATE, 2) == 300  # nobody has reported
    watchdog.first_report[1] = 0.2
    assert watchdog.limit(FIRST_UPDATE, 2) == 30 and watchdog.limit(FIRST_UPDATE, 1) == 300
    watchdog.first_report[1] = 4.0
    assert watchdog.limit(FIRST_UPDATE, 2) == 40

    floor = 3
    stages = {"hang_build": r"did not finish 'model build' within (\d+) s \(10x the slowest of the ranks that did, "
                            r"(\d+\.\d) s\)",
              "hang_forward": rf"at stage 'first update', past its deadline of \d+(\.\d+)? s \(timeouts.first_update "
                              rf"unset and no round timed yet: 10x the other ranks' first report, at least {floor} s"}
    start, jobs = time.monotonic(), {}
    for fault in stages:
        cfg = write_config(tmp_path / f"{fault}.yaml", DEFAULTS)
        jobs[fault] = spawn_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / fault),
                                env={"FAULT": fault, "FAULT_FLOOR": str(floor)})
    try:
        for fault, proc in jobs.items():
            code, err = finish(proc, timeout=120)
            assert code != 0, fault
            said = re.search(stages[fault], err)
            assert "rank 2" in err and said, err[-3000:]
            if fault == "hang_build":  # the limit it waited: the floor, or 10x the slowest other rank's build
                assert abs(float(said[1]) - max(floor, 10 * float(said[2]))) <= 1, said[0]
            assert time.monotonic() - start < 60  # start-up, then a derived deadline, not the fallback of 300 s
    finally:
        for proc in jobs.values():
            if proc.poll() is None:  # a failed check above leaves no job behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


def test_a_rank_that_leaves_through_c_exit0_fails_the_job_and_is_named_by_the_run_directory(tmp_path):
    text = TRAINING.replace("rounds: 3", "rounds: 6").replace(f"first_update: {DEADLINE}", "first_update: 20")
    result, _ = run_with_fault(tmp_path, text, fault="c_exit0", fault_call=2)
    # MPICH kills the other ranks at once, and without the rank's supervisor (mpifl.cli.supervisor) it reported 0
    assert result.returncode != 0
    assert "[rank 2] mpifl: this rank (PID" in result.stderr, result.stderr[-3000:]
    assert "left with exit status 0 before mpifl run finished" in result.stderr
    # the run directory says what happened too (the job scripts check `mpifl status` afterwards: test_pbs_resume)
    status = run_mpi(1, "status", str(tmp_path / "run"))  # the post-mortem a job's epilogue prints
    assert status.returncode == 1 and "not complete" in status.stdout, status.stdout + status.stderr
    assert "rank 2: last heard of at" in status.stdout and "in round 1" in status.stdout, status.stdout
