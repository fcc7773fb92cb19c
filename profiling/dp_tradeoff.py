"""Accuracy against epsilon for DP-FedAvg on the shipped digits data: one federated run per noise
multiplier, plus a run without DP, then a table and a plot.

The task: 100 logical clients (an IID split of the 1,437 training digits), each taking part in a
round with probability 0.2 (Poisson sampling), 30 rounds, the quick start's MLP, clipped deltas (C = 1.0)
summed, noised and divided by 20, FedAvg's server step. Epsilon is at delta = 1e-5 (RDP accountant,
add-or-remove adjacency). Run from the repository root (about a minute):

    python profiling/dp_tradeoff.py [--out docs/img/dp-tradeoff.png]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = """
name: dp-tradeoff
seed: 0
rounds: {rounds}
clients: {{num_clients: 100, per_round: 20}}
data: {{dataset: digits, partition: iid}}
model: {{name: mlp, kwargs: {{hidden: [128, 64]}}}}
train: {{optimizer: sgd, lr: 0.1, momentum: 0.9, local_epochs: 2, batch_size: 8}}
strategy: {{update: delta, weighting: equal}}
eval: {{every: {rounds}}}
output: {{progress: false, save_model: false}}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.4, 0.7, 1.0, 2.0, 4.0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--out", default=None, help="write the plot here (needs matplotlib)")
    p.add_argument("--bin", default=str(Path(sys.executable).parent))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dp-tradeoff-"))
    config = work / "config.yaml"
    config.write_text(CONFIG.format(rounds=args.rounds))
    rows = []
    for z in [None, *args.noise]:
        overrides = [] if z is None else ["privacy.mode=central", "privacy.sampling=poisson",
                                          f"privacy.clip={args.clip}", f"privacy.noise_multiplier={z}"]
        run_dir = work / ("plain" if z is None else f"z{z}")
        subprocess.run([f"{args.bin}/mpiexec", "-n", "3", f"{args.bin}/mpifl", "run", str(config), "--run-dir",
                        str(run_dir), *overrides], check=True, stderr=subprocess.DEVNULL)
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        eps = last["privacy"]["epsilon"] if "privacy" in last else None
        rows.append((z, eps, last["eval"]["accuracy"]))
    print(f"| noise multiplier z | epsilon after {args.rounds} rounds (delta 1e-5) | held-out accuracy |")
    print("|---|---|---|")
    for z, eps, acc in rows:
        label = "no DP" if z is None else f"{z:g}" + (" (clipping only)" if z == 0 else "")
        print(f"| {label} | {'-' if eps is None else ('inf' if eps == float('inf') else f'{eps:.2f}')} | {acc:.3f} |")
    if args.out:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        private = [(e, a) for z, e, a in rows if z is not None and e not in (None, float("inf"))]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.plot([e for e, _ in private], [a for _, a in private], marker="o", label=f"DP-FedAvg (C = {args.clip:g})")
        for z, e, a in rows:
            if z is not None and e not in (None, float("inf")):
                ax.annotate(f"z={z:g}", (e, a), textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.axhline(rows[0][2], color="gray", linestyle="--", label="no DP")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks([t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500) if t <= 2 * max(e for e, _ in private)],
                      labels=None)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("epsilon at delta = 1e-5 (log scale)")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(f"Digits, 100 clients, each in a round with q = 0.2, {args.rounds} rounds")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
