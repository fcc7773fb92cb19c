"""What a narrower wire dtype costs: the quick start with fp32, bf16 and fp16 client updates.

For each variant: the error of one round's global update against fp32
(||model_1 - model_1(fp32)|| / ||model_1(fp32) - model_0||), the final held-out accuracy after
the full run, and the bytes the server received per round.

    python profiling/wire_dtype_loss.py [OUT_DIR] [--mpiexec PATH]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mpifl.config import load_config
from mpifl.learning.datasets import load_dataset
from mpifl.learning.models import build_model
from mpifl.storage.hdf5 import load_tensors
from mpifl.wire.flat import FlatModel

VARIANTS = {"fp32 weights": ("weights", "null"), "bf16 weights": ("weights", "bfloat16"),
            "bf16 delta": ("delta", "bfloat16"), "fp16 delta": ("delta", "float16")}
CONFIG = "configs/quickstart.yaml"


def run(mpiexec: str, run_dir: Path, update: str, wire: str, *extra: str) -> list[dict]:
    subprocess.run([mpiexec, "-n", "3", sys.executable, "-m", "mpifl", "run", CONFIG, f"strategy.update={update}",
                    f"strategy.wire_dtype={wire}", "output.progress=false", *extra, "--run-dir", str(run_dir)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def distance(a: dict, b: dict) -> float:
    return float(sum(((a[k].float() - b[k].float()) ** 2).sum() for k in a).sqrt())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="runs/wire-dtype")
    parser.add_argument("--mpiexec", default="mpiexec")
    args = parser.parse_args()
    out = Path(args.out)
    cfg = load_config(CONFIG)
    data = load_dataset(cfg.data)
    initial = dict(FlatModel(build_model(cfg.model, cfg.seed, data.input_shape, data.num_classes)).tensors())
    one_round, full = {}, {}
    for name, (update, wire) in VARIANTS.items():
        slug = name.replace(" ", "-")
        run(args.mpiexec, out / f"{slug}-1round", update, wire, "rounds=1")
        one_round[name] = load_tensors(out / f"{slug}-1round" / "model.h5")
        full[name] = run(args.mpiexec, out / slug, update, wire)
    base = one_round["fp32 weights"]
    step = distance(base, initial)
    print("| client update | bytes received / round | one-round update error vs fp32 | final accuracy |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        error = distance(one_round[name], base) / step
        last = full[name][-1]
        print(f"| {name} | {last['bytes_received']:,} | {error:.2e} | {last['eval']['accuracy']:.4f} |")


if __name__ == "__main__":
    main()
