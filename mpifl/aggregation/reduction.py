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
chunk; ``clients.min_participants`` (and ``secagg.min_cohort``) is checked before the first
finished chunk is written, so an aborted round leaves the global model untouched; under a virtual clock
(``ReductionRound.keep_model``) such a round is received to its end and every chunk committed unchanged (the server
then has its usable clients' per-client state put back: roles.server). Under
``accept_failures`` a rank still training past its deadline has the rest of its round dropped
(dropping.py). The slots and the receives posted into them are receives.py's; the held stacks,
held.py's.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from mpi4py import MPI

from mpifl.aggregation.dropping import Dropping, StragglerClock, dropped_headers
from mpifl.aggregation.held import HeldStacks
from mpifl.aggregation.kernels import count_nonfinite
from mpifl.aggregation.receives import PostedReceives, ReceivePool
from mpifl.aggregation.round_task import BelowQuorum, ReductionRound, RoundAborted, checked_totals
from mpifl.aggregation.schedule import ChunkTicket, Finish, Fold, FoldSchedule, Ticket
from mpifl.aggregation.strategies import ACCUMULATOR_DTYPE, Strategy
from mpifl.logs import log, world_rank
from mpifl.planning.pools import holds_stacks
from mpifl.units import range_list
from mpifl.wire import protocol
from mpifl.wire.codecs import Codec
from mpifl.wire.flat import DTYPES
from mpifl.wire.late import OwedStream
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.spec import Chunk
from mpifl.wire.transport import Backoff, wake
from mpifl.wire.watchdog import FIRST_UPDATE, UPDATE_COMPLETE, RankStalled, Watchdog

__all__ = ["BelowQuorum", "Dropping", "GlobalState", "ReceivePool", "ReductionRound", "ReductionStats", "RoundAborted",
           "StreamedReduction"]


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


@dataclass
class ReductionStats:
    """What one round's reduction observed."""

    metas: dict[int, protocol.UpdateMeta] = field(default_factory=dict)  # every logical client's header
    groups: dict[int, protocol.GroupMeta] = field(default_factory=dict)  # clients.groups: each group's header
    first_arrival: float | None = None  # perf_counter when the first update meta landed
    aggregate_seconds: float = 0.0
    nonfinite: int = 0  # NaN/Inf values in the finished global model (each update was checked on its client)
    last_drop: float | None = None  # perf_counter when the last rank was dropped past a deadline this round
    unapplied: str | None = None  # under a virtual clock: why too few usable updates left the model unchanged


class ChunkDecoder:
    """Compressed updates (``compression.method``): each chunk decoded into one reused fp32 scratch, made on first
    use, before it is folded as usual."""

    def __init__(self, codec: Codec, chunks: Sequence[Chunk]):
        self.codec, self.numel = codec, max(c.numel for c in chunks)
        self.scratch: torch.Tensor | None = None

    def decode(self, slot: np.ndarray, numel: int) -> torch.Tensor:
        """The ``numel`` values a chunk's bytes in ``slot`` encode."""
        if self.scratch is None:
            self.scratch = torch.empty(self.numel, dtype=ACCUMULATOR_DTYPE)
        return self.codec.decode(slot, numel, self.scratch)


class StreamedReduction:
    """Receive and fold one round of updates into the global model held by ``state``."""

    def __init__(self, comm: MPI.Comm, state: GlobalState, exchange: ExchangeLayout, strategy: Strategy,
                 pool: ReceivePool, task: ReductionRound, *, watchdog: Watchdog | None = None,
                 dropping: Dropping | None = None):
        plan = task.layout
        self.comm, self.state, self.strategy, self.task, self.exchange = comm, state, strategy, task, exchange
        self.chunks, self.wire = exchange.chunks, exchange.wire
        self.decoder = ChunkDecoder(exchange.codec, self.chunks) if exchange.codec is not None else None
        self.watchdog = watchdog
        self.arrived = {rank: [0, 0] for rank in task.by_rank}  # headers and chunks landed from each rank
        self.total_weight: float | None = None  # set once every header is in, before the first finish
        self.usable: int | None = None  # the usable logical participants, counted then too (grouped streams)
        self.schedule = FoldSchedule(task.by_rank, len(self.chunks), plan.window, task.order)
        summed = task.noise is not None or task.unmask is not None
        if plan.held and not holds_stacks(strategy.stacked, exchange.codec is not None, summed,
                                          max(map(len, task.by_rank.values()), default=0)):
            raise ValueError("held stacks need a stacking strategy, uncompressed updates, no noise or masks, "
                             "and one participant per rank")
        # the participants' chunks stay in their slots and the network reads them there (no stacking copy)
        self.targets: dict[int, torch.Tensor] = {}  # each finished chunk's new value, checked as it is committed
        self.held = HeldStacks(self._commit, self._post_chunk) if plan.held else None
        pool.ensure(plan.slots_per_rank * len(task.by_rank), 0 if self.held is not None else plan.window)
        self.pool = pool
        self.free_slots = list(range(len(pool.slots)))
        self.receives = PostedReceives(list(task.by_rank), watchdog)
        self.acc_of: dict[int, torch.Tensor] = {}
        self.stats = ReductionStats()
        self.waited: set[int] = set()  # ranks past a deadline waited for, as too few would be left (said once)
        self.clock = StragglerClock(dropping, time.monotonic())
        # a whole-update rule (Krum, the geometric median): chunks are kept, and finished once the last has landed
        self.whole = strategy.whole_update
        self.whole_count: int | None = None  # the usable participants the whole-update rule combines
        self.whole_written = False
        self.kept = [False] * len(self.chunks)  # the chunks every usable participant's rows hold (whole-update rules)
        self.kept_below = 0  # the first chunk not kept yet: elements below its first are, in every row

    def run(self) -> ReductionStats:
        """Post receives, fold chunks in order as they land, finish every chunk."""
        for rank in self.schedule.ranks:
            self._post_meta(rank)
            for _ in range(self.task.layout.slots_per_rank):
                self._post_chunk(rank, self.free_slots.pop())
        if self.whole:
            self.strategy.combiner.begin(len(self.schedule.order), sum(c.numel for c in self.chunks), self.task.round)
        try:
            self._receive_and_fold()
            self._settle()
            if self.whole:
                self._finish_whole()
        finally:
            if self.held is not None:
                self.held.drain()
        return self.stats

    def _receive_and_fold(self) -> None:
        backoff = Backoff()
        while not self.schedule.done:
            if self.held is not None and self.held.done():
                self._settle()
            landed = self.receives.completed()
            if landed is None and self.held is not None and self.held.busy:  # every slot waits on that chunk
                self._settle()
                continue
            if landed is None:
                raise RuntimeError(f"reduction stalled with chunks {self.schedule.low}.. unfinished and nothing posted")
            if not landed:
                if self._check_deadlines():
                    self._perform()
                    continue
                backoff.pause()
                continue
            backoff.reset()
            for ticket, obj in landed:
                self._landed(ticket, obj)
            self._perform()

    def _post_meta(self, rank: int) -> None:
        ticket = self.schedule.meta_ticket(rank)
        if ticket is not None:
            buffer = protocol.header_bytes(self.task.header_clients)
            self.receives.add(self.comm.irecv(buffer, source=rank, tag=self.task.meta_tag), ticket)

    def _post_chunk(self, rank: int, slot: int) -> None:
        ticket = self.schedule.chunk_ticket(rank, slot)
        if ticket is None:
            self.free_slots.append(slot)
            return
        buf = self.pool.slots[slot][: self.wire[ticket.chunk].nbytes]
        self.receives.add(self.comm.Irecv([buf, MPI.BYTE], source=rank, tag=self.task.update_tag), ticket)

    def waiting(self) -> dict[int, tuple[str, str | None]]:
        """Each rank awaited (a receive for what it owes next is posted): the stage it is in and the logical client
        concerned.

        A rank whose chunk slots are all full waits on the fold order, not the other way round, though the
        receive of its next header may be posted: with an update in flight it owes a chunk first.
        """
        awaited: dict[int, tuple[str, str | None]] = {}
        for rank, streams in self.task.by_rank.items():
            stage, label = rank_stage(streams, self.arrived[rank], len(self.chunks), self.task.labels or {},
                                      self.exchange.grouped)
            posted = self.receives.headers if stage == FIRST_UPDATE else self.receives.chunks
            if posted[rank] > 0:
                awaited[rank] = stage, label
        return awaited

    @property
    def model_touched(self) -> bool:
        """Whether any finished chunk has been written into the global state this round (a whole-update rule writes
        none before the last chunk has landed)."""
        return self.whole_written if self.whole else any(self.schedule.finished)

    def _landed(self, ticket: Ticket, meta: object) -> None:
        wake(self.comm, ticket.rank)  # its send is complete: it may post the next message, or go on
        if self.watchdog is not None:
            self.watchdog.progress(ticket.rank)
        if isinstance(ticket, ChunkTicket):
            self.arrived[ticket.rank][1] += 1
            self.schedule.chunk_landed(ticket)
            return
        self.arrived[ticket.rank][0] += 1
        stream, usable, members = _header(meta)
        if stream is None or self.schedule.rank_of.get(stream) != ticket.rank:
            raise RuntimeError(f"rank {world_rank(ticket.rank)} sent an unexpected update header: {meta!r}")
        if self.stats.first_arrival is None:
            self.stats.first_arrival = time.perf_counter()
        self.stats.metas.update((m.client, m) for m in members)
        if isinstance(meta, protocol.GroupMeta):
            self.stats.groups[stream] = meta
        self.schedule.meta_landed(stream, usable)
        self.clock.header_landed(ticket.rank, bool(self.schedule.headerless(ticket.rank)))
        self._post_meta(ticket.rank)

    def _check_deadlines(self) -> bool:
        """While nothing lands: a rank silent past its deadline ends the job, unless (accept_failures) it is still
        training and can be dropped, as can a straggler. Whether a rank was dropped (folds may be possible)."""
        dropped = False
        for rank, why in self.clock.overdue(self.waiting, len(self.task.by_rank)):
            dropped |= self._drop(rank, why, straggler=True)
        if self.watchdog is None:
            return dropped
        try:
            self.watchdog.check(self.waiting)
        except RankStalled as stalled:
            if self.clock.dropping is None or stalled.interrupted or not self._drop(stalled.rank, str(stalled)):
                raise
            dropped = True
        return dropped

    def _drop(self, rank: int, why: str, straggler: bool = False) -> bool:
        """Drop the rest of ``rank``'s round: only while it trains (nothing of those participants is folded), and
        only if clients.min_participants (and secagg.min_cohort) can still be met, else a ``straggler`` is waited
        for, which the log says. Whether it was dropped."""
        dropping = self.clock.dropping
        assert dropping is not None  # _check_deadlines drops only with a Dropping
        stage = self.waiting().get(rank)
        streams = self.schedule.headerless(rank)
        if stage is None or stage[0] != FIRST_UPDATE or not streams:
            return False
        members = {s: dropping.members(rank, s) for s in streams}
        everyone = sum(len(dropping.members(r, s)) for r, ss in self.task.by_rank.items() for s in ss)
        failed = sum(1 for m in self.stats.metas.values() if m.error is not None)
        left = everyone - failed - sum(map(len, members.values()))
        if left < self.task.quorum:
            if straggler:
                self._waited_for(rank, why, members, left)
            return False
        raced_metas, raced_chunks = self.receives.cancel(rank)
        self.schedule.drop(rank)
        metas, groups = dropped_headers(members, why, self.task.round, self.exchange.grouped)
        self.stats.metas.update((m.client, m) for m in metas)
        self.stats.groups.update(groups)
        sizes = [self.wire[j].nbytes for _ in streams for j in range(len(self.chunks))]
        dropping.owe(OwedStream(rank, self.task.round, tuple(sorted(c for cs in members.values() for c in cs)),
                                len(streams) - raced_metas, deque(sizes[raced_chunks:])))
        self.stats.last_drop = time.perf_counter()
        return True

    def _waited_for(self, rank: int, why: str, members: Mapping[int, tuple[int, ...]], left: int) -> None:
        """Say, once a round for each rank, that ``rank`` past its deadline is waited for: dropping its
        participants (``members``) would leave ``left`` usable updates, too few for the round's quorum."""
        if rank in self.waited:
            return
        self.waited.add(rank)
        task = self.task
        rule = f"clients.min_participants={task.min_participants}" if task.min_participants >= task.min_cohort \
            else f"secagg.min_cohort={task.min_cohort}"
        clients = sorted(c for cs in members.values() for c in cs)
        plural = "s" if len(clients) > 1 else ""
        log(f"round {task.round}: {why}; waited for, not dropped: dropping logical client{plural} "
            f"{range_list(clients)} would leave {max(left, 0)} usable update{'s' if left != 1 else ''}, fewer than "
            f"{rule}", rank=0)

    def _perform(self) -> None:
        """Fold and finish what the schedule allows now; a folded chunk's slot takes its rank's next chunk."""
        for step in self.schedule.steps():
            start = time.perf_counter()
            if isinstance(step, Finish):
                self._finish(step)
            else:
                self._fold(step)
            self.stats.aggregate_seconds += time.perf_counter() - start
            # a folded chunk's slot takes the next, unless its chunk is held there until it finishes
            if isinstance(step, Fold) and step.slot is not None and (self.held is None or step.row is None):
                self._post_chunk(step.rank, step.slot)

    def _fold(self, step: Fold) -> None:
        if step.row is None:
            return  # a failed participant: its chunk was received only to keep the stream in step (or never)
        assert step.slot is not None  # only a dropped participant's chunks have no slot, and they have no row
        if self.held is not None:
            self.held.hold(step.chunk, step.row, step.rank, step.slot)
            return
        if step.row == 0 and not self.whole:
            self.acc_of[step.chunk] = self._accumulator(step.chunk)
        if self.decoder is not None:  # compressed: decoded into a reused fp32 scratch, then folded as usual
            x = self.decoder.decode(self.pool.slots[step.slot], self.chunks[step.chunk].numel)
        else:
            x = self._received(step.chunk, step.slot)
        # a group's partial sum arrives weighted: it folds with weight 1; a single update, with its own
        grouped = step.client in self.stats.groups
        weight = 1.0 if grouped else self._weight(self.stats.metas[step.client])
        if self.whole:
            self.strategy.combiner.keep(step.row, self.exchange.first_elements[step.chunk], x, weight, step.client)
            return
        self.strategy.fold(self.acc_of[step.chunk], x, weight, step.row)

    def _received(self, chunk: int, slot: int) -> torch.Tensor:
        """Chunk ``chunk`` as it landed in ``slot`` (the wire dtype)."""
        wire = self.wire[chunk]
        return torch.from_numpy(self.pool.slots[slot][: wire.nbytes]).view(DTYPES[wire.dtype])

    def _weight(self, meta: protocol.UpdateMeta) -> float:
        """A participant's weight: the round's own (asynchronous FL), else the strategy's from its header."""
        return self.task.weights[meta.client] if self.task.weights is not None else self.strategy.weight_of(meta)

    def _accumulator(self, j: int) -> torch.Tensor:
        numel = self.chunks[j].numel
        storage = self.pool.accumulators[self.schedule.accumulator(j)]
        if self.strategy.stacked:
            participants = len(self.schedule.order)
            return storage[: participants * numel].view(participants, numel)
        return storage[:numel]

    def _total_weight(self) -> float | None:
        """The round's divisor, checked once, before anything is written (``checked_totals``); None where too few
        usable updates leave the model unchanged (a virtual clock: ``stats.unapplied`` says why)."""
        if self.total_weight is None and self.stats.unapplied is None:
            try:
                self.total_weight, self.strategy.round_statistics_total = checked_totals(
                    self.strategy, self.stats.metas, self.task, self.schedule.order)
            except BelowQuorum as below:
                if not self.task.keep_model or (below.usable and self.task.unrestorable_state):
                    raise
                self.stats.unapplied = str(below)
        return self.total_weight

    def _keep(self, j: int) -> None:
        """Commit chunk ``j`` unchanged: its target holds the old value, the server state is not touched."""
        self.targets[j] = self.state.finish_target(self.chunks[j])
        self._commit(j)

    def _finish(self, step: Finish) -> None:
        if self.held is not None:
            self._finish_held(step)
            return
        total = self._total_weight()
        chunk, acc = self.chunks[step.chunk], self.acc_of.pop(step.chunk, None)
        if total is None:
            self._keep(step.chunk)
            return
        if self.whole:  # finished with the others once the last chunk has landed (_finish_whole)
            self.whole_count = step.count
            self.kept[step.chunk] = True  # folded (kept) for every participant: the schedule's Finish follows them
            while self.kept_below < len(self.chunks) and self.kept[self.kept_below]:
                self.kept_below += 1
            self.strategy.combiner.advance(step.count, self.exchange.first_elements[self.kept_below])
            return
        assert acc is not None  # a chunk with a usable update has been folded into its accumulator
        if self.task.unmask is not None:  # secure aggregation: the ring sum of masked updates becomes the float sum
            self.task.unmask(acc, self.exchange.first_elements[step.chunk], self.stats.metas)
        if self.task.noise is not None:  # DP-FedAvg: the round's noise added to a chunk's sum
            self.task.noise(acc, self.exchange.first_elements[step.chunk])
        target = self.targets[step.chunk] = self.state.finish_target(chunk)
        self.strategy.finish(acc, self._participants(step), total, target, self.state.server_state(chunk), chunk)
        self._commit(step.chunk)

    def _finish_whole(self) -> None:
        """A whole-update rule, once every chunk has landed: solve it over the kept updates, then finish every chunk
        in order with its combination (nothing when too few usable updates left the model unchanged)."""
        if self.total_weight is None or self.whole_count is None:
            return
        start = time.perf_counter()
        combiner = self.strategy.combiner
        combiner.solve(self.whole_count)
        self.whole_written = True
        for j, chunk in enumerate(self.chunks):
            target = self.targets[j] = self.state.finish_target(chunk)
            combined = combiner.combined_chunk(self.exchange.first_elements[j], chunk.numel)
            self.strategy.finish(combined, self.whole_count, self.total_weight, target, self.state.server_state(chunk),
                                 chunk)
            self._commit(j)
        self.stats.aggregate_seconds += time.perf_counter() - start

    def _commit(self, j: int) -> None:
        """Commit finished chunk ``j``, counting the NaN/Inf values of its new value first: every update was checked
        on its client, so any here came after the check (a corrupted link, a strategy's overflow), and a round that
        made them must not be published."""
        self.stats.nonfinite += count_nonfinite([self.targets.pop(j)])
        self.state.commit(self.chunks[j])

    def _participants(self, step: Finish) -> int:
        """The ``count`` a summed chunk's ``finish`` is told: its usable logical participants. A reduction group's
        partial sum (or the chain's one sum) is one stream of the schedule but holds every usable member of it."""
        if not self.exchange.grouped:
            return step.count
        if self.usable is None:  # every header is in by the first finish: counted once a round, not per chunk
            self.usable = sum(1 for meta in self.stats.metas.values() if meta.error is None)
        return self.usable

    def _finish_held(self, step: Finish) -> None:
        """Finish a chunk whose stack is its receive slots: on the strategy's worker threads while the receives go
        on, or here when the strategy cannot (held.py)."""
        assert self.held is not None  # _finish finishes here only with held stacks
        self.held.settle()  # one chunk at a time (_perform times this step)
        total = self._total_weight()
        chunk = self.chunks[step.chunk]
        target, state = self.state.finish_target(chunk), self.state.server_state(chunk)
        self.targets[step.chunk] = target
        if total is None:  # unchanged: committed as it is, its slots freed
            self.held.finishing_in(step.chunk, [])
            return
        rows = [self._received(step.chunk, slot) for slot in self.held.slots(step.chunk)]
        jobs = self.strategy.start_finish(rows, step.count, total, target, state)
        if jobs is None:
            self.strategy.finish(rows, step.count, total, target, state, chunk)
        self.held.finishing_in(step.chunk, jobs or [])

    def _settle(self) -> None:
        """Wait for the chunk finishing in the background and commit it (the wait counts as aggregation time)."""
        if self.held is not None:
            self.stats.aggregate_seconds += self.held.settle()

    def run_without_updates(self) -> ReductionStats:
        """DP-FedAvg with nobody sampled (Poisson sampling): the noise alone still moves the model, so that
        an empty round looks like any other."""
        self.total_weight = self.task.divisor
        for j in range(len(self.chunks)):
            self.acc_of[j] = self._accumulator(j).zero_()
            self._finish(Finish(j, 0))
        return self.stats


def rank_stage(streams: Sequence[int], landed: Sequence[int], per_stream: int, labels: Mapping[int, str],
               grouped: bool) -> tuple[str, str]:
    """The stage of an awaited rank that sends ``streams`` and has sent ``landed`` = (headers, chunks) so far
    (``per_stream`` chunks each), and the stream concerned: the one whose chunks flow, or come next."""
    metas, chunks = landed
    current = streams[min(chunks // per_stream, len(streams) - 1)]
    training = chunks % per_stream == 0 and metas <= chunks // per_stream
    label = labels.get(current) or (f"reduction group {current}" if grouped else f"logical client {current}")
    return FIRST_UPDATE if training else UPDATE_COMPLETE, label


def _header(meta: object) -> tuple[int | None, bool, tuple[protocol.UpdateMeta, ...]]:
    """(stream id, usable, logical clients' headers) of an update header: a client's, or a reduction group's."""
    if isinstance(meta, protocol.UpdateMeta):
        return meta.client, meta.error is None, (meta,)
    if isinstance(meta, protocol.GroupMeta):
        return meta.group, meta.usable, meta.members
    return None, False, ()
