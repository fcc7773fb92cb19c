"""``clients.accept_failures``: a rank past its deadline while it trains loses the rest of its round.

The server measures each rank's training from when it took up the round's model (or, if later, from when the
reduction began taking up updates) to its last header (``StragglerClock``); the straggler rule turns those times
into a deadline, and a rank still training past it, or silent past its stage's watchdog deadline, has the rest of
its round dropped by the reduction: its receives are cancelled, its participants without a header are recorded as
failed (``dropped_headers``), and what it still sends goes to the late-stream drain (wire.late).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mpifl.logs import world_rank
from mpifl.wire import protocol
from mpifl.wire.late import OwedStream
from mpifl.wire.watchdog import CHECK_EVERY_SECONDS, FIRST_UPDATE, StragglerRule


@dataclass(frozen=True)
class Dropping:
    """What the reduction needs to drop a rank past its deadline."""

    rule: StragglerRule
    # time.monotonic() when a rank began this round's training (None: it is still finishing a round it was dropped
    # from, so its clock has not started)
    started: Callable[[int], float | None]
    members: Callable[[int, int], tuple[int, ...]]  # (rank, stream) -> the logical clients in that stream
    owe: Callable[[OwedStream], None]  # what a dropped rank will still send goes to the drain


class StragglerClock:
    """Each rank's training time this round, and which ranks are still training past the straggler deadline."""

    def __init__(self, dropping: Dropping | None, began: float):
        self.dropping, self.began = dropping, began
        self.trained: dict[int, float] = {}  # rank -> seconds from taking up the model to its last header
        self.next_check = began

    def started(self, rank: int) -> float | None:
        """When ``rank``'s training began, as far as the server can tell: when it took up the round's model or, if
        later, when this reduction began taking up updates (None: it is still finishing a round it was dropped
        from). Before the reduction a rank that has trained waits for the server to take its update, and the server
        cannot tell it from one still training: a round whose dispatch waited on ranks finishing a dropped round
        would otherwise drop a rank that trained in time, and leave it out of the next round too."""
        if self.dropping is None:
            return self.began
        took_up = self.dropping.started(rank)
        return None if took_up is None else max(took_up, self.began)

    def header_landed(self, rank: int, more_to_come: bool) -> None:
        """A header from ``rank`` landed; with none ``more_to_come`` its training this round is over."""
        if self.dropping is not None and not more_to_come:
            self.trained[rank] = time.monotonic() - (self.started(rank) or self.began)

    def overdue(self, waiting: Callable[[], Mapping[int, tuple[str, str | None]]],
                ranks: int) -> list[tuple[int, str]]:
        """The ranks still training past the straggler deadline, each with why (checked every few seconds, from
        ``waiting()``: each awaited rank's stage)."""
        if self.dropping is None or time.monotonic() < self.next_check:
            return []
        self.next_check = time.monotonic() + CHECK_EVERY_SECONDS
        limit = self.dropping.rule.limit(list(self.trained.values()), ranks)
        out = []
        for rank, (stage, _) in sorted(waiting().items()):
            started = self.started(rank)
            took = 0.0 if started is None else time.monotonic() - started
            if limit is not None and stage == FIRST_UPDATE and took > limit:
                out.append((rank, f"rank {world_rank(rank)} was still training after {took:.1f} s, past the "
                                  "straggler deadline "
                                  f"of {limit:g} s ({self.dropping.rule.describe()})"))
        return out


def dropped_headers(members: Mapping[int, tuple[int, ...]], why: str, round_: int,
                    grouped: bool) -> tuple[list[protocol.UpdateMeta], dict[int, protocol.GroupMeta]]:
    """The failed headers that stand for a dropped rank's streams (``members``: stream -> its logical clients):
    each client's, and each reduction group's where the streams are groups."""
    why = f"{why}; dropped from round {round_}, it rejoins at the next round it is in time for"
    metas: list[protocol.UpdateMeta] = []
    groups: dict[int, protocol.GroupMeta] = {}
    for stream, clients in members.items():
        stream_metas = tuple(protocol.UpdateMeta(c, 0, 0.0, {}, why) for c in clients)
        metas.extend(stream_metas)
        if grouped:
            groups[stream] = protocol.GroupMeta(stream, stream_metas)
    return metas, groups
