"""Random values addressed by model element: reproducible, and independent of chunk size and ranks.

Element e of the model (in the chunks' element numbering) takes value ``e mod B`` of block
``e // B`` (B = 2**16), a block being ``torch.randn(B)`` from a generator seeded with
``derive_seed(seed, PRIVACY, *key, block)``. So the noise depends on (seed, key, element) only:
the same for any chunk size, any rank count, and after a resume. Generating whole blocks keeps
it at torch's vectorized speed. Secure aggregation's masks are uniform int32 blocks, made the same way.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from mpifl.planning.seeds import PRIVACY, derive_seed

BLOCK = 1 << 16


class ElementStream:
    """Random values per model element, for one key: block ``index`` is ``draw(generator)`` of BLOCK values."""

    def __init__(self, seed: int, *key: int,
                 draw: Callable[[torch.Generator], torch.Tensor] = lambda g: torch.randn(BLOCK, generator=g)) -> None:
        self.seed, self.key, self.draw = seed, key, draw
        self._cached: tuple[int, torch.Tensor] | None = None

    def block(self, index: int) -> torch.Tensor:
        """Block ``index`` (the last one is cached: chunks mostly come in order)."""
        if self._cached is None or self._cached[0] != index:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, PRIVACY, *self.key, index))
            self._cached = index, self.draw(generator)
        return self._cached[1]

    def pieces(self, first: int, count: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(position in the caller's range, values) covering elements first .. first + count."""
        done = 0
        while done < count:
            index, offset = divmod(first + done, BLOCK)
            take = min(count - done, BLOCK - offset)
            yield done, self.block(index)[offset:offset + take]
            done += take


class ElementNoise(ElementStream):
    """Standard normal noise per model element, for one key (e.g. (round,) or (round, client))."""

    def add(self, x: torch.Tensor, first: int, std: float) -> None:
        """X += std * noise of elements first .. first + len(x) (x is a flat view, modified in place)."""
        for at, values in self.pieces(first, x.numel()):
            x[at:at + values.numel()].add_(values, alpha=std)


class ElementMask(ElementStream):
    """Uniform 32-bit integers per model element (secure aggregation's masks), for one key."""

    def __init__(self, seed: int, *key: int) -> None:
        super().__init__(seed, *key, draw=lambda g: torch.randint(-2 ** 31, 2 ** 31, (BLOCK,), dtype=torch.int32,
                                                                  generator=g))

    def add(self, ring: torch.Tensor, first: int, sign: int = 1) -> None:
        """Ring += sign * mask, modulo 2**32 (int32 arithmetic wraps)."""
        for at, values in self.pieces(first, ring.numel()):
            target = ring[at:at + values.numel()]
            target.add_(values) if sign > 0 else target.sub_(values)
