"""Compressed updates on the wire: stochastic block quantization to int8 or 4 bits (after QSGD).

Each chunk of a client's fp32 update is cut into blocks of ``block`` elements. A block's scale
is its largest magnitude s; an element x becomes the integer q = sign(x) floor(|x| L / s + u), u
uniform in [0, 1) and L = 127 (int8) or 7 (4 bits), so that q s / L is an unbiased estimate of
x (Alistarh et al. 2017, QSGD, with per-block max scales). The u come from a stream addressed by
model element and keyed by (seed, round, client), so encoding is reproducible. On the wire a
chunk is its fp32 scales, then its values: one int8 per element, or two 4-bit values (offset by
8) per byte. The server decodes each chunk into a reused fp32 scratch as it folds it.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from mpifl.wire.flat import Chunk, _align

LEVELS = {8: 127, 4: 7}


class BlockQuantizer:
    """int8 or 4-bit stochastic quantization with one fp32 scale per block."""

    def __init__(self, bits: int, block: int = 256) -> None:
        if bits not in LEVELS:
            raise ValueError(f"compression: {bits}-bit quantization is not built (8 or 4)")
        self.bits, self.block, self.levels = bits, block, LEVELS[bits]

    def payload_bytes(self, numel: int) -> int:
        """Wire bytes of a chunk of ``numel`` elements: scales, then values."""
        return 4 * math.ceil(numel / self.block) + (numel if self.bits == 8 else (numel + 1) // 2)

    def wire_chunks(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunks as they travel compressed (bytes, 64-byte aligned in the client's wire buffer)."""
        out, offset = [], 0
        for c in chunks:
            nbytes = self.payload_bytes(c.numel)
            out.append(Chunk(c.index, "uint8", offset, nbytes, 1))
            offset = _align(offset + nbytes)
        return out

    def encode(self, x: torch.Tensor, out: np.ndarray, uniform: torch.Tensor, bound: float | None = None) -> float:
        """Quantize fp32 ``x`` into ``out`` (uint8 bytes), with ``uniform`` noise in [0, 1) per element; return
        the squared L2 norm of what was encoded. With ``bound``, scales shrink so that norm stays within it."""
        n, blocks = x.numel(), math.ceil(x.numel() / self.block)
        padded = torch.zeros(blocks * self.block)
        padded[:n] = x
        grid = padded.view(blocks, self.block)
        scales = grid.abs().amax(dim=1)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        u = torch.zeros(blocks * self.block)
        u[:n] = uniform
        q = torch.floor(grid.abs() / safe[:, None] * self.levels + u.view(blocks, self.block))
        q = q.clamp_(max=self.levels).mul_(torch.sign(grid))
        scales_out = torch.from_numpy(out[:4 * blocks]).view(torch.float32)
        scales_out.copy_(scales)
        values = out[4 * blocks:]
        if self.bits == 8:
            torch.from_numpy(values).view(torch.int8).copy_(q.flatten()[:n].to(torch.int8))
        else:
            nibbles = (q.flatten()[:n] + 8).to(torch.uint8)
            if n % 2:
                nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8)])
            torch.from_numpy(values).copy_(nibbles[0::2] | (nibbles[1::2] << 4))
        return float(torch.sum((q * (scales / self.levels)[:, None]) ** 2, dtype=torch.float64))

    def rescale(self, out: np.ndarray, numel: int, factor: float) -> None:
        """Multiply an encoded chunk's scales by ``factor`` (clipping after quantization)."""
        torch.from_numpy(out[:4 * math.ceil(numel / self.block)]).view(torch.float32).mul_(factor)

    def decode(self, data: np.ndarray, numel: int, out: torch.Tensor) -> torch.Tensor:
        """The fp32 values of an encoded chunk, written into ``out[:numel]`` (returned)."""
        blocks = math.ceil(numel / self.block)
        scales = torch.from_numpy(data[:4 * blocks]).view(torch.float32)
        values = torch.from_numpy(data[4 * blocks:self.payload_bytes(numel)])
        result = out[:numel]
        if self.bits == 8:
            result.copy_(values.view(torch.int8))
        else:
            pairs = torch.stack([values & 0xF, values >> 4], dim=1).flatten()[:numel]
            result.copy_(pairs).sub_(8)
        per_element = torch.repeat_interleave(scales / self.levels, self.block)[:numel]
        return result.mul_(per_element)


def codec_for(method: str, block: int) -> BlockQuantizer | None:
    """The codec of ``compression.method`` (None: updates travel uncompressed)."""
    return {"int8": lambda: BlockQuantizer(8, block), "int4": lambda: BlockQuantizer(4, block)}.get(
        method, lambda: None)()
