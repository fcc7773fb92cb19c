"""Combiners, the first stage of a strategy: how the participants' chunks become one fp32 chunk.

The streamed reduction hands a combiner, chunk by chunk, every included participant's chunk in
ascending client order (``fold``), then asks for the combined chunk (``combine``, in place in the
accumulator, or ``combine_into`` the global chunk when nothing else follows). The accumulator is
reused memory: ``fold`` with ``index == 0`` must overwrite, never read, it. A combiner declares
``stacked`` (one accumulator row per participant instead of one running row) and so how many
fp32 rows it needs per chunk, and its ``capabilities`` (what run modes it can take: a weighted sum
may be pre-summed in reduction groups, an order statistic may not). A subclass that changes how it
combines (fold, combine, ...) declares its own: until it does, mpifl assumes the safe side
(``compatibility.declared_capabilities``). A participant's weight comes from its whole update
header (``weight_of``: samples, local steps, the trainer's metrics). New combiners go here and are
named in ``registry.BUILTIN``.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mpifl.aggregation import kernels
from mpifl.config import StrategyConfig
from mpifl.config.capabilities import (
    MEAN,
    NORMALIZED_MEAN,
    ORDER_STATISTIC,
    Capabilities,
)
from mpifl.errors import JobFailure
from mpifl.wire.memory import share_malloc_arenas
from mpifl.wire.protocol import UpdateMeta

MAX_SORT_THREADS = 16  # robust combiners: threads sharing a chunk's sorting network
COMBINING = frozenset({"fold", "combine", "combine_into", "start_combine_into"})  # what makes a combiner what it is


def declared_capabilities(combiner: Combiner) -> Capabilities | None:
    """What ``combiner`` declares it is: its own ``capabilities``, or its class's, or the nearest base's, unless
    a class on the way changed how it combines (overrode fold, combine, ...) without declaring; None then,
    or when nothing declares (a subclass that only changes weights keeps its base's capabilities)."""
    if vars(combiner).get("capabilities") is not None:
        return vars(combiner)["capabilities"]
    for cls in type(combiner).__mro__:
        if vars(cls).get("capabilities") is not None:
            return vars(cls)["capabilities"]
        if COMBINING & vars(cls).keys():
            return None
    return None


def checked_combined(combined: object, combiner: Combiner, numel: int, strategy: str) -> torch.Tensor:
    """``combiner.combine``'s result, once it is the fp32 chunk of ``numel`` elements it must be (shape and dtype
    only: nothing per element); else the job ends naming ``strategy`` (strategy.name), the method and both."""
    if isinstance(combined, torch.Tensor) and combined.shape == (numel,) and \
            combined.dtype == kernels.ACCUMULATOR_DTYPE:
        return combined
    got = (f"a {str(combined.dtype).removeprefix('torch.')} tensor of shape {tuple(combined.shape)}"
           if isinstance(combined, torch.Tensor) else type(combined).__name__)
    raise JobFailure(f"strategy.name {strategy!r}: {type(combiner).__qualname__}.combine returned {got} where the "
                     f"combined chunk, a float32 tensor of shape ({numel},), was expected; return the chunk "
                     "computed in acc's memory (WeightedMean's acc.div_(total_weight), say)")


class Combiner:
    """Base class: an unweighted, unstacked combiner; subclasses implement fold and combine."""

    stacked = False  # True: the accumulator is a (participants, chunk) stack, not one running row
    # True: the combination needs whole updates (distances.py's Krum, geometric median): the reduction ``keep``s
    # every participant's chunks and finishes every chunk after the last has landed, instead of folding
    whole_update = False
    capabilities: Capabilities | None = None  # None: declares nothing, the safe side is assumed

    def __init__(self, cfg: StrategyConfig) -> None:
        self.cfg = cfg

    def weight(self, num_samples: int) -> float:
        """A participant's weight, from its sample count (equal weights here)."""
        return 1.0

    def weight_of(self, meta: UpdateMeta) -> float:
        """A participant's weight from its update header (``num_samples``, ``local_steps``, the trainer's
        ``metrics``); here ``weight(meta.num_samples)``. Clients compute it too (reduction groups, secure
        aggregation), so it must read only those fields: never ``train_seconds``, a wall-clock time."""
        return self.weight(meta.num_samples)

    def total_weight(self, metas: Sequence[UpdateMeta]) -> float:
        """What the weighted sum of the usable participants ``metas`` is divided by: their weights' sum here.
        A combiner that divides by a total of its own declares ``Capabilities.own_total``."""
        return sum(self.weight_of(m) for m in metas)

    def statistics_total(self, metas: Sequence[UpdateMeta]) -> float | None:
        """What the weighted sum of the model's statistics (BatchNorm's running mean and variance) is divided by,
        where it must differ from ``total_weight``; None here: they are divided as the rest."""
        return None

    def accumulator_rows(self, participants: int) -> int:
        """fp32 accumulator rows per chunk for ``participants`` participants."""
        return participants if self.stacked else 1

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, index: int) -> None:
        """Take in the ``index``-th included participant's chunk ``x`` (wire dtype) into ``acc`` (fp32)."""
        raise NotImplementedError

    def combine(self, acc: torch.Tensor, count: int, total_weight: float) -> torch.Tensor:
        """The combined fp32 chunk of ``count`` participants, computed in ``acc``'s memory."""
        raise NotImplementedError

    def combine_into(self, out: torch.Tensor, acc: torch.Tensor, count: int, total_weight: float) -> None:
        """Write the combined chunk into ``out`` (the model's dtype), rounded once."""
        out.copy_(checked_combined(self.combine(acc, count, total_weight), self, out.numel(), self.cfg.name))

    def start_combine_into(self, out: torch.Tensor, acc: kernels.Rows, count: int,
                           total_weight: float) -> list[Future] | None:
        """``combine_into`` begun on worker threads (its jobs), or None where the combiner has none."""
        return None

    def round_metrics(self) -> Mapping[str, float]:
        """What the combination measured in the round just reduced (recorded in ``strategy_metrics``); none here."""
        return {}

    def round_rejected(self) -> tuple[int, ...] | None:
        """The logical clients whose usable updates the combination left out of the round just reduced (Krum's
        rejected), recorded as the round's ``rejected``; None for a combiner that leaves nobody out by choice."""
        return None

    # A whole-update combiner (``whole_update``; distances.DistanceRule) is called through these instead of fold and
    # combine: ``begin`` a round, ``keep`` each usable participant's chunks as they land, ``solve`` once every chunk
    # has, then each chunk's ``combined_chunk`` is finished as a combined chunk would be.

    def begin(self, rows: int, elements: int, round_: int = 0) -> None:
        """Round (or server step) ``round_`` of at most ``rows`` usable participants, each update ``elements``
        elements long."""
        raise NotImplementedError

    def keep(self, row: int, start: int, x: torch.Tensor, weight: float, client: int) -> None:
        """Keep the ``row``-th usable participant's (logical client ``client``) elements from ``start`` on."""
        raise NotImplementedError

    def advance(self, count: int, landed: int) -> None:
        """The first ``count`` kept participants (the round's usable ones) hold elements 0 .. ``landed``: work ahead
        on them while the rest lands (nothing by default)."""

    def solve(self, count: int) -> None:
        """Apply the rule to the first ``count`` kept participants (every chunk has landed)."""
        raise NotImplementedError

    def combined_chunk(self, start: int, numel: int) -> torch.Tensor:
        """The combination's fp32 elements ``start`` .. ``start + numel``."""
        raise NotImplementedError


class WeightedMean(Combiner):
    """FedAvg (McMahan et al. 2017): the mean weighted by sample count (or equal weights), fused fp32 sums."""

    capabilities = MEAN

    def weight(self, num_samples: int) -> float:
        """The sample count with ``strategy.weighting: samples``, else 1."""
        return float(num_samples) if self.cfg.weighting == "samples" else 1.0

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, index: int) -> None:
        """Acc = w*x for the first participant, then acc += w*x (one rounding each); narrow chunks
        (bf16, fp16) are widened into a reused fp32 scratch first, the fast path."""
        kernels.fold(acc, x, weight, index == 0, self._scratch(x, acc) if x.dtype != acc.dtype else None)

    def _scratch(self, x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        scratch = getattr(self, "scratch", None)
        if scratch is None or scratch.numel() < x.numel():
            self.scratch = scratch = torch.empty(x.numel(), dtype=acc.dtype)
        return scratch

    def combine(self, acc: torch.Tensor, count: int, total_weight: float) -> torch.Tensor:
        """Acc / total_weight, in place."""
        return acc.div_(total_weight)

    def combine_into(self, out: torch.Tensor, acc: torch.Tensor, count: int, total_weight: float) -> None:
        """One fp32 division straight into ``out``, one rounding; through ``combine`` where a subclass overrides it
        (a plug-in's own rule over the weighted sums), which the fused division would skip."""
        if type(self).combine is not WeightedMean.combine:
            super().combine_into(out, acc, count, total_weight)
            return
        kernels.weighted_mean_into(out, acc, total_weight)


def local_steps_of(meta: UpdateMeta) -> int:
    """The optimizer steps a participant's trainer reports in its header; an error naming it when there are none."""
    if not meta.local_steps:
        raise ValueError(f"logical client {meta.client}'s update header reports local_steps={meta.local_steps!r}: "
                         "fednova normalises by each client's local steps, so its trainer must return them "
                         "(TrainResult.local_steps > 0; the built-in trainers do)")
    return meta.local_steps


def fednova_total(samples_and_steps: Sequence[tuple[float, int]]) -> float:
    """FedNova's divisor of sum_i (p_i / tau_i) * delta_i, for participants with weight p_i and tau_i local steps:
    (sum p)^2 / sum p * tau, so that the result is tau_eff * sum_i (p_i / sum p) * delta_i / tau_i with
    tau_eff = sum_i (p_i / sum p) * tau_i (Wang et al. 2020, eq. 6, plain local SGD)."""
    total = sum(p for p, _ in samples_and_steps)
    return total * total / sum(p * tau for p, tau in samples_and_steps)


class NormalizedAverage(WeightedMean):
    """FedNova (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
    Optimization", NeurIPS): each client's delta is normalised by its own local steps tau_i before averaging,
    and the average is scaled back by the effective steps tau_eff. Clients that take more steps (more data,
    more epochs) then no longer pull the model towards their own objective. As a weighted sum: weight
    p_i / tau_i in the fold (so reduction groups and secure aggregation still work), and the divisor
    ``fednova_total``. The normaliser is the paper's for plain local SGD (a_i = tau_i); with local momentum
    the paper's ||a_i||_1 differs."""

    capabilities = NORMALIZED_MEAN

    def weight_of(self, meta: UpdateMeta) -> float:
        """The client's weight p_i (samples, or 1) over its local steps tau_i."""
        return self.weight(meta.num_samples) / local_steps_of(meta)

    def total_weight(self, metas: Sequence[UpdateMeta]) -> float:
        """``fednova_total`` over the round's usable participants."""
        return fednova_total([(self.weight(m.num_samples), local_steps_of(m)) for m in metas])

    def statistics_total(self, metas: Sequence[UpdateMeta]) -> float | None:
        """The fold's own weights' sum, sum_i p_i / tau_i: statistics take the mean weighted by p_i / tau_i, a
        convex combination. tau_eff's scaling would extrapolate them by tau_eff * sum_i q_i / tau_i >= 1 (3 with
        steps of 10 and 100): a running variance went below zero in round 1 on Fashion-MNIST's CNN."""
        return math.fsum(self.weight_of(m) for m in metas)


class SortedStack(Combiner):
    """A coordinate-wise trimmed mean of every participant's chunk (unweighted; Yin et al. 2018):
    the mean of each column's sorted values k..count-k-1, by a sorting network over the stack's
    rows (kernels.trimmed_mean_columns; bitwise numpy's sort, NaN last)."""

    stacked = True
    capabilities = ORDER_STATISTIC

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, index: int) -> None:
        """Copy the chunk into stack row ``index`` (widened to fp32, exact)."""
        acc[index].copy_(x)

    def trimmed(self, count: int) -> int:
        """How many values to drop from each end of a column of ``count``."""
        raise NotImplementedError

    def combine(self, acc: kernels.Rows, count: int, total_weight: float) -> torch.Tensor:
        """The statistic of the first ``count`` rows: written into row 0 of a stack, or into a reused
        fp32 chunk when the rows are the receive slots themselves."""
        out = acc[0] if isinstance(acc, torch.Tensor) else self._combined(acc[0].numel())
        self.combine_into(out, acc, count, total_weight)
        return out

    def combine_into(self, out: torch.Tensor, acc: kernels.Rows, count: int, total_weight: float) -> None:
        """The statistic of the first ``count`` rows (a stack, or the participants' own chunks in any
        float dtype) straight into ``out``, rounded once.

        The columns are split into one span per worker thread (whole tiles), each with its own scratch
        tile: numpy's min/max release the GIL, so the server's cores share the sorting network. Every
        column's result depends on that column only, so the split never changes a bit.
        """
        if len(self._workers()) == 1:  # no thread hop
            rows = acc[:count]
            width = min(rows[0].numel(), kernels.tile_width(count))
            kernels.trimmed_mean_columns(out, rows, self.trimmed(count), self._scratch(0, count, width))
            return
        for job in self.start_combine_into(out, acc, count, total_weight, wait=True):
            job.result()

    def start_combine_into(self, out: torch.Tensor, acc: kernels.Rows, count: int, total_weight: float,
                           wait: bool = False) -> list[Future]:
        """``combine_into`` as one job per worker thread (whole tiles each); ``out`` and the rows must
        stay untouched until every job is done. Unless the caller just ``wait``s for them, one core
        is left to the caller (the server's receives go on beside the sorting network)."""
        rows, k = acc[:count], self.trimmed(count)
        n = rows[0].numel()
        width = min(n, kernels.tile_width(count))
        workers = len(self._workers()) if wait else max(1, len(self._workers()) - 1)
        return [self._workers()[i].submit(kernels.trimmed_mean_columns, out[a:b], rows, k,
                                          self._scratch(i, count, width), slice(a, b))
                for i, (a, b) in enumerate(kernels.column_spans(n, width, workers))]

    def _combined(self, numel: int) -> torch.Tensor:
        combined = getattr(self, "combined", None)
        if combined is None or combined.numel() < numel:
            self.combined = combined = torch.empty(numel, dtype=kernels.ACCUMULATOR_DTYPE)
        return combined[:numel]

    def _workers(self) -> list[ThreadPoolExecutor]:
        """One single-thread pool per worker (each keeps its own scratch): as many as the cores this process
        may use, at most ``MAX_SORT_THREADS``."""
        if getattr(self, "workers", None) is None:
            count = max(1, min(MAX_SORT_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                               else os.cpu_count() or 1))
            share_malloc_arenas()
            self.workers = [ThreadPoolExecutor(1, thread_name_prefix="mpifl-sort") for _ in range(count)]
        return self.workers

    def _scratch(self, worker: int, count: int, width: int) -> torch.Tensor:
        """Worker ``worker``'s reused (count + 2, tile width) fp32 tile for the sorting network."""
        scratches = self.__dict__.setdefault("scratches", {})
        scratch = scratches.get(worker)
        if scratch is None or scratch.shape[0] < count + 2 or scratch.shape[1] < width:
            scratches[worker] = scratch = torch.empty(count + 2, width, dtype=kernels.ACCUMULATOR_DTYPE)
        return scratch[:count + 2, :width]


class Median(SortedStack):
    """Coordinate-wise median; the mean of the middle two for an even count."""

    def trimmed(self, count: int) -> int:
        """All but the middle one or two values."""
        return kernels.median_count(count)


class TrimmedMean(SortedStack):
    """Coordinate-wise mean after dropping floor(beta * participants) values at each end."""

    def trimmed(self, count: int) -> int:
        """floor(beta * count), beta = ``strategy.trim_fraction``."""
        return kernels.trimmed_count(count, self.cfg.trim_fraction)
