"""The streamed, deterministic reduction on the server: the MPI receiver of a round's updates.

Each rank has a few receive slots; ``Testsome`` over all of them progresses every stream at once.
What lands goes to the ``FoldSchedule`` (schedule.py: the fold order, the accumulator window, why
the result is bitwise reproducible); this class performs the folds it allows with the strategy
and writes finished chunks into the global state. Memory: the receive slots plus ``window``
chunk accumulators. Robust strategies (median, trimmed mean) need every participant's chunk j
at once: with one participant per rank the chunks stay in their slots, which the sorting
network reads directly (``PoolLayout.held_stacks``), beside the receives on worker threads;
otherwise each accumulator is a participants x chunk stack.
A participant whose header carries an error (``clients.accept_failures``) is skipped in every
chunk; ``clients.min_participants`` is checked before the first finished chunk is written, so
an aborted round leaves the global model untouched. Under ``accept_failures`` a rank still training
past its deadline (``Dropping``: silent, or slower than the straggler rule allows) has the rest of
its round dropped: its receives are cancelled, its headerless participants are skipped, and what it
still sends is handed to the late-stream drain (wire.late).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from mpi4py import MPI

from mpifl.aggregation.schedule import ChunkTicket, Finish, Fold, FoldSchedule, MetaTicket, Ticket
from mpifl.aggregation.strategies import ACCUMULATOR_DTYPE, Strategy
from mpifl.planning.pools import PoolLayout, PoolShape, holds_stacks
from mpifl.wire import protocol
from mpifl.wire.flat import DTYPES
from mpifl.wire.late import OwedStream
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import host_bytes, host_tensor
from mpifl.wire.spec import Chunk, element_offsets
from mpifl.wire.transport import Backoff, wake
from mpifl.wire.watchdog import CHECK_EVERY_SECONDS, FIRST_UPDATE, UPDATE_COMPLETE, RankStalled, StragglerRule, Watchdog


class GlobalState(Protocol):
    """Where finished chunks of the new global model go (a subset of storage.stores.GlobalStore)."""

    def finish_target(self, chunk: Chunk) -> torch.Tensor:
        """Where chunk's new value goes; holds the old value on entry."""
        ...

    def server_state(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """The strategy's state slices for ``chunk``."""
        ...

    def commit(self, chunk: Chunk) -> None:
        """Chunk's new value (and state) is final."""
        ...


class RoundAborted(RuntimeError):
    """Too few usable updates: the round is not applied and the job stops."""


@dataclass
class ReductionStats:
    """What one round's reduction observed."""

    metas: dict[int, protocol.UpdateMeta] = field(default_factory=dict)  # every logical client's header
    groups: dict[int, protocol.GroupMeta] = field(default_factory=dict)  # clients.groups: each group's header
    first_arrival: float | None = None  # perf_counter when the first update meta landed
    aggregate_seconds: float = 0.0


@dataclass(frozen=True)
class ReductionRound:
    """What one round's reduction folds and how: who sends what, the pool layout, and the round's own
    weights, divisor, noise and unmasking (each None when the round has none)."""

    round: int
    by_rank: dict[int, list[int]]  # rank -> its streams (participants or groups), in fold order
    layout: PoolLayout
    order: Sequence[int] | None = None  # the streams' fold order when not ascending
    weights: Mapping[int, float] | None = None  # asynchronous FL's staleness weights
    divisor: float | None = None  # a fixed divisor of the weighted sum (FedBuff's K, DP-FedAvg's k)
    noise: Callable[[torch.Tensor, int], None] | None = None  # DP-FedAvg: adds noise to a chunk's sum
    unmask: Callable[[torch.Tensor, int, Mapping], None] | None = None  # secure aggregation: ring sum to floats
    labels: Mapping[int, str] | None = None  # what a stream is called in messages, where more than its id says


@dataclass(frozen=True)
class Dropping:
    """``clients.accept_failures``: a rank past its deadline while training loses the rest of its round."""

    rule: StragglerRule
    # time.monotonic() when a rank began this round's training (None: it is still finishing a round it was dropped
    # from, so its clock has not started)
    started: Callable[[int], float | None]
    members: Callable[[int, int], tuple[int, ...]]  # (rank, stream) -> the logical clients in that stream
    owe: Callable[[OwedStream], None]  # what a dropped rank will still send goes to the drain


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


class StreamedReduction:
    """Receive and fold one round of updates into the global model held by ``state``."""

    def __init__(self, comm: MPI.Comm, state: GlobalState, exchange: ExchangeLayout, strategy: Strategy,
                 pool: ReceivePool, task: ReductionRound, *, min_participants: int = 1,
                 watchdog: Watchdog | None = None, dropping: Dropping | None = None):
        by_rank, plan, order, noise, unmask = task.by_rank, task.layout, task.order, task.noise, task.unmask
        self.comm, self.state, self.strategy = comm, state, strategy
        self.chunks, self.wire, self.grouped = exchange.chunks, exchange.wire, exchange.grouped
        self.codec = exchange.codec  # compression.method: decode each chunk before folding
        self.decoded: torch.Tensor | None = None  # the reused fp32 scratch it decodes into, made on first use
        self.min_participants, self.round, self.watchdog = min_participants, task.round, watchdog
        self.by_rank, self.labels = by_rank, task.labels or {}
        self.weights, self.divisor = task.weights, task.divisor  # staleness weights; a fixed divisor
        self.noise = noise  # DP-FedAvg: adds the round's noise to a chunk's sum, given its first element
        self.unmask = unmask  # secure aggregation: the ring sum of masked updates becomes the float sum
        self.first_element = element_offsets(self.chunks)
        self.metas_in = {rank: 0 for rank in by_rank}  # what has landed from each rank, for its deadlines
        self.chunks_in = {rank: 0 for rank in by_rank}
        self.posted = {rank: 0 for rank in by_rank}  # receives outstanding: a rank is awaited only when > 0
        self.total_weight: float | None = None  # set once every header is in, before the first finish
        self.schedule = FoldSchedule(by_rank, len(self.chunks), plan.window, order)
        self.plan = plan
        # the participants' chunks stay in their slots and the network reads them there (no stacking copy)
        summed = noise is not None or unmask is not None
        if plan.held and not holds_stacks(strategy.stacked, exchange.codec is not None, summed,
                                          max(map(len, by_rank.values()), default=0)):
            raise ValueError("held stacks need a stacking strategy, uncompressed updates, no noise or masks, "
                             "and one participant per rank")
        # held stacks: chunk -> the (rank, slot) of each included participant's chunk, in row order
        self.held: dict[int, list[tuple[int, int]]] | None = {} if plan.held else None
        self.finishing: tuple[int, list[Future]] | None = None  # the chunk finishing in the background, its jobs
        pool.ensure(plan.slots_per_rank * len(by_rank), 0 if self.held is not None else plan.window)
        self.pool = pool
        self.free_slots = list(range(len(pool.slots)))
        self.requests: list[MPI.Request] = []
        self.tickets: list[Ticket] = []
        self.free_requests: list[int] = []  # indices of completed requests, reused before the list grows
        self.acc_of: dict[int, torch.Tensor] = {}
        self.stats = ReductionStats()
        self.dropping, self.began = dropping, time.monotonic()
        self.trained: dict[int, float] = {}  # rank -> seconds from taking up the model to its last header
        self.next_straggler_check = self.began
        self.meta_tag = protocol.round_tag(protocol.META, task.round)
        self.update_tag = protocol.round_tag(protocol.UPDATE, task.round)

    def run(self) -> ReductionStats:
        """Post receives, fold chunks in order as they land, finish every chunk."""
        for rank in self.schedule.ranks:
            self._post_meta(rank)
            for _ in range(self.plan.slots_per_rank):
                self._post_chunk(rank, self.free_slots.pop())
        try:
            self._receive_and_fold()
            self._settle()
        finally:
            self._drain()
        return self.stats

    def _receive_and_fold(self) -> None:
        backoff = Backoff()
        while not self.schedule.done:
            if self._background_done():
                self._settle()
            done, objects = MPI.Request.testsome(self.requests)
            if done is None and self.finishing is not None:  # every slot is held by the chunk being finished
                self._settle()
                continue
            if done is None:
                raise RuntimeError(f"reduction stalled with chunks {self.schedule.low}.. unfinished and nothing posted")
            if not done:
                if self._check_deadlines():
                    self._perform()
                    continue
                backoff.pause()
                continue
            backoff.reset()
            assert objects is not None  # testsome returns None for both or for neither
            for index, obj in zip(done, objects):
                self.requests[index] = MPI.REQUEST_NULL
                self.free_requests.append(index)
                self._landed(self.tickets[index], obj)
            self._perform()

    def _add_request(self, request: MPI.Request, ticket: Ticket) -> None:
        if self.posted[ticket.rank] == 0 and self.watchdog is not None:
            self.watchdog.progress(ticket.rank)  # awaited again (its slots were full): its clock starts now
        self.posted[ticket.rank] += 1
        if self.free_requests:
            i = self.free_requests.pop()
            self.requests[i], self.tickets[i] = request, ticket
            return
        self.requests.append(request)
        self.tickets.append(ticket)

    def _post_meta(self, rank: int) -> None:
        ticket = self.schedule.meta_ticket(rank)
        if ticket is not None:
            self._add_request(self.comm.irecv(source=rank, tag=self.meta_tag), ticket)

    def _post_chunk(self, rank: int, slot: int) -> None:
        ticket = self.schedule.chunk_ticket(rank, slot)
        if ticket is None:
            self.free_slots.append(slot)
            return
        buf = self.pool.slots[slot][: self.wire[ticket.chunk].nbytes]
        self._add_request(self.comm.Irecv([buf, MPI.BYTE], source=rank, tag=self.update_tag), ticket)

    def waiting(self) -> dict[int, tuple[str, str | None]]:
        """Each rank awaited (a receive from it is posted): the stage it is in and the logical client concerned.

        A rank whose receive slots are all full waits on the fold order, not the other way round.
        """
        out: dict[int, tuple[str, str | None]] = {}
        per_client = len(self.chunks)
        for rank, clients in self.by_rank.items():
            metas, chunks = self.metas_in[rank], self.chunks_in[rank]
            if self.posted[rank] == 0:
                continue
            current = min(chunks // per_client, len(clients) - 1)  # whose chunks flow, or come next
            training = chunks % per_client == 0 and metas <= chunks // per_client
            label = self.labels.get(clients[current]) or \
                (f"reduction group {clients[current]}" if self.grouped else f"logical client {clients[current]}")
            out[rank] = (FIRST_UPDATE if training else UPDATE_COMPLETE, label)
        return out

    @property
    def model_touched(self) -> bool:
        """Whether any finished chunk has been written into the global state this round."""
        return any(self.schedule.finished)

    def _landed(self, ticket: Ticket, meta: object) -> None:
        wake(self.comm, ticket.rank)  # its send is complete: it may post the next message, or go on
        self.posted[ticket.rank] -= 1
        if self.watchdog is not None:
            self.watchdog.progress(ticket.rank)
        if isinstance(ticket, ChunkTicket):
            self.chunks_in[ticket.rank] += 1
            self.schedule.chunk_landed(ticket)
            return
        self.metas_in[ticket.rank] += 1
        stream, usable, members = _header(meta)
        if stream is None or self.schedule.rank_of.get(stream) != ticket.rank:
            raise RuntimeError(f"rank {ticket.rank} sent an unexpected update header: {meta!r}")
        if self.stats.first_arrival is None:
            self.stats.first_arrival = time.perf_counter()
        self.stats.metas.update((m.client, m) for m in members)
        if isinstance(meta, protocol.GroupMeta):
            self.stats.groups[stream] = meta
        self.schedule.meta_landed(stream, usable)
        if self.dropping is not None and not self.schedule.headerless(ticket.rank):
            self.trained[ticket.rank] = time.monotonic() - (self._started(ticket.rank) or self.began)
        self._post_meta(ticket.rank)

    def _started(self, rank: int) -> float | None:
        return self.dropping.started(rank) if self.dropping is not None else self.began

    def _check_deadlines(self) -> bool:
        """While nothing lands: a rank silent past its deadline ends the job, unless (accept_failures) it is still
        training and can be dropped, as can a straggler. Whether a rank was dropped (folds may be possible)."""
        dropped = False
        if self.dropping is not None and time.monotonic() >= self.next_straggler_check:
            self.next_straggler_check = time.monotonic() + CHECK_EVERY_SECONDS
            limit = self.dropping.rule.limit(list(self.trained.values()), len(self.by_rank))
            for rank, (stage, _) in sorted(self.waiting().items()):
                started = self._started(rank)
                took = 0.0 if started is None else time.monotonic() - started
                if limit is not None and stage == FIRST_UPDATE and took > limit:
                    dropped |= self._drop(rank, f"rank {rank} was still training after {took:.1f} s, past the "
                                                f"straggler deadline of {limit:g} s ({self.dropping.rule.describe()})")
        if self.watchdog is None:
            return dropped
        try:
            self.watchdog.check(self.waiting)
        except RankStalled as stalled:
            if self.dropping is None or stalled.interrupted or not self._drop(stalled.rank, str(stalled)):
                raise
            dropped = True
        return dropped

    def _drop(self, rank: int, why: str) -> bool:
        """Drop the rest of ``rank``'s round: only while it trains (nothing of those participants is folded), and
        only if clients.min_participants can still be met. Whether it was dropped."""
        assert self.dropping is not None  # _check_deadlines drops only with a Dropping
        stage = self.waiting().get(rank)
        streams = self.schedule.headerless(rank)
        if stage is None or stage[0] != FIRST_UPDATE or not streams:
            return False
        members = {s: self.dropping.members(rank, s) for s in streams}
        everyone = sum(len(self.dropping.members(r, s)) for r, ss in self.by_rank.items() for s in ss)
        failed = sum(1 for m in self.stats.metas.values() if m.error is not None)
        if everyone - failed - sum(map(len, members.values())) < self.min_participants:
            return False
        raced_metas, raced_chunks = self._cancel_receives(rank)
        self.schedule.drop(rank)
        why = f"{why}; dropped from round {self.round}, it rejoins at the next round it is in time for"
        for stream, clients in members.items():
            metas = tuple(protocol.UpdateMeta(c, 0, 0.0, {}, why) for c in clients)
            self.stats.metas.update((m.client, m) for m in metas)
            if self.grouped:
                self.stats.groups[stream] = protocol.GroupMeta(stream, metas)
        sizes = [self.wire[j].nbytes for _ in streams for j in range(len(self.chunks))]
        self.dropping.owe(OwedStream(rank, self.round, tuple(sorted(c for cs in members.values() for c in cs)),
                                     len(streams) - raced_metas, deque(sizes[raced_chunks:])))
        return True

    def _cancel_receives(self, rank: int) -> tuple[int, int]:
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
            self.free_requests.append(i)
        self.posted[rank] = 0
        return raced_metas, raced_chunks

    def _perform(self) -> None:
        """Fold and finish what the schedule allows now; a folded chunk's slot takes its rank's next chunk."""
        for step in self.schedule.steps():
            start = time.perf_counter()
            if isinstance(step, Fold):
                self._fold(step)
            else:
                self._finish(step)
            self.stats.aggregate_seconds += time.perf_counter() - start
            if isinstance(step, Fold) and step.slot is not None and not self._holds(step):
                self._post_chunk(step.rank, step.slot)

    def _holds(self, step: Fold) -> bool:
        """Whether ``step``'s slot stays full until its chunk finishes (it is a row of the held stack)."""
        return self.held is not None and step.row is not None

    def _fold(self, step: Fold) -> None:
        if step.row is None:
            return  # a failed participant: its chunk was received only to keep the stream in step (or never)
        assert step.slot is not None  # only a dropped participant's chunks have no slot, and they have no row
        if self.held is not None:
            self._hold(step)
            return
        if step.row == 0:
            self.acc_of[step.chunk] = self._accumulator(step.chunk)
        if self.codec is not None:  # compressed: decoded into a reused fp32 scratch, then folded as usual
            x = self.codec.decode(self.pool.slots[step.slot], self.chunks[step.chunk].numel, self._decoded())
        else:
            x = self._received(step.chunk, step.slot)
        # a group's partial sum arrives weighted: it folds with weight 1; a single update, with its own
        grouped = step.client in self.stats.groups
        weight = 1.0 if grouped else self._weight(self.stats.metas[step.client])
        self.strategy.fold(self.acc_of[step.chunk], x, weight, step.row)

    def _received(self, chunk: int, slot: int) -> torch.Tensor:
        """Chunk ``chunk`` as it landed in ``slot`` (the wire dtype)."""
        wire = self.wire[chunk]
        return torch.from_numpy(self.pool.slots[slot][: wire.nbytes]).view(DTYPES[wire.dtype])

    def _hold(self, step: Fold) -> None:
        """Keep the chunk in its slot as row ``step.row`` of its chunk's stack."""
        assert self.held is not None  # _fold holds chunks only with held stacks
        rows = self.held.setdefault(step.chunk, [])
        assert len(rows) == step.row, "rows are taken in the fold order"
        assert step.slot is not None  # a held row was received
        rows.append((step.rank, step.slot))

    def _decoded(self) -> torch.Tensor:
        if self.decoded is None:
            self.decoded = torch.empty(max(c.numel for c in self.chunks), dtype=ACCUMULATOR_DTYPE)
        return self.decoded

    def _statistics_total(self, usable: list[protocol.UpdateMeta]) -> float | None:
        """What the round's statistics are divided by where not by ``total_weight``: asynchronously, where they
        arrive as values, their weights' own sum (not FedBuff's K); otherwise the strategy's (FedNova's)."""
        if self.weights is not None:
            return math.fsum(self._weight(m) for m in usable) if self.strategy.statistics_absolute else None
        return None if self.divisor is not None else self.strategy.statistics_total(usable)

    def _weight(self, meta: protocol.UpdateMeta) -> float:
        """A participant's weight: the round's own (asynchronous FL), else the strategy's from its header."""
        return self.weights[meta.client] if self.weights is not None else self.strategy.weight_of(meta)

    def _accumulator(self, j: int) -> torch.Tensor:
        numel = self.chunks[j].numel
        storage = self.pool.accumulators[self.schedule.accumulator(j)]
        if self.strategy.stacked:
            participants = len(self.schedule.order)
            return storage[: participants * numel].view(participants, numel)
        return storage[:numel]

    def _check_participation(self) -> None:
        """Before anything is written: enough usable updates, with positive total weight."""
        order = self.schedule.order
        usable = [m for m in self.stats.metas.values() if m.error is None]
        if len(usable) < self.min_participants:
            raise RoundAborted(f"round {self.round}: only {len(usable)} of {len(self.stats.metas)} participants sent a "
                               f"usable update, fewer than clients.min_participants={self.min_participants}; "
                               "the round is not applied")
        if self.divisor is not None:
            self.total_weight = self.divisor
        elif self.weights is not None:  # asynchronous FL's own weights
            self.total_weight = sum(self._weight(m) for m in usable)
        else:
            self.total_weight = self.strategy.total_weight(usable)
        self.strategy.round_statistics_total = self._statistics_total(usable)
        if self.total_weight <= 0:
            raise RoundAborted(f"round {self.round}: zero total client weight (clients {order}); cannot average")

    def _finish(self, step: Finish) -> None:
        if self.held is not None:
            self._finish_held(step)
            return
        if self.total_weight is None:
            self._check_participation()
        assert self.total_weight is not None  # _check_participation set it, or raised
        chunk, acc = self.chunks[step.chunk], self.acc_of.pop(step.chunk)
        if self.unmask is not None:
            self.unmask(acc, self.first_element[step.chunk], self.stats.metas)
        if self.noise is not None:
            self.noise(acc, self.first_element[step.chunk])
        self.strategy.finish(acc, step.count, self.total_weight, self.state.finish_target(chunk),
                             self.state.server_state(chunk), chunk)
        self.state.commit(chunk)

    def _finish_held(self, step: Finish) -> None:
        """Finish a chunk whose stack is its receive slots: on the strategy's worker threads while the
        receives go on (one chunk at a time, so the store sees finish_target and commit in order), or
        here when the strategy cannot; the slots are freed once the statistic is written."""
        self._settle(timed=False)  # _perform times this step
        if self.total_weight is None:
            self._check_participation()
        assert self.total_weight is not None  # _check_participation set it, or raised
        assert self.held is not None  # _finish finishes here only with held stacks
        chunk = self.chunks[step.chunk]
        rows = [self._received(step.chunk, slot) for _, slot in self.held.get(step.chunk, ())]
        target, state = self.state.finish_target(chunk), self.state.server_state(chunk)
        jobs = self.strategy.start_finish(rows, step.count, self.total_weight, target, state)
        if jobs is None:
            self.strategy.finish(rows, step.count, self.total_weight, target, state, chunk)
            jobs = []
        self.finishing = (step.chunk, jobs)
        if not jobs:
            self._settle(timed=False)

    def _settle(self, timed: bool = True) -> None:
        """Wait for the chunk being finished in the background, commit it and free its slots (the wait
        counts as aggregation time when ``timed``)."""
        if self.finishing is None:
            return
        j, jobs = self.finishing
        start = time.perf_counter()
        try:
            for job in jobs:
                job.result()
        finally:
            self.finishing = None
        if timed:
            self.stats.aggregate_seconds += time.perf_counter() - start
        self.state.commit(self.chunks[j])
        assert self.held is not None  # only _finish_held finishes in the background
        for rank, slot in self.held.pop(j, ()):
            self._post_chunk(rank, slot)

    def _background_done(self) -> bool:
        return self.finishing is not None and all(job.done() for job in self.finishing[1])

    def _drain(self) -> None:
        """After a failure: let a background finish end before its slots and target are reused."""
        if self.finishing is not None:
            wait(self.finishing[1])
            self.finishing = None

    def run_without_updates(self) -> ReductionStats:
        """DP-FedAvg with nobody sampled (Poisson sampling): the noise alone still moves the model, so that
        an empty round looks like any other."""
        self.total_weight = self.divisor
        for j in range(len(self.chunks)):
            self.acc_of[j] = self._accumulator(j).zero_()
            self._finish(Finish(j, 0))
        return self.stats


def _header(meta: object) -> tuple[int | None, bool, tuple[protocol.UpdateMeta, ...]]:
    """(stream id, usable, logical clients' headers) of an update header: a client's, or a reduction group's."""
    if isinstance(meta, protocol.UpdateMeta):
        return meta.client, meta.error is None, (meta,)
    if isinstance(meta, protocol.GroupMeta):
        return meta.group, meta.usable, meta.members
    return None, False, ()
