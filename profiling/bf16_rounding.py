"""What a bf16 global model loses each round: the same tiny Llama trained with AdamW at a fine-tuning learning rate,
once with bf16 weights (what travels, what the server holds) and once with fp32 ones, and the share of the model's
elements that a whole round left exactly unchanged, between the last two rounds' checkpoints.

The ``causal_lm`` trainer steps fp32 master copies, but a client starts each round from the global model, and the
server rounds each new global model to bf16 (8 significant bits): a weight whose change over the round is under half
its bf16 step (about 2^-9 of it) keeps its old value. Run from the repository root:

    python profiling/bf16_rounding.py [--lr 2e-5] [--rounds 4]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gpu_check import mpiexec  # the venv's mpiexec, else the system's

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """
name: bf16-rounding
seed: 0
rounds: {rounds}
clients: {{num_clients: 4, per_round: 2}}
data:
  dataset: text
  partition: iid
  kwargs: {{vocab_size: 512, seq_len: 64, test_fraction: 0.05, max_chars: 200000}}
model:
  name: transformers
  dtype: {dtype}
  transformers:
    architecture: llama
    config: {{vocab_size: 512, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,
             num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256,
             tie_word_embeddings: false}}
train: {{trainer: causal_lm, optimizer: adamw, lr: {lr}, batch_size: 4, local_steps: 3, max_grad_norm: 1.0}}
eval: {{every: {rounds}, batch_size: 16}}
checkpoint: {{every: 1, keep: {rounds}}}
output: {{progress: false}}
"""


def unchanged_share(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> float:
    """The share of all elements whose bits are the same in ``before`` and ``after`` (each element a row of its
    bytes: ``model_tensors``)."""
    same = sum(int((before[k] == after[k]).all(axis=1).sum()) for k in before)
    return same / sum(len(v) for v in before.values())


def model_tensors(path: Path) -> dict[str, np.ndarray]:
    """A checkpoint's exchanged tensors, each as one row of raw bytes per element (bf16 stays 2 bytes)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from mpifl.storage.hdf5 import load_tensors

    return {name: t.reshape(-1).contiguous().view(torch.uint8).reshape(-1, t.element_size()).numpy()
            for name, t in load_tensors(path).items()}


def run(work: Path, dtype: str, lr: float, rounds: int) -> tuple[float, float]:
    """One run; the share of elements its last round left unchanged, and its final held-out loss."""
    config = work / f"{dtype}.yaml"
    config.write_text(CONFIG.format(dtype=dtype, lr=lr, rounds=rounds))
    run_dir = work / dtype
    command = [mpiexec(Path(sys.executable).parent), "-n", "3", sys.executable, "-m", "mpifl", "run", str(config),
               "--run-dir", str(run_dir)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"bf16_rounding: the {dtype} run exited {done.returncode}:\n{done.stderr[-3000:]}")
    checkpoints = sorted((run_dir / "checkpoints").glob("ckpt-r*.h5"))
    share = unchanged_share(model_tensors(checkpoints[-2]), model_tensors(checkpoints[-1]))
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return share, last["eval"]["loss"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lr", type=float, default=2e-5, help="AdamW's learning rate (configs/llama3.1-8b-full.yaml's)")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    print(f"| model.dtype | elements unchanged by round {args.rounds} | held-out loss after it |\n|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bf16-rounding-") as work:
        for dtype in ("bfloat16", "float32"):
            share, loss = run(Path(work), dtype, args.lr, args.rounds)
            print(f"| {dtype} | {share:.1%} | {loss:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
