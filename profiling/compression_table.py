"""Bytes per round against accuracy and encoding time for fp32, bf16, int8, 4-bit and top-k updates.

Every run is ``configs/quickstart.yaml`` (digits, 8 clients, 4 per round, 15 rounds) with clients
sending their delta (``strategy.update=delta``): as fp32, as bf16 (``strategy.wire_dtype``), and
quantized to int8 or 4 bits with one fp32 scale per 256 values (``compression.method``), and
sparsified to the top 10% or 1% of each chunk with error feedback (``compression.method=topk``).
Run from the repository root (about two minutes):

    python profiling/compression_table.py
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
RUNS = {"fp32": [], "bf16": ["strategy.wire_dtype=bfloat16"], "int8": ["compression.method=int8"],
        "4-bit": ["compression.method=int4"],
        "top-k 10%": ["compression.method=topk", "compression.fraction=0.1"],
        "top-k 1%": ["compression.method=topk", "compression.fraction=0.01"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--bin", default=str(Path(sys.executable).parent))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="compression-"))
    rows = []
    for name, overrides in RUNS.items():
        run_dir = work / name
        subprocess.run([f"{args.bin}/mpiexec", "-n", "3", f"{args.bin}/mpifl", "run",
                        str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(run_dir), "output.progress=false",
                        "strategy.update=delta", f"rounds={args.rounds}", f"eval.every={args.rounds}", *overrides],
                       check=True, stderr=subprocess.DEVNULL)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows.append((name, records[-1]["bytes_received"], records[-1]["eval"]["accuracy"]))
    fp32, speed = rows[0][1], codec_speed()
    print(f"| update | bytes received per round | of fp32 | held-out accuracy after {args.rounds} rounds | "
          "encode / decode 4 M values (one core) |")
    print("|---|---|---|---|---|")
    for name, nbytes, accuracy in rows:
        print(f"| {name} | {nbytes:,} | {nbytes / fp32:.3f} | {accuracy:.4f} | {speed.get(name, '-')} |")
    return 0


def codec_speed(numel: int = 4 << 20, repeats: int = 5) -> dict[str, str]:
    """Median milliseconds to encode and to decode one 16 MiB fp32 chunk, one thread."""
    import time

    import numpy as np
    import torch

    from mpifl.wire.codecs import BlockQuantizer, TopK

    torch.set_num_threads(1)
    x, uniform, out = torch.randn(numel), torch.rand(numel), {}
    codecs = {"int8": BlockQuantizer(8, 256), "4-bit": BlockQuantizer(4, 256), "top-k 10%": TopK(0.1),
              "top-k 1%": TopK(0.01)}
    for name, codec in codecs.items():
        buf, scratch, enc, dec = np.zeros(codec.payload_bytes(numel), np.uint8), torch.empty(numel), [], []
        for _ in range(repeats):
            t = time.perf_counter()
            codec.encode(x, buf, uniform if codec.stochastic else None)
            enc.append(time.perf_counter() - t)
            t = time.perf_counter()
            codec.decode(buf, numel, scratch)
            dec.append(time.perf_counter() - t)
        out[name] = f"{1000 * statistics.median(enc):.0f} / {1000 * statistics.median(dec):.0f} ms"
    wide = torch.empty(numel, dtype=torch.bfloat16)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        wide.copy_(x)
        x.copy_(wide)
        times.append(time.perf_counter() - t)
    out["bf16"] = f"{1000 * statistics.median(times):.0f} ms both ways"
    return out


if __name__ == "__main__":
    sys.exit(main())
