"""Compressed updates, in process: int8 and 4-bit stochastic block quantization is unbiased, within
one step of every value, exactly as large on the wire as planned, and clipped when DP asks; top-k
sends the k largest magnitudes exactly, breaks ties by index, and is exactly 8k bytes a chunk."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpifl.wire.codecs import BlockQuantizer, TopK
from mpifl.wire.spec import Chunk


def round_trip(codec, x, uniform):
    out = np.zeros(codec.payload_bytes(x.numel()), dtype=np.uint8)
    squared = codec.encode(x, out, uniform)
    return codec.decode(out, x.numel(), torch.empty(x.numel())), squared, out


@pytest.mark.parametrize("bits,numel", [(8, 1000), (8, 256), (4, 1001), (4, 7)])
def test_every_value_comes_back_within_one_quantization_step_of_its_block(bits, numel):
    codec, x = BlockQuantizer(bits, block=64), torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 3
    decoded, squared, out = round_trip(codec, x, torch.rand(numel, generator=torch.Generator().manual_seed(2)))
    blocks = x.new_zeros(math.ceil(numel / 64) * 64)
    blocks[:numel] = x.abs()
    step = (blocks.view(-1, 64).amax(dim=1) / codec.levels).repeat_interleave(64)[:numel]
    assert bool(((decoded - x).abs() <= step * (1 + 1e-6)).all())
    assert squared == pytest.approx(float(decoded.double().pow(2).sum()))
    assert out.nbytes == 4 * math.ceil(numel / 64) + (numel if bits == 8 else (numel + 1) // 2)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    codec, x = BlockQuantizer(bits, block=32), torch.randn(512, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    mean = sum(round_trip(codec, x, torch.rand(512, generator=g))[0] for _ in range(800)) / 800
    assert float((mean - x).abs().mean()) < 0.1 * float((round_trip(codec, x, torch.zeros(512))[0] - x).abs().mean())


def test_zero_blocks_and_rescaling_for_a_dp_bound():
    codec = BlockQuantizer(8, block=16)
    x = torch.cat([torch.zeros(16), torch.full((16,), 2.0)])
    decoded, squared, out = round_trip(codec, x, torch.zeros(32))
    assert torch.equal(decoded[:16], torch.zeros(16)) and torch.allclose(decoded[16:], torch.full((16,), 2.0))
    codec.rescale(out, 32, 0.5)
    assert torch.allclose(codec.decode(out, 32, torch.empty(32)), x * 0.5)


def encode_topk(codec, x):
    out = np.zeros(codec.payload_bytes(x.numel()), dtype=np.uint8)
    squared = codec.encode(x, out)
    return out, squared


@pytest.mark.parametrize("fraction,numel,k", [(0.01, 1000, 10), (0.01, 1001, 11), (0.1, 7, 1), (0.01, 5, 1),
                                              (1.0, 9, 9), (0.5, 3, 2)])
def test_topk_keeps_ceil_fraction_of_each_chunk_at_least_one_in_8k_wire_bytes(fraction, numel, k):
    codec = TopK(fraction)
    assert codec.k(numel) == k and codec.payload_bytes(numel) == 8 * k  # k int32 indices + k fp32 values
    chunks = [Chunk(0, "float32", 0, 4 * numel, 4), Chunk(1, "float32", 4 * numel, 4 * numel, 4)]
    wire = codec.wire_chunks(chunks)
    assert [w.nbytes for w in wire] == [8 * k, 8 * k] and wire[1].offset % 64 == 0


def test_topk_round_trip_sends_the_largest_magnitudes_exactly_and_zeros_the_rest():
    codec, x = TopK(0.1), torch.randn(1000, generator=torch.Generator().manual_seed(5))
    out, squared = encode_topk(codec, x)
    decoded = codec.decode(out, 1000, torch.full((1200,), 7.0))  # a dirty scratch, longer than the chunk
    kept = torch.nonzero(decoded).squeeze(1)
    assert len(kept) == 100 and torch.equal(decoded[kept], x[kept])
    assert float(x.abs()[decoded == 0].max()) <= float(x.abs()[kept].min())
    assert squared == pytest.approx(float(x[kept].double().pow(2).sum()))


def test_topk_ties_go_to_the_lower_index_and_the_bytes_are_reproducible():
    x = torch.tensor([1.0, -3.0, 3.0, 0.0, 3.0, -3.0, 2.0, float("nan")])
    codec = TopK(0.5)  # k = 4: NaN counts as largest, then three of the four |3|s, lowest indices first
    out, _ = encode_topk(codec, x)
    indices = torch.from_numpy(out[:16]).view(torch.int32)
    assert indices.tolist() == [1, 2, 4, 7]
    big = torch.randint(-3, 4, (100_000,), generator=torch.Generator().manual_seed(6)).float()  # many ties
    first, second = encode_topk(TopK(0.01), big)[0], encode_topk(TopK(0.01), big.clone())[0]
    assert np.array_equal(first, second)
    chosen = torch.from_numpy(first[:4000]).view(torch.int32).long()
    assert torch.equal(chosen, torch.nonzero(big.abs() == 3).squeeze(1)[:1000])  # the first 1000 at |x| = 3


def test_topk_rescaling_for_a_dp_bound_and_subtracting_what_was_sent():
    codec, x = TopK(0.25), torch.arange(1.0, 9.0)
    out, squared = encode_topk(codec, x)
    assert squared == 7.0 ** 2 + 8.0 ** 2
    codec.rescale(out, 8, 0.5)
    assert codec.decode(out, 8, torch.empty(8)).tolist() == [0, 0, 0, 0, 0, 0, 3.5, 4.0]
    residual = x.clone()
    codec.subtract(out, 8, residual)
    assert residual.tolist() == [1, 2, 3, 4, 5, 6, 3.5, 4.0]


def test_topk_fraction_outside_0_1_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"compression.fraction: must be in \(0, 1\], got 0"):
        TopK(0)
