"""Chunk streams over MPI: raw-byte ``Isend``/``Irecv``, bounded in flight, polite waits.

Waiting ranks test, spin briefly, then sleep: when ranks outnumber cores, a rank
spinning inside a blocking MPI wait takes the CPU the others need (1.5-2x slower
rounds at 4 clients on 2 cores). Sleep-polling relies on MPI copying between
processes of one node in a single step (MPICH's CMA path), which is the default.
The sleeps double while nothing happens, from 0.2 to 2 ms: the server waits out
its client ranks' training every round, and each poll wakes it on a core they
train on. With doorbells (``mpifl.wire.doorbell``, ``transport.doorbells``), a
sender wakes a sleeping receiver on its node at once, so the sleeps cost no
latency there, and on one node they may grow to 20 ms.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
from mpi4py import MPI

from mpifl.wire import protocol
from mpifl.wire.doorbell import Doorbells
from mpifl.wire.watchdog import MODEL_DELIVERED

if TYPE_CHECKING:
    import torch

SPIN_SECONDS = 50e-6
SLEEP_SECONDS = 200e-6  # the first sleep of a wait
LONGEST_SLEEP_SECONDS = 2e-3  # what a wait may add to a message's latency, at most
# With doorbells between every pair of ranks (all on one node), a message rings its receiver awake, and the sleeps
# only bound how often a waiting rank looks anyway. Each look wakes it on a core that others train on: on the
# cross-device CNN (2 client ranks, 2 cores) a 20 ms cap instead of 2 ms halved the spread between the ranks'
# training (13 to 7 ms a round) and cut rounds by 3% (profiling/doorbells.py).
RUNG_LONGEST_SLEEP_SECONDS = 20e-3


_doorbells: Doorbells | None = None  # this rank's, while a run uses them (use_doorbells)


@contextlib.contextmanager
def use_doorbells(bells: Doorbells | None) -> Iterator[None]:
    """Sends ring, and waits sleep on, ``bells`` for the duration (None: poll alone)."""
    global _doorbells
    previous, _doorbells = _doorbells, bells
    try:
        yield
    finally:
        _doorbells = previous


def wake(comm: MPI.Comm, dest: int) -> None:
    """Wake ``dest``: a message to it was just posted, or one from it just landed (nothing without doorbells or
    off this node)."""
    if _doorbells is not None:
        _doorbells.ring(comm, dest)


def longest_sleep() -> float:
    """The cap of a wait's sleeps: longer where every rank it may wait on rings it (``RUNG_LONGEST_SLEEP_SECONDS``)."""
    return RUNG_LONGEST_SLEEP_SECONDS if _doorbells is not None and _doorbells.everyone else LONGEST_SLEEP_SECONDS


def _nap(seconds: float) -> bool:
    """Sleep ``seconds``, or until rung; whether rung."""
    if _doorbells is not None:
        return _doorbells.nap(seconds)
    time.sleep(seconds)
    return False


class Backoff:
    """Spin for a moment, then sleep between polls, each sleep twice the last up to ``longest_sleep()``; a ring
    (``mpifl.wire.doorbell``) starts the wait over."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.sleep = SLEEP_SECONDS

    def reset(self) -> None:
        """Progress was made: the next wait spins again before it sleeps, and sleeps briefly first."""
        self.since, self.sleep = None, SLEEP_SECONDS

    def pause(self) -> None:
        """One idle poll: return at once while spinning, else sleep to leave the core to others."""
        now = time.perf_counter()
        if self.since is None:
            self.since = now
        elif now - self.since > SPIN_SECONDS:
            if _nap(self.sleep):  # a message is on its way: spin until MPI hands it over
                self.reset()
            else:
                self.sleep = min(2 * self.sleep, longest_sleep())


def wait(request: MPI.Request, check: Callable[[], None] | None = None) -> None:
    """Wait for one request without hogging the CPU; ``check`` (a deadline) is called while waiting."""
    backoff = Backoff()
    while not request.Test():
        if check is not None:
            check()
        backoff.pause()


def wait_all(requests: Sequence[MPI.Request]) -> None:
    """Wait for all requests without hogging the CPU."""
    backoff = Backoff()
    while not MPI.Request.Testall(list(requests)):
        backoff.pause()


def arrive_together(comm: MPI.Comm) -> None:
    """Return once every rank of ``comm`` has called this: a barrier whose wait sleeps (``Ibarrier`` polled).

    Why: MPICH's blocking collectives poll a core while they wait. Called before a blocking collective that ranks
    reach at different times (at start-up, while others still import torch), it keeps the early ranks off the
    cores the late ones need."""
    wait(comm.Ibarrier())


def send_object(comm: MPI.Comm, obj: object, dest: int, tag: int) -> None:
    """Send a small control object (pickled), waiting politely."""
    request = comm.isend(obj, dest=dest, tag=tag)
    wake(comm, dest)
    wait(request)


def recv_object(comm: MPI.Comm, source: int, tag: int) -> object:
    """Receive a small control object, waiting politely."""
    status = MPI.Status()
    backoff = Backoff()
    while not comm.Iprobe(source=source, tag=tag, status=status):
        backoff.pause()
    return comm.recv(source=status.Get_source(), tag=tag)


class SendWatch(Protocol):
    """What a sender waits with: a round's ``Watchdog``, or any deadline that ends the job when a destination takes
    up nothing (``check`` raises naming it; ``progress`` says one landed)."""

    def check(self, waiting: Callable[[], dict[int, tuple[str, str | None]]]) -> None:
        """Raise for a rank in ``waiting()`` ({rank: (stage, what it owes)}) silent past its deadline."""

    def progress(self, rank: int) -> None:
        """A message to or from ``rank`` completed."""


def send_chunks(comm: MPI.Comm, dests: Sequence[int], tag: int, chunks: Iterable[np.ndarray],
                inflight: int, watchdog: SendWatch | None = None) -> None:
    """Send each chunk to every destination, at most ``inflight`` chunks per destination in flight.

    With a ``watchdog``, a destination that takes up nothing past its deadline raises RankStalled.
    """
    send_windows(comm, dests, tag, [chunks], inflight, watchdog)


def send_windows(comm: MPI.Comm, dests: Sequence[int], tag: int, windows: Iterable[Iterable[np.ndarray]],
                 inflight: int, watchdog: SendWatch | None = None) -> None:
    """``send_chunks`` over a stream of windows of chunks, without draining at window boundaries: the
    sends of window i may still be in flight while window i+1's are posted, and are complete before
    window i+2 is asked for (what ``GlobalStore.outgoing`` allows)."""
    pending: deque[tuple[int, int, MPI.Request]] = deque()  # (window, destination, request), oldest first
    limit = inflight * len(dests)
    for i, window in enumerate(windows):
        for chunk in window:
            for dest in dests:
                while len(pending) >= limit:
                    _wait_sent(*pending.popleft()[1:], watchdog)
                pending.append((i, dest, comm.Isend([chunk, MPI.BYTE], dest=dest, tag=tag)))
                wake(comm, dest)
        while pending and pending[0][0] < i:  # window i-1 is sent before window i+1 is asked for
            _wait_sent(*pending.popleft()[1:], watchdog)
    while pending:
        _wait_sent(*pending.popleft()[1:], watchdog)


def _wait_sent(dest: int, request: MPI.Request, watchdog: SendWatch | None) -> None:
    if watchdog is None:
        wait(request)
        return
    wait(request, lambda: watchdog.check(lambda: {dest: (MODEL_DELIVERED, None)}))
    watchdog.progress(dest)


def recv_chunks(comm: MPI.Comm, source: int, tag: int, chunks: Iterable[np.ndarray], inflight: int) -> None:
    """Receive a stream of chunks straight into the given buffers, in order."""
    pending: deque[MPI.Request] = deque()
    for chunk in chunks:
        while len(pending) >= inflight:
            wait(pending.popleft())
            wake(comm, source)  # its send is complete: it may post the next
        pending.append(comm.Irecv([chunk, MPI.BYTE], source=source, tag=tag))
    wait_all(pending)
    wake(comm, source)


def relay_chunks(comm: MPI.Comm, parent: int, children: Sequence[int], tag: int, chunks: Sequence[np.ndarray],
                 inflight: int) -> None:
    """Receive a stream of chunks from ``parent`` into the given buffers and pass each one on to ``children``
    as soon as it lands (a pipelined broadcast tree); at most ``inflight`` chunks per peer in flight."""
    if not children:
        recv_chunks(comm, parent, tag, chunks, inflight)
        return
    received: deque[tuple[int, MPI.Request]] = deque()
    sent: deque[MPI.Request] = deque()
    posted = 0
    for _ in range(len(chunks)):
        while posted < len(chunks) and len(received) < inflight:
            received.append((posted, comm.Irecv([chunks[posted], MPI.BYTE], source=parent, tag=tag)))
            posted += 1
        j, request = received.popleft()
        wait(request)
        wake(comm, parent)
        for child in children:
            while len(sent) >= inflight * len(children):
                wait(sent.popleft())
            sent.append(comm.Isend([chunks[j], MPI.BYTE], dest=child, tag=tag))
            wake(comm, child)
    wait_all(sent)


def pass_on(comm: MPI.Comm, hops: Sequence[protocol.ChainHop], tags: tuple[int, int],
            slots: Sequence[np.ndarray], sizes: Sequence[int],
            combine: Callable[[int, int, np.ndarray | None], np.ndarray]) -> None:
    """Play ``hops``, this rank's part of a pipelined chain, every chunk passed on as soon as it lands. For each
    chunk j, and within it each hop h in the chain's order: receive chunk j of the running stream from
    ``hops[h].source`` (tag ``tags[0]``; nothing where the hop starts the chain) into a ring of ``slots``, turn it
    into what to send with ``combine(j, h, received)`` and send that to ``hops[h].dest`` (the same tag, or
    ``tags[1]`` to the server).

    The (chunk, hop) order is what lets one rank hold several hops without deadlock: chunk j of a hop waits only
    on chunk j of the hop before it, which its rank reaches before any later (chunk, hop), and a receive is
    posted ``len(slots)`` incoming chunks ahead. Each pair of ranks sends and receives in that one order, so
    MPI's non-overtaking rule matches the chunks without a header. At most ``len(slots)`` chunks in flight in."""
    ring = len(slots)
    items = [(j, h) for j in range(len(sizes)) for h in range(len(hops))]
    incoming = [(j, h) for j, h in items if hops[h].source is not None]
    posted: dict[tuple[int, int], tuple[np.ndarray, MPI.Request]] = {}

    def post(i: int) -> None:
        j, h = incoming[i]
        source, buffer = hops[h].source, slots[i % ring][:sizes[j]]
        assert source is not None  # only hops with a source have incoming chunks
        posted[j, h] = buffer, comm.Irecv([buffer, MPI.BYTE], source=source, tag=tags[0])

    for i in range(min(ring, len(incoming))):
        post(i)
    taken = 0
    for j, h in items:
        hop, received = hops[h], None
        if hop.source is not None:
            received, request = posted.pop((j, h))
            wait(request)
            wake(comm, hop.source)
        out = combine(j, h, received)
        sent = comm.Isend([out, MPI.BYTE], dest=hop.dest, tag=tags[1] if hop.dest == protocol.SERVER else tags[0])
        wake(comm, hop.dest)
        wait(sent)  # the later receives progress meanwhile
        if hop.source is not None:  # its slot is free again: it takes the incoming chunk ``ring`` places on
            if taken + ring < len(incoming):
                post(taken + ring)
            taken += 1


class ProgressInbox:
    """Rank 0's side of the training ranks' progress reports (``protocol.PROGRESS``): each call receives what
    has arrived, without waiting, and says from which ranks (a watchdog's ``heard``)."""

    def __init__(self, comm: MPI.Comm):
        self.comm, self.status = comm, MPI.Status()

    def __call__(self) -> list[int]:
        """The ranks whose reports arrived since the last call (one entry per report)."""
        ranks = []
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=protocol.PROGRESS, status=self.status):
            rank = self.status.Get_source()
            self.comm.recv(source=rank, tag=protocol.PROGRESS)
            ranks.append(rank)
        return ranks


class ProgressReporter:
    """A training rank's side: a forward pre-hook on its model that tells rank 0 the round goes on, at most every
    ``every`` seconds (and at a round's first forward pass). It reports from inside the model's own forward
    passes, so a rank stuck in user code (a hung data loader, a trainer that sleeps) falls silent."""

    def __init__(self, comm: MPI.Comm, every: float = 1.0):
        self.comm, self.every = comm, every
        self.round, self.next_at = 0, 0.0
        self.sent: list[MPI.Request] = []

    def attach(self, module: torch.nn.Module) -> None:
        """Report from ``module``'s forward passes."""
        module.register_forward_pre_hook(lambda _module, _inputs: self.tick())

    def start_round(self, round_: int) -> None:
        """A new round (or step): its first forward pass reports at once."""
        self.round, self.next_at = round_, 0.0

    def tick(self) -> None:
        """One forward pass: report when due (a tiny eager message; finished sends are reaped here)."""
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + self.every
        self.sent = [r for r in self.sent if not r.Test()]
        self.sent.append(self.comm.isend(self.round, dest=protocol.SERVER, tag=protocol.PROGRESS))

    def close(self) -> None:
        """Complete every report (before MPI finalizes)."""
        MPI.Request.Waitall(self.sent)
        self.sent = []

