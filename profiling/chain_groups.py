"""The chain reduction with several groups per rank against point-to-point groups, side by side: the same runs,
interleaved, each figure the median over ``--repeats`` of the per-run medians of rounds 2..R.

A 4.35 M-parameter MLP (17.4 MB fp32), 8 of 16 clients a round, one local step each, 1 MiB chunks, on 2 client
ranks; the layouts:

- ``direct-2`` / ``chain-2``: 2 groups, one per rank (the chain passes once through the ranks);
- ``direct-8`` / ``chain-8``: 8 groups, 4 per rank (the chain's running sum goes back and forth 8 hops; each rank
  keeps its 4 group sums until they have passed).

For each: seconds per round, the return phase (update streams in, until the last is folded), the bytes the server
receives, and the client ranks' peak RSS; then chain/direct ratios. Every chain run must give the final model of
its direct run, bit for bit (checked). Run from the repository root, on a quiet machine:

    python profiling/chain_groups.py --repeats 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from combinations import digest  # every tensor of the final model (and kept per-client vectors: none here)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TASK = ["seed=3", "clients.num_clients=16", "clients.per_round=8", "data.dataset=digits", "model.name=mlp",
        "model.kwargs={hidden: [2048, 2048]}", "train.local_steps=1", "transport.chunk_mb=1", "eval.every=0",
        "transport.floor_probe_mb=0", "output.progress=false"]
LAYOUTS = {"direct-2": ["clients.groups=2"], "chain-2": ["clients.groups=2", "transport.reduce=chain"],
           "direct-8": ["clients.groups=8"], "chain-8": ["clients.groups=8", "transport.reduce=chain"]}


def run(run_dir: Path, overrides: list[str], rounds: int) -> None:
    """One run of the task on 3 ranks (server + 2 client ranks)."""
    subprocess.run([str(BIN / "mpiexec"), "-n", "3", str(BIN / "mpifl"), "run", str(ROOT / "configs/quickstart.yaml"),
                    "--run-dir", str(run_dir), f"rounds={rounds}", *TASK, *overrides],
                   check=True, capture_output=True, timeout=600)


def figures(run_dir: Path) -> dict[str, float]:
    """Medians over rounds 2..R of the round and its return phase; the server's bytes in; the client ranks' peak."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    return {"s/round": statistics.median(r["time"]["round"] for r in records),
            "return s": statistics.median(r["time"]["return"] for r in records),
            "server MB in": records[-1]["bytes_received"] / 1e6,
            "client peak MB": max(r["client_peak_rss_bytes"] for r in records) / 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    digests: dict[str, set[str]] = {name: set() for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, overrides in LAYOUTS.items():
                run_dir = Path(tmp) / f"{name}-r{repeat}"
                run(run_dir, overrides, args.rounds)
                runs[name].append(figures(run_dir))
                digests[name].add(digest(run_dir))
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    keys = list(next(iter(medians.values())))
    print(f"{'layout':<10}" + "".join(f"{key:>16}" for key in keys))
    for name, row in medians.items():
        print(f"{name:<10}" + "".join(f"{row[key]:>16.3f}" for key in keys))
    for groups in (2, 8):
        chain, direct = medians[f"chain-{groups}"], medians[f"direct-{groups}"]
        print(f"chain/direct, {groups} groups: " + ", ".join(f"{key} {chain[key] / direct[key]:.2f}x" for key in keys))
    bad = [g for g in (2, 8) if digests[f"chain-{g}"] != digests[f"direct-{g}"] or len(digests[f"chain-{g}"]) != 1]
    print("final models: " + ("the chain's bits are point-to-point's in every run" if not bad else
                              f"DIFFER with {bad} groups: {digests}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
