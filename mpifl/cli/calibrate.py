"""``mpifl calibrate RUN_DIR``: the virtual-time cost model (``clock.task_overhead``, ``clock.seconds_per_sample``,
``clock.speed_sigma``) fitted to what a measured run's clients took, so that simulated rounds, at any number of
clients, take as long as measured ones.

Each record's ``timing`` holds every usable participant's rank, training samples and seconds. A task's work is its
samples times ``train.local_epochs`` (or ``train.local_steps`` x ``train.batch_size``), as the clock counts it
(mpifl.clock.planners.task_samples). The fit is the median line of seconds on work (least absolute deviations),
``seconds = overhead + per_sample x work``, per device class (the ranks that train on a GPU, and those on CPUs:
``ranks.txt``). Round 1 is left out: a rank's first clients pay one-time costs (imports, first touches of memory).

A median line, not least squares: on a machine shared with other work a few tasks stall for many times their
length, and least squares follows them, while the median line moves only once half the tasks stall. The simulated
devices' speeds have median 1, so the simulated median task lies on the line. The spread of the measured seconds
about it, as the sigma of their log-ratio (robustly, from its median absolute deviation), becomes the devices'
speed spread.

Two runs give nothing to fit, and are refused: one without ``timing``, and one with batched clients
(``train.batched_clients``), where a batch trains as one model: its first client's recorded time is the whole
batch's, the others' a few microseconds, and the batch takes as long as its longest client (every lane steps until
it is done) whatever the others hold, so its time is no task's and no sum of the samples. A fit whose R² is below
``WEAK_FIT`` is printed with a warning above its overrides.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpifl.cli.report import load_metrics
from mpifl.clock.planners import task_samples
from mpifl.config import Config, load_config

WEAK_FIT = 0.5  # R² below which the output warns that the line explains less than half of the seconds' variance


class CalibrationError(ValueError):
    """The run's records hold nothing a cost model can be fitted to; the message says why and what to run."""


@dataclass(frozen=True)
class CostFit:
    """One device class's fitted cost: seconds = overhead + per_sample x work, with a lognormal spread."""

    overhead: float  # seconds per task
    per_sample: float  # seconds per sample of work
    sigma: float  # spread of log(measured / fitted): 1.4826 x its median absolute deviation
    tasks: int
    r2: float  # the share of the seconds' variance the line explains

    def overrides(self) -> list[str]:
        """The ``key=value`` overrides that set the clock to this fit."""
        return [f"clock.task_overhead={self.overhead:.6g}", f"clock.seconds_per_sample={self.per_sample:.6g}",
                f"clock.speed_sigma={self.sigma:.4g}"]


def fit_costs(tasks: Sequence[tuple[float, float]]) -> CostFit:
    """The median line of seconds on work over ``tasks`` ((work, seconds) pairs), neither coefficient negative
    (a negative one is set to 0 and the other refitted alone)."""
    if len(tasks) < 2:
        raise CalibrationError(f"{len(tasks)} measured task(s); a fit needs at least 2 (run more rounds)")
    work, seconds = (np.array(column, dtype=float) for column in zip(*tasks))
    if np.ptp(work) > 0:
        overhead, per_sample = median_line(work, seconds)
    else:  # every task did the same work: the time is all overhead
        overhead, per_sample = float(np.median(seconds)), 0.0
    if overhead < 0:
        overhead, per_sample = 0.0, float(np.median(seconds / work)) if (work > 0).all() else 0.0
    if per_sample < 0:
        overhead, per_sample = float(np.median(seconds)), 0.0
    fitted = overhead + per_sample * work
    spread = robust_sigma(np.log(seconds / fitted)) if (fitted > 0).all() and (seconds > 0).all() else 0.0
    total = float(((seconds - seconds.mean()) ** 2).sum())
    r2 = 1.0 - float(((seconds - fitted) ** 2).sum()) / total if total > 0 else 1.0
    return CostFit(float(overhead), float(per_sample), spread, len(tasks), r2)


def median_line(x: np.ndarray, y: np.ndarray, iterations: int = 100) -> tuple[float, float]:
    """(intercept, slope) of the line minimising the sum of absolute deviations of ``y`` from it, by iteratively
    reweighted least squares (each point weighted by the inverse of its last residual, floored so an exact fit
    cannot divide by zero), started from least squares."""
    design = np.column_stack([np.ones_like(x), x])
    coef = np.linalg.lstsq(design, y, rcond=None)[0]
    floor = 1e-9 * max(float(np.abs(y).max()), 1e-30)
    for _ in range(iterations):
        weights = 1.0 / np.maximum(np.abs(y - design @ coef), floor)
        root = np.sqrt(weights)
        updated = np.linalg.lstsq(design * root[:, None], y * root, rcond=None)[0]
        if np.allclose(updated, coef, rtol=1e-10, atol=0):
            coef = updated
            break
        coef = updated
    return float(coef[0]), float(coef[1])


def robust_sigma(values: np.ndarray) -> float:
    """The standard deviation of ``values`` as a normal distribution's would be, read from their median absolute
    deviation (1.4826 MAD): a machine shared with other work adds rare long stalls to a few tasks, which would
    inflate a plain standard deviation, and with it every simulated device's spread."""
    return float(1.4826 * np.median(np.abs(values - np.median(values))))


def task_work(samples: int, cfg: Config) -> float:
    """A task's work in samples, as the clock counts it (mpifl.clock.planners.task_samples)."""
    return task_samples([samples], 1, cfg.train.local_epochs, cfg.train.local_steps, cfg.train.batch_size)[0]


def device_classes(run_dir: Path) -> dict[int, str]:
    """Each rank's device class from ``ranks.txt``: 'gpu' where it names a GPU, else 'cpu'."""
    table = run_dir / "ranks.txt"  # rank host pid local_rank cores gpu threads
    rows = [line.split() for line in table.read_text().splitlines()[1:]] if table.is_file() else []
    return {int(row[0]): ("cpu" if row[5] == "-" else "gpu") for row in rows if len(row) > 5}


def measured_tasks(records: Sequence[dict], cfg: Config, classes: dict[int, str]) -> dict[str, list[tuple]]:
    """(work, seconds) of every measured task after round 1, by device class."""
    out: dict[str, list[tuple]] = {}
    for record in records:
        if record["round"] == 1:
            continue
        for task in record.get("timing", ()):
            if not (isinstance(task, list) and len(task) == 4 and all(isinstance(v, (int, float)) for v in task)):
                raise CalibrationError(f"round {record['round']}: 'timing' holds {task!r}, not [client, rank, "
                                       "samples, seconds]: this record is not one mpifl wrote")
            _, rank, samples, seconds = task
            out.setdefault(classes.get(rank, "cpu"), []).append((task_work(samples, cfg), seconds))
    return out


def calibrate(run_dir: str | Path) -> dict[str, CostFit]:
    """Each device class's fit for the run in ``run_dir``."""
    run_dir = Path(run_dir)
    records = load_metrics(run_dir, "calibrate")
    cfg = load_config(run_dir / "config.yaml")
    width = cfg.train.batched_clients
    if width:
        raise CalibrationError(
            f"{run_dir} trained its clients {width} at a time (train.batched_clients={width}): a batch's time is "
            "recorded as its first client's (the others' as about 0) and is set by its longest client, so no "
            "per-client cost can be fitted; calibrate an unbatched run of the same config "
            "(train.batched_clients=0)")
    if not records:
        raise CalibrationError(f"{run_dir / 'metrics.jsonl'} records no round yet: calibrate a run that finished "
                               "2 rounds or more")
    if not any(r.get("timing") for r in records):
        raise CalibrationError(f"{run_dir}: its records have no 'timing' (written since mpifl 2026-11-29); rerun it")
    tasks = measured_tasks(records, cfg, device_classes(run_dir))
    if not tasks:
        rounds = max(r["round"] for r in records)
        raise CalibrationError(f"{run_dir}: no task was timed after round 1 (the run has {rounds} round(s); round "
                               "1's times hold each rank's warm-up and are left out): calibrate a run of at least "
                               "2 rounds, whose tasks after round 1 number 2 or more")
    return {kind: fit_costs(pairs) for kind, pairs in sorted(tasks.items())}


def render(fits: dict[str, CostFit]) -> str:
    """The fits as a table, and the overrides of the class with the most tasks."""
    lines = ["| devices | tasks | overhead (s) | per sample (s) | spread (sigma) | R² |", "|---|---|---|---|---|---|"]
    lines += [f"| {kind} | {f.tasks} | {f.overhead:.4g} | {f.per_sample:.4g} | {f.sigma:.3f} | {f.r2:.3f} |"
              for kind, f in fits.items()]
    weak = [weak_fit_warning(kind, f) for kind, f in fits.items() if f.r2 < WEAK_FIT]
    kind, best = max(fits.items(), key=lambda item: item[1].tasks)
    lines += ["", *weak, f"to simulate {kind} devices like these: " + " ".join(best.overrides())]
    return "\n".join(lines)


def weak_fit_warning(kind: str, fit: CostFit) -> str:
    """One line saying that ``fit``'s line explains little of what its tasks took, and what helps."""
    return (f"warning: {kind}: R² {fit.r2:.2f} < {WEAK_FIT}: the line explains little of the measured times "
            "(tasks stalled by other work on the machine, too few rounds, or clients too alike in size to tell "
            "overhead from per-sample cost), so simulated times follow it only roughly; measure longer on a "
            "quieter machine")
