"""Out-of-core round time against the in-memory server and against the disk, in one run.

Model-only exchange of a blob model with 2 clients (3 ranks), ``rounds`` rounds each:
- the in-memory server (``server.state=memory``);
- the out-of-core server with ``checkpoint.keep=2`` (each round overwrites the checkpoint that
  publishing it prunes: its blocks and cached pages are reused) and with ``checkpoint.keep=1``
  (a new file every round);
and ``dd`` on the same file system: writing a new file of the model's size (with and without
fsync), overwriting it, and reading it back. Medians skip the first two rounds (no file to
recycle yet). The in-memory and keep=2 runs alternate ``--repeats`` times, so each ratio compares
runs minutes apart on a shared machine; the median ratio is printed last. Run from the repository root:

    python profiling/ooc_speed.py --model-mb 2000 [--rounds 8] [--repeats 3] [--dir runs/ooc-speed]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = """rounds: {rounds}
clients: {{num_clients: 2}}
model: {{name: blob, kwargs: {{size_mb: {mb}}}}}
train: {{trainer: none}}
eval: {{every: 0}}
output: {{progress: false, save_model: false}}
"""


def dd(args: list[str]) -> float:
    """GB/s that dd reports."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    value, unit = re.search(r"([\d.]+) ([GMk]?B)/s", out).groups()
    return float(value) * {"GB": 1, "MB": 1e-3, "kB": 1e-6, "B": 1e-9}[unit]


def disk(directory: Path, mb: int) -> dict[str, float]:
    target, count = directory / "dd.bin", max(1, mb // 16)
    rates = {"write new file, fsync": dd(["if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "conv=fsync"])}
    target.unlink()
    rates["write new file"] = dd(["if=/dev/zero", f"of={target}", "bs=16M", f"count={count}"])
    rates["overwrite"] = dd(["if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "conv=notrunc"])
    rates["read (cached)"] = dd([f"if={target}", "of=/dev/null", "bs=16M"])
    target.unlink()
    return rates


def run(bin_dir: str, config: Path, run_dir: Path, *overrides: str) -> tuple[float, int, dict]:
    shutil.rmtree(run_dir, ignore_errors=True)
    subprocess.run([f"{bin_dir}/mpiexec", "-n", "3", f"{bin_dir}/mpifl", "run", str(config), "--run-dir", str(run_dir),
                    *overrides], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = records[2:-1] or records[-1:]  # not the first two (nothing to recycle yet), nor the last (fsync)
    split = {k: statistics.median(r["time"][k] for r in steady) for k in ("dispatch", "return", "aggregate",
                                                                          "checkpoint")}
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return statistics.median(r["time"]["round"] for r in steady), records[-1]["server_peak_rss_bytes"], split


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-mb", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="in-memory and keep=2 runs, interleaved")
    p.add_argument("--dir", default=None, help="where runs and dd write (default: a temporary folder here)")
    p.add_argument("--bin", default=str(Path(sys.executable).parent))
    args = p.parse_args()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ooc-speed-", dir="."))
    work.mkdir(parents=True, exist_ok=True)
    config = work / "config.yaml"
    config.write_text(CONFIG.format(rounds=args.rounds, mb=args.model_mb))
    runs = {"in-memory server": ["server.state=memory"],
            "out-of-core, checkpoint.keep=2": ["server.state=disk", "checkpoint.keep=2"],
            "out-of-core, checkpoint.keep=1": ["server.state=disk", "checkpoint.keep=1"]}
    print(f"model {args.model_mb} MiB, 2 clients, median of rounds 3..{args.rounds - 1}; "
          f"{args.repeats} repeats, interleaved (keep=1 in the first only)")
    print("| repeat | server | s/round | ÷ in-memory | server peak RSS | split (dispatch / return / aggregate / "
          "checkpoint) |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for repeat in range(1, args.repeats + 1):
        memory = None
        for name, overrides in runs.items():
            if repeat > 1 and "keep=1" in name:
                continue
            seconds, peak, split = run(args.bin, config, work / "run", *overrides)
            memory = memory or seconds
            if "keep=2" in name:
                ratios.append(seconds / memory)
            print(f"| {repeat} | {name} | {seconds:.2f} | {seconds / memory:.2f}× | {peak / 2**20:.0f} MiB | "
                  + " / ".join(f"{v:.2f}" for v in split.values()) + " |", flush=True)
    print(f"out-of-core (keep=2) ÷ in-memory, median over repeats: {statistics.median(ratios):.2f}× "
          f"({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"dd on the same file system, {args.model_mb} MiB in 16 MiB blocks (GB/s): "
          + ", ".join(f"{k} {v:.2f}" for k, v in disk(work, args.model_mb).items()))
    shutil.rmtree(work, ignore_errors=True) if not args.dir else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
