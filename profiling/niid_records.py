"""The NIID-Bench grid's finished runs, kept in the repository as one small JSON record per run.

A full-protocol run takes 25-60 minutes on a 2-core machine and its run directory (checkpoints, logs) is not
committed, so a grid that runs across sessions and machines keeps what it finished here:
``profiling/results/niid_bench/<setting>/<run>.json``, each with the global model's test accuracy after every
round, the seed, the commit and date it finished at, the machine and the command. ``profiling/niid_bench.py``
writes a record when a full-protocol run finishes and reads it instead of running that cell again;
``profiling/niid_bench.py --grid`` prints the grid table of docs/benchmarks.md from the records alone, and
tests/test_niid_records.py checks that the page's table is that output, so every figure there comes from a record.

Pure: no MPI, no torch, nothing run.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RECORDS = Path(__file__).resolve().parent / "results" / "niid_bench"
# Runs on Flower's baseline's own split of seed 42 (niid_bench.py --partition flower): not grid cells, kept apart
FLOWER_SPLIT_RECORDS = RECORDS.parent / "niid_bench_flower_split"

# The grid's rows and columns, in the order the table prints them.
GRID_SETTINGS = ("iid", "label1", "label2", "label3", "quantity")
GRID_ALGORITHMS = ("fedavg", "fedprox", "scaffold", "fednova")


@dataclass(frozen=True)
class RunRecord:
    """One finished full-protocol run of one algorithm on one seed of one setting.

    ``accuracy`` holds the test accuracy (a fraction) after each evaluated round, in round order; it is None only
    for a run whose directory was lost before records were kept, whose ``last``, ``best`` and ``best_round`` were
    copied from the page that published them (``note`` says so)."""

    setting: str                 # niid_bench.py's --setting
    label: str                   # the table's row: "fedavg", "fedprox (mu=0.01)", ...
    seed: int
    rounds: int                  # rounds run (the protocol's 50)
    last: float                  # accuracy after the last round
    best: float                  # best accuracy over rounds
    best_round: int              # the first round that reached ``best``
    commit: str                  # the commit the run finished at
    date: str                    # when it finished, YYYY-MM-DD
    machine: str
    command: str
    accuracy: list[float] | None = None
    round_seconds: float | None = None  # the rounds' wall time summed from metrics.jsonl (every round, resumed or not)
    note: str = ""
    # The round in which a client's update held NaN/Inf: the run stopped there (the protocol drops no client), so
    # ``rounds`` is the one before it and ``last`` that round's accuracy. None for a run of the whole protocol.
    diverged_round: int | None = None

    @property
    def algorithm(self) -> str:
        """The algorithm its row label names."""
        return algorithm_of(self.label)

    @property
    def file_name(self) -> str:
        """The run directory's name plus .json."""
        return record_file_name(self.label, self.seed)


def algorithm_of(label: str) -> str:
    """The algorithm a row label names ("fedprox (mu=0.01)" -> "fedprox")."""
    return label.split()[0]


def record_file_name(label: str, seed: int) -> str:
    """``<label without spaces or brackets>-seed<k>.json``: "fedprox (mu=0.01)", 2 -> fedprox-mu0.01-seed2.json."""
    return f"{run_name(label)}-seed{seed}.json"


def run_name(label: str) -> str:
    """A row label as a file name: "fedprox (mu=0.01)" -> "fedprox-mu0.01"."""
    return label.replace(" ", "").replace("(", "-").replace(")", "").replace("=", "")


def best_of(accuracy: Sequence[float]) -> tuple[float, int]:
    """The best accuracy over rounds and the first round (1-based) that reached it."""
    best = max(accuracy)
    return best, accuracy.index(best) + 1


def record_from_curve(accuracy: Sequence[float], **fields: Any) -> RunRecord:
    """A record from a finished run's per-round accuracies; ``fields`` are RunRecord's others (setting, label,
    seed, commit, date, machine, command, round_seconds)."""
    if not accuracy:
        raise ValueError(f"{fields.get('setting')} {fields.get('label')} seed {fields.get('seed')}: a record needs "
                         "at least one evaluated round")
    best, best_round = best_of(accuracy)
    return RunRecord(rounds=len(accuracy), last=accuracy[-1], best=best, best_round=best_round,
                     accuracy=list(accuracy), **fields)


def record_path(record: RunRecord, root: Path = RECORDS) -> Path:
    """Where ``record`` is kept."""
    return root / record.setting / record.file_name


def find_record(setting: str, label: str, seed: int, root: Path = RECORDS) -> RunRecord | None:
    """The kept record of one cell's seed, or None."""
    path = root / setting / record_file_name(label, seed)
    return read_record(path) if path.is_file() else None


def write_record(record: RunRecord, root: Path = RECORDS) -> Path:
    """Keep ``record`` (one JSON object per file, keys sorted, so that a diff shows what changed)."""
    path = record_path(record, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(record), indent=1, sort_keys=True) + "\n")
    return path


def read_record(path: Path) -> RunRecord:
    """One record; a file that is not one is named in the error."""
    try:
        return RunRecord(**json.loads(path.read_text()))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a NIID-Bench run record ({err})") from err


def read_records(root: Path = RECORDS) -> list[RunRecord]:
    """Every kept record, in setting, label and seed order."""
    records = [read_record(p) for p in sorted(root.glob("*/*.json"))]
    return sorted(records, key=lambda r: (r.setting, r.label, r.seed))


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean and the sample standard deviation (None for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def percent(values: Sequence[float]) -> str:
    """Accuracies (fractions) as "mean ± std" in %, one decimal; a single value without a spread."""
    mean, std = mean_std(values)
    return f"{100 * mean:.1f}" + (f" ± {100 * std:.1f}" if std is not None else "")


def cell_text(records: Sequence[RunRecord]) -> tuple[str, str, str]:
    """One cell's seeds (as "0 1 2"), its last-round and its best-over-rounds accuracies (mean ± std in %)."""
    if not records:
        return "not run yet", "", ""
    ordered = sorted(records, key=lambda r: r.seed)
    seeds = " ".join(str(r.seed) for r in ordered)
    diverged = [f"seed {r.seed} diverged in round {r.diverged_round}" for r in ordered if r.diverged_round]
    if diverged:  # its last figure is the round before: say so where the figure is read
        seeds += f" ({'; '.join(diverged)})"
    return seeds, percent([r.last for r in records]), percent([r.best for r in records])


def grid_table(records: Iterable[RunRecord], flower: Mapping[str, Mapping[str, float]],
               settings: Sequence[str] = GRID_SETTINGS, algorithms: Sequence[str] = GRID_ALGORITHMS) -> str:
    """The grid as markdown: one row per setting and algorithm with mpifl's seeds, its accuracy after the last
    round and the best over rounds (mean ± sample std over seeds, in %), Flower's single run (its README does not
    say which round), and mpifl's best minus Flower's in points. FedProx's row is the one mu the runs used."""
    by_cell: dict[tuple[str, str], list[RunRecord]] = {}
    for record in records:
        by_cell.setdefault((record.setting, record.algorithm), []).append(record)
    lines = ["| setting | algorithm | seeds | mpifl, after round 50 | mpifl, best round | Flower (1 run) "
             "| mpifl best − Flower |",
             "|---|---|---|---|---|---|---|"]
    for setting in settings:
        for algorithm in algorithms:
            cell = by_cell.get((setting, algorithm), [])
            variants = sorted({r.label for r in cell})
            if len(variants) > 1:
                raise ValueError(f"{setting} {algorithm}: records of more than one variant "
                                 f"({', '.join(variants)}); the grid shows one")
            name = cell[0].label if cell else algorithm
            seeds, last, best = cell_text(cell)
            theirs = flower.get(setting, {}).get(algorithm)
            diff = (f"{100 * mean_std([r.best for r in cell])[0] - theirs:+.1f}"
                    if cell and theirs is not None else "")
            lines.append(f"| `{setting}` | {name} | {seeds} | {last} | {best} | "
                         f"{'no row' if theirs is None else f'{theirs:.1f}'} | {diff} |")
    return "\n".join(lines)


def plot_grid(records: Sequence[RunRecord], folder: Path, settings: Sequence[str] = GRID_SETTINGS,
              split: str = "") -> list[Path]:
    """One figure per setting with kept curves, ``folder/niid_grid-<setting>.png``: each algorithm's test accuracy
    per round, the mean over its seeds with ± one standard deviation shaded (``mpifl compare``'s figure). Records
    without a per-round curve are left out; the figures' legends count the seeds drawn. ``split`` names a split
    other than NIID-Bench's in the title ("Flower's split of seed 42"), so a figure never passes for a grid cell's."""
    from mpifl.cli.compare import RunOutcome, plot_groups

    written = []
    for setting in settings:
        # one group per algorithm in the table's order, empty where no curve is kept: an algorithm keeps its colour
        # and marker in every figure
        groups: dict[str, tuple[str, list[RunOutcome]]] = {a: (a, []) for a in GRID_ALGORITHMS}
        for r in records:
            if r.setting == setting and r.accuracy is not None:
                members = groups.setdefault(r.algorithm, (r.label, []))[1]
                groups[r.algorithm] = (r.label, members)  # the row's label ("fedprox (mu=0.01)")
                members.append(RunOutcome(
                    run_dir=Path(r.file_name), config={"seed": r.seed},
                    curve={i + 1: a for i, a in enumerate(r.accuracy)}, best=r.best, final=r.last,
                    reached_round=None, reached_virtual_seconds=None))
        if any(members for _, members in groups.values()):
            folder.mkdir(parents=True, exist_ok=True)
            subject = f"{setting}, {split}" if split else setting
            written.append(plot_groups(list(groups.values()), "test accuracy", folder / f"niid_grid-{setting}.png",
                                       subject=subject))
    return written


# What docs/benchmarks.md says of each run, beside its figures: the curve from round SETTLED on (the first rounds
# climb from chance), and the mean of its last LAST_ROUNDS rounds (the best of 50 rounds is the top of a swing).
SETTLED, LAST_ROUNDS = 10, 10


def settled_range(accuracy: Sequence[float], from_round: int = SETTLED) -> tuple[float, float]:
    """The lowest and highest accuracy from round ``from_round`` (1-based) on."""
    tail = accuracy[from_round - 1:]
    return min(tail), max(tail)


def largest_change(accuracy: Sequence[float], from_round: int = SETTLED) -> tuple[float, int]:
    """The largest change from one round to the next (signed, in accuracy) between rounds from ``from_round`` on,
    and the round it led into; the first such round where two are as large."""
    changes = [(accuracy[i] - accuracy[i - 1], i + 1) for i in range(from_round, len(accuracy))]
    return max(changes, key=lambda c: (abs(c[0]), -c[1])) if changes else (0.0, from_round)


def last_rounds_mean(accuracy: Sequence[float], rounds: int = LAST_ROUNDS) -> float:
    """The mean accuracy over the last ``rounds`` rounds."""
    return statistics.fmean(accuracy[-rounds:])


def against(accuracy: Sequence[float], other: Sequence[float], from_round: int = SETTLED + 1) -> tuple[int, int, float]:
    """How a curve lies against another of the same split: the rounds it is strictly above the other, the rounds
    both have, and its mean gap (accuracy) over the rounds from ``from_round`` on."""
    both = min(len(accuracy), len(other))
    above = sum(a > b for a, b in zip(accuracy[:both], other[:both], strict=True))
    gaps = [accuracy[i] - other[i] for i in range(from_round - 1, both)]
    return above, both, statistics.fmean(gaps) if gaps else 0.0


def describe(record: RunRecord, reference: RunRecord | None = None) -> list[str]:
    """The figures docs/benchmarks.md gives of one run, as lines: its last and best accuracy, the range and the
    largest round-to-round change from round ``SETTLED`` on, the mean of its last rounds, and how it lies against
    ``reference`` (FedAvg on the same seed) where both keep a curve. A record without a curve gives its figures."""
    head = (f"{record.setting} {record.label} seed {record.seed} (commit {record.commit[:7]}, {record.date}"
            + (f", {record.round_seconds:,.0f} s of rounds" if record.round_seconds else "") + ")")
    lines = [head, f"  after round {record.rounds}: {100 * record.last:.2f}%; best {100 * record.best:.2f}% "
                   f"(round {record.best_round})"
             + (f"; diverged in round {record.diverged_round}" if record.diverged_round else "")]
    curve = record.accuracy
    if curve is None:
        return [*lines, "  no per-round curve kept" + (" (the record's note says why)" if record.note else "")]
    if len(curve) >= SETTLED + 1:
        low, high = settled_range(curve)
        change, at = largest_change(curve)
        lines.append(f"  from round {SETTLED}: {100 * low:.2f}-{100 * high:.2f}%; largest change {100 * change:+.2f} "
                     f"points ({100 * curve[at - 2]:.2f}% -> {100 * curve[at - 1]:.2f}%, round {at})")
    lines.append(f"  rounds {max(1, len(curve) - LAST_ROUNDS + 1)}-{len(curve)}: "
                 f"{100 * last_rounds_mean(curve):.2f}% on average")
    if reference is not None and reference.accuracy is not None and reference is not record:
        above, both, gap = against(curve, reference.accuracy)
        lines.append(f"  against {reference.label} seed {reference.seed}: above it in {above} of {both} rounds; "
                     f"{100 * gap:+.2f} points on average from round {SETTLED + 1}; its rounds "
                     f"{max(1, len(reference.accuracy) - LAST_ROUNDS + 1)}-{len(reference.accuracy)}: "
                     f"{100 * last_rounds_mean(reference.accuracy):.2f}%")
    elif reference is not None and reference is not record:
        lines.append(f"  against {reference.label} seed {reference.seed}: no curve kept (after round "
                     f"{reference.rounds} {100 * reference.last:.2f}%, best {100 * reference.best:.2f}%)")
    return lines


def describe_cell(records: Sequence[RunRecord]) -> str:
    """One cell over its recorded seeds: last and best, mean ± sample std in %, as the grid table gives them."""
    seeds, last, best = cell_text(records)
    return f"{records[0].setting} {records[0].label} over seeds {seeds}: after the last round {last}, best {best}"
