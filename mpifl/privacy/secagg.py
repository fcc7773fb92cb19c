"""Secure aggregation, simulated faithfully (Bonawitz et al. 2017, with double masking).

Each client i of a round's cohort turns its weighted update into fixed point in the ring
Z_(2^32): q_i = round(w_i x_i 2^f), clamped to +-(2^31 - 1) / cohort so that no sum can wrap.
So a value is exact only within +-(2^31 - 1) / (cohort w_i 2^f) (``ring.value_range``: the
encoder's clamp, the server's warning, the check before a run and the docs all take it from there).
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

from mpifl.aggregation.combiners import Combiner, WeightedMean
from mpifl.aggregation.strategies import Strategy
from mpifl.config import Config, SecAggConfig
from mpifl.config.capabilities import MEAN
from mpifl.privacy.noise import ElementMask
from mpifl.privacy.ring import clamp_limit, range_problem

PAIR, SELF = 3, 4  # noise-stream keys (dp.py holds 0..2)


def largest_weight(strategy: Strategy, sizes: Sequence[int] | None = None) -> tuple[float, str] | None:
    """The largest weight a client of the run carries, and where it comes from (for the message), from every
    client's training samples ``sizes``; without them (the data not read yet) the weight of one sample, which the
    largest is at least. None where only the rounds know it: a combiner that weighs by more than the sample count
    (FedNova's p_i / tau_i, a plug-in's own weight_of), or a plug-in's own weight before the data is read."""
    weigher = type(strategy.weigher)
    if weigher.weight_of is not Combiner.weight_of:
        return None
    if sizes:
        heaviest = max(range(len(sizes)), key=lambda c: strategy.weight(sizes[c]))
        return strategy.weight(sizes[heaviest]), (f"logical client {heaviest}'s: {sizes[heaviest]:,} training "
                                                  f"samples, strategy.weighting={strategy.cfg.weighting!r}")
    if weigher.weight not in (Combiner.weight, WeightedMean.weight):
        return None
    if strategy.cfg.weighting == "equal":
        return strategy.weight(1), "strategy.weighting='equal'"
    return strategy.weight(1), ("at least 1: every client holds a sample; once the data is read, mpifl validate and "
                                "the server's start check the largest client's")


def config_range_problem(cfg: Config, strategy: Strategy, sizes: Sequence[int] | None = None) -> str | None:
    """``range_problem`` for the run's cohort (clients.per_round) and largest client weight (``largest_weight``)."""
    known = largest_weight(strategy, sizes) if cfg.secagg.enabled else None
    floor_only = not sizes and strategy.cfg.weighting != "equal"  # one sample's weight: the largest is at least it
    return range_problem(cfg.secagg, cfg.clients_per_round(), *known, at_least=floor_only) if known else None


class SecureAggregation:
    """Both sides: a client masks its update (``mask``); the server unmasks the ring sum (``unmask``)."""

    def __init__(self, cfg: SecAggConfig, seed: int) -> None:
        self.cfg, self.seed, self.scale = cfg, seed, float(2 ** cfg.fraction_bits)

    def _pair(self, round_: int, a: int, b: int) -> ElementMask:
        return ElementMask(self.seed, PAIR, round_, min(a, b), max(a, b))

    def mask(self, chunks: Sequence[torch.Tensor], firsts: Sequence[int], weight: float, cohort: Sequence[int],
             round_: int, client: int) -> dict:
        """Replace the fp32 update chunks, in place, by their masked fixed-point values (as int32 bits)."""
        start, clamped, peak = time.perf_counter(), 0, 0.0
        bound = clamp_limit(len(cohort))
        for chunk, first in zip(chunks, firsts):
            if chunk.numel():  # the largest |x|, for the server's warning and advice when values are clamped
                peak = max(peak, float(chunk.abs().max()))
            q = torch.round(chunk * (weight * self.scale))
            clamped += int((q.abs() > bound).sum())
            ring = chunk.view(torch.int32)
            ring.copy_(q.clamp_(-bound, bound).to(torch.int32))
            if self.cfg.masking:
                ElementMask(self.seed, SELF, round_, client).add(ring, first)
                for other in cohort:
                    if other != client:
                        self._pair(round_, client, other).add(ring, first, 1 if client < other else -1)
        return {"secagg_seconds": time.perf_counter() - start, "secagg_clamped": clamped, "secagg_peak": peak}

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
