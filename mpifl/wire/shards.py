"""Which bytes of the flat layout each rank of a sharded client group owns (``clients.sharding: fsdp``), without torch.

A sharded client's R ranks each hold one row range of every parameter, split along its first dimension as
PyTorch's FSDP (``fully_shard``) splits it: ``torch.chunk`` semantics, ``ceil(rows / R)`` rows per rank, the last
ranks taking fewer or none. Buffers (BatchNorm's statistics, rotary tables) are not sharded: every rank holds all of
each, and the group's first rank speaks for them.

The exchange keeps the flat layout of an unsharded client (``mpifl.wire.spec``): a rank's part of a chunk is the
intersection of the chunk's byte range with the byte ranges it owns (``pieces_in``), so the chunks the server
sends and folds are byte for byte those of an unsharded client, whatever R is.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from mpifl.wire.spec import Chunk, ModelSpec


def shard_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """The rows [start, stop) of a first dimension of ``rows`` that part ``index`` of ``parts`` holds:
    ``torch.chunk``'s split, which FSDP's ``Shard(0)`` follows (``ceil(rows / parts)`` each, the rest last)."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts}")
    per = math.ceil(rows / parts) if rows else 0
    start = min(index * per, rows)
    return start, min(start + per, rows)


@dataclass(frozen=True)
class OwnedSpan:
    """A byte range of the flat buffer that one rank holds, in one tensor: ``start``..``stop`` of the flat buffer,
    which is ``local_offset``.. of that rank's local bytes of tensor ``name``."""

    name: str
    start: int
    stop: int
    local_offset: int
    statistic: bool = False  # a floating buffer: sent as a value under Config.statistics_as_values

    @property
    def nbytes(self) -> int:
        """Bytes in the span."""
        return self.stop - self.start


def owned_spans(spec: ModelSpec, sharded: Collection[str], parts: int, index: int,
                receiving: bool = False) -> list[OwnedSpan]:
    """The byte ranges of the flat layout that rank ``index`` of a group of ``parts`` holds, in layout order.

    A tensor named in ``sharded`` (a parameter under FSDP) gives its owned rows; any other (a buffer) is whole
    on every rank: all of it when ``receiving`` (every rank needs its value), on the first rank only otherwise (one
    rank sends it)."""
    spans = []
    for entry in spec.entries:
        if entry.name in sharded and entry.shape:
            row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
            first, last = shard_rows(entry.shape[0], parts, index)
            if last > first:
                spans.append(OwnedSpan(entry.name, entry.offset + first * row_bytes, entry.offset + last * row_bytes,
                                       0, entry.statistic))
        elif receiving or index == 0:
            spans.append(OwnedSpan(entry.name, entry.offset, entry.offset + entry.nbytes, 0, entry.statistic))
    return sorted(spans, key=lambda s: s.start)


@dataclass(frozen=True)
class Piece:
    """The part of one owned span inside one chunk: chunk bytes [chunk_start, chunk_stop) are the span's local
    bytes from ``local_start``."""

    span: int  # index into the rank's spans
    chunk_start: int
    chunk_stop: int
    local_start: int

    @property
    def nbytes(self) -> int:
        """Bytes in the piece."""
        return self.chunk_stop - self.chunk_start


def pieces_in(spans: Sequence[OwnedSpan], chunk: Chunk) -> list[Piece]:
    """A rank's pieces of one chunk, in layout order (a chunk may cross tensors, and a span may cross chunks)."""
    lo, hi = chunk.offset, chunk.offset + chunk.nbytes
    out = []
    for i, span in enumerate(spans):
        start, stop = max(lo, span.start), min(hi, span.stop)
        if start < stop:
            out.append(Piece(i, start - lo, stop - lo, span.local_offset + start - span.start))
    return out


def pieces_by_chunk(spans: Sequence[OwnedSpan], chunks: Sequence[Chunk]) -> list[list[Piece]]:
    """``pieces_in`` for every chunk, found in one pass over both sorted lists."""
    out: list[list[Piece]] = []
    first = 0
    for chunk in chunks:
        lo, hi = chunk.offset, chunk.offset + chunk.nbytes
        while first < len(spans) and spans[first].stop <= lo:
            first += 1
        found, i = [], first
        while i < len(spans) and spans[i].start < hi:
            span = spans[i]
            start, stop = max(lo, span.start), min(hi, span.stop)
            if start < stop:
                found.append(Piece(i, start - lo, stop - lo, span.local_offset + start - span.start))
            i += 1
        out.append(found)
    return out


def shard_bytes(spec: ModelSpec, sharded: Collection[str], parts: int, index: int) -> int:
    """Bytes of the exchanged tensors rank ``index`` holds (its rows of every sharded tensor, and every buffer)."""
    return sum(s.nbytes for s in owned_spans(spec, sharded, parts, index, receiving=True))
