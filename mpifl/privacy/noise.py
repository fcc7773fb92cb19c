"""Gaussian noise addressed by model element: reproducible, and independent of chunk size and ranks.

Element e of the model (in the chunks' element numbering) takes value ``e mod B`` of block
``e // B`` (B = 2**20), a block being ``torch.randn(B)`` from a generator seeded with
``derive_seed(seed, PRIVACY, *key, block)``. So the noise depends on (seed, key, element) only:
the same for any chunk size, any rank count, and after a resume. Generating whole blocks keeps
it at torch's vectorized speed.
"""
from __future__ import annotations

import torch

from mpifl.roles.federation import derive_seed

PRIVACY = 5  # seed stream key (federation.py and clock/devices.py hold 1..4)
BLOCK = 1 << 20


class ElementNoise:
    """Standard normal noise per model element, for one key (e.g. (round,) or (round, client))."""

    def __init__(self, seed: int, *key: int) -> None:
        self.seed, self.key = seed, key
        self._cached: tuple[int, torch.Tensor] | None = None

    def block(self, index: int) -> torch.Tensor:
        """Noise block ``index`` (the last one is cached: chunks mostly come in order)."""
        if self._cached is None or self._cached[0] != index:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, PRIVACY, *self.key, index))
            self._cached = index, torch.randn(BLOCK, generator=generator)
        return self._cached[1]

    def add(self, x: torch.Tensor, first: int, std: float) -> None:
        """x += std * noise of elements first .. first + len(x) (x is a flat view, modified in place)."""
        done = 0
        while done < x.numel():
            index, offset = divmod(first + done, BLOCK)
            take = min(x.numel() - done, BLOCK - offset)
            x[done:done + take].add_(self.block(index)[offset:offset + take], alpha=std)
            done += take
