"""Krum, Multi-Krum, Bulyan and the geometric median: the rules over the Gram matrix, and the kept updates they read."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from mpifl.aggregation.distances import (
    Bulyan,
    DistanceRule,
    GeometricMedian,
    KeptRows,
    Krum,
    SingleKrum,
    bulyan_coordinates,
    bulyan_counts,
    bulyan_selection,
    kept_gram,
    krum_neighbours,
    krum_scores,
    krum_selection,
    squared_distances,
    weiszfeld,
)
from mpifl.config import StrategyConfig


def honest_and_byzantine(honest: int = 7, byzantine: int = 2, dim: int = 50, seed: int = 0) -> np.ndarray:
    """Honest updates scattered around one point, Byzantine ones far away (as a sign-flipped, scaled attack)."""
    rng = np.random.default_rng(seed)
    centre = rng.normal(size=dim)
    good = centre + 0.1 * rng.normal(size=(honest, dim))
    bad = -10.0 * centre + rng.normal(size=(byzantine, dim))
    return np.vstack([good, bad])


def gram_of(points: np.ndarray) -> np.ndarray:
    return points @ points.T


def test_squared_distances_from_the_gram_matrix_are_the_pairwise_distances():
    points = np.random.default_rng(1).normal(size=(5, 8))
    want = np.array([[np.sum((a - b) ** 2) for b in points] for a in points])
    np.testing.assert_allclose(squared_distances(gram_of(points)), want, atol=1e-12)


def test_krum_sums_each_updates_distances_to_its_n_minus_f_minus_2_nearest_others():
    points = np.array([[0.0], [1.0], [3.0], [7.0], [20.0]])
    scores = krum_scores(squared_distances(gram_of(points)), byzantine=1)  # 5 - 1 - 2 = 2 neighbours
    assert scores.tolist() == [1 + 9, 1 + 4, 4 + 9, 16 + 36, 169 + 289]


def test_krum_neighbours_never_fall_below_one_and_a_lone_update_has_none():
    assert krum_neighbours(9, 2) == 5
    assert krum_neighbours(4, 3) == 1  # n < 2f + 3: fewer than the guarantee needs, never none
    assert krum_neighbours(1, 0) == 0


def test_krum_keeps_an_honest_update_and_multi_krum_rejects_every_byzantine_one():
    points = honest_and_byzantine()
    distances = squared_distances(gram_of(points))
    (single,) = krum_selection(distances, byzantine=2, keep=1)
    assert single < 7
    assert krum_selection(distances, byzantine=2, keep=7) == tuple(range(7))


def test_a_tie_in_krum_scores_goes_to_the_lower_row():
    points = np.array([[0.0], [1.0], [0.0], [1.0]])
    assert krum_selection(squared_distances(gram_of(points)), byzantine=0, keep=1) == (0,)


def brute_force_median(points: np.ndarray, weights: np.ndarray) -> float:
    """The smallest sum_i a_i ||z - x_i|| over a fine grid of 2-D points z."""
    xs = np.linspace(points[:, 0].min(), points[:, 0].max(), 401)
    ys = np.linspace(points[:, 1].min(), points[:, 1].max(), 401)
    grid = np.stack(np.meshgrid(xs, ys), axis=-1).reshape(-1, 2)
    return float(np.min(np.sum(weights * np.linalg.norm(grid[:, None, :] - points[None], axis=2), axis=1)))


def test_weiszfeld_finds_the_geometric_median_of_weighted_points():
    points = np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 3.0], [5.0, 5.0], [1.0, 2.0]])
    weights = np.array([1.0, 2.0, 1.0, 1.0, 3.0])
    found = weiszfeld(gram_of(points), weights, iterations=200, tolerance=0.0, smoothing=1e-9)
    assert found.coefficients.sum() == pytest.approx(1.0)
    z = found.coefficients @ points
    objective = float(np.sum(weights / weights.sum() * np.linalg.norm(points - z, axis=1)))
    # distances from the Gram matrix lose ~sqrt(eps) * |x| to cancellation where z lies on an update, as here
    assert found.objective == pytest.approx(objective, rel=1e-6)
    assert objective <= brute_force_median(points, weights / weights.sum()) + 1e-4


def test_the_geometric_median_barely_moves_under_far_outliers_where_the_mean_does():
    points = honest_and_byzantine()
    honest_centre = points[:7].mean(axis=0)
    found = weiszfeld(gram_of(points), np.ones(9), iterations=50, tolerance=1e-9, smoothing=1e-6)
    median_error = np.linalg.norm(found.coefficients @ points - honest_centre)
    mean_error = np.linalg.norm(points.mean(axis=0) - honest_centre)
    assert median_error < 0.1 * mean_error


def test_weiszfeld_stops_once_the_objective_improves_by_less_than_the_tolerance():
    points = honest_and_byzantine()
    assert weiszfeld(gram_of(points), np.ones(9), iterations=100, tolerance=1e-2, smoothing=1e-6).iterations < 100
    assert weiszfeld(gram_of(points), np.ones(9), iterations=0, tolerance=0.0, smoothing=1e-6).coefficients \
        .tolist() == pytest.approx([1 / 9] * 9)


def keep_in_chunks(rule, points: np.ndarray, chunk: int, weights=None) -> None:
    """Hand ``rule`` the points row by row in chunks of ``chunk`` elements, as the reduction does."""
    rule.begin(len(points), points.shape[1])
    for start in range(0, points.shape[1], chunk):
        for row, x in enumerate(points):
            weight = 1.0 if weights is None else float(weights[row])
            rule.keep(row, start, torch.from_numpy(x[start:start + chunk].astype(np.float32)), weight, 10 + row)


@pytest.mark.parametrize("ram_bytes", [1 << 30, 0])  # in RAM, and in a temporary file
def test_the_gram_matrix_of_kept_updates_does_not_depend_on_the_chunks_they_arrived_in(ram_bytes):
    points = np.random.default_rng(3).normal(size=(4, 1000)).astype(np.float32)
    grams = []
    for chunk in (7, 256, 1000):
        kept = KeptRows(4, 1000, ram_bytes)
        for start in range(0, 1000, chunk):
            for row in range(4):
                kept.write(row, start, points[row, start:start + chunk])
        grams.append(kept_gram(kept, 4, block=128))
        kept.close()
    assert all(np.array_equal(grams[0], g) for g in grams[1:])
    centred = points.astype(np.float64) - points[0]
    np.testing.assert_allclose(grams[0], centred @ centred.T, rtol=1e-12, atol=1e-9)


def test_the_gram_matrix_has_the_same_bits_however_its_blocks_are_handed_out():
    points = np.random.default_rng(5).normal(size=(5, 700)).astype(np.float32)
    kept = KeptRows(5, 700)
    for row in range(5):
        kept.write(row, 0, points[row])
    whole = kept_gram(kept, 5, block=64)
    pieces = np.zeros((5, 5))
    for start, stop in ((0, 128), (128, 640), (640, 700)):  # as chunks finish: whole blocks, then the last
        kept_gram(kept, 5, pieces, start, stop, block=64)
    assert np.array_equal(pieces, whole)


def test_a_rule_sums_the_gram_matrix_as_chunks_land_to_the_same_bits():
    points = np.random.default_rng(6).normal(size=(4, 200_000)).astype(np.float32)
    ahead, at_end = (GeometricMedian(StrategyConfig(name="geometric_median")) for _ in range(2))
    for rule in (ahead, at_end):
        keep_in_chunks(rule, points, chunk=200_000)
    ahead.advance(4, 70_000)  # one whole block of 65,536 elements summed ahead
    assert ahead.summed == 65_536
    ahead.advance(4, 150_000)
    for rule in (ahead, at_end):
        rule.solve(4)
    assert np.array_equal(ahead.gram, at_end.gram) and np.array_equal(ahead.solved, at_end.solved)


def test_kept_updates_in_a_file_read_back_as_written():
    kept = KeptRows(3, 10, ram_bytes=0)
    assert kept.array is None
    kept.write(2, 4, np.arange(6, dtype=np.float32))
    assert kept.read(2, 4, np.empty(6, dtype=np.float32)).tolist() == list(range(6))
    kept.close()


def test_krum_gives_the_selected_update_itself_bit_for_bit():
    points = honest_and_byzantine(dim=30).astype(np.float32)
    rule = SingleKrum(StrategyConfig(name="krum", byzantine_clients=2))
    keep_in_chunks(rule, points, chunk=8)
    rule.solve(len(points))
    got = torch.cat([rule.combined_chunk(start, min(8, 30 - start)) for start in range(0, 30, 8)]).numpy()
    assert any(np.array_equal(got, p) for p in points[:7])
    assert rule.round_metrics() == {"kept": 1.0, "rejected": 8.0}


def test_multi_krum_averages_the_kept_updates_by_their_weights():
    points = honest_and_byzantine(dim=12).astype(np.float32)
    weights = np.arange(1, 10, dtype=np.float64)
    rule = Krum(StrategyConfig(name="multi_krum", weighting="samples", byzantine_clients=2))
    keep_in_chunks(rule, points, chunk=5, weights=weights)
    rule.solve(len(points))
    got = torch.cat([rule.combined_chunk(s, min(5, 12 - s)) for s in range(0, 12, 5)]).numpy()
    want = (weights[:7, None] * points[:7].astype(np.float64)).sum(axis=0) / weights[:7].sum()
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert rule.round_metrics() == {"kept": 7.0, "rejected": 2.0}


def test_multi_krum_keeps_krum_keep_updates_when_it_is_set():
    rule = Krum(StrategyConfig(name="multi_krum", byzantine_clients=2, krum_keep=3))
    assert [rule.kept_count(n) for n in (9, 2)] == [3, 2]


def test_bulyan_selects_n_minus_2f_and_averages_n_minus_4f_values_a_coordinate_never_fewer_than_one():
    assert bulyan_counts(11, 2) == (7, 3)  # n = 4f + 3: the guarantee's least n
    assert bulyan_counts(9, 2) == (5, 1)
    assert bulyan_counts(5, 2) == (1, 1)  # below: one update, its own values
    assert bulyan_counts(4, 0) == (4, 4)  # f = 0: every update, every value (the plain mean)


def test_bulyans_krum_selection_takes_the_honest_updates_one_at_a_time():
    points = honest_and_byzantine(honest=9, byzantine=2)
    chosen = bulyan_selection(squared_distances(gram_of(points)), byzantine=2, theta=7)
    assert len(chosen) == 7 and set(chosen) <= set(range(9))
    # one at a time: the first choice is Krum's own, each later one Krum's among the rest
    assert chosen[0] == min(chosen) and krum_selection(squared_distances(gram_of(points)), 2, 1)[0] in chosen


def test_bulyans_coordinate_rule_is_the_mean_of_the_beta_values_nearest_the_median_whatever_the_rows_order():
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(7, 40)).astype(np.float32)
    got = bulyan_coordinates(rows, beta=3)
    for k in range(40):  # the paper's argmin over every subset of beta values, by brute force
        column = rows[:, k].astype(np.float64)
        med = float(np.median(column))
        best = min(itertools.combinations(column, 3), key=lambda subset: sum(abs(v - med) for v in subset))
        assert got[k] == pytest.approx(sum(best) / 3, abs=1e-12)
    assert np.array_equal(bulyan_coordinates(rows[rng.permutation(7)], beta=3), got)
    assert np.array_equal(bulyan_coordinates(rows, beta=7), rows.astype(np.float64).sum(axis=0) / 7)  # the mean
    assert np.array_equal(bulyan_coordinates(rows, beta=1), np.median(rows.astype(np.float64), axis=0))


def test_bulyan_in_chunks_rejects_the_far_updates_and_records_what_it_kept():
    points = honest_and_byzantine(honest=9, byzantine=2, dim=23).astype(np.float32)
    rule = Bulyan(StrategyConfig(name="bulyan", byzantine_clients=2))
    keep_in_chunks(rule, points, chunk=6)
    rule.solve(len(points))
    got = torch.cat([rule.combined_chunk(s, min(6, 23 - s)) for s in range(0, 23, 6)]).numpy()
    chosen = bulyan_selection(squared_distances(gram_of(points.astype(np.float64))), 2, 7)
    np.testing.assert_array_equal(got, bulyan_coordinates(points[list(chosen)], beta=3).astype(np.float32))
    assert rule.round_metrics() == {"kept": 7.0, "rejected": 4.0, "averaged_per_coordinate": 3.0}
    assert set(rule.round_rejected()) >= {19, 20}  # the Byzantine clients (keep_in_chunks: client 10 + row)
    small = Bulyan(StrategyConfig(name="bulyan", byzantine_clients=2))
    keep_in_chunks(small, points[:8], chunk=6)
    small.solve(8)
    assert small.round_metrics()["below_guarantee"] == 1.0  # 8 < 4f + 3 = 11


def test_the_geometric_median_rule_records_its_iterations_and_objective():
    points = honest_and_byzantine(dim=20).astype(np.float32)
    rule = GeometricMedian(StrategyConfig(name="geometric_median", geomed_iterations=3))
    keep_in_chunks(rule, points, chunk=6)
    rule.solve(len(points))
    metrics = rule.round_metrics()
    assert metrics["weiszfeld_iterations"] <= 3 and metrics["median_objective"] > 0


def test_a_later_round_with_fewer_participants_reuses_the_kept_rows():
    rule = GeometricMedian(StrategyConfig(name="geometric_median"))
    for rows in (5, 3):
        keep_in_chunks(rule, np.ones((rows, 4)), chunk=4)
        rule.solve(rows)
        assert torch.equal(rule.combined_chunk(0, 4), torch.ones(4))


def test_a_combination_of_identical_updates_is_that_update():
    for name, cls in (("krum", SingleKrum), ("multi_krum", Krum), ("geometric_median", GeometricMedian)):
        rule = cls(StrategyConfig(name=name))
        keep_in_chunks(rule, np.full((4, 6), 0.25), chunk=4)
        rule.solve(4)
        assert torch.equal(rule.combined_chunk(0, 6), torch.full((6,), 0.25)), name


def test_every_pair_of_rows_enters_the_distances_once_centred():
    points = np.random.default_rng(4).normal(size=(6, 9)).astype(np.float32)
    kept = KeptRows(6, 9)
    for row in range(6):
        kept.write(row, 0, points[row])
    distances = squared_distances(kept_gram(kept, 6))
    for i, j in itertools.combinations(range(6), 2):
        assert distances[i, j] == pytest.approx(float(np.sum((points[i].astype(np.float64) - points[j]) ** 2)),
                                                rel=1e-9)


class Medoid(DistanceRule):
    """The plug-in of docs/reference/plugins.md: the update with the smallest sum of squared distances to the rest."""

    def coefficients(self, gram, weights):
        best = int(np.argmin(squared_distances(gram).sum(axis=1)))
        self.metrics = {"medoid": float(self.clients[best])}
        return np.eye(len(weights))[best]


def test_a_plug_in_rule_over_whole_updates_writes_only_its_coefficients():
    from mpifl.api import Replace, Strategy
    from mpifl.config import load_config

    strategy = Strategy(StrategyConfig(name="tests:medoid"), Medoid(StrategyConfig(name="tests:medoid")),
                        Replace(StrategyConfig()))
    assert strategy.whole_update and strategy.capabilities.whole_update and strategy.declared
    points = honest_and_byzantine(dim=10).astype(np.float32)
    keep_in_chunks(strategy.combiner, points, chunk=3)
    strategy.combiner.solve(len(points))
    got = torch.cat([strategy.combiner.combined_chunk(s, min(3, 10 - s)) for s in range(0, 10, 3)]).numpy()
    medoid = int(np.argmin(((points[:, None] - points[None]) ** 2).sum(axis=(1, 2))))
    assert np.array_equal(got, points[medoid]) and strategy.round_metrics() == {"medoid": 10.0 + medoid}
    from mpifl.aggregation.compatibility import strategy_problem

    problem = strategy_problem(strategy, load_config(None, ["clients.groups=2"]))  # needs every own update
    assert problem is not None and problem.startswith("clients.groups:")
