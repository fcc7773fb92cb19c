"""Held stacks: a robust strategy's rows left in their receive slots.

With one participant per rank, a robust strategy (median, trimmed mean) needs every participant's chunk j at once,
and each already lies in a receive slot: the sorting network reads the rows there (``PoolLayout.held_stacks``),
without a stacking copy, on the strategy's worker threads while the receives of later chunks go on. One chunk
finishes at a time, so the store sees ``finish_target`` and ``commit`` in order; its slots are freed (each takes its
rank's next chunk) once the statistic is written.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, wait


class HeldStacks:
    """Each chunk's rows as (rank, slot) in fold order, and the one chunk finishing in the background."""

    def __init__(self, commit: Callable[[int], None], release: Callable[[int, int], None]):
        """``commit(chunk)``: its new value is final; ``release(rank, slot)``: the slot takes the rank's next
        chunk."""
        self.commit, self.release = commit, release
        self.rows: dict[int, list[tuple[int, int]]] = {}
        self.finishing: tuple[int, list[Future]] | None = None

    def hold(self, chunk: int, row: int, rank: int, slot: int) -> None:
        """Keep ``chunk`` as it landed from ``rank`` in ``slot`` as row ``row`` of its stack."""
        rows = self.rows.setdefault(chunk, [])
        assert len(rows) == row, "rows are taken in the fold order"
        rows.append((rank, slot))

    def slots(self, chunk: int) -> list[int]:
        """The slots of ``chunk``'s rows, in row order."""
        return [slot for _, slot in self.rows.get(chunk, ())]

    def finishing_in(self, chunk: int, jobs: list[Future]) -> None:
        """``chunk`` finishes through ``jobs`` (none: it has finished already, and is settled now)."""
        self.finishing = (chunk, jobs)
        if not jobs:
            self.settle()

    @property
    def busy(self) -> bool:
        """Whether a chunk is finishing in the background."""
        return self.finishing is not None

    def done(self) -> bool:
        """Whether the chunk finishing in the background has finished (and waits to be settled)."""
        return self.finishing is not None and all(job.done() for job in self.finishing[1])

    def settle(self) -> float:
        """Wait for the chunk finishing in the background, commit it and free its slots; the seconds waited."""
        if self.finishing is None:
            return 0.0
        chunk, jobs = self.finishing
        start = time.perf_counter()
        try:
            for job in jobs:
                job.result()
        finally:
            self.finishing = None
        waited = time.perf_counter() - start
        self.commit(chunk)
        for rank, slot in self.rows.pop(chunk, ()):
            self.release(rank, slot)
        return waited

    def drain(self) -> None:
        """After a failure: let a background finish end before its slots and target are reused."""
        if self.finishing is not None:
            wait(self.finishing[1])
            self.finishing = None
