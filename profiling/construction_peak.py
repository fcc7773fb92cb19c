"""Peak RSS of building a config's model, as a client rank builds it, against 1.15 x model + 600 MB.

Each way of building runs in a fresh process (peak RSS is per process):
  mpifl:  meta device -> one flat buffer -> seeded init into it (what every rank does)
  normal: transformers' from_config on CPU, then copied into the flat buffer (for comparison)

    python profiling/construction_peak.py configs/gpt2-large.yaml
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

MB = 1e6


def measure(config: str, way: str) -> dict:
    import torch

    from mpifl.config import load_config
    from mpifl.metrics import current_rss_bytes, peak_rss_bytes
    from mpifl.wire.flat import FlatModel

    torch.set_num_threads(1)
    cfg = load_config(config)
    if cfg.model.name == "transformers":
        import transformers  # noqa: F401 - imports count in the baseline, not in construction
    baseline = current_rss_bytes()
    start = time.perf_counter()
    if way == "mpifl":
        from mpifl.learning.models import build_flat_model
        flat = build_flat_model(cfg.model, cfg.seed)
    else:
        from mpifl.learning import hf
        from mpifl.wire.flat import DTYPES
        model = __import__("transformers").AutoModelForCausalLM.from_config(hf.load_config(cfg.model),
                                                                            dtype=DTYPES[cfg.model.dtype])
        flat = FlatModel(model)
    return {"way": way, "model_bytes": flat.spec.total_bytes + flat.frozen_spec.total_bytes,
            "baseline_rss": baseline, "peak_rss": peak_rss_bytes(), "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--way", choices=("mpifl", "normal"))
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(args.config, args.way)))
        return
    for way in ("mpifl", "normal"):
        out = subprocess.run([sys.executable, __file__, args.config, "--way", way], capture_output=True, text=True,
                             check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        bound = 1.15 * r["model_bytes"] + 600 * MB
        print(f"{way:>6}: model {r['model_bytes'] / MB:,.0f} MB; RSS after imports {r['baseline_rss'] / MB:,.0f} MB; "
              f"peak {r['peak_rss'] / MB:,.0f} MB = {r['peak_rss'] / r['model_bytes']:.2f} x model "
              f"(bound 1.15 x model + 600 MB = {bound / MB:,.0f} MB: "
              f"{'within' if r['peak_rss'] <= bound else 'OVER'}); "
              f"built in {r['seconds']:.1f} s")


if __name__ == "__main__":
    main()
