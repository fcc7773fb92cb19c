"""The server's receive pool for a round: how many receive slots per rank and how wide an accumulator
window, sized from a memory budget. The server sizes its pool with ``pool_layout``, and the memory
model (``planning.memory``) counts the same layout's bytes with ``pool_bytes``: one source for both.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpifl.config import Config
from mpifl.wire.layout import ExchangeLayout


@dataclass(frozen=True)
class PoolLayout:
    """Receive slots per rank and the accumulator window, derived from a memory budget."""

    slots_per_rank: int
    window: int
    held: bool = False  # robust strategies, one participant per rank: the receive slots are the stack

    @classmethod
    def from_budget(cls, budget_bytes: int, chunk_bytes: int, acc_chunk_bytes: int, ranks: int,
                    inflight: int, num_chunks: int, sequential: bool) -> PoolLayout:
        """Split the budget between slots (half) and accumulators (half); at least 1 slot and 2 accumulators."""
        slots = max(1, min(inflight, budget_bytes // 2 // max(1, ranks * chunk_bytes)))
        window = num_chunks if sequential else max(2, budget_bytes // 2 // max(1, acc_chunk_bytes))
        return cls(slots, min(window, num_chunks))

    @classmethod
    def held_stacks(cls, budget_bytes: int, chunk_bytes: int, ranks: int, inflight: int, num_chunks: int
                    ) -> PoolLayout:
        """A robust strategy with one participant per rank: the whole budget goes to receive slots,
        at least two per rank (a slot stays full until its chunk's statistic is taken)."""
        slots = max(2, min(inflight, budget_bytes // max(1, ranks * chunk_bytes)))
        return cls(slots, num_chunks, held=True)


@dataclass(frozen=True)
class PoolShape:
    """The sizes a pool is built from: one receive slot (the widest wire chunk) and one accumulator
    (the widest model chunk in fp32, times the rows a stacking strategy keeps)."""

    slot_bytes: int
    accumulator_bytes: int
    num_chunks: int
    inflight: int

    @classmethod
    def of(cls, exchange: ExchangeLayout, rows: int = 1) -> PoolShape:
        """The pool of an exchange layout: ``rows`` fp32 rows per accumulator (a robust stack's participants)."""
        return cls(slot_bytes=max(c.nbytes for c in exchange.wire),
                   accumulator_bytes=max(c.numel for c in exchange.chunks) * rows * 4,
                   num_chunks=len(exchange.chunks), inflight=exchange.inflight)


def holds_stacks(stacked: bool, compressed: bool, summed: bool, streams_per_rank: int) -> bool:
    """Whether a round's stack can be the receive slots themselves (``PoolLayout.held_stacks``): a stacking
    strategy, every chunk received as it is (no codec), no sum to unmask or add noise to (``summed``),
    and one stream per rank (so a slot is freed within a window of chunks)."""
    return stacked and not compressed and not summed and streams_per_rank == 1


def pool_layout(shape: PoolShape, budget_bytes: int, ranks: int, *, stacked: bool, held: bool,
                sequential: bool) -> PoolLayout:
    """The round's pool: ``ranks`` sending ranks, ``sequential`` when a rank sends several streams one after
    another (its window then spans the model). A stacking strategy gets at least two chunks' stacks."""
    if stacked:
        budget_bytes = max(budget_bytes, 2 * shape.accumulator_bytes * 2)
    if held:
        return PoolLayout.held_stacks(budget_bytes, shape.slot_bytes, ranks, shape.inflight, shape.num_chunks)
    return PoolLayout.from_budget(budget_bytes, shape.slot_bytes, shape.accumulator_bytes, ranks, shape.inflight,
                                  shape.num_chunks, sequential)


def pool_bytes(shape: PoolShape, layout: PoolLayout, ranks: int) -> int:
    """Bytes the receive pool allocates for ``layout``: its slots, and its accumulators unless the slots
    hold the stack."""
    accumulators = 0 if layout.held else layout.window * shape.accumulator_bytes
    return ranks * layout.slots_per_rank * shape.slot_bytes + accumulators


@dataclass(frozen=True)
class FloorProbe:
    """``transport.floor_probe_mb``'s probe of the raw-MPI floor before round 1 (``aggregation.floor``): what each
    client rank moves each way per probe round, and the buffers the server holds meanwhile. The probe runs before
    the server's pool exists, so its buffers and the pool never coexist."""

    nbytes: int  # each client rank's share of the probe, each way; 0: no probe
    itemsize: int  # of the dtype updates travel in: fp32 group sums, else strategy.wire_dtype or the model's
    chunk_bytes: int  # transport.chunk_mb, at most nbytes, in whole elements
    client_ranks: int
    inflight: int

    @classmethod
    def of(cls, exchange: ExchangeLayout, probe_mb: float, client_ranks: int, itemsize: int) -> FloorProbe:
        """``probe_mb`` MiB shared among the client ranks (the server's traffic stays that size however many there
        are), at most the model's bytes each, at least one element; 0 turns the probe off."""
        nbytes = 0
        if probe_mb > 0 and client_ranks >= 1:
            wanted = min(int(probe_mb * 2**20) // client_ranks, exchange.model_bytes)
            nbytes = max(itemsize, wanted // itemsize * itemsize)
        chunk = max(1, min(exchange.chunk_bytes, nbytes) // itemsize) * itemsize
        return cls(nbytes, itemsize, chunk, client_ranks, exchange.inflight)

    @property
    def server_bytes(self) -> int:
        """The server's buffers while it probes: ``inflight`` receive slots per client rank, an fp32 accumulator
        and the buffer it sends."""
        if not self.nbytes:
            return 0
        return self.client_ranks * self.inflight * self.chunk_bytes + self.nbytes // self.itemsize * 4 + self.nbytes


def floor_probe_dtype(cfg: Config, grouped: bool) -> str:
    """The dtype the floor probe moves: that of the updates, fp32 group sums with ``clients.groups``, else
    ``strategy.wire_dtype`` or the model's."""
    return "float32" if grouped else (cfg.strategy.wire_dtype or cfg.model.dtype)
