"""One launch path for every rank: rank-prefixed logs, and abort-on-exception."""
from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Callable, TypeVar

T = TypeVar("T")


class SetupError(RuntimeError):
    """A problem every rank detects identically: reported once, exit status 2, no abort."""


def env_rank() -> int | None:
    """This process's rank as the launcher tells it, before MPI is initialised."""
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "MV2_COMM_WORLD_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def log(message: str, rank: int | None = None) -> None:
    """Print one line to stderr prefixed with the rank."""
    rank = env_rank() if rank is None else rank
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(prefix + message, file=sys.stderr, flush=True)


def guarded(fn: Callable[[], T]) -> T:
    """Run ``fn``; on any exception print rank, host and traceback, then abort every rank."""
    from mpi4py import MPI

    try:
        return fn()
    except SetupError:
        raise
    except BaseException as err:  # noqa: BLE001 - any escape from a rank must end the job
        if isinstance(err, SystemExit) and not err.code:
            raise
        rank = MPI.COMM_WORLD.Get_rank()
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        sys.stderr.write(f"[mpifl rank {rank} on {socket.gethostname()}] failed, aborting the job:\n{text}")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        os._exit(1)  # Abort may return before the launcher kills us: never unwind further
