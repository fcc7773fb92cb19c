"""A cross-device task: many small clients, a LEAF-style CNN, FedAvg; seconds per round and the
simulation overhead per logical client.

The data is FEMNIST-like and synthetic (nothing is downloaded): 28 x 28 images of 62 classes,
``--clients`` writers with lognormal sample counts (median ``--samples``). The model is the LEAF
FEMNIST CNN shape, two 5 x 5 convolutions (32, 64) and a 512-wide dense layer: 1.69 M parameters.

Overhead per logical client = (round time - the busiest rank's own training time) / that rank's
clients in the round: everything mpifl adds around training (receiving the model, resets,
folding, sending, the server's reduction), per client. Run from the repository root:

    python profiling/cross_device.py [--clients 1000 --per-round 20 --ranks 2 --rounds 6 --groups 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent


def leaf_cnn(num_classes: int = 62) -> nn.Module:
    """LEAF's FEMNIST CNN: conv 5x5 32, pool, conv 5x5 64, pool, dense 512, dense classes."""
    return nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, num_classes))


def femnist_like(clients: int = 1000, samples: int = 20, sigma: float = 0.5, seed: int = 0):
    """Synthetic FEMNIST-shaped data with each writer's own samples (a natural partition)."""
    rng = np.random.default_rng(seed)
    sizes = np.maximum(2, rng.lognormal(np.log(samples), sigma, clients).astype(int))
    total = int(sizes.sum())
    x = rng.random((total, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 62, total)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    writers = [np.arange(bounds[i], bounds[i + 1]) for i in range(clients)]
    test = slice(0, min(500, total))
    return (torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(x[test]), torch.from_numpy(y[test]), writers)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--samples", type=int, default=20, help="median samples per client")
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--ranks", type=int, default=2, help="client ranks")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--groups", type=int, default=2, help="clients.groups (0: every update travels)")
    p.add_argument("--bin", default=str(Path(sys.executable).parent))
    args = p.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="cross-device-"))
    config = run_dir / "config.yaml"
    config.write_text(f"""
name: cross-device
rounds: {args.rounds}
clients: {{num_clients: {args.clients}, per_round: {args.per_round}, groups: {args.groups}, placement: balanced}}
data: {{dataset: "cross_device:femnist_like", kwargs: {{clients: {args.clients}, samples: {args.samples}}},
        partition: natural}}
model: {{name: "cross_device:leaf_cnn"}}
train: {{optimizer: sgd, lr: 0.05, batch_size: 10, local_epochs: 1, device: cpu}}
eval: {{every: 0}}
output: {{progress: false, save_model: false}}
""")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [f"{args.bin}/mpiexec", "-n", str(args.ranks + 1), f"{args.bin}/mpifl", "run", str(config),
           "--run-dir", str(run_dir / "run")]
    subprocess.run(cmd, check=True, env=env, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    params = sum(t.numel() for t in leaf_cnn().parameters())
    overheads, rounds = [], []
    for r in records:
        busiest = max(r["ranks"].values(), key=lambda rank: rank["train_seconds"])
        overheads.append((r["time"]["round"] - busiest["train_seconds"]) / busiest["clients"])
        rounds.append(r["time"]["round"])
    print(f"{args.clients} clients, {args.per_round} per round, {args.ranks} client ranks, groups {args.groups}, "
          f"LEAF CNN {params / 1e6:.2f} M parameters; medians over rounds 2..{args.rounds}:")
    print(f"  seconds per round {statistics.median(rounds):.3f}; peak RSS: server "
          f"{max(r['server_peak_rss_bytes'] for r in records) / 2**20:.0f} MiB, largest client rank "
          f"{max(r['client_peak_rss_bytes'] for r in records) / 2**20:.0f} MiB")
    print(f"  overhead per logical client {1000 * statistics.median(overheads):.1f} ms "
          f"(round time minus the busiest rank's own training, per client on that rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
