"""The 70B preset's memory, planned against measured, at its real tensor shapes on one machine.

The preset is shortened to what a workstation holds: one decoder layer instead of 80, with the real 128,256 x 8,192
embedding and head (2.96 B parameters, 5.5 GiB in bf16), 2 clients on 2 client ranks, a model-only exchange through
the out-of-core server, as the preset runs. Whatever the server holds scales with the largest tensor, the window and
the pool, not with the layer count, so its figure is the 80-layer figure too; the clients' grows with the model.

    python profiling/llm_preset_memory.py                  # 3 rounds, about 4 minutes and 13 GiB here
    python profiling/llm_preset_memory.py server.window_mb=128 transport.pool_mb=128

It prints each role's peak RSS (VmHWM, as each rank reports it in metrics.jsonl) beside what ``mpifl plan`` says for
the same config and rank count, and exits 1 where one is more than 10% off.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from mpifl.cli.plan import estimate
from mpifl.config import load_config

ROOT = Path(__file__).resolve().parent.parent
SHORTENED = ["model.transformers.config.num_hidden_layers=1", "clients.num_clients=2"]
TOLERANCE = 0.10


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="more config overrides (key=value)")
    p.add_argument("--config", default=str(ROOT / "configs" / "llama3.1-70b.yaml"))
    p.add_argument("--rounds", type=int, default=3, help="rounds (the server's peak comes once the pool exists)")
    p.add_argument("--bin", default=str(Path(sys.executable).parent))
    args = p.parse_args()
    overrides = [*SHORTENED, f"rounds={args.rounds}", *args.overrides]
    nranks = 3
    _, plan = estimate(load_config(args.config, overrides), nranks=nranks, ranks_per_node=nranks, server_alone=False)
    with tempfile.TemporaryDirectory(prefix="preset-memory-") as run_dir:
        job = subprocess.run([f"{args.bin}/mpiexec", "-n", str(nranks), f"{args.bin}/mpifl", "run", args.config,
                              *overrides, "--run-dir", run_dir], cwd=ROOT, capture_output=True, text=True)
        if job.returncode:
            print(job.stderr[-3000:], file=sys.stderr)
            return job.returncode
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    measured = {"server": max(r["server_peak_rss_bytes"] for r in records),
                "client": max(r["client_peak_rss_bytes"] for r in records)}
    planned = {"server": plan.server_bytes, "client": plan.client_bytes}
    print(f"{Path(args.config).name} {' '.join(overrides)}, {nranks} ranks")
    print("| rank | planned (GiB) | measured peak RSS (GiB) | measured / planned |")
    print("|---|---|---|---|")
    worst = 0.0
    for role, label in (("server", "0 (server)"), ("client", "1-2 (clients, the fuller)")):
        ratio = measured[role] / planned[role]
        worst = max(worst, abs(ratio - 1))
        print(f"| {label} | {planned[role] / 2**30:.3f} | {measured[role] / 2**30:.3f} | {ratio:.3f} |")
    per_round = ", ".join(f"{r['server_peak_rss_bytes'] / 2**30:.3f}" for r in records)
    print(f"server peak by round (GiB): {per_round}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
