"""A cross-device task: many small clients, a LEAF-style CNN, FedAvg; seconds per round and the
simulation overhead per logical client.

The data is FEMNIST-like and synthetic (nothing is downloaded): 28 x 28 images of 62 classes,
``--clients`` writers with lognormal sample counts (median ``--samples``). The model is the LEAF
FEMNIST CNN shape, two 5 x 5 convolutions (32, 64) and a 512-wide dense layer: 1.69 M parameters.

Overhead per logical client = (round time - the busiest rank's own training time) / that rank's
clients in the round: everything mpifl adds around training (receiving the model, resets,
folding, sending, the server's reduction), per client. Run from the repository root:

    python profiling/cross_device.py [--clients 1000 --per-round 20 --ranks 2 --rounds 6 --groups 2]

Seconds per round exclude the held-out evaluation (``--eval-every``; by default only after the last
round). ``profiling/peers/compare.sh`` runs the same task in Flower and pfl.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
import task  # noqa: E402  (profiling/peers/task.py: the data and models shared with Flower and pfl)
from task import big_mlp, leaf_cnn  # noqa: E402,F401  (model plugins: "cross_device:leaf_cnn")


def femnist_like(clients: int = 1000, samples: int = 20, sigma: float = 0.5, noise: float = 1.0, seed: int = 0):
    """Synthetic FEMNIST-shaped data with each writer's own samples (a natural partition); learnable
    (a fixed random template per class plus Gaussian noise), identical to what the peer comparison in
    ``profiling/peers`` gives Flower and pfl."""
    import torch  # here, not at the top: the launcher's own RSS stays small (compare.sh sums the tree)
    x, y, x_test, y_test, writers = task.femnist_data(clients, samples, sigma, noise, seed=seed)
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(x_test), torch.from_numpy(y_test), writers


def write_parquet(folder: Path, clients: int, samples: int) -> dict:
    """The same data as :func:`femnist_like`, as Parquet tables with a client column (``data.dataset:
    table``): each client rank then reads only its own writers' rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    x, y, x_test, y_test, writers = task.femnist_data(clients, samples, 0.5, 1.0, seed=0)
    client = np.repeat(np.arange(clients), [len(w) for w in writers])
    for name, xs, ys, ids in (("train", x, y, client), ("test", x_test, y_test, np.zeros(len(y_test), int))):
        pixels = pa.FixedSizeListArray.from_arrays(pa.array(xs.reshape(-1)), 784)
        pq.write_table(pa.table({"client_id": ids, "label": ys, "pixels": pixels}), folder / f"{name}.parquet",
                       row_group_size=4096)
    return {"path": str(folder / "train.parquet"), "test_path": str(folder / "test.parquet"), "shape": [1, 28, 28]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--samples", type=int, default=20, help="median samples per client")
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--ranks", type=int, default=2, help="client ranks")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--groups", type=int, default=2, help="clients.groups (0: every update travels)")
    p.add_argument("--group-by", default="id", choices=("id", "cost"),
                   help="clients.group_by (cost: each round's groups of near-equal work; needs --placement "
                   "per_round, and so --data plugin)")
    p.add_argument("--placement", default="balanced", choices=("round_robin", "balanced", "per_round"),
                   help="clients.placement")
    p.add_argument("--model", default="leaf_cnn", choices=("leaf_cnn", "big_mlp"),
                   help="big_mlp: the communication-heavy 784-8192-2048-62 MLP (93 MB fp32)")
    p.add_argument("--memory-format", default="contiguous", choices=("contiguous", "channels_last"),
                   help="model.memory_format (channels_last: NHWC activations, faster CNN training on a CPU)")
    p.add_argument("--nhwc-pooling", default="true", choices=("true", "false"),
                   help="model.nhwc_pooling (false: PyTorch's own NCHW max-pooling kernel, as other frameworks run it)")
    p.add_argument("--step-in-backward", default="false", choices=("true", "false"),
                   help="train.step_in_backward (true: each parameter steps inside backward; false, the default: one "
                   "optimizer step after backward)")
    p.add_argument("--reuse-freed-memory", default="true", choices=("true", "false"),
                   help="train.reuse_freed_memory (false: client ranks hand freed memory back to the kernel, as a "
                   "plain process does, and page-fault it in again at the next step)")
    p.add_argument("--doorbells", default="true", choices=("true", "false"),
                   help="transport.doorbells (false: a waiting rank sees a message at its next poll, up to 2 ms "
                   "later, instead of being woken)")
    p.add_argument("--strategy", default="fedavg", choices=("fedavg", "scaffold"),
                   help="strategy.name (scaffold: each client's c_i kept on its home rank; with --placement "
                        "per_round, lent each round to the rank that trains the client)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="train.device")
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out accuracy every K rounds (0: only after the last round)")
    p.add_argument("--data", default="table", choices=("table", "plugin"),
                   help="table: Parquet files, each rank reads only its clients (the default); plugin: "
                   "rank 0 builds the whole set in memory and shares it")
    p.add_argument("--batched-clients", type=int, default=0,
                   help="train.batched_clients (K clients of a rank trained at once as lanes of one batched model; "
                   "0: one at a time)")
    p.add_argument("--seed", type=int, default=0, help="the run's seed (client sampling, model initialisation, "
                   "minibatch order); the data stay those of seed 0")
    p.add_argument("--json", action="store_true", help="also print 'RESULT {json}' (seconds per round "
                   "without evaluation, peak RSS, final accuracy) for profiling/peers/compare.sh")
    p.add_argument("--bin", default=str(Path(sys.executable).parent))
    p.add_argument("--keep", type=Path, help="the mpifl run directory (default: inside a temporary folder)")
    args = p.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="cross-device-"))
    config = run_dir / "config.yaml"
    if args.data == "table":
        data = json.dumps({"dataset": "table", "kwargs": write_parquet(run_dir, args.clients, args.samples),
                           "partition": "natural"})
    else:
        data = (f'{{dataset: "cross_device:femnist_like", '
                f'kwargs: {{clients: {args.clients}, samples: {args.samples}}}, partition: natural}}')
    config.write_text(f"""
name: cross-device
seed: {args.seed}
rounds: {args.rounds}
clients: {{num_clients: {args.clients}, per_round: {args.per_round}, groups: {args.groups},
          placement: {args.placement}, group_by: {args.group_by}}}
data: {data}
model: {{name: "cross_device:{args.model}", memory_format: {args.memory_format}, nhwc_pooling: {args.nhwc_pooling}}}
train: {{optimizer: sgd, lr: 0.05, batch_size: 10, local_epochs: 1, device: {args.device},
        step_in_backward: {args.step_in_backward}, reuse_freed_memory: {args.reuse_freed_memory},
        batched_clients: {args.batched_clients}}}
{"strategy: {name: scaffold, update: delta}" if args.strategy == "scaffold" else ""}
eval: {{every: {args.eval_every or args.rounds}}}
transport: {{doorbells: {args.doorbells}}}
output: {{progress: false, save_model: false}}
""")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    mpifl_run = args.keep or run_dir / "run"
    cmd = [f"{args.bin}/mpiexec", "-n", str(args.ranks + 1), f"{args.bin}/mpifl", "run", str(config),
           "--run-dir", str(mpifl_run)]
    done = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"the mpifl run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (mpifl_run / "metrics.jsonl").read_text().splitlines()]
    round_seconds = [r["time"]["round"] - r["time"]["eval"] for r in records]  # evaluation excluded
    accuracy = [r["eval"]["accuracy"] for r in records if "eval" in r][-1]
    records = records[1:]
    params = sum(t.numel() for t in task.build_model("cnn" if args.model == "leaf_cnn" else "mlp100mb").parameters())
    overheads, rounds = [], []
    for r in records:
        busiest = max(r["ranks"].values(), key=lambda rank: rank["train_seconds"])
        overheads.append((r["time"]["round"] - busiest["train_seconds"]) / busiest["clients"])
        rounds.append(r["time"]["round"] - r["time"]["eval"])
    print(f"{args.clients} clients, {args.per_round} per round, {args.ranks} client ranks, groups {args.groups}, "
          f"placement {args.placement}, group_by {args.group_by}, memory format {args.memory_format}, "
          f"nhwc_pooling {args.nhwc_pooling}, step_in_backward {args.step_in_backward}, "
          f"reuse_freed_memory {args.reuse_freed_memory}, doorbells {args.doorbells}, "
          f"data {args.data}, {args.model} {params / 1e6:.2f} M parameters; medians over rounds 2..{args.rounds}:")
    print(f"  seconds per round {statistics.median(rounds):.3f}; peak RSS: server "
          f"{max(r['server_peak_rss_bytes'] for r in records) / 2**20:.0f} MiB, largest client rank "
          f"{max(r['client_peak_rss_bytes'] for r in records) / 2**20:.0f} MiB")
    spread = statistics.median(max(w["train_seconds"] for w in r["ranks"].values()) /
                               statistics.mean(w["train_seconds"] for w in r["ranks"].values()) for r in records)
    print(f"  busiest rank's training over the ranks' mean: {spread:.2f} (1.00: the ranks finish together)")
    print(f"  overhead per logical client {1000 * statistics.median(overheads):.1f} ms "
          f"(round time minus the busiest rank's own training, per client on that rank)")
    print(f"  held-out accuracy after round {args.rounds}: {accuracy:.3f}")
    if any("state_loans" in r for r in records):
        print(f"  clients whose state was lent to the rank that trained them: median "
              f"{statistics.median(r['state_loans'] for r in records):g} per round")
    if args.json:
        print("RESULT " + json.dumps(task.summarize(
            round_seconds, accuracy, server_peak_rss_mib=max(r["server_peak_rss_bytes"] for r in records) // 2**20,
            client_peak_rss_mib=max(r["client_peak_rss_bytes"] for r in records) // 2**20,
            note=f"{args.ranks} client ranks + server (MPI), groups {args.groups} by {args.group_by}, "
                 f"placement {args.placement}, "
                 f"memory format {args.memory_format}, nhwc_pooling {args.nhwc_pooling}, "
                 f"reuse_freed_memory {args.reuse_freed_memory}, doorbells {args.doorbells}")),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
