"""The server's receive side of a round: the preallocated receive slots and accumulators (``ReceivePool``), and the
receives posted into them (``PostedReceives``), which one ``Testsome`` progresses all at once."""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from mpifl.aggregation.kernels import ACCUMULATOR_DTYPE
from mpifl.aggregation.schedule import ChunkTicket, MetaTicket, Ticket
from mpifl.planning.pools import PoolShape
from mpifl.wire.memory import host_bytes, host_tensor
from mpifl.wire.watchdog import Watchdog


class ReceivePool:
    """Preallocated, pre-touched receive slots and accumulators, reused every round.

    Slots hold chunks as they arrive (the wire layout: narrowed or compressed bytes);
    accumulators hold the model's chunks in fp32, ``rows`` of them: 1 for a mean, the
    participants per round for a robust stack.
    """

    def __init__(self, shape: PoolShape):
        self.shape = shape
        self.chunk_bytes = shape.slot_bytes
        self.acc_numel = shape.accumulator_bytes // ACCUMULATOR_DTYPE.itemsize
        self.slots: list[np.ndarray] = []
        self.accumulators: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        """Bytes allocated so far: what the memory model's ``server_pool_bytes`` predicts."""
        return sum(s.nbytes for s in self.slots) + sum(a.numel() * a.element_size() for a in self.accumulators)

    def ensure(self, slots: int, accumulators: int) -> None:
        """Grow (never shrink) to at least this many slots and accumulators."""
        while len(self.slots) < slots:
            self.slots.append(host_bytes(self.chunk_bytes))
        while len(self.accumulators) < accumulators:
            self.accumulators.append(host_tensor(self.acc_numel, ACCUMULATOR_DTYPE))


class PostedReceives:
    """The round's outstanding receives, each with its ticket (what it will hold), and how many of each kind are
    posted per rank: a rank is awaited, and its deadlines run, only while a receive for what it owes next is
    posted (a header while it trains, a chunk while its update is in flight). A rank whose chunk slots are all
    full waits on the fold order, even while its next header's receive is posted."""

    def __init__(self, ranks: list[int], watchdog: Watchdog | None):
        self.requests: list[MPI.Request] = []
        self.tickets: list[Ticket] = []
        self.free: list[int] = []  # indices of completed requests, reused before the list grows
        self.headers = {rank: 0 for rank in ranks}  # header receives posted per rank
        self.chunks = {rank: 0 for rank in ranks}  # chunk receives posted per rank
        self.watchdog = watchdog

    def add(self, request: MPI.Request, ticket: Ticket) -> None:
        """Track a posted receive (a rank awaited again after its slots were full restarts its clock)."""
        posted = self.chunks if isinstance(ticket, ChunkTicket) else self.headers
        if posted[ticket.rank] == 0 and self.watchdog is not None:
            self.watchdog.progress(ticket.rank)
        posted[ticket.rank] += 1
        if self.free:
            i = self.free.pop()
            self.requests[i], self.tickets[i] = request, ticket
            return
        self.requests.append(request)
        self.tickets.append(ticket)

    def completed(self) -> list[tuple[Ticket, object]] | None:
        """The receives completed since the last call, with what each received (a header's object, or None for a
        chunk); None when nothing at all is posted."""
        done, objects = MPI.Request.testsome(self.requests)
        if done is None:
            return None
        assert objects is not None  # testsome returns None for both or for neither
        out = []
        for index, obj in zip(done, objects):
            self.requests[index] = MPI.REQUEST_NULL
            self.free.append(index)
            ticket = self.tickets[index]
            (self.chunks if isinstance(ticket, ChunkTicket) else self.headers)[ticket.rank] -= 1
            out.append((ticket, obj))
        return out

    def cancel(self, rank: int) -> tuple[int, int]:
        """Cancel every receive posted for ``rank``; (headers, chunks) that landed before the cancel could take."""
        raced_metas = raced_chunks = 0
        for i, (request, ticket) in enumerate(zip(self.requests, self.tickets)):
            if ticket.rank != rank or request == MPI.REQUEST_NULL:
                continue
            request.Cancel()
            status = MPI.Status()
            request.Wait(status)
            if not status.Is_cancelled():
                raced_metas += isinstance(ticket, MetaTicket)
                raced_chunks += isinstance(ticket, ChunkTicket)
            self.requests[i] = MPI.REQUEST_NULL
            self.free.append(i)
        self.headers[rank] = self.chunks[rank] = 0
        return raced_metas, raced_chunks
