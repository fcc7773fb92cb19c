"""Compressed updates, in process: int8 and 4-bit stochastic block quantization is unbiased, within
one step of every value, exactly as large on the wire as planned, and clipped when DP asks."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpifl.wire.codecs import BlockQuantizer


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
