"""The robust strategies against FedAvg, side by side: their round-time ratio.

Runs ``mpifl bench exchange`` (model-only, one client rank per participant) for FedAvg and each
robust strategy (the median, the trimmed mean, Krum, Multi-Krum, Bulyan, the geometric median), one job
after another, ``--repeats`` times interleaved, so the
three strategies see the same machine. Each job also times the raw-MPI floor, so a strategy's
"x floor" is normalised by a floor measured minutes, not hours, apart. Prints, per repeat,
each strategy's median round and its ratio to that repeat's FedAvg round; then the median ratio
over repeats. Run from the repository root:

    python profiling/robust_speed.py [--model-mb 500] [--clients 8] [--rounds 5] [--repeats 3] [--strategies ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STRATEGIES = ("fedavg", "median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geometric_median")


def bench(bin_dir: str, strategy: str, args: argparse.Namespace, out: Path) -> dict:
    subprocess.run([f"{bin_dir}/mpiexec", "-n", str(args.clients + 1), f"{bin_dir}/mpifl", "bench", "exchange",
                    "--model-mb", str(args.model_mb), "--rounds", str(args.rounds), "--pickle-rounds", "0",
                    "--strategy", strategy, "--json", str(out)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mb", type=float, default=500)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES[1:]), choices=STRATEGIES[1:],
                        help="the robust strategies timed beside FedAvg")
    args = parser.parse_args()
    strategies = ("fedavg", *args.strategies)
    bin_dir = str(Path(sys.executable).parent)
    ratios: dict[str, list[float]] = {s: [] for s in strategies}
    print(f"{args.model_mb:g} MiB fp32, {args.clients} participants (one per client rank), "
          f"median of {args.rounds} rounds per job")
    print(f"{'repeat':<7} {'strategy':<17} {'s/round':>8} {'x floor':>8} {'x fedavg':>9} {'aggregate s':>12} "
          f"{'server RSS MiB':>15}")
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(1, args.repeats + 1):
            results = {s: bench(bin_dir, s, args, Path(tmp) / f"{s}.json") for s in strategies}
            base = results["fedavg"]["seconds_per_round"]["mpifl"]
            for s, r in results.items():
                secs = r["seconds_per_round"]["mpifl"]
                ratios[s].append(secs / base)
                print(f"{repeat:<7} {s:<17} {secs:>8.3f} {r['ratio_to_floor']['mpifl']:>8.2f} {secs / base:>9.2f} "
                      f"{r['time_split']['aggregate']:>12.3f} {r['peak_rss_bytes']['server'] / 2**20:>15.0f}")
    print("median ratio to the FedAvg round over repeats: "
          + ", ".join(f"{s} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for s, v in ratios.items()
                      if s != "fedavg"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
