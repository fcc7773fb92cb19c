"""Check the scale model (mpifl.planning.scale) against runs on this machine, then print its 70B table.

1. Calibrate: run ``mpifl bench exchange`` with 2 clients (3 ranks) and derive this machine's
   rates from mpifl's own split: the link from the dispatch (N x S sent), and the return's cost
   per byte (receive and fold, which share the server's core on shared memory).
2. Predict the round for 4, 8 and 16 clients (5, 9, 17 ranks, oversubscribed on 2 cores) and
   run them; print predicted against measured time, their growth in N, and the server's peak
   RSS against ``mpifl plan``'s memory formula.
3. Print the model's table for Llama-3.1-70B in bf16 on Polaris: 8, 32 and 100 clients,
   point-to-point against trees, in memory against out of core.

Run from the repository root (a few minutes; nothing else should run meanwhile):

    python profiling/scale_check.py [--model-mb 64] [--rounds 5] [--rates-out rates.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from mpifl.cli.bench import exchange_config
from mpifl.cli.plan import estimate
from mpifl.planning.scale import LUSTRE, POLARIS, Rates, growth, round_estimate

LLAMA_70B_BF16 = 70.6e9 * 2  # bytes: 70.6 billion parameters in bf16


def bench(bin_dir: str, ranks: int, model_mb: float, rounds: int, work: Path) -> dict:
    out = work / f"bench-{ranks}.json"
    subprocess.run([f"{bin_dir}/mpiexec", "-n", str(ranks), f"{bin_dir}/mpifl", "bench", "exchange",
                    "--model-mb", str(model_mb), "--rounds", str(rounds), "--pickle-rounds", "0", "--json", str(out)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def calibrate(result: dict) -> tuple[Rates, float]:
    """This machine's rates from a 2-client run, and its receive rate (bytes/s into the server): link =
    N x S / dispatch; receive = N x S / return; fold = N x E / aggregate (they add up on shared memory)."""
    clients, size = result["clients"], result["model_bytes"]
    split = result["time_split"]
    link = clients * size / split["dispatch"]
    gather = split["return"] + split["aggregate"]
    fold = clients * size / 4 / split["aggregate"]
    receive = clients * size / split["return"]
    return Rates(name="this machine (calibrated at 2 clients)", link=link, fold=fold, fold_narrow=fold,
                 disk_read=0, disk_write=0, node_memory=0, receive_uses_server_core=True,
                 sources=(f"mpifl bench exchange, {size / 2**20:.0f} MiB, {clients} clients: "
                          f"dispatch {split['dispatch']:.3f} s, "
                          f"return {split['return']:.3f} s, aggregate {split['aggregate']:.3f} s "
                          f"(return + fold {gather:.3f} s)",)), receive


def predicted(rates: Rates, receive: float, size: float, clients: int) -> float:
    """The model with separate send and receive rates (on shared memory the receiver copies)."""
    base = round_estimate(size, 4, clients, rates, chunk_bytes=16 * 2**20)
    send = base.dispatch
    gather = clients * size / receive + clients * size / 4 / rates.fold + 16 * 2**20 / rates.link
    return send + gather


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-mb", type=float, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, nargs="+", default=[3, 5, 9, 17])
    p.add_argument("--rates-out", help="write the calibrated rates as JSON (for mpifl plan --time --rates FILE)")
    p.add_argument("--bin", default=str(Path(sys.executable).parent))
    p.add_argument("--table-only", action="store_true", help="only the 70B table (no runs)")
    args = p.parse_args()
    if args.table_only:
        print_table()
        return 0
    work = Path(tempfile.mkdtemp(prefix="scale-check-"))
    runs = {r - 1: bench(args.bin, r, args.model_mb, args.rounds, work) for r in args.ranks}
    first = runs[min(runs)]
    rates, receive = calibrate(first)
    size = first["model_bytes"]
    if args.rates_out:
        fields = {k: v for k, v in rates.__dict__.items() if k != "name"}
        Path(args.rates_out).write_text(json.dumps(fields, indent=2))
    print(f"calibrated at {min(runs)} clients, {size / 2**20:.0f} MiB fp32: link {rates.link / 1e9:.2f} GB/s out, "
          f"{receive / 1e9:.2f} GB/s in, fold {rates.fold / 1e9:.2f} G elements/s (receive and fold add up)")
    print("| clients (ranks) | predicted s/round | measured s/round (min-max) | measured ÷ predicted | "
          "predicted growth | measured growth | server peak RSS | plan's server formula |")
    print("|---|---|---|---|---|---|---|---|")
    guess = {n: predicted(rates, receive, size, n) for n in runs}
    seen = {n: r["seconds_per_round"]["mpifl"] for n, r in runs.items()}
    grow_guess, grow_seen = growth(guess), growth(seen)
    for n, r in runs.items():
        cfg = exchange_config(argparse.Namespace(rounds=args.rounds, model_mb=args.model_mb, dtype="fp32",
                                                 strategy="fedavg", wire_dtype=None, chunk_mb=16.0, inflight=4,
                                                 pool_mb=None, dispatch_fanout=0, reduce="direct"), n + 1)
        _, plan = estimate(cfg, n + 1, n + 1, False)
        low, high = r["spread"]["mpifl"]
        print(f"| {n} ({n + 1}) | {guess[n]:.3f} | {seen[n]:.3f} ({low:.3f}-{high:.3f}) | {seen[n] / guess[n]:.2f} | "
              f"{grow_guess[n]:.2f} | {grow_seen[n]:.2f} | {r['peak_rss_bytes']['server'] / 2**20:.0f} MiB | "
              f"{plan.server_bytes / 2**20:.0f} MiB |")
    print()
    print_table()
    return 0


def print_table() -> None:
    print(f"Llama-3.1-70B in bf16 (S = {LLAMA_70B_BF16 / 1e9:.0f} GB), one client per node, model-only exchange, "
          "predicted seconds per round on Polaris nodes")
    print("| clients | point-to-point, in memory | point-to-point, out of core (local SSD) | out of core (Lustre) "
          "| tree + chain, in memory | tree + chain, out of core (local SSD) | server receives, p2p / tree + chain |")
    print("|---|---|---|---|---|---|---|")
    for n in (8, 32, 100):
        cells = [round_estimate(LLAMA_70B_BF16, 2, n, POLARIS),
                 round_estimate(LLAMA_70B_BF16, 2, n, POLARIS, out_of_core=True),
                 round_estimate(LLAMA_70B_BF16, 2, n, LUSTRE, out_of_core=True),
                 round_estimate(LLAMA_70B_BF16, 2, n, POLARIS, tree=True),
                 round_estimate(LLAMA_70B_BF16, 2, n, POLARIS, tree=True, out_of_core=True)]
        print(f"| {n} | " + " | ".join(f"{e.total:,.0f}" for e in cells)
              + f" | {cells[0].server_in / 1e12:.2f} TB / {cells[3].server_in / 1e12:.2f} TB |")


if __name__ == "__main__":
    sys.exit(main())
