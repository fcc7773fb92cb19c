"""``mpifl run`` runs each rank under a small supervisor (mpifl.cli.supervisor): a rank that leaves with exit status 0
past Python's cleanup (``os._exit``, C's ``_exit``) makes its launched process exit 1, naming it, so that mpiexec
cannot report a half-finished run as a success; a rank that fails before MPI starts on it makes its supervisor end by
SIGKILL, so that mpiexec ends the job instead of leaving the other ranks in MPI_Init; every other way out keeps its
status or its signal. And the ranks agree on what their checks before MPI found, so a problem on one rank only ends
the job with status 2."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import run_mpi, write_config

from mpifl.cli.supervisor import ANNOUNCED, MPI_STARTED, NOTES_AT, heard_from_rank, killed_line

SUPERVISED = textwrap.dedent("""
    import os, signal, sys, time
    from mpifl.cli.supervisor import mark_mpi_started, supervised

    def body():
        {body}

    sys.exit(supervised(body))
""")


def supervise(body: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    code = SUPERVISED.format(body=body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PMI_RANK": "2", **(env or {})})


def finished(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


@pytest.mark.parametrize("body,status", [
    ("return 0", 0),
    ("return 3", 3),
    ("raise SystemExit(4)", 4),
    ("raise RuntimeError('broken')", 1),
    ("os._exit(5)", 5),
])
def test_a_rank_that_leaves_any_announced_way_or_with_a_nonzero_status_keeps_its_status(body, status):
    code, err = finished(supervise("mark_mpi_started(); " + body))
    assert code == status, err
    assert "left with exit status 0" not in err


@pytest.mark.parametrize("body", ["os._exit(0)", "import ctypes; ctypes.CDLL(None)._exit(0)"])
def test_a_rank_that_leaves_with_0_past_pythons_cleanup_makes_its_launched_process_exit_1_naming_it(body):
    code, err = finished(supervise("mark_mpi_started(); " + body))
    assert code == 1
    assert "[rank 2] mpifl: this rank (PID" in err and "left with exit status 0 before mpifl run finished" in err


def test_a_rank_ended_by_a_signal_ends_its_supervisor_by_the_same_signal_after_a_line_that_names_it():
    code, err = finished(supervise("os.kill(os.getpid(), signal.SIGKILL)"))
    assert code == -signal.SIGKILL
    assert re.search(r"\] its process \(pid \d+\) was killed by signal 9 \(SIGKILL\): the kernel's OOM killer, or a "
                     r"kill -9; the job ends$", err, re.M), err


def test_what_a_rank_tells_its_supervisor_is_parsed_so_a_run_directory_may_hold_any_byte_but_nul():
    said = MPI_STARTED + NOTES_AT + b"2 /runs/max-xm" + b"\0" + ANNOUNCED
    assert heard_from_rank(said) == (MPI_STARTED + ANNOUNCED, (2, Path("/runs/max-xm")))
    assert heard_from_rank(MPI_STARTED) == (MPI_STARTED, None)
    assert killed_line(42, 11).startswith("its process (pid 42) was killed by signal 11 (SIGSEGV): a crash in native")


LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    time.sleep(120)
""")


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped by init, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("launched", [True, False], ids=["under-a-launcher", "singleton"])
def test_a_launched_rank_ends_with_the_launchers_process_and_a_singleton_outlives_its_shell(tmp_path, launched):
    """mpiexec and its proxy killed by SIGKILL left the ranks running alone to the end of the run, writing
    checkpoints; a rank variable (PMI_RANK) says a launcher's process started the supervisor, which then dies with
    it, and the rank with the supervisor. Without one (nohup mpifl run ...), the shell's end ends nothing."""
    pids = tmp_path / "pids"
    body = f"open({str(pids)!r}, 'w').write(f'{{os.getppid()}} {{os.getpid()}}'); time.sleep(60); return 0"
    env = {**os.environ, "PMI_RANK": "1"} if launched else {k: v for k, v in os.environ.items() if k != "PMI_RANK"}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, SUPERVISED.format(body=body)], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (pids.exists() and " " in pids.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        supervisor, rank = map(int, pids.read_text().split())
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while launched and (alive(supervisor) or alive(rank)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (alive(supervisor), alive(rank)) == ((False, False) if launched else (True, True))
    finally:
        for pid in (locals().get("rank"), locals().get("supervisor")):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_without_supervision_the_launched_process_is_the_rank_itself():
    code, err = finished(supervise("os._exit(0)", env={"MPIFL_SUPERVISE": "0"}))
    assert code == 0 and not err


def test_sigterm_sent_to_the_supervisor_alone_reaches_the_rank_and_sigusr1_is_left_to_the_rank(tmp_path):
    marker = tmp_path / "terminated"
    body = ("mark_mpi_started(); "
            f"signal.signal(signal.SIGTERM, lambda *a: open({str(marker)!r}, 'w').close()); print('ready', "
            "flush=True); [time.sleep(0.05) for _ in range(400) if not os.path.exists(" + repr(str(marker)) + ")]; "
            "return 7")
    proc = supervise(body)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGUSR1)  # ignored by the supervisor: the launcher's group signal reaches the rank
    time.sleep(0.2)
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGTERM)
    code, err = finished(proc)
    assert code == 7 and marker.exists(), err


def test_group_signals_that_land_while_the_supervisor_is_still_forking_are_left_to_the_rank():
    # The rank signals its supervisor as its first act, before the supervisor may have set its handlers: without
    # the signals held back across the fork, 3-4 supervisors in 30 died of SIGUSR1 or raised KeyboardInterrupt here.
    body = ("[os.kill(os.getppid(), s) for s in (signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)]; "
            "mark_mpi_started(); return 0")
    outcomes = [finished(supervise(body)) for _ in range(30)]
    assert [code for code, _ in outcomes] == [0] * 30, [err for code, err in outcomes if code][:1]


@pytest.mark.parametrize("body,status", [("raise ImportError('a module missing on this node')", 1),
                                         ("os._exit(0)", 1), ("return 4", 4)])
def test_a_rank_that_fails_before_mpi_starts_ends_its_supervisor_by_sigkill_so_the_launcher_ends_the_job(body,
                                                                                                           status):
    code, err = finished(supervise(body))
    assert code == -signal.SIGKILL
    assert f"ended with exit status {status} before MPI started on it" in err


def test_a_config_error_which_every_rank_finds_alike_keeps_its_status_2():
    code, err = finished(supervise("return 2"))
    assert code == 2 and "before MPI started" not in err


def test_a_rank_that_started_mpi_keeps_its_failure_status():
    code, err = finished(supervise("mark_mpi_started(); return 1"))
    assert code == 1 and "before MPI started" not in err


def test_a_problem_found_before_mpi_on_one_rank_only_ends_the_job_with_status_2_naming_the_rank(tmp_path):
    """Every rank checks the config before MPI starts, then the ranks agree on what they found
    (mpifl.cli.commands.agree_on_checks). A problem on one rank only (a plug-in failing on one node) once made that
    rank exit 2 silently, and MPICH's mpiexec left the other ranks in MPI_Init for ever."""
    cfg = write_config(tmp_path / "c.yaml", "rounds: 1\nclients: {num_clients: 2}\n"
                       "data: {dataset: synthetic, kwargs: {num_samples: 100}}\noutput: {progress: false}\n"
                       "strategy: {name: 'plugin_helpers:crashing_on_rank_2'}\n")
    started = time.monotonic()
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), fresh=True)
    assert result.returncode == 2
    assert ("[rank 0] mpifl: config error: strategy.name: building 'plugin_helpers:crashing_on_rank_2' failed: "
            "RuntimeError: deliberate failure on rank 2 before MPI starts (found on rank 2 only)") in result.stderr
    assert time.monotonic() - started < 60 and not (tmp_path / "run").exists()


def test_a_rank_that_says_more_than_a_pipe_holds_is_never_blocked_by_its_supervisor():
    """A sweep's rank names each run's directory to its supervisor in turn (tell_run_dir); the supervisor reads as
    the rank writes, so a grid longer than a pipe's 64 KiB of such lines does not block the rank in a write."""
    body = ("mark_mpi_started(); from mpifl.cli.supervisor import tell_run_dir; "
            "[tell_run_dir(f'/runs/grid/seed={p},strategy.name=fedavg,train.lr=0.01', 1) for p in range(2000)]; "
            "return 0")
    code, err = finished(supervise(body))
    assert code == 0, err
