"""The streamed, deterministic reduction on the server.

Every participant's update arrives as a stream of chunks from its rank. Each rank has a
few receive slots; ``Testsome`` over all of them progresses every stream at once. An
arrived chunk (participant p, chunk j) is folded as soon as it is next in the fixed
order for chunk j (participants by ascending id); early arrivals wait in their slots.
So the sum for every element is taken in the same order whatever order chunks land in,
and the result is bitwise reproducible.

Memory: the receive slots plus at most ``window`` chunk accumulators. When a rank hosts
several participants in one round it sends them one after another, so chunk j of its
second participant comes only after every chunk of its first: the window must then
span the whole model (documented in the README), otherwise it is derived from the budget.
Deadlock-free: the lowest-id participant with chunks outstanding can always fold.

Robust strategies (median, trimmed mean) keep a stack of every participant's chunk j:
the accumulator window then holds participants x chunk per chunk, never participants
x model. A participant whose header carries an error (``clients.accept_failures``) is
skipped in every chunk; ``clients.min_participants`` is checked before the first
finished chunk is written, so an aborted round leaves the global model untouched.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from mpi4py import MPI

from mpifl.wire import protocol
from mpifl.aggregation.strategies import ACCUMULATOR_DTYPE, Strategy
from mpifl.wire.flat import DTYPES, Chunk
from mpifl.wire.transport import Backoff, touched_empty


class GlobalState(Protocol):
    """Where finished chunks of the new global model go (see state.py)."""

    def finish_target(self, chunk: Chunk) -> torch.Tensor: ...

    def server_state(self, chunk: Chunk) -> dict[str, torch.Tensor]: ...

    def commit(self, chunk: Chunk) -> None: ...


class RoundAborted(RuntimeError):
    """Too few usable updates: the round is not applied and the job stops."""


@dataclass
class ReductionStats:
    """What one round's reduction observed."""

    metas: dict[int, protocol.UpdateMeta] = field(default_factory=dict)
    first_arrival: float | None = None  # perf_counter when the first update meta landed
    aggregate_seconds: float = 0.0


@dataclass(frozen=True)
class PoolPlan:
    """Receive slots per rank and the accumulator window, derived from a memory budget."""

    slots_per_rank: int
    window: int

    @classmethod
    def from_budget(cls, budget_bytes: int, chunk_bytes: int, acc_chunk_bytes: int, ranks: int,
                    inflight: int, num_chunks: int, sequential: bool) -> "PoolPlan":
        """Split the budget between slots (half) and accumulators (half); at least 1 slot and 2 accumulators."""
        slots = max(1, min(inflight, budget_bytes // 2 // max(1, ranks * chunk_bytes)))
        window = num_chunks if sequential else max(2, budget_bytes // 2 // max(1, acc_chunk_bytes))
        return cls(slots, min(window, num_chunks))


class ReceivePool:
    """Preallocated, pre-touched receive slots and accumulators, reused every round.

    ``chunks`` are the chunks as they arrive (the wire layout); ``rows`` is 1 for a mean,
    the participants per round for a robust stack.
    """

    def __init__(self, chunks: list[Chunk], rows: int = 1):
        self.chunk_bytes = max(c.nbytes for c in chunks)
        self.acc_numel = max(c.numel for c in chunks) * rows
        self.slots: list[np.ndarray] = []
        self.accumulators: list[torch.Tensor] = []

    def ensure(self, slots: int, accumulators: int) -> None:
        """Grow (never shrink) to at least this many slots and accumulators."""
        while len(self.slots) < slots:
            self.slots.append(touched_empty(self.chunk_bytes))
        while len(self.accumulators) < accumulators:
            self.accumulators.append(torch.zeros(self.acc_numel, dtype=ACCUMULATOR_DTYPE))


class StreamedReduction:
    """Receive and fold one round of updates into the global model held by ``state``."""

    def __init__(self, comm: MPI.Comm, state: GlobalState, chunks: list[Chunk], strategy: Strategy,
                 by_rank: dict[int, list[int]], pool: ReceivePool, plan: PoolPlan,
                 wire: list[Chunk] | None = None, min_participants: int = 1, round_: int = 0):
        self.comm, self.state, self.chunks, self.strategy = comm, state, chunks, strategy
        self.wire = wire or chunks
        self.min_participants, self.round = min_participants, round_
        self.included = [0] * len(chunks)
        self.total_weight: float | None = None  # set once every header is in, before the first finish
        self.order = sorted(c for clients in by_rank.values() for c in clients)
        self.position = {c: i for i, c in enumerate(self.order)}
        self.rank_of = {c: r for r, clients in by_rank.items() for c in clients}
        self.plan = plan
        pool.ensure(plan.slots_per_rank * len(by_rank), plan.window)
        self.pool = pool
        # Each rank's stream: its participants in ascending id, each one's chunks in order.
        self.streams = {r: [(c, j) for c in sorted(cl) for j in range(len(chunks))] for r, cl in by_rank.items()}
        self.posted = {r: 0 for r in by_rank}
        self.meta_next = {r: 0 for r in by_rank}
        self.clients_on = {r: len(cl) for r, cl in by_rank.items()}
        self.free_slots = list(range(len(pool.slots)))
        self.requests: list[MPI.Request] = []
        self.tickets: list[tuple] = []
        self.arrived: dict[tuple[int, int], int] = {}  # (chunk, position) -> slot
        self.next_position = [0] * len(chunks)
        self.acc_of: dict[int, torch.Tensor] = {}
        self.low = 0  # smallest unfinished chunk
        self.finished = [False] * len(chunks)
        self.stats = ReductionStats()

    def run(self) -> ReductionStats:
        """Post receives, fold chunks in order as they land, finish every chunk."""
        for rank in self.streams:
            self._post_meta(rank)
            for _ in range(self.plan.slots_per_rank):
                self._post_chunk(rank, self.free_slots.pop())
        backoff = Backoff()
        while self.low < len(self.chunks):
            done, objects = MPI.Request.testsome(self.requests)
            if done is None:
                raise RuntimeError(f"reduction stalled with chunks {self.low}.. unfinished and nothing posted")
            if not done:
                backoff.pause()
                continue
            backoff.reset()
            for index, obj in zip(done, objects):
                self.requests[index] = MPI.REQUEST_NULL
                self._landed(self.tickets[index], obj)
            self._drain()
        return self.stats

    def _add_request(self, request: MPI.Request, ticket: tuple) -> None:
        for i, old in enumerate(self.requests):
            if old == MPI.REQUEST_NULL:
                self.requests[i], self.tickets[i] = request, ticket
                return
        self.requests.append(request)
        self.tickets.append(ticket)

    def _post_meta(self, rank: int) -> None:
        if self.meta_next[rank] < self.clients_on[rank]:
            request = self.comm.irecv(source=rank, tag=protocol.META)
            self._add_request(request, ("meta", rank))

    def _post_chunk(self, rank: int, slot: int) -> None:
        stream = self.streams[rank]
        if self.posted[rank] >= len(stream):
            self.free_slots.append(slot)
            return
        client, j = stream[self.posted[rank]]
        self.posted[rank] += 1
        buf = self.pool.slots[slot][: self.wire[j].nbytes]
        request = self.comm.Irecv([buf, MPI.BYTE], source=rank, tag=protocol.UPDATE)
        self._add_request(request, ("chunk", rank, slot, client, j))

    def _landed(self, ticket: tuple, meta: object) -> None:
        if ticket[0] == "meta":
            if not isinstance(meta, protocol.UpdateMeta) or self.rank_of.get(meta.client) != ticket[1]:
                raise RuntimeError(f"rank {ticket[1]} sent an unexpected update header: {meta!r}")
            if self.stats.first_arrival is None:
                self.stats.first_arrival = time.perf_counter()
            self.stats.metas[meta.client] = meta
            self.meta_next[ticket[1]] += 1
            self._post_meta(ticket[1])
        else:
            _, rank, slot, client, j = ticket
            self.arrived[(j, self.position[client])] = slot

    def _drain(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for (j, pos), slot in list(self.arrived.items()):
                if self._ready(j, pos):
                    del self.arrived[(j, pos)]
                    self._fold(j, pos, slot)
                    progressed = True

    def _ready(self, j: int, pos: int) -> bool:
        return (j < self.low + self.plan.window and self.next_position[j] == pos
                and self.order[pos] in self.stats.metas)

    def _fold(self, j: int, pos: int, slot: int) -> None:
        start = time.perf_counter()
        wire = self.wire[j]
        client = self.order[pos]
        meta = self.stats.metas[client]
        if meta.error is None:
            index = self.included[j]
            if index == 0:
                self.acc_of[j] = self._accumulator(j)
            x = torch.from_numpy(self.pool.slots[slot][: wire.nbytes]).view(DTYPES[wire.dtype])
            self.strategy.fold(self.acc_of[j], x, self.strategy.weight(meta), index)
            self.included[j] += 1
        self.next_position[j] += 1
        if self.next_position[j] == len(self.order):
            self._finish(j)
        self.stats.aggregate_seconds += time.perf_counter() - start
        self._post_chunk(self.rank_of[client], slot)

    def _accumulator(self, j: int) -> torch.Tensor:
        numel = self.chunks[j].numel
        storage = self.pool.accumulators[j % self.plan.window]
        if self.strategy.stacked:
            return storage[: len(self.order) * numel].view(len(self.order), numel)
        return storage[:numel]

    def _check_participation(self) -> None:
        """Before anything is written: enough usable updates, with positive total weight."""
        usable = [m for m in self.stats.metas.values() if m.error is None]
        if len(usable) < self.min_participants:
            raise RoundAborted(f"round {self.round}: only {len(usable)} of {len(self.order)} participants sent a "
                               f"usable update, fewer than clients.min_participants={self.min_participants}; "
                               "the round is not applied")
        self.total_weight = sum(self.strategy.weight(m) for m in usable)
        if self.total_weight <= 0:
            raise RoundAborted(f"round {self.round}: zero total client weight (clients {self.order}); cannot average")

    def _finish(self, j: int) -> None:
        if self.total_weight is None:
            self._check_participation()
        chunk = self.chunks[j]
        self.strategy.finish(self.acc_of.pop(j), self.included[j], self.total_weight, self.state.finish_target(chunk),
                             self.state.server_state(chunk))
        self.state.commit(chunk)
        self.finished[j] = True
        while self.low < len(self.chunks) and self.finished[self.low]:
            self.low += 1
