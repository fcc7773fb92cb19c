"""Virtual time calibrated from a measured run (`mpifl calibrate`): the fit recovers a line and its spread, ignores
tasks stalled by other work, and a simulated 10,000-client run built from its overrides runs rounds of the measured
run's length. How close they come is a timing, so it is measured in profiling/calibration_check.py, not here."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import ROOT, mpifl_here, run_mpi, write_config

from mpifl.cli.calibrate import fit_costs
from mpifl.config import dump_config, load_config

sys.path.insert(0, str(ROOT / "profiling"))
import calibration_check as check

# The simulated round times must be of the measured ones' size: a wrong unit (milliseconds for seconds), a fitted
# override lost on the way or a work measure that disagrees with the clock's would put them orders of magnitude
# apart. How close they come (within 25% on an idle machine) is profiling/calibration_check.py's figure.
SAME_SIZE = 2.0


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


def measured_run(path, seconds_of, batched=0, rounds=3, clients=40):
    """A run directory as a CPU run leaves it for calibrate: its config and each round's ``timing``."""
    path.mkdir()
    cfg = load_config(None, data={"rounds": rounds, "train": {"batched_clients": batched}})
    (path / "config.yaml").write_text(dump_config(cfg))
    rng = np.random.default_rng(0)
    with open(path / "metrics.jsonl", "w") as out:
        for r in range(1, rounds + 1):
            samples = rng.integers(10, 500, clients)
            timing = [[c, 1 + c % 2, int(n), seconds_of(int(n), rng)] for c, n in enumerate(samples)]
            out.write(json.dumps({"round": r, "timing": timing}) + "\n")
    return path


def test_a_run_with_batched_clients_is_refused_in_one_line_that_says_to_calibrate_an_unbatched_run(tmp_path):
    # a batch's first client carries the whole batch's time, the others next to nothing
    run = measured_run(tmp_path / "batched", lambda n, rng: 0.5 if rng.random() < 0.1 else 1e-4, batched=10)
    refused = mpifl_here("calibrate", str(run))
    assert refused.returncode == 1 and refused.stdout == ""  # no table, no overrides
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("mpifl calibrate: ") and "train.batched_clients=10" in line
    assert "calibrate an unbatched run of the same config" in line


def test_a_one_round_run_is_refused_in_one_line_that_says_how_many_rounds_calibrate_needs(tmp_path):
    """Round 1's times hold each rank's warm-up and are left out: a one-round run has nothing to fit."""
    refused = mpifl_here("calibrate", str(measured_run(tmp_path / "one", lambda n, rng: 0.01, rounds=1)))
    assert refused.returncode == 1 and refused.stdout == ""
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("mpifl calibrate: ") and "no task was timed after round 1 (the run has 1 round(s)" in line
    assert line.endswith("calibrate a run of at least 2 rounds, whose tasks after round 1 number 2 or more")


def test_records_with_no_round_or_a_malformed_timing_are_refused_in_one_line_naming_the_round(tmp_path):
    """They used to say the records were older than 'timing', and to end with a ValueError traceback."""
    run = measured_run(tmp_path / "run", lambda n, rng: 0.01)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("")
    refused = mpifl_here("calibrate", str(run))
    assert refused.returncode == 1 and "metrics.jsonl records no round yet" in refused.stderr, refused.stderr
    bad = {**json.loads(lines[1]), "timing": "x"}
    (run / "metrics.jsonl").write_text("\n".join([lines[0], json.dumps(bad), *lines[2:]]) + "\n")
    refused = mpifl_here("calibrate", str(run))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert f"round {bad['round']}: 'timing' holds 'x', not [client, rank, samples, seconds]" in refused.stderr


def test_a_fit_that_explains_little_of_the_measured_times_is_warned_of_above_its_overrides(tmp_path):
    weak = mpifl_here("calibrate", str(measured_run(tmp_path / "weak", lambda n, rng: (0.01 + 1e-4 * n)
                                                    * rng.lognormal(0, 1.0))))
    assert weak.returncode == 0, weak.stderr
    lines = weak.stdout.strip().splitlines()
    assert lines[-1].startswith("to simulate cpu devices like these: clock.task_overhead=")  # still the last line
    assert lines[-2].startswith("warning: cpu: R² ") and "explains little of the measured times" in lines[-2]
    good = mpifl_here("calibrate", str(measured_run(tmp_path / "good", lambda n, rng: (0.01 + 1e-4 * n)
                                                    * rng.lognormal(0, 0.05))))
    assert good.returncode == 0 and "warning" not in good.stdout


def test_a_simulated_10000_client_run_calibrated_on_a_measured_20_client_run_runs_rounds_of_its_length(tmp_path):
    cfg = write_config(tmp_path / "measured.yaml", check.MEASURED)
    measured = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "measured"))
    assert measured.returncode == 0, measured.stderr[-3000:]
    fitted = run_mpi(1, "calibrate", str(tmp_path / "measured"))
    assert fitted.returncode == 0, fitted.stderr
    overrides = check.fitted_overrides(fitted.stdout)
    assert [o.split("=")[0] for o in overrides] == ["clock.task_overhead", "clock.seconds_per_sample",
                                                     "clock.speed_sigma"]
    simulated = run_mpi(3, "run", str(cfg), *check.simulated_overrides(tmp_path / "measured",
                                                                       tmp_path / "partition.json", overrides),
                        "--run-dir", str(tmp_path / "simulated"))
    assert simulated.returncode == 0, simulated.stderr[-3000:]
    real, virtual = check.round_times(tmp_path / "measured", tmp_path / "simulated")
    assert len(real) == 80 and len(virtual) == 200
    for q, error in check.relative_errors(real, virtual).items():
        assert 1 / SAME_SIZE <= 1 + error <= SAME_SIZE, (q, error)


def test_the_measured_sizes_are_each_client_s_training_and_validation_samples(tmp_path):
    from mpifl.learning.partitions import partition_csv

    histogram = np.array([[3, 1], [0, 2]])
    (tmp_path / "partition.csv").write_text(partition_csv(histogram, np.array([1, 0])))
    assert check.measured_sizes(tmp_path) == [5, 2]
    (tmp_path / "partition.csv").write_text(partition_csv(histogram, np.array([0, 0])))
    assert check.measured_sizes(tmp_path) == [4, 2]


def test_the_simulated_clients_repeat_the_measured_sizes_end_to_end():
    lists, samples = check.repeated_partition([3, 1, 2], 5)
    assert lists == [[0, 1, 2], [3], [4, 5], [6, 7, 8], [9]] and samples == 10
