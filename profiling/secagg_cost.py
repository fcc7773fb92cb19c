"""What simulated secure aggregation costs on the quick start: time, bytes and quantization error.

Three runs of ``configs/quickstart.yaml`` (digits, 8 clients, 4 per round, 15 rounds): plain fp32
FedAvg; fixed point without masks (``secagg.masking=false``); and masked fixed point. Reported:
the slowest client's training and masking time per round (medians), the largest difference of
the final model from the plain run, held-out accuracy, and bytes. Run from the repository root:

    python profiling/secagg_cost.py [--fraction-bits 16]
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fraction-bits", type=int, default=16)
    p.add_argument("--bin", default=str(Path(sys.executable).parent))
    args = p.parse_args()
    from mpifl.storage.hdf5 import load_tensors

    work = Path(tempfile.mkdtemp(prefix="secagg-cost-"))
    runs = {"fp32 FedAvg": [], "fixed point, no masks": ["secagg.enabled=true", "secagg.masking=false"],
            "secure aggregation": ["secagg.enabled=true"]}
    rows, plain = [], None
    for name, overrides in runs.items():
        run_dir = work / name.replace(" ", "_").replace(",", "")
        subprocess.run([f"{args.bin}/mpiexec", "-n", "3", f"{args.bin}/mpifl", "run",
                        str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(run_dir), "output.progress=false",
                        f"secagg.fraction_bits={args.fraction_bits}", *overrides],
                       check=True, stderr=subprocess.DEVNULL)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        model = load_tensors(run_dir / "model.h5")
        plain = plain or model
        diff = max(float((model[k] - plain[k]).abs().max()) for k in model)
        masking = statistics.median(r["secagg"]["mask_seconds"] for r in records) if "secagg" in records[0] else 0.0
        training = statistics.median(r["client_train_seconds"] for r in records)
        rows.append((name, training, masking, diff, records[-1]["eval"]["accuracy"], records[-1]["bytes_received"]))
    print("| run | slowest client's training (median) | its masking (median) | max abs(model - fp32 model) | "
          "accuracy | bytes received per round |")
    print("|---|---|---|---|---|---|")
    for name, training, masking, diff, accuracy, nbytes in rows:
        print(f"| {name} | {training * 1000:.1f} ms | {masking * 1000:.1f} ms | {diff:.2e} | {accuracy:.4f} | "
              f"{nbytes:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
