"""Distance-based robust combiners: Krum, Multi-Krum, Bulyan and the geometric median.

Krum (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent",
NeurIPS) keeps the update whose squared distances to its n - f - 2 nearest others sum least, n the round's
usable participants and f how many of them may be Byzantine; Multi-Krum (El Mhamdi et al. 2018, "The
Hidden Vulnerability of Distributed Learning in Byzantium", ICML) averages the m best-scored, and the same
paper's Bulyan selects theta = n - 2f updates by Krum, one at a time, then takes coordinate by coordinate the
mean of the beta = theta - 2f selected values closest to their median. The geometric median (RFA: Pillutla,
Kakade and Harchaoui 2022, "Robust Aggregation for Federated Learning", IEEE TSP) minimises
sum_i a_i ||z - x_i||, by the smoothed Weiszfeld iteration.

All four need *whole* updates: which participants Krum keeps, and the median's weights, depend on
distances between whole updates, known only once the last chunk has landed, while the streamed reduction
finishes chunk by chunk. So these combiners declare ``whole_update``: the reduction hands them every
participant's chunks as they land (``keep``: fp32 rows, participants x model, in RAM up to ``RAM_BYTES``,
else, and always on an out-of-core server (``server.state: disk``), in an unlinked temporary file in
``tempfile``'s directory, ``$TMPDIR``), and finishes every chunk once the last has landed.

The rules work on the n x n Gram matrix of the kept updates, centred on the first (``kept_gram``:
float64, over fixed blocks of the flat model, each summed as soon as every row holds it and added in
turn, so that neither the chunk size, the rank count nor the arrival order changes a bit). Squared
distances are G_ii + G_jj - 2 G_ij, and a Weiszfeld iterate is a combination sum_i c_i x_i of the
updates, so it never needs a model of its own. The result, chunk by chunk, is sum_i c_i x_i,
accumulated in float64 in row order and rounded once to fp32; Bulyan's, which is no such combination, is its
coordinate rule over the selected rows (``bulyan_coordinates``), each coordinate on its own.
"""
from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from mpifl.aggregation.combiners import Combiner
from mpifl.aggregation.kernels import ACCUMULATOR_DTYPE
from mpifl.config import StrategyConfig
from mpifl.config.capabilities import WHOLE_UPDATE, WHOLE_UPDATE_COORDINATE_WISE
from mpifl.errors import JobFailure
from mpifl.logs import log
from mpifl.planning.memory import KEPT_UPDATES_RAM_BYTES as RAM_BYTES  # up to this in RAM; larger, in a file
from mpifl.units import range_list

GRAM_BLOCK = 1 << 16  # elements of each row per block of the Gram matrix: fixed, so the sums never depend on chunks
BULYAN_TILE = 1 << 12  # elements per tile of Bulyan's rule: float64 temporaries in cache (2.8x faster than 32768)


# -- the rules, over the n x n Gram matrix ----------------------------------------------------------------------

def squared_distances(gram: np.ndarray) -> np.ndarray:
    """||x_i - x_j||^2 from the Gram matrix G_ij = x_i . x_j (of any common centring), never below 0."""
    diagonal = np.diag(gram)
    return np.maximum(diagonal[:, None] + diagonal[None, :] - 2.0 * gram, 0.0)


def krum_neighbours(participants: int, byzantine: int) -> int:
    """How many nearest others Krum sums each update's squared distances over: n - f - 2, at least 1 (and 0 for a
    lone participant). Blanchard et al.'s guarantee needs n >= 2f + 3; below, fewer neighbours than that."""
    if participants < 2:
        return 0
    return max(1, min(participants - byzantine - 2, participants - 1))


def krum_scores(distances: np.ndarray, byzantine: int) -> np.ndarray:
    """Each update's Krum score: the sum of its ``krum_neighbours`` smallest squared distances to the others."""
    n = distances.shape[0]
    k = krum_neighbours(n, byzantine)
    others = np.where(np.eye(n, dtype=bool), np.inf, distances)
    return np.sort(others, axis=1)[:, :k].sum(axis=1)


def krum_selection(distances: np.ndarray, byzantine: int, keep: int) -> tuple[int, ...]:
    """The rows of the ``keep`` best-scored updates (lowest Krum score; a tie goes to the lower row), ascending."""
    order = np.argsort(krum_scores(distances, byzantine), kind="stable")
    return tuple(sorted(int(i) for i in order[:max(1, min(keep, len(order)))]))


def mean_coefficients(weights: np.ndarray, rows: tuple[int, ...]) -> np.ndarray:
    """The coefficients of the ``weights``-weighted mean of ``rows`` (0 elsewhere)."""
    coefficients = np.zeros(len(weights))
    chosen = list(rows)
    coefficients[chosen] = weights[chosen] / math.fsum(weights[chosen])
    return coefficients


def bulyan_counts(participants: int, byzantine: int) -> tuple[int, int]:
    """Bulyan's (theta, beta): theta = n - 2f updates selected by Krum, beta = theta - 2f values averaged per
    coordinate, each at least 1 (El Mhamdi et al. 2018; their guarantee needs n >= 4f + 3)."""
    theta = max(1, participants - 2 * byzantine)
    return theta, max(1, theta - 2 * byzantine)


def bulyan_selection(distances: np.ndarray, byzantine: int, theta: int) -> tuple[int, ...]:
    """Bulyan's first stage: ``theta`` rows chosen one at a time, each the Krum choice (lowest score, f =
    ``byzantine``, a tie to the lower row) among the rows not chosen yet, scored over those rows alone; ascending."""
    remaining = list(range(distances.shape[0]))
    chosen: list[int] = []
    while len(chosen) < min(theta, distances.shape[0]):
        scores = krum_scores(distances[np.ix_(remaining, remaining)], byzantine)
        chosen.append(remaining.pop(int(np.argmin(scores))))  # argmin: the first of equal scores, the lower row
    return tuple(sorted(chosen))


def bulyan_coordinates(rows: np.ndarray, beta: int) -> np.ndarray:
    """Bulyan's second stage over the selected rows (theta x elements): for each coordinate, the mean of the
    ``beta`` values closest to the coordinate's median, in float64. Sorted, those values are a run of beta
    neighbours; the run with the least sum of |value - median| is taken (the lowest on a tie) and summed in sorted
    order, so the result does not depend on the rows' order."""
    values = np.sort(rows.astype(np.float64), axis=0)
    theta = values.shape[0]
    beta = max(1, min(beta, theta))
    middle = theta // 2
    median = values[middle] if theta % 2 else (values[middle - 1] + values[middle]) / 2.0
    distance = np.abs(values - median)
    cumulative = np.zeros((theta + 1, values.shape[1]))
    for k in range(theta):  # row by row: numpy's cumsum along the first axis is several times slower
        np.add(cumulative[k], distance[k], out=cumulative[k + 1])
    cost = cumulative[beta:] - cumulative[:-beta]  # (theta - beta + 1) x elements: each run's summed distance
    first = np.argmin(cost, axis=0)  # the first of equal costs: the lowest run
    window = np.take_along_axis(values, first[None, :] + np.arange(beta)[:, None], axis=0)
    return window.sum(axis=0) / beta


@dataclass(frozen=True)
class Weiszfeld:
    """The smoothed Weiszfeld iteration's result: the median's coefficients over the updates, the iterations
    taken, and the objective sum_i a_i ||z - x_i|| at the median."""

    coefficients: np.ndarray
    iterations: int
    objective: float


def distances_to(gram: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """||z - x_i|| for z = sum_j c_j x_j (the coefficients sum to 1), from the Gram matrix."""
    gc = gram @ coefficients
    return np.sqrt(np.maximum(coefficients @ gc - 2.0 * gc + np.diag(gram), 0.0))


def weiszfeld(gram: np.ndarray, weights: np.ndarray, iterations: int, tolerance: float,
              smoothing: float) -> Weiszfeld:
    """The geometric median of the updates with weights a_i, as coefficients: from the weighted mean, at most
    ``iterations`` smoothed Weiszfeld steps z <- sum_i b_i x_i / sum_i b_i, b_i = a_i / max(nu, ||z - x_i||)
    (Pillutla et al. 2022, Algorithm 3; nu = ``smoothing`` keeps a step finite when z lands on an update),
    stopping once the objective improves by less than ``tolerance`` of itself."""
    alphas = weights / math.fsum(weights)
    coefficients = alphas.copy()
    objective = float(alphas @ distances_to(gram, coefficients))
    taken = 0
    while taken < iterations:
        betas = alphas / np.maximum(smoothing, distances_to(gram, coefficients))
        candidate = betas / math.fsum(betas)
        value = float(alphas @ distances_to(gram, candidate))
        taken += 1
        improved = objective - value
        coefficients, objective = candidate, value
        if improved <= tolerance * objective:
            break
    return Weiszfeld(coefficients, taken, objective)


# -- the kept updates ------------------------------------------------------------------------------------------

class KeptRows:
    """Every participant's whole update as fp32 rows (participants x elements): a RAM array up to ``ram_bytes``,
    else an unlinked temporary file read and written at offsets (its pages are the kernel's cache, not this
    process's memory, so an out-of-core server's resident size does not grow by the kept updates)."""

    def __init__(self, rows: int, elements: int, ram_bytes: int = RAM_BYTES):
        self.rows, self.elements = rows, elements
        size = rows * elements * 4
        self.array = np.empty((rows, elements), dtype=np.float32) if size <= ram_bytes else None
        self.file = None if self.array is not None else tempfile.TemporaryFile(prefix="mpifl-kept-updates-")
        if self.file is not None:
            os.ftruncate(self.file.fileno(), size)

    def fits(self, rows: int, elements: int, ram_bytes: int) -> bool:
        """Whether these rows can hold that many (reused from round to round)."""
        return rows <= self.rows and elements == self.elements and \
            (self.array is None) == (rows * elements * 4 > ram_bytes)

    def write(self, row: int, start: int, values: np.ndarray) -> None:
        """Row ``row``'s elements from ``start`` on are ``values`` (fp32)."""
        if self.array is not None:
            self.array[row, start:start + len(values)] = values
            return
        assert self.file is not None
        view, offset = np.ascontiguousarray(values, dtype=np.float32).data.cast("B"), \
            (row * self.elements + start) * 4
        while view:
            written = os.pwrite(self.file.fileno(), view, offset)
            view, offset = view[written:], offset + written

    def read(self, row: int, start: int, out: np.ndarray) -> np.ndarray:
        """Row ``row``'s ``len(out)`` elements from ``start`` on, into ``out`` (fp32)."""
        if self.array is not None:
            out[:] = self.array[row, start:start + len(out)]
            return out
        assert self.file is not None
        view, offset = out.data.cast("B"), (row * self.elements + start) * 4
        while view:
            got = os.preadv(self.file.fileno(), [view], offset)
            if got <= 0:
                raise OSError(f"the kept updates' temporary file ended at byte {offset}")
            view, offset = view[got:], offset + got
        return out

    def close(self) -> None:
        """Free the rows (the file is unlinked already: closing it returns its disk space)."""
        if self.file is not None:
            self.file.close()
        self.array = self.file = None


def block_gram(centred: np.ndarray) -> np.ndarray:
    """The Gram matrix of one block's rows (float64): each row's products with the rows from it on, summed by
    numpy's pairwise summation along the row, one thread, so the same bits whatever BLAS or cores the server has
    (a BLAS product may split its sums by thread)."""
    count = len(centred)
    gram = np.empty((count, count))
    for i in range(count):
        gram[i, i:] = (centred[i:] * centred[i]).sum(axis=1)
        gram[i:, i] = gram[i, i:]
    return gram


def kept_gram(kept: KeptRows, count: int, gram: np.ndarray | None = None, start: int = 0, stop: int | None = None,
              block: int = GRAM_BLOCK) -> np.ndarray:
    """Add to ``gram`` (float64, count x count; zeros when None) the Gram matrix of the first ``count`` kept rows
    centred on row 0, y_i = x_i - x_0, over elements ``start`` .. ``stop`` (whole blocks of ``block`` elements from
    element 0, but the last), block by block: however the blocks are handed out, each is added in turn, so the sum
    has the same bits whatever the chunks were and whenever they landed. Centring keeps the distances exact where
    updates are large and close (weights, not deltas)."""
    stop = kept.elements if stop is None else stop
    gram = np.zeros((count, count)) if gram is None else gram
    rows = np.empty((count, min(block, kept.elements)), dtype=np.float32)
    for at in range(start, stop, block):
        width = min(block, kept.elements - at)
        for i in range(count):
            kept.read(i, at, rows[i, :width])
        centred = rows[:, :width].astype(np.float64)
        centred -= centred[0]
        gram += block_gram(centred)
    return gram


# -- the combiners ---------------------------------------------------------------------------------------------

class DistanceRule(Combiner):
    """A combiner over whole updates: the reduction ``begin``s a round, ``keep``s every usable participant's chunks
    as they land, and, once the last has, ``solve``s the rule and asks for each ``combined_chunk``, which ``combine``
    passes on unchanged. A rule is ``coefficients(gram, weights)``: what each kept row counts in the result."""

    whole_update = True
    capabilities = WHOLE_UPDATE
    ram_bytes = RAM_BYTES

    def __init__(self, cfg: StrategyConfig) -> None:
        super().__init__(cfg)
        self.kept: KeptRows | None = None
        self.weights = np.zeros(0)
        self.clients: list[int] = []
        self.solved: np.ndarray | None = None
        self.metrics: dict[str, float] = {}
        self.rejected: tuple[int, ...] | None = None  # the logical clients the rule left out this round
        self.round = 0  # the round (or server step) being reduced, as the log names it

    def weight(self, num_samples: int) -> float:
        """The sample count with ``strategy.weighting: samples``, else 1."""
        return float(num_samples) if self.cfg.weighting == "samples" else 1.0

    def begin(self, rows: int, elements: int, round_: int = 0) -> None:
        """Round (or server step) ``round_`` of at most ``rows`` usable participants, each update ``elements``
        elements long."""
        if self.kept is None or not self.kept.fits(rows, elements, self.ram_bytes):
            if self.kept is not None:
                self.kept.close()
            self.kept = KeptRows(rows, elements, self.ram_bytes)
        self.weights, self.clients = np.zeros(rows), [-1] * rows
        self.solved, self.metrics, self.rejected, self.round = None, {}, None, round_
        self.gram: np.ndarray | None = None  # the kept rows' Gram matrix, summed block by block as chunks finish
        self.summed = 0  # the elements it covers, from 0

    def keep(self, row: int, start: int, x: torch.Tensor, weight: float, client: int) -> None:
        """Keep the ``row``-th usable participant's (logical client ``client``, weighing ``weight``) elements from
        ``start`` on, ``x`` (any float dtype, widened exactly to fp32)."""
        assert self.kept is not None  # begin comes first
        values = x.numpy() if x.dtype == ACCUMULATOR_DTYPE else x.to(ACCUMULATOR_DTYPE).numpy()
        self.kept.write(row, start, values)
        self.weights[row], self.clients[row] = weight, client

    def advance(self, count: int, landed: int) -> None:
        """Every row holds elements 0 .. ``landed`` of the first ``count`` (the round's usable participants): sum the
        Gram matrix over the whole blocks among them not summed yet, while the rest is still on its way."""
        assert self.kept is not None  # begin comes first
        if self.gram is None:
            self.gram = np.zeros((count, count))
        stop = landed if landed >= self.kept.elements else landed - landed % GRAM_BLOCK
        if stop > self.summed:
            kept_gram(self.kept, count, self.gram, self.summed, stop)
            self.summed = stop

    def solve(self, count: int) -> None:
        """Apply the rule to the first ``count`` kept rows (every chunk has landed)."""
        assert self.kept is not None  # begin comes first
        weights = self.weights[:count]
        if count and not (np.isfinite(weights).all() and (weights > 0).all()):
            raise JobFailure(f"strategy.name {self.cfg.name!r}: the participants' weights must be positive and finite, "
                             f"got {weights.tolist()}")
        self.advance(count, self.kept.elements)
        assert self.gram is not None and self.gram.shape == (count, count)  # advance summed the same participants
        self.solved = self.coefficients(self.gram, weights)

    def coefficients(self, gram: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """What each of the updates counts in the result (the rule; the coefficients sum to 1)."""
        raise NotImplementedError

    def combined_chunk(self, start: int, numel: int) -> torch.Tensor:
        """The result's ``numel`` elements from ``start`` on: sum_i c_i x_i in float64, row by row, rounded once."""
        assert self.kept is not None and self.solved is not None  # solve comes first
        total, row = np.zeros(numel), np.empty(numel, dtype=np.float32)
        for i, c in enumerate(self.solved):
            if c != 0.0:
                total += c * self.kept.read(i, start, row)
        return torch.from_numpy(total.astype(np.float32))

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, index: int) -> None:
        """Never called: a whole-update rule keeps its rows (``keep``)."""
        raise JobFailure(f"strategy.name {self.cfg.name!r} combines whole updates: the reduction keeps them (keep), "
                         "it does not fold them")

    def combine(self, acc: torch.Tensor, count: int, total_weight: float) -> torch.Tensor:
        """``acc``, the chunk ``combined_chunk`` computed already."""
        return acc

    def round_metrics(self) -> Mapping[str, float]:
        """What the rule found this round (``strategy_metrics``)."""
        return dict(self.metrics)

    def round_rejected(self) -> tuple[int, ...] | None:
        """The logical clients the rule left out this round (Krum's), or None (the geometric median weighs all)."""
        return self.rejected


class Krum(DistanceRule):
    """Multi-Krum: the weighted mean (``strategy.weighting``) of the ``strategy.krum_keep`` updates with the lowest
    Krum scores, f = ``strategy.byzantine_clients``; ``keep`` 1 is Krum itself."""

    keep_default = 0  # 0: n - f

    def kept_count(self, participants: int) -> int:
        """How many updates are averaged: the configured m, or n - f, within 1..n."""
        wanted = self.keep_default if self.keep_default else self.cfg.krum_keep
        return max(1, min(wanted or participants - self.cfg.byzantine_clients, participants))

    def coefficients(self, gram: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The selection's weighted mean; the kept logical clients are logged and counted."""
        n = len(weights)
        rows = krum_selection(squared_distances(gram), self.cfg.byzantine_clients, self.kept_count(n))
        kept = sorted(self.clients[i] for i in rows)
        dropped = sorted(self.clients[i] for i in range(n) if i not in rows)
        self.metrics = {"kept": float(len(rows)), "rejected": float(n - len(rows))}
        self.rejected = tuple(dropped)
        if n < 2 * self.cfg.byzantine_clients + 3:
            self.metrics["below_guarantee"] = 1.0
        log(f"round {self.round}: {self.cfg.name} kept logical client{'s' if len(kept) > 1 else ''} {range_list(kept)}"
            + (f", rejected {range_list(dropped)}" if dropped else "")
            + (f" (n={n} < 2f+3={2 * self.cfg.byzantine_clients + 3}: Krum's guarantee does not hold this round)"
               if n < 2 * self.cfg.byzantine_clients + 3 else ""), rank=0)
        return mean_coefficients(weights, rows)


class SingleKrum(Krum):
    """Krum: the one update with the lowest score."""

    keep_default = 1


class Bulyan(DistanceRule):
    """Bulyan (El Mhamdi et al. 2018): theta = n - 2f updates selected by Krum one at a time, then, coordinate by
    coordinate, the mean of the beta = theta - 2f selected values closest to their median; f =
    ``strategy.byzantine_clients``. Unweighted, as the paper's rule (``strategy.weighting`` plays no part)."""

    capabilities = WHOLE_UPDATE_COORDINATE_WISE
    selected: tuple[int, ...] = ()  # the rows Krum selected this round, ascending
    beta = 1  # how many of their values closest to the median each coordinate averages

    def coefficients(self, gram: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The selection (``combined_chunk`` applies the coordinate rule to it); logged and counted as Krum's.
        What it returns, the selection's plain mean, is not the result: Bulyan is no combination of the rows."""
        n, f = len(weights), self.cfg.byzantine_clients
        theta, self.beta = bulyan_counts(n, f)
        self.selected = bulyan_selection(squared_distances(gram), f, theta)
        kept = sorted(self.clients[i] for i in self.selected)
        dropped = sorted(self.clients[i] for i in range(n) if i not in self.selected)
        self.metrics = {"kept": float(len(self.selected)), "rejected": float(n - len(self.selected)),
                        "averaged_per_coordinate": float(min(self.beta, len(self.selected)))}
        self.rejected = tuple(dropped)
        if n < 4 * f + 3:
            self.metrics["below_guarantee"] = 1.0
        log(f"round {self.round}: bulyan kept logical client{'s' if len(kept) > 1 else ''} {range_list(kept)}"
            + (f", rejected {range_list(dropped)}" if dropped else "")
            + (f"; the mean of the {min(self.beta, len(kept))} values closest to each coordinate's median"
               if min(self.beta, len(kept)) > 1 else "; the value closest to each coordinate's median")
            + (f" (n={n} < 4f+3={4 * f + 3}: Bulyan's guarantee does not hold this round)" if n < 4 * f + 3 else ""),
            rank=0)
        return mean_coefficients(np.ones(n), self.selected)

    def combined_chunk(self, start: int, numel: int) -> torch.Tensor:
        """The coordinate rule over the selected rows' ``numel`` elements from ``start`` on, rounded once to fp32, a
        tile of ``BULYAN_TILE`` elements at a time: a whole 16 MiB chunk's float64 temporaries would cost the server
        some GiB and, out of the cache, ten times the time (each coordinate is its own, so tiles change no bit)."""
        assert self.kept is not None and self.solved is not None  # solve comes first
        out = np.empty(numel, dtype=np.float32)
        rows = np.empty((len(self.selected), min(numel, BULYAN_TILE)), dtype=np.float32)
        for at in range(0, numel, BULYAN_TILE):
            width = min(BULYAN_TILE, numel - at)
            for k, i in enumerate(self.selected):
                self.kept.read(i, start + at, rows[k, :width])
            out[at:at + width] = bulyan_coordinates(rows[:, :width], self.beta)
        return torch.from_numpy(out)


class GeometricMedian(DistanceRule):
    """RFA's geometric median, weighted by ``strategy.weighting`` (Pillutla et al. weight by samples)."""

    def coefficients(self, gram: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The smoothed Weiszfeld median's coefficients; its iterations and objective are recorded."""
        found = weiszfeld(gram, weights, self.cfg.geomed_iterations, self.cfg.geomed_tolerance,
                          self.cfg.geomed_smoothing)
        self.metrics = {"weiszfeld_iterations": float(found.iterations), "median_objective": found.objective}
        return found.coefficients
