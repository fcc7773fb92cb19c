"""One job at a time in a run directory: rank 0 holds an advisory lock on ``<run dir>/.lock`` while its job runs.

Why: two jobs writing one run directory (a batch job submitted again while the first still runs, one sweep started
twice) interleave their metrics and checkpoints, and each resumes from the other's files. The lock is ``flock(2)``'s:
the kernel drops it when the holding process ends, however it ends (SIGKILL, the OOM killer, a node's crash ends the
job's processes with it), so a dead job never leaves it held. A file system without ``flock`` (a Lustre mount
without ``-o flock``) refuses the call: the job then goes on unlocked, saying so, as it ran before there was a
lock. The lock file holds the holder's host, pid and start time, for the message of the job that finds it held.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from mpifl.logs import log

LOCK_FILE = ".lock"
_held: dict[Path, int] = {}  # run directory -> the open file that holds its lock, in this process


class RunDirectoryInUse(ValueError):
    """Another live job holds the run directory's lock; the message names it."""


def lock_run_dir(path: Path) -> None:
    """Take ``path``'s lock for this process (``path`` exists), or raise RunDirectoryInUse naming the job that
    holds it. Taking a lock this process holds already does nothing."""
    key = path.resolve()
    if key in _held:
        return
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            holder = os.read(fd, 512).decode(errors="replace").strip() or "another job"
            os.close(fd)
            raise RunDirectoryInUse(
                f"run directory {path} is in use by a job still running ({holder}): two jobs writing one run "
                "directory would interleave their checkpoints; wait for it to end, or stop it first (its lock "
                f"goes with its last process; {path / LOCK_FILE})") from None
        os.close(fd)
        log(f"mpifl: warning: cannot lock {path / LOCK_FILE} ({os.strerror(err.errno or 0)}: the file system has no "
            "flock?): nothing stops a second job from writing this run directory while this one runs", rank=0)
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
             .encode())
    _held[key] = fd


def release_run_dir(path: Path) -> None:
    """Drop ``path``'s lock if this process holds it (its job is over: the next run of a sweep, or a pooled job, may
    take it)."""
    fd = _held.pop(path.resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor of the open file drops the flock


HOLDER_PATIENCE = 2.0  # seconds a held lock is watched before it is taken for a job still running


def lock_holder(path: Path, patience: float = HOLDER_PATIENCE) -> str | None:
    """Who holds ``path``'s lock, as its file names the job (``pid 81234 on HOST, since ...``), while a process other
    than this one holds it for ``patience`` seconds; else None (no lock file, the lock free or freed meanwhile, or no
    flock on this file system). What ``mpifl status`` reads to tell a run still going on another node from one that
    stopped. The patience is for a job that has just failed: its launcher returns while its dying rank 0 still
    holds the lock for an instant."""
    lock = path / LOCK_FILE
    if path.resolve() in _held or not lock.is_file():
        return None
    deadline = time.monotonic() + patience
    while True:
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            if time.monotonic() >= deadline:
                return os.read(fd, 512).decode(errors="replace").strip() or "another job"
        else:
            return None  # free: the shared lock taken here goes with the descriptor
        finally:
            os.close(fd)
        time.sleep(0.1)
