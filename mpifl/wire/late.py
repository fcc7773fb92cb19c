"""Late streams: what a rank dropped from a round still sends, drained on rank 0 while later rounds run.

Under ``clients.accept_failures`` a rank still training past its deadline has the rest of its round
dropped (aggregation.reduction). It does not know: it finishes training and sends those updates, on
that round's tags (``protocol.round_tag``), so they can never be taken for a later round's. Rank 0
must still take them up, or the rank's sends never complete and it never reads its next header. This
module receives them into a small scratch ring and throws them away, from rank 0's polling (the
watchdog's ``heard``), so the rank rejoins as soon as it is done, and the other ranks are not held up.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from mpifl.errors import INTERRUPTED, JobFailure
from mpifl.logs import world_rank
from mpifl.wire import protocol
from mpifl.wire.memory import host_bytes
from mpifl.wire.transport import Backoff


@dataclass
class OwedStream:
    """What one rank still owes of one round: update headers, then chunks of these sizes, in order."""

    rank: int
    round: int
    clients: tuple[int, ...]  # the logical clients dropped (for the messages)
    metas: int
    chunk_sizes: deque[int]
    dropped_at: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        """Whether everything owed has been taken up."""
        return self.metas == 0 and not self.chunk_sizes


@dataclass
class _Drain:
    """The receives in flight for one owed stream, into a ring of scratch slots used in turn."""

    requests: deque[MPI.Request] = field(default_factory=deque)
    slots: list[np.ndarray] = field(default_factory=list)
    posted: int = 0


class DroppedClients:
    """Rank 0's note of the logical clients it dropped past their deadline, whose update it refused or that failed,
    or whose usable updates went to a round not applied (under a virtual clock), by rank, until the rank's next
    header names them (``Header.dropped``): a dropped rank cannot tell while it trains, and a rank whose clients keep
    state that the server's must match (SCAFFOLD's c_i, FedDyn's g_i) puts theirs back when it reads it."""

    def __init__(self) -> None:
        self.by_rank: dict[int, set[int]] = {}

    def note(self, owed: OwedStream, home: Callable[[int], int] | None = None) -> None:
        """``owed``'s clients were dropped from its rank's round; ``home``: the rank that keeps each client's state
        when that is another (``clients.placement: per_round``), which puts it back, so it is told too."""
        self.add(owed.rank, owed.clients, home)

    def add(self, rank: int, clients: Iterable[int], home: Callable[[int], int] | None = None) -> None:
        """``clients`` of ``rank`` are left out of the round they trained (dropped past a deadline, or in a round not
        applied); ``home`` as for ``note``."""
        clients = tuple(clients)
        self.by_rank.setdefault(rank, set()).update(clients)
        if home is not None:
            for client in clients:
                self.by_rank.setdefault(home(client), set()).add(client)

    def take(self, rank: int) -> tuple[int, ...]:
        """The clients of ``rank`` dropped since its last header (ascending), for the header about to go."""
        return tuple(sorted(self.by_rank.pop(rank, ())))


def first_silent(owed: Iterable[OwedStream], last_heard: Callable[[OwedStream], float], now: float,
                 limit: float) -> OwedStream | None:
    """The first of ``owed`` whose rank was last heard from (``last_heard``) more than ``limit`` s before ``now``."""
    return next((o for o in owed if now - last_heard(o) > limit), None)


class LateStreams:
    """Rank 0's drain of the streams that dropped ranks still send (a small receive ring per owed stream)."""

    def __init__(self, comm: MPI.Comm, ring: int, slot_bytes: int,
                 log: Callable[[str], None] = lambda message: None):
        self.comm, self.ring, self.slot_bytes, self.log = comm, max(1, ring), slot_bytes, log
        self.owed: list[OwedStream] = []
        self.drains: dict[int, _Drain] = {}  # id(owed stream) -> its receives
        self.finished: dict[int, float] = {}  # rank -> time.monotonic() when its last owed stream was in
        self.heard_at: dict[int, float] = {}  # rank -> when it last sent anything: a late chunk, a progress report
        self.retired: set[int] = set()  # busy ranks silent past the deadline (said once)
        # the headers of dropped streams, discarded with their updates: what they report of their rank's cost
        # (the work of the round it was dropped from) is counted where they land (take_discarded)
        self.discarded: list[protocol.UpdateMeta] = []
        self.status = MPI.Status()

    def add(self, owed: OwedStream) -> None:
        """Take up ``owed`` from now on."""
        if not owed.done:
            self.owed.append(owed)

    def take_discarded(self) -> list[protocol.UpdateMeta]:
        """The dropped streams' headers that landed since the last call (their updates discarded)."""
        taken, self.discarded = self.discarded, []
        return taken

    def owes(self, rank: int) -> bool:
        """Whether ``rank`` still has a dropped stream in flight."""
        return any(o.rank == rank for o in self.owed)

    def __call__(self) -> list[int]:
        """Take up whatever has arrived, without waiting; the ranks heard from (a watchdog's ``heard``)."""
        heard = []
        for owed in list(self.owed):
            if self._progress(owed):
                heard.append(owed.rank)
            if owed.done:
                self._retire(owed)
        self.note(heard)
        return heard

    def note(self, ranks: list[int]) -> None:
        """``ranks`` were heard from just now (their progress reports count: a busy rank reports its training)."""
        now = time.monotonic()
        for rank in ranks:
            self.heard_at[rank] = now
            self.retired.discard(rank)

    def busy(self, round_: int, silence_limit: float, setting: str = "timeouts.first_update") -> dict[int, int]:
        """The ranks still sending a round they were dropped from (rank -> that round), which round ``round_``
        leaves out rather than wait for. One silent past ``silence_limit`` s (``setting``) since it was dropped or
        last heard from is retired, said once: every round leaves it out until it is heard from again, and if it
        never is, ``finish`` ends the job naming it once the last round is on disk. What has already arrived is
        taken up first: a rank whose small late chunks went out eagerly may have trained and sent a later round
        since, and is not busy."""
        while self():
            pass
        now = time.monotonic()
        busy: dict[int, int] = {}
        for owed in self.owed:
            busy[owed.rank] = min(busy.get(owed.rank, owed.round), owed.round)
            silent = now - self._last_heard(owed)
            if silent > silence_limit and owed.rank not in self.retired:
                self.retired.add(owed.rank)
                self.log(f"round {round_}: rank {world_rank(owed.rank)}, dropped from round {owed.round} past its "
                         "deadline, has "
                         f"sent nothing for {silent:.1f} s (past {silence_limit:g} s, {setting}): retired, every "
                         "round leaves it out until it is heard from; if it never is, the job ends non-zero, naming "
                         "it, once the last round is on disk")
        return busy

    def _last_heard(self, owed: OwedStream) -> float:
        return max(owed.dropped_at, self.heard_at.get(owed.rank, 0.0))

    def finish(self, silence_limit: float, setting: str = "timeouts.first_update",
               heard: Callable[[], Iterable[int]] | None = None,
               stop_requested: Callable[[], bool] = lambda: False, grace: float = 5.0) -> None:
        """Take up everything still owed (before the stop), for as long as each owing rank is heard from; a rank
        silent past ``silence_limit`` s (``setting``) ends the job. ``heard``: the server's, which takes up the
        ranks' progress reports besides these streams (None: the streams alone). A rank dropped from the last round
        is often still training it, which sends no chunk until it is done, only progress reports: counting the
        streams alone ended the job under a rank that kept reporting (found by a new user with a ``slowdown``).

        After a SIGTERM (``stop_requested``: what PBS sends before the walltime) the wait lasts ``grace`` s more
        (timeouts.sigterm_grace), whatever the ranks report: what they still owe is discarded anyway, and every
        round is on disk, so the job ends as stopped on request (exit 3) rather than run into the walltime."""
        listen = heard if heard is not None else self
        backoff = Backoff()
        sigterm_at: float | None = None
        while self.owed:
            arrived = list(listen())  # the server's heard notes its progress reports here (note)
            now = time.monotonic()
            if sigterm_at is None and stop_requested():
                sigterm_at = now
            if sigterm_at is not None and now - sigterm_at > grace:
                owing = sorted({o.rank for o in self.owed})
                raise JobFailure(f"SIGTERM arrived while rank{'s' if len(owing) > 1 else ''} "
                                 f"{', '.join(map(str, owing))} still owed the late updates of a round it was "
                                 f"dropped from; stopped waiting after {grace:g} s (timeouts.sigterm_grace): every "
                                 "round is on disk, and those updates would have been discarded", INTERRUPTED)
            silent = first_silent(self.owed, self._last_heard, now, silence_limit)
            if silent is not None:
                raise JobFailure(f"rank {world_rank(silent.rank)} was dropped from round {silent.round} and has "
                                 "sent nothing of "
                                 f"logical clients {list(silent.clients)} for {now - self._last_heard(silent):.1f} s "
                                 f"(the limit is {silence_limit:g} s, {setting}); every round is on disk")
            if arrived:
                backoff.reset()
            else:
                backoff.pause()

    def _progress(self, owed: OwedStream) -> bool:
        """Receive what has landed of ``owed``; whether anything did."""
        landed = False
        meta_tag = protocol.round_tag(protocol.META, owed.round)
        while owed.metas and self.comm.Iprobe(source=owed.rank, tag=meta_tag, status=self.status):
            meta = self.comm.recv(source=owed.rank, tag=meta_tag)
            self.discarded.extend(meta.members if isinstance(meta, protocol.GroupMeta) else
                                  [meta] if isinstance(meta, protocol.UpdateMeta) else [])
            owed.metas -= 1
            landed = True
        drain = self.drains.setdefault(id(owed), _Drain())
        tag = protocol.round_tag(protocol.UPDATE, owed.round)
        while True:
            while drain.requests and drain.requests[0].Test():  # same source and tag: they finish in order
                drain.requests.popleft()
                owed.chunk_sizes.popleft()
                landed = True
            in_flight = len(drain.requests)
            if in_flight >= min(self.ring, len(owed.chunk_sizes)):
                return landed
            if not drain.slots:
                drain.slots = [host_bytes(self.slot_bytes, touch=False) for _ in range(self.ring)]
            buf = drain.slots[drain.posted % self.ring][:owed.chunk_sizes[in_flight]]
            drain.requests.append(self.comm.Irecv([buf, MPI.BYTE], source=owed.rank, tag=tag))
            drain.posted += 1

    def _retire(self, owed: OwedStream) -> None:
        self.owed.remove(owed)
        self.drains.pop(id(owed), None)
        self.finished[owed.rank] = time.monotonic()
        self.log(f"round {owed.round}: rank {world_rank(owed.rank)}'s late updates of logical clients "
                 f"{list(owed.clients)} "
                 f"arrived {time.monotonic() - owed.dropped_at:.1f} s after it was dropped, and were discarded")
