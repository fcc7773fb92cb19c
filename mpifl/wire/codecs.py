"""Compressed updates on the wire: stochastic block quantization to int8 or 4 bits (after QSGD), or
top-k sparsification.

Each chunk of a client's fp32 update is cut into blocks of ``block`` elements. A block's scale
is its largest magnitude s; an element x becomes the integer q = sign(x) floor(|x| L / s + u), u
uniform in [0, 1) and L = 127 (int8) or 7 (4 bits), so that q s / L is an unbiased estimate of
x (Alistarh et al. 2017, QSGD, with per-block max scales). The u come from a stream addressed by
model element and keyed by (seed, round, client), so encoding is reproducible. On the wire a
chunk is its fp32 scales, then its values: one int8 per element, or two 4-bit values (offset by
8) per byte. The server decodes each chunk into a reused fp32 scratch as it folds it.

Top-k keeps the k = max(1, ceil(fraction n)) largest magnitudes of each n-element chunk; on the
wire a chunk is its k int32 chunk-local indices (ascending), then their k fp32 values: 8k bytes,
fixed per chunk. Ties at the k-th magnitude go to the lower index, so the selection is bitwise
reproducible. What is not sent is kept by the client as its error-feedback residual
(roles.residuals).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from mpifl.wire.spec import Chunk, aligned

LEVELS = {8: 127, 4: 7}


def _wire_chunks(chunks: list[Chunk], payload_bytes: Callable[[int], int]) -> list[Chunk]:
    """Chunks of ``payload_bytes(numel)`` bytes each, 64-byte aligned in the client's wire buffer."""
    out, offset = [], 0
    for c in chunks:
        nbytes = payload_bytes(c.numel)
        out.append(Chunk(c.index, "uint8", offset, nbytes, 1))
        offset = aligned(offset + nbytes)
    return out


class BlockQuantizer:
    """int8 or 4-bit stochastic quantization with one fp32 scale per block."""

    stochastic = True  # encode takes uniform noise per element

    def __init__(self, bits: int, block: int = 256) -> None:
        if bits not in LEVELS:
            raise ValueError(f"compression: {bits}-bit quantization is not built (8 or 4)")
        self.bits, self.block, self.levels = bits, block, LEVELS[bits]

    def payload_bytes(self, numel: int) -> int:
        """Wire bytes of a chunk of ``numel`` elements: scales, then values."""
        return 4 * math.ceil(numel / self.block) + (numel if self.bits == 8 else (numel + 1) // 2)

    def wire_chunks(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunks as they travel compressed (bytes, 64-byte aligned in the client's wire buffer)."""
        return _wire_chunks(chunks, self.payload_bytes)

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


class TopK:
    """Top-k sparsification: the k largest magnitudes of each chunk, as int32 indices and fp32 values."""

    stochastic = False  # encode needs no noise

    def __init__(self, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"compression.fraction: must be in (0, 1], got {fraction!r}")
        self.fraction = fraction

    def k(self, numel: int) -> int:
        """Values kept of a chunk of ``numel`` elements."""
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def payload_bytes(self, numel: int) -> int:
        """Wire bytes of a chunk of ``numel`` elements: k int32 indices, then k fp32 values."""
        return 8 * self.k(numel)

    def wire_chunks(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunks as they travel compressed (bytes, 64-byte aligned in the client's wire buffer)."""
        return _wire_chunks(chunks, self.payload_bytes)

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The ascending indices of the k largest |x|; ties at the threshold go to the lower index (NaN counts
        as largest)."""
        n, k = x.numel(), self.k(x.numel())
        key = torch.nan_to_num(x.abs(), nan=math.inf)
        threshold = torch.kthvalue(key, n - k + 1).values  # the k-th largest magnitude
        chosen = key > threshold
        short = k - int(chosen.sum())
        if short:  # the first indices at the threshold fill the rest
            chosen[torch.nonzero(key == threshold).squeeze(1)[:short]] = True
        return torch.nonzero(chosen).squeeze(1)

    def _parts(self, data: np.ndarray, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An encoded chunk's indices (int32) and values (fp32), as views."""
        k = self.k(numel)
        indices, values = data[:4 * k], data[4 * k:8 * k]
        return torch.from_numpy(indices).view(torch.int32), torch.from_numpy(values).view(torch.float32)

    def encode(self, x: torch.Tensor, out: np.ndarray, uniform: torch.Tensor | None = None,
               bound: float | None = None) -> float:
        """Write the top-k of fp32 ``x`` into ``out`` (uint8 bytes); return the squared L2 norm of what was encoded."""
        indices, values = self._parts(out, x.numel())
        chosen = self.select(x)
        indices.copy_(chosen)
        torch.index_select(x, 0, chosen, out=values)
        return float(torch.sum(values.double() ** 2))

    def rescale(self, out: np.ndarray, numel: int, factor: float) -> None:
        """Multiply an encoded chunk's values by ``factor`` (clipping after sparsification)."""
        self._parts(out, numel)[1].mul_(factor)

    def decode(self, data: np.ndarray, numel: int, out: torch.Tensor) -> torch.Tensor:
        """The fp32 values of an encoded chunk, written into ``out[:numel]`` (returned): zeros, then the k values."""
        indices, values = self._parts(data, numel)
        result = out[:numel].zero_()
        return result.index_copy_(0, indices.long(), values)

    def subtract(self, data: np.ndarray, numel: int, residual: torch.Tensor) -> None:
        """``residual -= decode(data)``, touching only the k sent elements."""
        indices, values = self._parts(data, numel)
        at = indices.long()
        residual.index_copy_(0, at, residual.index_select(0, at).sub_(values))


Codec = BlockQuantizer | TopK


def codec_for(method: str, block: int, fraction: float = 0.01) -> Codec | None:
    """The codec of ``compression.method`` (None: updates travel uncompressed)."""
    makers: dict[str, Callable[[], Codec | None]] = {
        "int8": lambda: BlockQuantizer(8, block), "int4": lambda: BlockQuantizer(4, block),
        "topk": lambda: TopK(fraction)}
    return makers.get(method, lambda: None)()
