"""Doorbells: a rank that sends to another rank of its node wakes it at once.

A waiting rank polls MPI between sleeps (``transport.Backoff``): it must leave its core to the ranks that train,
so it cannot spin inside MPI. The price is latency: a message waits up to one sleep (2 ms) before its receiver
looks. A round pays it several times in a row (the header, the model, each update's header and chunks), about
4 ms of a 240 ms cross-device round measured on 2 cores, and most of a small model's round.

Each rank owns a named pipe (FIFO) on its node, and holds the write end of every other node rank's pipe. A
sender writes one byte to the receiver's pipe after posting a message to it. A waiting rank sleeps in
``select()`` on its pipe instead of in ``time.sleep``, so it wakes when a byte lands or when the sleep ends,
whichever comes first. The bytes carry nothing: the woken rank polls MPI as before. A ring that comes early,
late, twice or not at all (a full pipe, a rank on another node, a message MPI has not yet handed over) changes
only when a rank looks, never what it finds, so results stay bitwise those of the polling alone.

The pipes are unlinked as soon as every node rank has opened its ends: nothing is left on disk, even by a job
that is killed. Where a pipe cannot be made (no FIFOs on the file system, a descriptor ``select`` cannot watch),
that node's ranks go on without doorbells and poll alone.
"""
from __future__ import annotations

import contextlib
import os
import select
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from mpi4py import MPI

FD_SETSIZE = 1024  # select() watches descriptors below this only
PIPE_DIRS = ("/dev/shm",)  # node-local memory first; else the temporary directory


class Doorbells:
    """A rank's own pipe (its read end) and its node peers' pipes (their write ends, by rank in ``comm``)."""

    def __init__(self, comm: MPI.Comm, own: int, peers: dict[int, int], token: str):
        self.comm, self.own, self.peers, self.token = comm, own, peers, token
        self.everyone = len(peers) == comm.Get_size() - 1  # every other rank can ring this one: a job on one node

    @classmethod
    def open(cls, comm: MPI.Comm) -> Doorbells | None:
        """Make every rank's pipe and open its node peers' ones; None where this node cannot (collective over
        ``comm``)."""
        token = comm.bcast(f"{os.getpid()}-{time.time_ns()}" if comm.Get_rank() == 0 else None)
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            ranks = node.allgather(comm.Get_rank())
            directory = pipe_directory()
            mine = pipe_path(directory, token, comm.Get_rank())
            own = _make_pipe(mine)
            if not node.allreduce(own is not None, op=MPI.LAND):  # every rank of the node, or none of them
                if own is not None:
                    os.close(own)
                    mine.unlink(missing_ok=True)
                return None
            assert own is not None
            peers = {rank: os.open(pipe_path(directory, token, rank), os.O_WRONLY | os.O_NONBLOCK)
                     for rank in ranks if rank != comm.Get_rank()}
            node.Barrier()  # every end is open: the names can go
            mine.unlink(missing_ok=True)
            return cls(comm, own, peers, token)
        finally:
            node.Free()

    def ring(self, comm: MPI.Comm, dest: int) -> None:
        """Wake ``dest`` of ``comm``, if it is a node peer on this communicator (else nothing)."""
        fd = self.peers.get(dest) if comm == self.comm else None
        if fd is not None:
            with contextlib.suppress(OSError):  # a full pipe is rung already; a closed one has nobody waiting
                os.write(fd, b"\0")

    def nap(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, less if rung; whether it was rung (a ring is used up by the wake it causes)."""
        readable, _, _ = select.select([self.own], [], [], seconds)
        if readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(self.own, 4096):
                    pass
        return bool(readable)

    def close(self) -> None:
        """Close every end (the pipes are unlinked already: they go with their last descriptor)."""
        for fd in (self.own, *self.peers.values()):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.peers = {}


def pipe_directory() -> Path:
    """Where the node's pipes are made: node-local shared memory where there is some."""
    for candidate in PIPE_DIRS:
        if os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return Path(candidate)
    return Path(tempfile.gettempdir())


def pipe_path(directory: Path, token: str, rank: int) -> Path:
    """The pipe of ``rank`` in the job that ``token`` names (rank 0's process id and start time)."""
    return directory / f"mpifl-bell-{token}-{rank}"


def _make_pipe(path: Path) -> int | None:
    """The calling rank's pipe, open for reading without blocking (and for writing, so it never reads end-of-file); None
    where FIFOs cannot be made here or select() could not watch the descriptor."""
    try:
        os.mkfifo(path, 0o600)
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except (OSError, AttributeError):  # AttributeError: no os.mkfifo on this platform
        return None
    if fd >= FD_SETSIZE:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def opened(comm: MPI.Comm, enabled: bool = True) -> Iterator[Doorbells | None]:
    """Doorbells over ``comm`` for the duration (collective); None when disabled or where the node cannot."""
    bells = Doorbells.open(comm) if enabled else None
    try:
        yield bells
    finally:
        if bells is not None:
            bells.close()
