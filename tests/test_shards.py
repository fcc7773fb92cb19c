"""Which bytes of the flat layout each rank of a sharded client group holds (mpifl.wire.shards): FSDP's row split,
every byte of the layout held by exactly one rank when sending and by every rank that needs it when receiving, and
each chunk cut into the pieces each rank gives and takes."""
from __future__ import annotations

import pytest
import torch

from mpifl.wire.shards import owned_spans, pieces_by_chunk, pieces_in, shard_bytes, shard_rows
from mpifl.wire.spec import layout

SPEC = layout([("embed.weight", (37, 8), "float32"), ("layers.0.norm.weight", (8,), "float32"),
               ("layers.0.proj.weight", (5, 8), "bfloat16"), ("layers.0.norm.running_mean", (8,), "float32"),
               ("head.weight", (3, 8), "float32")], statistics={"layers.0.norm.running_mean"})
SHARDED = {"embed.weight", "layers.0.norm.weight", "layers.0.proj.weight", "head.weight"}  # the buffer is not


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 8, 37, 128256])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_a_rank_holds_the_rows_torch_chunk_gives_it(rows, parts):
    pieces = torch.arange(rows).chunk(parts) if rows else ()
    for index in range(parts):
        first, last = shard_rows(rows, parts, index)
        want = pieces[index].tolist() if index < len(pieces) else []
        assert list(range(first, last)) == want


def owned_bytes(spans) -> list[int]:
    return [b for s in spans for b in range(s.start, s.stop)]


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_when_sending_every_byte_of_every_tensor_is_held_by_exactly_one_rank(parts):
    held = sorted(b for r in range(parts) for b in owned_bytes(owned_spans(SPEC, SHARDED, parts, r)))
    tensors = sorted(b for e in SPEC.entries for b in range(e.offset, e.offset + e.nbytes))
    assert held == tensors


@pytest.mark.parametrize("parts", [2, 3])
def test_when_receiving_every_rank_also_takes_the_buffers_whole(parts):
    buffer = next(e for e in SPEC.entries if e.name == "layers.0.norm.running_mean")
    for r in range(parts):
        spans = owned_spans(SPEC, SHARDED, parts, r, receiving=True)
        assert any(s.start == buffer.offset and s.stop == buffer.offset + buffer.nbytes and s.statistic
                   for s in spans)
    sends = [s for r in range(parts) for s in owned_spans(SPEC, SHARDED, parts, r) if s.name == buffer.name]
    assert len(sends) == 1  # one rank speaks for a buffer


def test_a_rank_holds_about_one_rth_of_the_parameters_plus_the_buffers():
    buffers = 8 * 4
    for parts in (2, 4):
        held = [shard_bytes(SPEC, SHARDED, parts, r) for r in range(parts)]
        parameters = sum(e.nbytes for e in SPEC.entries if e.name in SHARDED)
        assert sum(held) == parameters + parts * buffers
        assert max(held) - buffers <= -(-parameters // parts) + 4 * 8 * 4  # a few rows more where they split unevenly


@pytest.mark.parametrize("chunk_bytes", [4, 64, 100, 256, 4096])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_the_ranks_pieces_tile_each_chunk_once_leaving_only_padding(chunk_bytes, parts):
    chunks = SPEC.chunks(chunk_bytes)
    tensor_bytes = {b for e in SPEC.entries for b in range(e.offset, e.offset + e.nbytes)}
    for chunk in chunks:
        covered = []
        for r in range(parts):
            spans = owned_spans(SPEC, SHARDED, parts, r)
            for piece in pieces_in(spans, chunk):
                span = spans[piece.span]
                assert span.start <= chunk.offset + piece.chunk_start < chunk.offset + piece.chunk_stop <= span.stop
                assert piece.local_start == chunk.offset + piece.chunk_start - span.start
                assert piece.chunk_start % chunk.itemsize == 0 and piece.nbytes % chunk.itemsize == 0
                covered += range(chunk.offset + piece.chunk_start, chunk.offset + piece.chunk_stop)
        assert len(covered) == len(set(covered))
        assert set(covered) == tensor_bytes & set(range(chunk.offset, chunk.offset + chunk.nbytes))


@pytest.mark.parametrize("chunk_bytes", [4, 100, 4096])
def test_pieces_by_chunk_finds_in_one_pass_what_pieces_in_finds_chunk_by_chunk(chunk_bytes):
    chunks = SPEC.chunks(chunk_bytes)
    for parts in (1, 3):
        for r in range(parts):
            for receiving in (False, True):
                spans = owned_spans(SPEC, SHARDED, parts, r, receiving)
                assert pieces_by_chunk(spans, chunks) == [pieces_in(spans, c) for c in chunks]
