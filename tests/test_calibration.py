"""Virtual time calibrated from a measured run (`mpifl calibrate`): the fitted cost model makes a simulated
10,000-client run's round times match a measured 20-client run's."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from conftest import run_mpi, write_config

from mpifl.cli.calibrate import fit_costs

MEASURED = """
seed: 1
rounds: 81
clients: {num_clients: 20, per_round: 4}
data: {dataset: synthetic, partition: unbalanced, kwargs: {num_samples: 4000, num_features: 8, num_classes: 4}}
model: {name: mlp, kwargs: {hidden: [128, 128]}}
train: {lr: 0.05, batch_size: 16, local_epochs: 1}
eval: {every: 0}
output: {progress: false}
"""
SIMULATED_CLIENTS = 10_000
# The stated error of the round times' median and 90th percentile. Measured 2026-11-29 on 2 cores (the median-line
# fit): -7% and +7% on an idle machine; -10% and +19% with two busy loops competing for the cores, as the suite's
# other worker does: a shared machine's stalls land in the measured tail (docs/how-to/virtual-time.md).
STATED_ERROR = {0.5: 0.25, 0.9: 0.40}


def test_the_fit_recovers_a_line_and_never_goes_negative():
    rng = np.random.default_rng(0)
    work = rng.uniform(10, 1000, 200)
    fit = fit_costs(list(zip(work, 0.5 + 0.01 * work)))
    assert fit.overhead == pytest.approx(0.5) and fit.per_sample == pytest.approx(0.01) and fit.r2 == pytest.approx(1)
    assert fit.sigma == pytest.approx(0, abs=1e-9)
    through_zero = fit_costs([(100.0, 0.5), (200.0, 2.0), (300.0, 3.4)])  # a negative intercept: refitted at 0
    assert through_zero.overhead == 0 and through_zero.per_sample > 0
    noisy = fit_costs(list(zip(work, (0.5 + 0.01 * work) * rng.lognormal(0, 0.2, 200))))
    assert noisy.sigma == pytest.approx(0.2, abs=0.03)  # the spread becomes the devices' speed sigma
    with pytest.raises(ValueError, match="a fit needs at least 2"):
        fit_costs([(1.0, 1.0)])


def test_tasks_stalled_by_other_work_on_the_machine_do_not_move_the_fitted_line():
    rng = np.random.default_rng(1)
    work = rng.uniform(10, 1000, 400)
    seconds = (0.5 + 0.01 * work) * rng.lognormal(0, 0.05, 400)
    stalled = rng.random(400) < 0.2  # a fifth of the tasks shared their core with something else
    seconds[stalled] *= rng.uniform(2, 6, stalled.sum())
    fit = fit_costs(list(zip(work, seconds)))
    assert fit.overhead == pytest.approx(0.5, rel=0.15) and fit.per_sample == pytest.approx(0.01, rel=0.05)
    least_squares_slope = np.polyfit(work, seconds, 1)[0]
    assert least_squares_slope > 0.012  # what a plain least-squares fit makes of the same tasks


def quantiles(values, at=(0.5, 0.9)) -> list[float]:
    return [float(np.quantile(np.asarray(values, dtype=float), q)) for q in at]


def relative_error(measured: float, simulated: float) -> float:
    return abs(simulated - measured) / measured


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_simulated_10000_client_run_takes_rounds_as_long_as_the_measured_20_client_run_it_was_fitted_to(tmp_path):
    cfg = write_config(tmp_path / "measured.yaml", MEASURED)
    measured = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "measured"))
    assert measured.returncode == 0, measured.stderr[-3000:]
    fitted = run_mpi(1, "calibrate", str(tmp_path / "measured"))
    assert fitted.returncode == 0, fitted.stderr
    overrides = fitted.stdout.strip().splitlines()[-1].split(": ", 1)[1].split()
    assert [o.split("=")[0] for o in overrides] == ["clock.task_overhead", "clock.seconds_per_sample",
                                                     "clock.speed_sigma"]
    # 10,000 clients whose sizes are the measured 20's, repeated: the same population of tasks, sampled 4 a round
    with open(tmp_path / "measured" / "partition.csv") as f:
        sizes = [int(row[0]) for row in list(csv.reader(f))[1:]]
    start, lists = 0, []
    for client in range(SIMULATED_CLIENTS):
        size = sizes[client % len(sizes)]
        lists.append(list(range(start, start + size)))
        start += size
    (tmp_path / "partition.json").write_text(json.dumps(lists))
    samples = int(start / 0.8) + 1000  # synthetic data keeps a fifth for its test split
    simulated = run_mpi(3, "run", str(cfg), f"clients.num_clients={SIMULATED_CLIENTS}", "rounds=200",
                        f"data.kwargs.num_samples={samples}", "data.partition=file",
                        f"data.partition_file={tmp_path / 'partition.json'}", "clock.mode=sync",
                        "clock.bandwidth_mbps=1e9", *overrides, "--run-dir", str(tmp_path / "simulated"))
    assert simulated.returncode == 0, simulated.stderr[-3000:]
    real = [r["client_train_seconds"] for r in records(tmp_path / "measured")[1:]]  # round 1: one-time costs
    virtual = [r["virtual_round_seconds"] for r in records(tmp_path / "simulated")]
    for q, (want, got) in zip((0.5, 0.9), zip(quantiles(real), quantiles(virtual))):
        assert relative_error(want, got) <= STATED_ERROR[q], (q, want, got)
