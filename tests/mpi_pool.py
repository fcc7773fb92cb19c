"""A long-lived MPI job that runs the suite's ``mpifl run`` and ``mpifl sweep`` jobs one after another, so that each
rank imports torch once for many jobs instead of once per job.

Why: nearly all of a small test job's CPU time is its ranks' start-up (Python, torch, mpi4py: about 2 CPU-s a
rank), while its rounds take a fraction of a second. Started by ``tests/conftest.py`` (one pool per pytest
worker) as ``mpiexec -n SIZE python tests/mpi_pool.py QUEUE_DIR PARENT_PID JOBS``. Rank 0 takes job files
(``ID.job``: JSON with ``n``, ``argv``, ``cwd``, ``env``) from QUEUE_DIR in order; for each, world ranks 0..n-1
split off a communicator and call ``mpifl.cli.main(argv, comm=...)``, each with its stdout and stderr written to
``ID.rankR.out`` / ``ID.rankR.err``; rank 0 then writes ``ID.result`` (JSON: every rank's exit status). The
ranks above n sit the job out. A rank that fails aborts the whole pool as it would abort its own job
(``mpifl.roles.launch.abort``); the suite reads the job's files and starts a new pool for the next job.

Waiting never spins: between jobs and while sitting one out, ranks probe with a sleep between probes (MPICH's
blocking calls poll a core, and the pools share the machine's cores with the jobs).

The pool ends when QUEUE_DIR/stop appears, when PARENT_PID is gone, after ``IDLE_SECONDS`` without a job, or
after JOBS jobs (the third argument: each job's communicators and any state a plug-in keeps go with the pool).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from mpi4py import MPI

from mpifl.cli import main

# The benchmarks' plug-ins (profiling/cross_device.py): the GPU check's CPU form runs its jobs in this pool
# (tests/test_gpu_check.py), and its own jobs import them through PYTHONPATH (profiling/gpu_check.py).
sys.path.append(str(Path(__file__).resolve().parent.parent / "profiling"))

JOB_TAG, DONE_TAG = 7101, 7102
IDLE_SECONDS = 900.0
LONGEST_PAUSE = 0.05  # seconds between probes once nothing has come for a while (an idle pool: ~1% of a core)


def receive(comm: MPI.Intracomm, source: int, tag: int) -> object:
    """``comm.recv``, but probing with growing sleeps in between instead of MPI's busy poll."""
    pause, status = 0.0005, MPI.Status()
    while not comm.Iprobe(source=source, tag=tag, status=status):
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_PAUSE)
    return comm.recv(source=status.Get_source(), tag=tag)


def next_job(queue: Path, parent: int) -> dict | None:
    """The oldest job file in ``queue``, or None when the pool should end."""
    idle_since, pause = time.monotonic(), 0.001
    while True:
        if (queue / "stop").exists() or not _alive(parent) or time.monotonic() - idle_since > IDLE_SECONDS:
            return None
        jobs = sorted(queue.glob("*.job"), key=lambda p: int(p.stem))
        if jobs:
            job = json.loads(jobs[0].read_text())
            jobs[0].unlink()
            return job
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_PAUSE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def job_surroundings(job: dict, queue: Path, rank: int) -> Iterator[None]:
    """This rank's stdout and stderr into the job's files, the job's working directory and environment variables
    (those the suite lets a pooled job set: conftest.POOLED_ENV), and fresh warning registries (so a warning a
    previous job printed is printed again), all restored afterwards."""
    stem = queue / f"{job['id']}.rank{rank}"
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    here = os.getcwd()
    env = job.get("env") or {}
    before = {key: os.environ.get(key) for key in env}
    try:
        os.environ.update(env)
        for fd, suffix in ((1, "out"), (2, "err")):
            target = os.open(f"{stem}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(job["cwd"])
        with warnings.catch_warnings():
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.chdir(here)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


def run_job(job: dict, world: MPI.Intracomm, queue: Path) -> int | None:
    """Run ``job`` on world ranks 0..n-1 (None on the ranks that sit it out); this rank's exit status."""
    rank = world.Get_rank()
    inside = rank < job["n"]
    comm = world.Split(0 if inside else MPI.UNDEFINED, rank)
    if not inside:
        return None
    with job_surroundings(job, queue, rank):
        try:
            status = main(job["argv"], comm=comm)
        except SystemExit as exit_:  # argparse's errors, as `python -m mpifl` would end
            status = exit_.code if isinstance(exit_.code, int) else 1
    comm.Free()
    return int(status or 0)


def serve(queue: Path, parent: int, jobs: int) -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    for served in range(jobs + 1):
        if rank == 0:
            job = next_job(queue, parent) if served < jobs else None
            for other in range(1, size):
                world.send(job, dest=other, tag=JOB_TAG)
        else:
            job = receive(world, 0, JOB_TAG)
        if job is None:
            return
        status = run_job(job, world, queue)
        if rank == 0:
            statuses = [status] + [receive(world, r, DONE_TAG) for r in range(1, job["n"])]
            partial = queue / f"{job['id']}.partial"
            partial.write_text(json.dumps(statuses))
            partial.rename(queue / f"{job['id']}.result")  # the suite never reads a half-written result
        elif status is not None:
            world.send(status, dest=0, tag=DONE_TAG)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
