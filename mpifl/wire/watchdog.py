"""Progress-aware deadlines: a client rank that makes no progress past its stage's deadline ends the job, named.

A round has three stages per client rank, each with its own deadline on *silence* (any
message from the rank counts as progress and restarts its clock):

- ``model delivered``: the rank takes up the global model the server streams to it;
- ``first update``: the rank trains a logical client and sends its update header;
- ``update complete``: the rank streams that client's update chunks.

A rank silent past its deadline raises ``RankStalled``, naming the rank, the logical
client, the stage and the seconds waited. After a SIGTERM (what PBS sends at walltime) a
silent rank is given only ``sigterm_grace`` seconds, so the job can still save and stop.

A training rank reports progress from the forward passes of its model (``protocol.PROGRESS``,
at most once a second), which a rank stuck in user code cannot send. Until a round has been
timed, and unless ``timeouts.first_update`` is set, the ``first update`` deadline derives from
the other ranks: 10 times the slowest first report of this round (at least 30 s), or 300 s while
no rank has reported.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mpifl.config import TimeoutsConfig
from mpifl.errors import JobFailure
from mpifl.logs import world_rank

MODEL_DELIVERED = "model delivered"
FIRST_UPDATE = "first update"
UPDATE_COMPLETE = "update complete"
SETTING = {MODEL_DELIVERED: "model_delivered", FIRST_UPDATE: "first_update", UPDATE_COMPLETE: "update_complete"}
CHECK_EVERY_SECONDS = 0.05  # deadlines are seconds long: looking 20 times a second is plenty
FIRST_UPDATE_FALLBACK_SECONDS = 300.0  # training deadline before anything is measured: minutes, not half an hour
STALL_FLOOR_SECONDS = 30.0  # a derived deadline is never shorter
STALL_FACTOR = 10.0  # a rank may be this many times slower to report than the slowest other rank
STRAGGLER_FACTOR = 3.0  # accept_failures: a rank may train this many times as long as the slowest finished rank
STRAGGLER_FLOOR_SECONDS = 60.0  # ... and never less: a derived straggler deadline must not cut ordinary jitter


class RankStalled(JobFailure):
    """A client rank made no progress past its deadline."""

    def __init__(self, message: str, rank: int, stage: str, interrupted: bool):
        super().__init__(message)
        self.rank, self.stage, self.interrupted = rank, stage, interrupted


@dataclass(frozen=True)
class Deadlines:
    """Seconds of silence allowed per stage, and after a SIGTERM."""

    model_delivered: float
    first_update: float
    update_complete: float
    sigterm_grace: float = 5.0
    derive_first_update: bool = False  # unset and unmeasured: derive it from the other ranks' first reports

    def of(self, stage: str) -> float:
        """The deadline of ``stage``."""
        return getattr(self, SETTING[stage])


class Watchdog:
    """When each awaited rank last made progress in a round; raises RankStalled past its deadline."""

    def __init__(self, deadlines: Deadlines, round_: int, clients_of: dict[int, list[int]],
                 stop_requested: Callable[[], bool] = lambda: False,
                 heard: Callable[[], Iterable[int]] | None = None):
        """``heard``: the ranks whose progress reports arrived since the last call (None: no reports)."""
        self.deadlines, self.round, self.clients_of = deadlines, round_, clients_of
        self.stop_requested, self.heard = stop_requested, heard
        now = time.monotonic()
        self.started = now
        self.last = {rank: now for rank in clients_of}
        self.first_report: dict[int, float] = {}  # seconds from the round's start to each rank's first report
        self.sigterm_at: float | None = None
        self.next_check = now

    def progress(self, rank: int) -> None:
        """A message from ``rank`` landed."""
        now = time.monotonic()
        self.last[rank] = now
        self.first_report.setdefault(rank, now - self.started)

    def check(self, waiting: Callable[[], dict[int, tuple[str, str | None]]]) -> None:
        """Raise for the first rank in ``waiting()`` ({rank: (stage, what it owes)}) silent past its deadline."""
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + CHECK_EVERY_SECONDS
        if self.sigterm_at is None and self.stop_requested():
            self.sigterm_at = now
        for rank in self.heard() if self.heard is not None else ():
            if rank in self.last:
                self.progress(rank)
        for rank, (stage, who) in sorted(waiting().items()):
            since = self.last[rank]
            limit = self.limit(stage, rank)
            if self.sigterm_at is not None:
                since, limit = max(since, self.sigterm_at), min(limit, self.deadlines.sigterm_grace)
            if now - since > limit:
                raise self._stalled(rank, stage, who, now - self.last[rank], limit)

    def limit(self, stage: str, rank: int) -> float:
        """Seconds of silence ``rank`` may keep at ``stage``: the configured or measured deadline, or one derived
        from how soon the other ranks first reported this round."""
        if stage != FIRST_UPDATE or not self.deadlines.derive_first_update:
            return self.deadlines.of(stage)
        others = [seconds for r, seconds in self.first_report.items() if r != rank]
        return max(STALL_FLOOR_SECONDS, STALL_FACTOR * max(others)) if others else self.deadlines.first_update

    def _stalled(self, rank: int, stage: str, who: str | None, waited: float, limit: float) -> RankStalled:
        who = who or f"logical clients {self.clients_of[rank]}"
        interrupted = self.sigterm_at is not None
        derived = stage == FIRST_UPDATE and self.deadlines.derive_first_update
        setting = f"timeouts.{SETTING[stage]}"
        if derived:
            setting = (f"{setting} unset and no round timed yet: {STALL_FACTOR:g}x the other ranks' first report, "
                       f"at least {STALL_FLOOR_SECONDS:g} s, else {FIRST_UPDATE_FALLBACK_SECONDS:g} s")
        why = (f"SIGTERM arrived and it stayed silent {limit:g} s more (timeouts.sigterm_grace)" if interrupted
               else f"past its deadline of {limit:g} s ({setting})")
        return RankStalled(f"round {self.round}: rank {world_rank(rank)} ({who}) made no progress for {waited:.1f} s "
                           f"at stage '{stage}', {why}", rank, stage, interrupted)


def default_deadlines(timeouts: TimeoutsConfig, chunk_bytes: int, inflight: int,
                      slowest_train_seconds: float | None, derive: bool = True) -> Deadlines:
    """Deadlines from the ``timeouts`` section; unset ones from the chunk size and the training times so far.
    ``derive``: whether an unmeasured training deadline may derive from the other ranks' reports (not where a
    rank legitimately waits on another after training, as in the chain reduction)."""
    transfer = 60.0 + inflight * chunk_bytes / 10e6  # a rank's in-flight chunks at a slow 10 MB/s, plus a minute
    unmeasured = slowest_train_seconds is None
    training = FIRST_UPDATE_FALLBACK_SECONDS if slowest_train_seconds is None else 60.0 + 10.0 * slowest_train_seconds
    return Deadlines(timeouts.model_delivered or transfer, timeouts.first_update or training,
                     timeouts.update_complete or transfer, timeouts.sigterm_grace,
                     derive_first_update=derive and timeouts.first_update is None and unmeasured)


@dataclass(frozen=True)
class StragglerRule:
    """``clients.accept_failures``: when a rank still training has the rest of its round dropped.

    A rank's training time runs from when it took up the model. With ``timeouts.straggler`` that many
    seconds; else derived once half the round's ranks have finished: STRAGGLER_FACTOR times the slowest
    of them, at least STRAGGLER_FLOOR_SECONDS (so scheduling noise never drops anyone).
    """

    fixed: float | None = None  # timeouts.straggler

    def limit(self, finished: list[float], ranks: int) -> float | None:
        """Seconds of training allowed, given the training times of the ranks finished so far (of ``ranks``);
        None while there is nothing to derive it from."""
        if self.fixed is not None:
            return self.fixed
        if not finished or 2 * len(finished) < ranks:
            return None
        return max(STRAGGLER_FLOOR_SECONDS, STRAGGLER_FACTOR * max(finished))

    def describe(self) -> str:
        """Where the limit comes from, for messages."""
        if self.fixed is not None:
            return "timeouts.straggler"
        return (f"timeouts.straggler unset: {STRAGGLER_FACTOR:g}x the slowest finished rank, "
                f"at least {STRAGGLER_FLOOR_SECONDS:g} s")


class RunDeadlines:
    """The run's current deadlines: set ones from the ``timeouts`` section, the rest from the chunk size and the
    slowest training measured so far. One object, shared by everything on rank 0 that waits on ranks."""

    def __init__(self, timeouts: TimeoutsConfig, chunk_bytes: int, inflight: int, derive: bool = True):
        self.timeouts, self.chunk_bytes, self.inflight, self.derive = timeouts, chunk_bytes, inflight, derive
        self.slowest_train: float | None = None  # the slowest logical client's training so far

    def observe(self, train_seconds: float) -> None:
        """A round's slowest training time: the training deadline follows the slowest seen."""
        self.slowest_train = max(self.slowest_train or 0.0, train_seconds)

    def current(self) -> Deadlines:
        """The deadlines as of now."""
        return default_deadlines(self.timeouts, self.chunk_bytes, self.inflight, self.slowest_train, self.derive)
