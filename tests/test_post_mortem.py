"""`mpifl status`: from the run directory alone, how far a run got and which rank went quiet first."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from mpifl.storage.notes import RankNotes, note_rank
from mpifl.storage.rundir import post_mortem


def run_dir_with(tmp_path, rounds_recorded: int, notes: list[tuple[int, str, int, float]]):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("rounds: 6\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in range(1, rounds_recorded + 1)))
    for rank, state, round_, when in notes:
        note_rank(run, rank, state, round_)
        path = run / "ranks" / f"rank{rank:05d}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "time": when}))
    return run


def test_a_complete_run_says_so_and_nothing_else(tmp_path):
    run = run_dir_with(tmp_path, 6, [(0, "finished", 6, 10.0), (1, "finished", 6, 10.0)])
    assert post_mortem(run) == (True, [f"{run}: 6 of 6 rounds recorded; no checkpoint", "complete"])


def test_a_torn_last_record_counts_the_rounds_before_it_and_says_which_line_tore(tmp_path, capsys):
    """A job killed while it appended round 4's record: status used to count no round at all, and to say it was
    rebuilding the file, which only a resume does."""
    run = run_dir_with(tmp_path, 3, [(0, "round", 4, 5.0), (1, "round", 4, 5.0)])
    with open(run / "metrics.jsonl", "a") as metrics:
        metrics.write('{"round": 4, "ev')
    complete, lines = post_mortem(run)
    assert not complete
    assert lines[0] == f"{run}: 3 of 6 rounds recorded (line 4 of metrics.jsonl is torn or not JSON: the rounds " \
        "before it); no checkpoint"
    assert "rebuilding" not in capsys.readouterr().err


def test_a_rank_a_round_behind_the_others_is_named_as_the_first_to_go_quiet(tmp_path):
    run = run_dir_with(tmp_path, 2, [(0, "round", 3, 50.0), (1, "round", 3, 50.0), (2, "round", 2, 49.9)])
    complete, lines = post_mortem(run)
    assert not complete and "rank 2 went quiet first" in lines[-1]
    assert "  rank 2: last heard of at" in "\n".join(lines) and "in round 2" in "\n".join(lines)


def test_a_failed_rank_is_named_and_ranks_killed_together_are_not_blamed(tmp_path):
    failed = run_dir_with(tmp_path / "a", 1, [(0, "failed", 2, 5.0), (1, "round", 2, 5.0)])
    assert "rank 0 failed" in post_mortem(failed)[1][-1]
    together = run_dir_with(tmp_path / "b", 1, [(0, "round", 2, 5.0), (1, "round", 2, 5.5)])
    assert "stopped together" in post_mortem(together)[1][-1]


def test_a_rank_its_supervisor_saw_killed_by_a_signal_is_named_before_ranks_that_failed_after_it(tmp_path):
    run = run_dir_with(tmp_path, 1, [(0, "failed", 2, 5.0), (1, "round", 2, 5.0), (2, "round", 2, 4.0)])
    RankNotes.picked_up(run, 2).failed("its process (pid 7) was killed by signal 9 (SIGKILL): ...", signal="SIGKILL")
    lines = post_mortem(run)[1]
    assert lines[-2].startswith("  rank 2: last heard of at")
    assert "'failed' in round 2: its process (pid 7) was killed" in lines[-2]
    assert lines[-1].startswith("not complete: ranks [0, 1, 2] did not finish; rank 2 was killed by SIGKILL")


def test_a_run_stopped_on_request_says_so_and_blames_no_rank(tmp_path):
    run = run_dir_with(tmp_path, 3, [(0, "interrupted", 3, 5.0), (1, "finished", 3, 5.0), (2, "finished", 3, 5.0)])
    complete, lines = post_mortem(run)
    assert not complete
    assert lines[-1] == ("not complete: stopped on request after round 3 (SIGTERM: by hand, or a scheduler's signal "
                         "before its time limit), as the rounds on disk show; continue with --resume")
    assert "did not finish" not in "\n".join(lines)


def test_a_run_whose_privacy_budget_is_spent_before_its_last_round_is_complete_and_says_why(tmp_path):
    run = run_dir_with(tmp_path, 2, [(0, "finished", 2, 5.0), (1, "finished", 2, 5.0)])
    (run / "config.yaml").write_text("rounds: 6\nprivacy: {mode: central, epsilon_budget: 5.2}\n")
    records = [{"round": 1, "privacy": {"epsilon": 4.9}},
               {"round": 2, "privacy": {"epsilon": 5.131, "budget_spent": True}}]  # as the server marks it
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert post_mortem(run) == (True, [f"{run}: 2 of 6 rounds recorded; no checkpoint",
                                       "complete: privacy.epsilon_budget 5.2 spent after round 2 of 6 "
                                       "(epsilon 5.131)"])
    (run / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")  # a round short of the budget's stop
    assert not post_mortem(run)[0]


def test_status_of_a_folder_that_is_no_run_says_which_without_calling_it_a_config_error(tmp_path):
    from conftest import mpifl_here

    missing, plain = mpifl_here("status", str(tmp_path / "nothere")), mpifl_here("status", str(tmp_path))
    assert (missing.returncode, missing.stderr) == (1, f"mpifl status: {tmp_path / 'nothere'} does not exist\n")
    assert plain.stderr == (f"mpifl status: {tmp_path} is not an mpifl run directory (no config.yaml), nor a sweep's "
                            "folder of them\n")


def full_disk(path: Path, *args, **kwargs):
    """``Path.write_text`` on a full disk: the file is created (an inode is free), its data is refused."""
    path.touch()
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_note_a_full_disk_refuses_raises_nothing_keeps_the_last_note_and_leaves_no_temporary_file(tmp_path,
                                                                                                  monkeypatch):
    run = run_dir_with(tmp_path, 1, [(0, "round", 2, 5.0), (1, "round", 2, 5.0)])
    before = (run / "ranks" / "rank00000.json").read_text()
    monkeypatch.setattr(Path, "write_text", full_disk)
    RankNotes(run, 0).failed("JobFailure: round 2: could not write checkpoint 'ckpt-r00002.h5.tmp': disk full")
    monkeypatch.undo()
    assert (run / "ranks" / "rank00000.json").read_text() == before
    assert sorted(p.name for p in (run / "ranks").iterdir()) == ["rank00000.json", "rank00000.unwritten",
                                                                 "rank00001.json"]
    note_rank(run, 0, "failed", 2, reason="a later note the disk takes")  # the notes are whole again
    assert not (run / "ranks" / "rank00000.unwritten").exists()


def test_status_after_a_lost_note_says_the_notes_are_incomplete_and_does_not_blame_the_launcher(tmp_path,
                                                                                                 monkeypatch):
    run = run_dir_with(tmp_path, 1, [(0, "round", 2, 5.0), (1, "round", 2, 5.0)])
    monkeypatch.setattr(Path, "write_text", full_disk)
    note_rank(run, 0, "failed", 2, reason="JobFailure: round 2: could not write checkpoint")
    note_rank(run, 2, "started", 0)  # its first note: it has none to keep
    monkeypatch.undo()
    complete, lines = post_mortem(run)
    assert not complete
    assert "(a newer note could not be written)" in lines[1] and lines[3] == "  rank 2: no note could be written"
    assert lines[-1] == ("not complete: ranks [0, 1, 2] did not finish; ranks [0, 2] could not write their last note "
                         "(a full disk?), so the notes are incomplete: the job's log says what ended it, in the line "
                         "'failed, aborting the job'; continue with --resume")
    assert "launcher" not in "\n".join(lines)


def test_status_names_the_failed_rank_and_its_reason_when_its_failure_note_was_written(tmp_path):
    run = run_dir_with(tmp_path, 1, [(1, "round", 2, 5.0)])
    note_rank(run, 0, "failed", 2, reason="JobFailure: round 2: could not write checkpoint 'c.tmp': disk full")
    lines = post_mortem(run)[1]
    assert "state 'failed' in round 2: JobFailure: round 2: could not write checkpoint 'c.tmp': disk full" in lines[1]
    assert lines[-1].endswith("rank 0 failed (reason above); continue with --resume")


def wait_until_running(pid: int, marker: bytes, seconds: float = 30.0) -> None:
    """Until process ``pid`` runs the program whose command line holds ``marker``: between fork and exec its
    command line is still its parent's."""
    import time

    deadline = time.monotonic() + seconds
    while marker not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"process {pid} did not start its program within {seconds} s"
        time.sleep(0.01)


def test_status_of_a_run_whose_ranks_still_run_here_says_so_and_advises_no_resume(tmp_path, monkeypatch):
    """A job checked mid-chain: its ranks are alive on this host (ranks.txt), so status says it is still running
    instead of advising a --resume that would start a second job on the same directory. A rank whose note says it
    ended, and a pid that now runs another program, do not count."""
    import socket
    import subprocess
    import sys

    monkeypatch.setattr("mpifl.storage.rundir.TEARDOWN_GRACE_S", 0.3)  # rank 2 failed: status waits that long first
    run = run_dir_with(tmp_path, 2, [(0, "round", 3, 50.0), (1, "round", 3, 50.0), (2, "failed", 2, 49.0)])
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "mpifl-rank-stand-in"])
    other = subprocess.Popen(["sleep", "60"])
    try:
        wait_until_running(rank.pid, b"mpifl-rank-stand-in")  # on a loaded machine it may not have exec'd yet
        wait_until_running(other.pid, b"sleep\x0060")
        host = socket.gethostname()
        (run / "ranks.txt").write_text(f"rank host pid local_rank cores gpu threads\n0 {host} {rank.pid} 0 0 - 1\n"
                                       f"1 {host} {other.pid} 1 0 - 1\n2 {host} {rank.pid} 2 0 - 1\n")
        complete, lines = post_mortem(run)
        assert not complete
        assert lines[-1] == (f"not complete: still running (rank 0 PID {rank.pid} alive on this host): wait for the "
                             "job to end, then ask again; do not --resume a run that is running")
    finally:
        rank.kill()
        other.kill()
        rank.wait()
        other.wait()
    complete, lines = post_mortem(run)  # once it ended: what the notes say, and the advice to resume
    assert not complete and "still running" not in lines[-1] and lines[-1].endswith("continue with --resume")


def test_status_asked_as_a_failed_job_is_torn_down_waits_for_its_dying_ranks_instead_of_calling_it_running(tmp_path):
    """A launcher returns once it has signalled the ranks, not once they are gone: a status asked at once (a job's
    epilogue) found a rank of a job that one rank's failure ended still alive, and said the job was running. Where a
    note says a rank failed, status gives the others a few seconds to go."""
    import socket
    import subprocess
    import sys

    run = run_dir_with(tmp_path, 1, [(0, "failed", 2, 50.0), (1, "round", 2, 50.0)])
    dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)", "mpifl-rank-stand-in"])
    try:
        wait_until_running(dying.pid, b"mpifl-rank-stand-in")
        (run / "ranks.txt").write_text("rank host pid local_rank cores gpu threads\n"
                                       f"1 {socket.gethostname()} {dying.pid} 0 0 - 1\n")
        complete, lines = post_mortem(run)  # it exits half a second in (a zombie runs nothing)
    finally:
        dying.kill()
        dying.wait()
    assert not complete and not any("still running" in line for line in lines)
