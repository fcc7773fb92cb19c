"""Clients as batch jobs in virtual time (clock.availability: queue): queue waits, walltimes, preemption, or a
Standard Workload Format trace; tasks cut short by a job's end are lost or carried on; bitwise and resumable."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROOT, run_mpi, same_model, stopped_and_resumed, write_config

from mpifl.clock.queue import QueueAvailability, online_stretches, read_swf
from mpifl.clock.schedule import SyncClock


def model(checkpoint: bool = False, num_clients: int = 6) -> QueueAvailability:
    return QueueAvailability(num_clients, 7, wait_median=300.0, wait_sigma=1.0, walltime=900.0,
                             preemption_rate=1 / 1500, checkpoint=checkpoint)


def test_each_client_runs_one_job_at_a_time_within_its_walltime_and_the_draws_are_its_own():
    queue = model()
    for client in range(6):
        runs = queue.runs(client, until=20_000.0)
        assert all(a < b <= a + 900.0 for a, b, _ in runs)
        assert all(b1 <= a2 for (_, b1, _), (a2, _, _) in zip(runs, runs[1:]))  # a job waits for the last to end
        assert all((b - a < 900.0 - 1e-6) == cut for a, b, cut in runs)  # a preempted job stops short
    assert any(cut for c in range(6) for _, _, cut in queue.runs(c, 20_000.0))
    assert model(num_clients=12).runs(3, 20_000.0) == queue.runs(3, 20_000.0)  # client 3's jobs, whatever N
    t = 5000.0
    assert list(queue.online(t)) == [any(a <= t < b for a, b, _ in queue.runs(c, t + 1)) for c in range(6)]


def test_a_task_past_its_job_s_end_is_lost_or_with_checkpoints_carried_on_in_the_next_jobs():
    runs = model().runs(0, 20_000.0)
    (a, b, _), (a2, _, _) = runs[0], runs[1]
    assert model().finish(0, a, 10.0).at == a + 10.0
    lost = model().finish(0, a, (b - a) + 1.0)
    assert lost.at is None and lost.lost_at == b
    carried = model(checkpoint=True).finish(0, a, (b - a) + 1.0)
    assert carried.at == pytest.approx(a2 + 1.0) and carried.continued
    with pytest.raises(ValueError, match="has no job running"):  # between jobs (every job waits in the queue)
        model().finish(0, (b + a2) / 2, 1.0)


SWF = """; Version: 2.2
; a trace the test writes: job, submit, wait, run, procs, cpu, mem, req procs, req time, req mem, status, ...
1 0 100 1000 1 -1 -1 1 1000 -1 1 1 1 -1 1 1 -1 -1
2 10 50 400 1 -1 -1 1 1000 -1 5 1 1 -1 1 1 -1 -1
3 20 -1 400 1 -1 -1 1 1000 -1 1 1 1 -1 1 1 -1 -1
4 30 2000 600 1 -1 -1 1 1000 -1 1 1 1 -1 1 1 -1 -1
5 40 0 300 1 -1 -1 1 1000 -1 0 1 1 -1 1 1 -1 -1
"""


def test_a_standard_workload_format_trace_deals_its_jobs_to_the_clients_in_submit_order(tmp_path):
    trace = tmp_path / "t.swf"
    trace.write_text(SWF)
    runs = read_swf(str(trace), num_clients=2)
    # job 3 has no known wait: skipped; jobs 1, 4 to client 0 and 2, 5 to client 1, each at its own submit + wait
    assert runs == {0: [(100.0, 1100.0, False), (2030.0, 2630.0, False)],
                    1: [(60.0, 460.0, True), (40.0, 340.0, True)]}
    trace.write_text(SWF + "6 50 0\n")
    with pytest.raises(ValueError, match=r"t.swf' line 8: a job line needs at least 11 fields"):
        read_swf(str(trace), 2)


def test_a_job_line_needs_the_eleven_fields_mpifl_reads_not_all_eighteen_and_a_refusal_says_so(tmp_path):
    trace = tmp_path / "t.swf"
    trace.write_text("1 0 100 1000 1 -1 -1 1 1000 -1 1\n")  # fields 12-18 (nodes, queue, ...) are never read
    assert read_swf(str(trace), 1) == {0: [(100.0, 1100.0, False)]}
    trace.write_text("1 0 100 1000 1 -1 -1 1 1000 -1\n")
    with pytest.raises(ValueError) as refused:
        read_swf(str(trace), 1)
    assert str(refused.value) == (f"clock.queue_trace {str(trace)!r} line 1: a job line needs at least 11 fields (the "
                                  "Standard Workload Format has 18; mpifl reads 2-4, 9 and 11), this one has 10")


@pytest.mark.parametrize("fields, named", [("0 -50 1000", "wait -50"), ("0 10 -7", "run time -7")],
                         ids=["wait", "run-time"])
def test_a_negative_wait_or_run_time_other_than_unknown_is_refused_naming_its_line(tmp_path, fields, named):
    """SWF writes -1 for a time it does not know, and those jobs are skipped; any other negative time is no time at
    all, and skipping it silently would deal every later job to another client."""
    trace = tmp_path / "t.swf"
    trace.write_text(SWF + f"6 {fields} 1 -1 -1 1 1000 -1 1\n")
    with pytest.raises(ValueError) as refused:
        read_swf(str(trace), 2)
    assert str(refused.value) == (f"clock.queue_trace {str(trace)!r} line 8: {named} is negative (SWF writes -1 "
                                  "for unknown)")


def test_jobs_that_never_ran_are_skipped_and_a_trace_of_only_those_says_how_many(tmp_path):
    trace, without = tmp_path / "t.swf", tmp_path / "without.swf"
    trace.write_text(SWF + "6 45 5 0 1 -1 -1 1 1000 -1 5\n")  # run time 0: cancelled in the queue
    without.write_text(SWF)
    assert read_swf(str(trace), 2) == read_swf(str(without), 2)
    trace.write_text("1 0 -1 100 1 -1 -1 1 100 -1 1\n2 5 3 0 1 -1 -1 1 100 -1 5\n")
    with pytest.raises(ValueError) as refused:
        read_swf(str(trace), 2)
    assert str(refused.value) == (f"clock.queue_trace {str(trace)!r} holds no job with a known wait and a run time "
                                  "above 0 (2 job(s) skipped: wait or run time -1, or run time 0)")


def test_jobs_submitted_in_the_same_second_go_to_clients_in_the_files_order(tmp_path):
    """Real traces submit many jobs in one second; SWF numbers them in the file's order. Job 2 waits less than job 1
    but is still the second job, so client 1's."""
    trace = tmp_path / "t.swf"
    trace.write_text("1 0 100 50 1 -1 -1 1 50 -1 1\n2 0 10 50 1 -1 -1 1 50 -1 1\n")
    assert read_swf(str(trace), 2) == {0: [(100.0, 150.0, False)], 1: [(10.0, 60.0, False)]}


@pytest.mark.parametrize("line", [
    "1 18 763 nan 1 -1 -1 1 1800 -1 1 4 1 -1 1 1 -1 -1",  # run time
    "1 18 nan 1800 1 -1 -1 1 1800 -1 1 4 1 -1 1 1 -1 -1",  # wait
    "1 inf 763 1800 1 -1 -1 1 1800 -1 1 4 1 -1 1 1 -1 -1",  # submit
    "1 18 763 1800 1 -1 -1 1 -inf -1 1 4 1 -1 1 1 -1 -1",  # requested time
    "1 18 763 1800 1 -1 -1 1 1800 -1 inf 4 1 -1 1 1 -1 -1",  # status
], ids=["nan-run", "nan-wait", "inf-submit", "inf-requested", "inf-status"])
def test_a_job_line_with_a_time_that_is_not_a_finite_number_is_refused_naming_its_line(tmp_path, line):
    """``float`` reads 'nan' and 'inf'; a NaN wait or run time passes the skip test for unknown (-1) ones and would
    put a job nowhere, changing the schedule without a word."""
    trace = tmp_path / "t.swf"
    trace.write_text(SWF + line + "\n")
    with pytest.raises(ValueError) as refused:
        read_swf(str(trace), 2)
    assert str(refused.value) == (f"clock.queue_trace {str(trace)!r} line 8: fields 2-4, 9 and 11 must be finite "
                                  f"numbers (submit, wait and run time; requested time; status), got {line!r}")


# Two clients whose jobs overlap: each job starts at its submit time plus its wait, as the trace says.
# job  submit  wait   run  req  status -> client: [start, end)  cut short
#  1      0    100   1000 1000    1    -> 0: [100, 1100)
#  2     10     50    400 1000    5    -> 1: [60, 460)          preempted
#  3    200    300   1500 1500    1    -> 0: [500, 2000)        overlaps 1 and outlasts it
#  4    300      0    500 1000    5    -> 1: [300, 800)         preempted, overlaps 2 and outlasts it
#  5    400    800    300 1000    5    -> 0: [1200, 1500)       preempted inside 3: takes client 0 offline at no point
#  6    500    300    200  200    1    -> 1: [800, 1000)        starts as 4 ends: one stretch, ended at 6's run time
#  7    600   2400   1000 1000    1    -> 0: [3000, 4000)
#  8    700   1300    100 1000    0    -> 1: [2000, 2100)       failed short of its time: preempted
OVERLAP = "".join(f"{job} {submit} {wait} {run} 1 -1 -1 1 {req} -1 {status} 1 1 -1 1 1 -1 -1\n" for
                  job, submit, wait, run, req, status in [(1, 0, 100, 1000, 1000, 1), (2, 10, 50, 400, 1000, 5),
                                                          (3, 200, 300, 1500, 1500, 1), (4, 300, 0, 500, 1000, 5),
                                                          (5, 400, 800, 300, 1000, 5), (6, 500, 300, 200, 200, 1),
                                                          (7, 600, 2400, 1000, 1000, 1), (8, 700, 1300, 100, 1000, 0)])


def overlapping(tmp_path, checkpoint: bool = False) -> QueueAvailability:
    trace = tmp_path / "overlap.swf"
    trace.write_text(OVERLAP)
    return QueueAvailability(2, 0, wait_median=0.0, wait_sigma=0.0, walltime=1.0, preemption_rate=0.0,
                             checkpoint=checkpoint, trace=str(trace))


def test_a_client_s_overlapping_trace_jobs_run_at_the_trace_s_own_times_and_it_is_online_while_any_runs(tmp_path):
    queue = overlapping(tmp_path)
    assert read_swf(str(tmp_path / "overlap.swf"), 2) == {
        0: [(100.0, 1100.0, False), (500.0, 2000.0, False), (1200.0, 1500.0, True), (3000.0, 4000.0, False)],
        1: [(60.0, 460.0, True), (300.0, 800.0, True), (800.0, 1000.0, False), (2000.0, 2100.0, True)]}
    # online: the union; a stretch ends by a preemption only where the job that ends it was preempted
    assert queue.runs(0, 5000.0) == [(100.0, 2000.0, False), (3000.0, 4000.0, False)]
    assert queue.runs(1, 5000.0) == [(60.0, 1000.0, False), (2000.0, 2100.0, True)]
    assert [queue.is_online(0, t) for t in (99.0, 100.0, 1100.0, 1499.0, 1500.0, 1999.0, 2000.0, 3000.0)] == [
        False, True, True, True, True, True, False, True]
    assert [queue.is_online(1, t) for t in (59.0, 460.0, 799.0, 800.0, 999.0, 1000.0, 2050.0)] == [
        False, True, True, True, True, False, True]
    assert queue.next_change(1000.0) == 2000.0 and queue.next_start(0, 2000.0) == 3000.0
    assert online_stretches([(0.0, 10.0, True), (5.0, 10.0, False)]) == [(0.0, 10.0, False)]  # a tie: not a cut


def test_a_task_in_overlapping_jobs_runs_to_the_last_one_s_end_which_says_whether_a_preemption_lost_it(tmp_path):
    queue = overlapping(tmp_path)
    assert queue.finish(0, 1000.0, 500.0).at == 1500.0  # past job 1's end: job 3 still runs
    across = queue.finish(0, 1400.0, 1000.0)  # job 5's preemption at 1500 cuts nothing; job 3's run time ends it
    assert (across.at, across.lost_at, across.preempted) == (None, 2000.0, False)
    met = queue.finish(1, 700.0, 500.0)  # job 4 hands over to job 6, whose run time ends at 1000
    assert (met.at, met.lost_at, met.preempted) == (None, 1000.0, False)
    cut = queue.finish(1, 2050.0, 100.0)
    assert (cut.at, cut.lost_at, cut.preempted) == (None, 2100.0, True)
    carried = overlapping(tmp_path, checkpoint=True).finish(0, 1900.0, 300.0)
    assert (carried.at, carried.continued) == (3200.0, True)


def test_a_round_records_a_task_a_preemption_lost_apart_from_one_its_job_s_normal_end_lost(tmp_path):
    clock = SyncClock(0, per_round=2, availability=overlapping(tmp_path), duration=lambda r, c: 2000.0,
                      deadline=None, over_selection=0.0)
    # round 1 starts when client 1 comes online (60) and its task is lost at its stretch's normal end (1000);
    # round 2 has client 0, lost at job 3's run time (2000); round 3 client 1, lost to job 8's failure (2100)
    rounds = [clock.round(r).record() for r in (1, 2, 3)]
    assert [(r["stragglers"], r["preempted"], r["job_ended"]) for r in rounds] == [
        ([1], [], [1]), ([0], [], [0]), ([1], [1], [])]
    assert [r["virtual_time"] for r in rounds] == [1000.0, 2000.0, 2100.0]
    assert [r["wasted_seconds"] for r in rounds] == [940.0, 1000.0, 100.0]


def test_a_round_waits_for_its_first_online_client_apart_from_its_own_seconds_and_does_not_wait_for_k(tmp_path):
    clock = SyncClock(0, per_round=2, availability=overlapping(tmp_path), duration=lambda r, c: 2000.0,
                      deadline=None, over_selection=0.0)
    rounds = [clock.round(r).record() for r in (1, 2, 3, 4)]
    # nobody is online at 0: round 1 waits for client 1's job (60); round 4 waits from round 3's end (2100) until
    # client 0's next job (3000); rounds 2 and 3 find a client online as the round before ends
    assert [r["virtual_wait_seconds"] for r in rounds] == [60.0, 0.0, 0.0, 900.0]
    assert [r["virtual_round_seconds"] for r in rounds] == [940.0, 1000.0, 100.0, 1000.0]
    assert list(np.cumsum([r["virtual_wait_seconds"] + r["virtual_round_seconds"] for r in rounds])) == [
        r["virtual_time"] for r in rounds]
    # 2 clients a round, but one online at each start: the round runs with that one, it does not wait for a second
    assert [(r["online"], r["selected"]) for r in rounds] == [(1, 1)] * 4


def test_an_over_selected_task_its_job_loses_after_the_round_closed_is_a_straggler_not_a_lost_task(tmp_path):
    tasks = iter([300.0, 300.0, 1000.0])  # the durations in the order the clock asks: rounds 1, 2 (clients 0, 1)
    clock = SyncClock(0, per_round=1, availability=overlapping(tmp_path), duration=lambda r, c: next(tasks),
                      deadline=None, over_selection=1.0)
    assert clock.round(1).kept == (1,)  # 60 to 360: client 1 alone online
    # round 2 starts at 360 with both online: client 0 arrives at 660 and closes it; client 1's task would have been
    # lost at 1000, its stretch's end, but the round no longer waited for it
    record = clock.round(2).record()
    assert (record["virtual_time"], record["stragglers"], record["job_ended"], record["preempted"]) == (
        660.0, [1], [], [])
    assert record["wasted_seconds"] == 300.0


@pytest.mark.parametrize("trace, said", [
    (None, "clock.queue_trace: '{path}' does not exist"),
    ("1 2 3\n", "clock.queue_trace '{path}' line 1: a job line needs at least 11 fields (the Standard Workload "
                "Format has 18; mpifl reads 2-4, 9 and 11), this one has 3"),
    ("; Version: 2.2\n;\n", "clock.queue_trace '{path}' holds no job with a known wait and a run time above 0 "
                            "(0 job(s) skipped"),
    ("1 18 x 1800 1 -1 -1 1 1800 -1 1 4 1 -1 1 1 -1 -1\n", "clock.queue_trace '{path}' line 1: fields 2-4"),
], ids=["missing", "three-fields", "comments-only", "not-a-number"])
def test_a_queue_trace_that_cannot_be_used_is_refused_before_a_job_with_its_key_file_and_line(tmp_path, trace, said):
    """The server reads the trace only as it plans its first round: after the queue wait, the ranks' start-up and the
    run directory. Every command that checks a config before a job starts reads it first, and exits 2."""
    from conftest import mpifl_here

    path = tmp_path / "trace.swf"
    if trace is not None:
        path.write_text(trace)
    said = said.format(path=path)
    config = str(ROOT / "configs" / "hpc_queue.yaml")
    for command in (("validate",), ("plan",), ("pbs", "-o", str(tmp_path / "j.pbs")),
                    ("slurm", "-o", str(tmp_path / "j.sbatch"))):
        result = mpifl_here(command[0], config, f"clock.queue_trace={path}", *command[1:])
        assert result.returncode == 2 and said in result.stderr, (command, result.stdout + result.stderr)
    assert not (tmp_path / "j.pbs").exists() and not (tmp_path / "j.sbatch").exists()
    run = run_mpi(2, "run", config, f"clock.queue_trace={path}", "--run-dir", str(tmp_path / "run"))
    assert run.returncode == 2 and said in run.stderr, run.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("trace, said", [
    ("[[0, 5]]", "expected an object {client id: [[start, end], ...]}, not a JSON list"),
    ('{"0": [[0, 5]], "9": [[1, 2]]}', "client 9 is not one of the 4 clients"),
    ('{"1": [[50, 10]]}', "client 1: interval [50, 10] must have finite start < end"),
    ('{"1": [[0, "noon"]]}', "client 1: interval [0, 'noon'] is not [start, end] in virtual seconds"),
    ('{"one": [[0, 5]]}', "key 'one' is not a client id"),
    ('{"0": [[0, 5]]', "is not JSON"),
], ids=["list", "client-outside", "backwards", "not-a-number", "not-an-id", "not-json"])
def test_an_availability_trace_that_cannot_be_used_is_refused_before_a_job_naming_the_file_and_client(
        tmp_path, trace, said):
    """Like the queue trace, the server reads it only as it plans its first round, so every command that checks a
    config before a job starts reads it first and exits 2, and writes no job script."""
    from conftest import mpifl_here

    (tmp_path / "online.json").write_text(trace)
    config = write_config(tmp_path / "c.yaml", RUN.format(extra="clock: {mode: sync, availability: trace}"))
    overrides = (f"clock.availability_trace={tmp_path / 'online.json'}", "clients.num_clients=4", "clients.per_round=2")
    for command in (("validate",), ("plan",), ("pbs", "-o", str(tmp_path / "j.pbs")),
                    ("slurm", "-o", str(tmp_path / "j.sbatch"))):
        result = mpifl_here(command[0], str(config), *overrides, *command[1:])
        assert result.returncode == 2, (command, result.stdout + result.stderr)
        assert f"clock.availability_trace '{tmp_path / 'online.json'}'" in result.stderr and said in result.stderr
    assert not (tmp_path / "j.pbs").exists() and not (tmp_path / "j.sbatch").exists()


def test_clock_settings_under_clock_mode_off_are_warned_of_as_ignored():
    """Real-time rounds read none of the virtual clock's settings: a trace, deadline or availability set beside
    ``clock.mode: off`` (forgotten, or a sweep's clean point) is said to be ignored, not silently dropped."""
    from mpifl.config import config_warnings, load_config

    config = ROOT / "configs" / "hpc_queue.yaml"
    warning, = config_warnings(load_config(config, ["clock.mode=off"]))
    assert warning.startswith("clock.") and "clock.queue_trace" in warning and "clock.availability" in warning
    assert "read only under virtual time, and clock.mode is 'off' (rounds in real time): ignored" in warning
    assert config_warnings(load_config(None, ["clock.mode=off"])) == []


def test_settings_the_queue_trace_makes_idle_are_warned_of_and_those_it_reads_are_not():
    from mpifl.config import config_warnings, load_config

    config = ROOT / "configs" / "hpc_queue.yaml"
    assert config_warnings(load_config(config)) == []
    assert config_warnings(load_config(config, ["clock.walltime=7200", "clock.queue_wait=60"])) == [
        "clock.queue_wait=60.0, clock.walltime=7200.0: ignored beside clock.queue_trace, whose jobs' own waits and "
        "run times (their walltimes and preemptions) replace the model's; unset one or the other"]
    assert config_warnings(load_config(config, ["clock.preemption_checkpoint=true"])) == []  # the trace's jobs use it
    assert config_warnings(load_config(config, ["clock.walltime=7200", "clock.queue_trace=null"])) == []
    assert config_warnings(load_config(config, ["clock.availability=always"])) == [
        "clock.queue_trace: read only with clock.availability 'queue', not 'always': "
        "'configs/traces/hpc_queue.swf' is ignored"]


RUN = """
seed: 5
rounds: 8
clients: {{num_clients: 10, per_round: 3}}
data: {{dataset: synthetic, kwargs: {{num_samples: 400, num_features: 8, num_classes: 4}}}}
model: {{name: mlp, kwargs: {{hidden: [8]}}}}
train: {{lr: 0.1, batch_size: 8}}
eval: {{every: 0}}
output: {{progress: false}}
{extra}
"""
SYNC = ("clock: {mode: sync, availability: queue, queue_wait: 300, walltime: 900, preemption_rate: 0.002, "
        "seconds_per_sample: 2, deadline: 400, over_selection: 0.34}")
FEDBUFF = ("strategy: {update: delta}\nclock: {mode: fedbuff, buffer: 2, concurrency: 4, availability: queue, "
           "queue_wait: 300, walltime: 900, preemption_rate: 0.002, seconds_per_sample: 2}")
COMPASS = ("strategy: {update: delta}\nclock: {mode: fedcompass, concurrency: 4, min_steps: 2, max_steps: 8, "
           "availability: queue, queue_wait: 300, walltime: 900, preemption_rate: 0.002, seconds_per_sample: 2}")


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra", [SYNC, FEDBUFF, COMPASS], ids=["sync", "fedbuff", "fedcompass"])
def test_batch_jobs_preempt_tasks_in_every_clock_mode_bitwise_on_any_ranks_and_through_a_resume(tmp_path, extra):
    cfg = write_config(tmp_path / "c.yaml", RUN.format(extra=extra))
    for name, ranks in (("two", 3), ("three", 4)):
        result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / name))
        assert result.returncode == 0, result.stderr[-3000:]
    two = records(tmp_path / "two")
    assert same_model(tmp_path / "two" / "model.h5", tmp_path / "three" / "model.h5")
    lost = [(r["preempted"], r["job_ended"]) for r in two]
    assert lost == [(r["preempted"], r["job_ended"]) for r in records(tmp_path / "three")]
    assert any(r["preempted"] for r in two)  # jobs ended under some tasks: they are never trained or folded
    assert all(not set(r["preempted"] + r["job_ended"]) & set(r["participants"]) for r in two if "stragglers" in r)
    stopped_and_resumed(tmp_path, cfg, resume_ranks=3)
    assert same_model(tmp_path / "split" / "model.h5", tmp_path / "two" / "model.h5")
    report = run_mpi(1, "report", str(tmp_path / "two"))
    assert report.returncode == 0 and "availability.png" in report.stdout, report.stderr


def test_the_shipped_example_runs_on_its_shipped_trace_and_checkpoints_carry_tasks_over(tmp_path):
    result = run_mpi(3, "run", str(ROOT / "configs" / "hpc_queue.yaml"), "rounds=6", "eval.every=6",
                     "--run-dir", str(tmp_path / "lost"))
    assert result.returncode == 0, result.stderr[-3000:]
    carried = run_mpi(3, "run", str(ROOT / "configs" / "hpc_queue.yaml"), "rounds=6", "eval.every=6",
                      "clock.preemption_checkpoint=true", "--run-dir", str(tmp_path / "carried"))
    assert carried.returncode == 0, carried.stderr[-3000:]
    lost, kept = records(tmp_path / "lost"), records(tmp_path / "carried")
    assert sum(len(r["preempted"] + r["job_ended"]) for r in lost) > sum(len(r["preempted"] + r["job_ended"])
                                                                         for r in kept)
    assert any(r["continued"] for r in kept) and not any(r["continued"] for r in lost)
    assert np.isfinite(lost[-1]["eval"]["accuracy"])
    # each lost task is named by what ended its client's stretch in the trace: a preemption, or a job's run time
    queue = QueueAvailability(12, 0, wait_median=0.0, wait_sigma=0.0, walltime=1.0, preemption_rate=0.0,
                              checkpoint=False, trace=str(ROOT / "configs" / "traces" / "hpc_queue.swf"))
    assert sum(r["virtual_wait_seconds"] + r["virtual_round_seconds"] for r in lost) == pytest.approx(
        lost[-1]["virtual_time"], rel=1e-12)  # the trace's first job starts after time 0: round 1 waits for it
    assert lost[0]["virtual_wait_seconds"] > 0
    for r in lost:
        start = r["virtual_time"] - r["virtual_round_seconds"]
        for field, preempted in (("preempted", True), ("job_ended", False)):
            assert all(cut == preempted for c in r[field] for a, b, cut in queue.runs(c, start + 1) if a <= start < b)
    assert any(r["job_ended"] for r in lost)


@pytest.mark.parametrize("mode, step", [("fedcompass", 8), ("fedbuff", 26)])
def test_an_async_schedule_that_outlasts_the_queue_trace_is_refused_naming_the_trace_and_the_step(mode, step):
    """Past the trace's last job no client trains again: validate names the trace and the first step that cannot
    happen, for FedCompass (whose refusal once named neither) as for FedBuff."""
    from conftest import mpifl_here

    refused = mpifl_here("validate", str(ROOT / "configs" / "hpc_queue.yaml"), f"clock.mode={mode}",
                         "clock.concurrency=3", f"rounds={step}")
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith(
        "cannot plan the virtual-time schedule: clock: no client can ever train again (clock.queue_trace "
        f"'configs/traces/hpc_queue.swf'); the run cannot reach step {step} of rounds={step}"), refused.stderr
