"""One job at a time in a run directory (mpifl.storage.lock): rank 0 of a job holds ``<run dir>/.lock`` from the
moment it readies the directory until its run is over, so a second job there (a batch job resubmitted while the first
still runs) is refused before it reads or writes anything, naming the job that holds it, and ``mpifl status`` says
the run is still going; the kernel drops the lock with its holder's process, however that ends, so a killed job never
blocks its own resume."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from mpifl.config import load_config
from mpifl.storage.lock import LOCK_FILE, RunDirectoryInUse, lock_holder, release_run_dir
from mpifl.storage.rundir import post_mortem, prepare_run_dir

CONFIG = {"rounds": 3, "clients": {"num_clients": 2}, "output": {"progress": False}}

HOLDER = textwrap.dedent("""
    import sys, time
    from mpifl.config import load_config
    from mpifl.storage.rundir import prepare_run_dir
    prepare_run_dir(load_config(None, data={data!r}), sys.argv[1], None, "auto")
    print("held", flush=True)
    time.sleep(120)
""")


def holding(run_dir) -> subprocess.Popen:
    """Another process that readies ``run_dir`` as a job's rank 0 does, then stays (a job still running)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(data=CONFIG), str(run_dir)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_job_in_a_run_directory_still_in_use_is_refused_naming_the_holder_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    holder = holding(run_dir)
    try:
        (run_dir / "metrics.jsonl").write_text('{"round": 1}\n')
        before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
        with pytest.raises(RunDirectoryInUse) as refused:
            prepare_run_dir(load_config(None, data=CONFIG), str(run_dir), None, "auto")
        said = str(refused.value)
        assert said.startswith(f"run directory {run_dir} is in use by a job still running (pid {holder.pid} on "
                               f"{socket.gethostname()}, since ")
        assert "two jobs writing one run directory would interleave their checkpoints" in said
        assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before  # metrics not put aside
        # mpifl status tells a run still going (its rank 0 perhaps on another node) from one that stopped
        complete, lines = post_mortem(run_dir)
        assert not complete and lines[-1].startswith(f"not complete: still running (its job holds {run_dir / LOCK_FILE}"
                                                     f": pid {holder.pid} on {socket.gethostname()}, since "), lines
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_goes_with_its_holders_process_even_killed_so_the_resume_takes_the_directory(tmp_path):
    run_dir = tmp_path / "run"
    holder = holding(run_dir)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    path, _ = prepare_run_dir(load_config(None, data=CONFIG), str(run_dir), None, "auto")
    try:
        assert f"pid {os.getpid()} on " in (path / LOCK_FILE).read_text()
    finally:
        release_run_dir(path)


def test_a_job_releases_the_directory_when_its_run_is_over_and_a_refused_one_never_kept_it(tmp_path):
    cfg = load_config(None, data=CONFIG)
    run_dir = tmp_path / "run"
    path, _ = prepare_run_dir(cfg, str(run_dir), None)
    (path / "metrics.jsonl").write_text('{"round": 1}\n')
    release_run_dir(path)
    with pytest.raises(ValueError, match="already holds"):  # refused: another run's records, no --resume
        prepare_run_dir(cfg, str(run_dir), None)
    holder = holding(run_dir)  # neither this process's run nor its refusal kept the lock
    holder.kill()
    holder.wait()
    assert lock_holder(run_dir) is None  # gone with its holder: nothing says the run is still going
