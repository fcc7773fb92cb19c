"""Doorbells on against off (``transport.doorbells``), side by side: the same runs, interleaved, each figure the
median over ``--repeats`` of the per-run medians of rounds 2..R.

- ``quickstart``: the quick start (17 k parameters, 3 ranks), where a round is mostly messages waiting to be seen;
- ``cnn``: the cross-device task of profiling/peers with the LEAF CNN (1.69 M parameters, 20 clients a round on 2
  client ranks, one reduction group each), where a round is mostly training.

For each: seconds per round, the time split's dispatch and return, and the round's overhead (the round minus its
busiest rank's training); then on/off ratios. Run from the repository root, on a quiet machine:

    python profiling/doorbells.py --repeats 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def quickstart(run_dir: Path, doorbells: str, rounds: int) -> None:
    subprocess.run([str(BIN / "mpiexec"), "-n", "3", str(BIN / "mpifl"), "run", str(ROOT / "configs/quickstart.yaml"),
                    "--run-dir", str(run_dir), f"rounds={rounds}", "eval.every=0", "output.progress=false",
                    f"transport.doorbells={doorbells}"], check=True, capture_output=True)


def cnn(run_dir: Path, doorbells: str, rounds: int) -> None:
    subprocess.run([sys.executable, str(ROOT / "profiling/cross_device.py"), "--model", "leaf_cnn", "--samples", "20",
                    "--rounds", str(rounds), "--per-round", "20", "--ranks", "2", "--groups", "2",
                    "--placement", "per_round", "--group-by", "cost", "--data", "plugin", "--keep", str(run_dir),
                    "--doorbells", doorbells], check=True, capture_output=True)


def figures(run_dir: Path) -> dict[str, float]:
    """Medians over rounds 2.. of the round, its dispatch and return, and its overhead beyond the busiest rank."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    busiest = [max(w["train_seconds"] for w in r["ranks"].values()) for r in records]
    return {"round": statistics.median(r["time"]["round"] - r["time"]["eval"] for r in records),
            "dispatch": statistics.median(r["time"]["dispatch"] for r in records),
            "return": statistics.median(r["time"]["return"] for r in records),
            "overhead": statistics.median(r["time"]["round"] - r["time"]["eval"] - b
                                          for r, b in zip(records, busiest))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quickstart-rounds", type=int, default=30)
    p.add_argument("--cnn-rounds", type=int, default=20)
    args = p.parse_args()
    tasks = {"quickstart": (quickstart, args.quickstart_rounds), "cnn": (cnn, args.cnn_rounds)}
    seen: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="doorbells-") as work:
        for repeat in range(args.repeats):  # interleaved: each repeat runs every task both ways
            for name, (run, rounds) in tasks.items():
                for doorbells in ("false", "true"):
                    run_dir = Path(work) / f"{name}-{doorbells}-{repeat}"
                    run(run_dir, doorbells, rounds)
                    seen.setdefault((name, doorbells), []).append(figures(run_dir))
    print(f"medians over {args.repeats} interleaved repeats (each a run's median over rounds 2..), milliseconds:")
    print(f"  {'task':<11} {'doorbells':<9} {'round':>8} {'dispatch':>9} {'return':>8} {'overhead':>9}")
    for (name, doorbells), runs in seen.items():
        row = {k: 1000 * statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"  {name:<11} {doorbells:<9} {row['round']:8.2f} {row['dispatch']:9.2f} {row['return']:8.2f} "
              f"{row['overhead']:9.2f}")
    for name in tasks:
        on, off = ({k: statistics.median(r[k] for r in seen[(name, d)]) for k in ("round", "overhead")}
                   for d in ("true", "false"))
        print(f"  {name}: round {on['round'] / off['round']:.2f}x, overhead {on['overhead'] / off['overhead']:.2f}x "
              "with doorbells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
