"""Rank-prefixed log lines on stderr."""
from __future__ import annotations

import os
import sys

RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "MV2_COMM_WORLD_RANK")


SUPERVISOR_PID = "MPIFL_SUPERVISOR_PID"  # set in a rank's environment by its supervisor (mpifl.cli.supervisor)


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
