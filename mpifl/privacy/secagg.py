"""Secure aggregation, simulated faithfully (Bonawitz et al. 2017, with double masking).

Each client i of a round's cohort turns its weighted update into fixed point in the ring
Z_(2^32): q_i = round(w_i x_i 2^f), clamped to +-(2^31 - 1) / cohort so that no sum can wrap.
It adds its self mask b_i and, for every other member j, the pairwise mask +m_ij if i < j, or
-m_ij if i > j, all modulo 2^32, and sends the result: 4 bytes per element, like fp32. The
server adds what arrives in the ring; the pairwise masks of survivors cancel. It then removes
each survivor's self mask and, for every dropped client d, the masks m_sd its survivors added:
in the protocol it rebuilds those seeds from the Shamir shares the survivors hold, which is
simulated here by deriving them (the seeds come from the run's seed, so nothing is secret in
the simulation). What remains is exactly sum_s q_s, which it turns back into floats (/ 2^f).

Masks are uniform int32 values addressed by model element (``noise.ElementMask``), keyed by
(round, i, j) or (round, i): the same for any chunking and rank count.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from mpifl.aggregation.combiners import WeightedMean
from mpifl.config import SecAggConfig
from mpifl.config.capabilities import MEAN
from mpifl.privacy.noise import ElementMask

PAIR, SELF = 3, 4  # noise-stream keys (dp.py holds 0..2)


class SecureAggregation:
    """Both sides: a client masks its update (``mask``); the server unmasks the ring sum (``unmask``)."""

    def __init__(self, cfg: SecAggConfig, seed: int) -> None:
        self.cfg, self.seed, self.scale = cfg, seed, float(2 ** cfg.fraction_bits)

    def _pair(self, round_: int, a: int, b: int) -> ElementMask:
        return ElementMask(self.seed, PAIR, round_, min(a, b), max(a, b))

    def mask(self, chunks: Sequence[torch.Tensor], firsts: Sequence[int], weight: float, cohort: Sequence[int],
             round_: int, client: int) -> dict:
        """Replace the fp32 update chunks, in place, by their masked fixed-point values (as int32 bits)."""
        start, clamped = time.perf_counter(), 0
        bound = (2 ** 31 - 1) // max(1, len(cohort))
        for chunk, first in zip(chunks, firsts):
            q = torch.round(chunk * (weight * self.scale))
            clamped += int((q.abs() > bound).sum())
            ring = chunk.view(torch.int32)
            ring.copy_(q.clamp_(-bound, bound).to(torch.int32))
            if self.cfg.masking:
                ElementMask(self.seed, SELF, round_, client).add(ring, first)
                for other in cohort:
                    if other != client:
                        self._pair(round_, client, other).add(ring, first, 1 if client < other else -1)
        return {"secagg_seconds": time.perf_counter() - start, "secagg_clamped": clamped}

    def unmask(self, round_: int, cohort: Sequence[int]) -> Callable[[torch.Tensor, int, Mapping], None]:
        """What turns a chunk's ring sum into the float sum of the survivors' weighted updates, in place."""
        def unmask(acc: torch.Tensor, first: int, metas: Mapping) -> None:
            ring = acc.view(torch.int32)
            survivors = [c for c in cohort if c in metas and metas[c].error is None]
            if self.cfg.masking:
                dropped = [c for c in cohort if c not in survivors]
                for s in survivors:
                    ElementMask(self.seed, SELF, round_, s).add(ring, first, -1)
                    for d in dropped:  # s added +m_sd if s < d: take it out
                        self._pair(round_, s, d).add(ring, first, -1 if s < d else 1)
            acc.copy_(ring.to(torch.float32)).div_(self.scale)
        return unmask


class RingSum(WeightedMean):
    """The server's combiner under secure aggregation: masked fixed-point updates (int32 bits, already
    weighted by their clients) add up modulo 2^32; ``SecureAggregation.unmask`` then makes the chunk the
    float sum, which is divided by the total weight as FedAvg does."""

    capabilities = MEAN  # a sum still, in the ring

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, index: int) -> None:
        """Acc (as int32) = x for the first participant, then acc += x, wrapping modulo 2^32."""
        ring, update = acc.view(torch.int32), x.view(torch.int32)
        ring.copy_(update) if index == 0 else ring.add_(update)
