"""Rank-prefixed log lines on stderr."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "MV2_COMM_WORLD_RANK")


SUPERVISOR_PID = "MPIFL_SUPERVISOR_PID"  # set in a rank's environment by its supervisor (mpifl.cli.supervisor)


# The COMM_WORLD rank of each rank of the communicator the server and the client ranks talk over: the same rank,
# but under clients.ranks_per_client R > 1, where the server and the group leaders talk over a communicator of their
# own (the k-th group's leader is rank k there): set once by the run (mpifl.roles.runner, from GroupLayout).
def same_rank(rank: int) -> int:
    """``rank`` itself: the naming of a run whose client ranks talk to the server over COMM_WORLD."""
    return rank


_world_rank: Callable[[int], int] = same_rank


def name_ranks_by_world(to_world: Callable[[int], int]) -> None:
    """From now on messages and records name a rank of the server's communicator by ``to_world(rank)``, its
    COMM_WORLD rank: the rank a user sees in mpiexec's, the supervisor's and the run directory's words."""
    global _world_rank
    _world_rank = to_world


def world_rank(rank: int) -> int:
    """The COMM_WORLD rank of ``rank`` of the server's communicator (``name_ranks_by_world``), for messages and
    records: a group's leader is named by its own MPI rank, not by its group's place among the groups."""
    return _world_rank(rank)


def env_rank() -> int | None:
    """The current process's rank as the launcher tells it, before MPI is initialised."""
    for var in RANK_VARIABLES:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def log(message: str, rank: int | None = None) -> None:
    """Write one line to stderr prefixed with the rank, in a single write so ranks' lines never interleave."""
    rank = env_rank() if rank is None else rank
    prefix = f"[rank {rank}] " if rank is not None else ""
    line = prefix + message + "\n"
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stderr (e.g. captured in tests)
        sys.stderr.write(line)
        return
    sys.stderr.flush()
    os.write(fd, line.encode(errors="replace"))
