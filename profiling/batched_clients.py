"""Clients trained as lanes of one batched model (``train.batched_clients``) against one at a time, on the trainer
alone (no MPI, no exchange): client updates per second, the FLOPs a client update costs, and the fraction of the
device's rated throughput that reaches. The table's two forms run interleaved, and each cell is the median of
``--repeats`` timings.

    python profiling/batched_clients.py --device cpu --model mlp cnn --clients 20 200
    python profiling/batched_clients.py --device cuda --model mlp cnn --clients 20 200 2000 --peak-tflops 67

The data are those of the cross-device comparison (``profiling/peers/task.py``): FEMNIST-like 28 x 28 images of
62 classes, lognormal client sizes of median 20, batch 10, one local epoch of SGD at lr 0.05, for the LEAF CNN
(1.69 M parameters); for the MLP, the quick start's shape (``mpifl.learning.models.mlp``, hidden 128 and 64) on
the same images. ``--peak-tflops``: the device's rated fp32 throughput (an H100 or H200 SXM: 67 TFLOP/s dense
fp32 without tensor cores, NVIDIA's datasheets), to state the fraction of it reached; FLOPs are counted by
``torch.utils.flop_counter`` (matrix products and convolutions, forward and backward) for each client's actual
steps. Prints a Markdown table, and with ``--json`` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "profiling" / "peers"))
import task  # noqa: E402  (the shared cross-device data and models)

from mpifl.config import TrainConfig  # noqa: E402
from mpifl.learning.batched import Lane, train_lanes  # noqa: E402
from mpifl.learning.datasets import ClientData  # noqa: E402
from mpifl.learning.models import mlp, use_nhwc_pooling  # noqa: E402
from mpifl.learning.trainers import TorchTrainer  # noqa: E402

CFG = TrainConfig(optimizer="sgd", lr=0.05, batch_size=10, local_epochs=1)


def build(name: str, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = task.leaf_cnn() if name == "cnn" else mlp((1, 28, 28), task.CLASSES)
    return use_nhwc_pooling(model).to(device)  # as mpifl builds it (the NHWC pooling acts on the CPU only)


def clients(count: int) -> list[ClientData]:
    x, y, _, _, writers = task.femnist_data(count, 20)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    return [ClientData(xs[w], ys[w]) for w in writers]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def one_at_a_time(model: torch.nn.Module, data: list[ClientData], device: str) -> float:
    """Seconds to train every client in turn from the same weights, as a client rank does."""
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = TorchTrainer(CFG)
    synchronize(device)
    began = time.perf_counter()
    for i, d in enumerate(data):
        model.load_state_dict(start)
        trainer.train(model, d, 1000 + i)
    synchronize(device)
    seconds = time.perf_counter() - began
    model.load_state_dict(start)
    return seconds


def batched(model: torch.nn.Module, data: list[ClientData], width: int, device: str) -> float:
    """Seconds to train every client as lanes of batches of ``width``."""
    synchronize(device)
    began = time.perf_counter()
    for first in range(0, len(data), width):
        lanes = [Lane(d, 1000 + first + i) for i, d in enumerate(data[first:first + width])]
        out = train_lanes(model, lanes, CFG, width)
        del out
    synchronize(device)
    return time.perf_counter() - began


def flops_per_update(model: torch.nn.Module, data: list[ClientData]) -> float:
    """Mean FLOPs of one client's training (forward and backward), counted on the first clients."""
    from torch.utils.flop_counter import FlopCounterMode

    sample = data[:20]
    counter = FlopCounterMode(display=False)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with counter:
        for i, d in enumerate(sample):
            TorchTrainer(CFG).train(model, d, i)
    model.load_state_dict(start)
    return counter.get_total_flops() / len(sample)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", nargs="+", default=["mlp", "cnn"], choices=("mlp", "cnn"))
    p.add_argument("--clients", nargs="+", type=int, default=[20, 200], help="clients a round")
    p.add_argument("--width", type=int, default=0, help="lanes per batch (0: all the round's clients at once)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sequential-limit", type=int, default=400,
                   help="time one-at-a-time training on at most this many clients and scale (it is linear)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's rated fp32 TFLOP/s (0: not stated)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)  # mpifl's default on a GPU (train.deterministic)
    rows = []
    for name in args.model:
        model = build(name, args.device)
        for count in args.clients:
            data = clients(count)
            width = args.width or count
            seq_data = data[:min(count, args.sequential_limit)]
            batched(model, data[:width], width, args.device)  # warm-up: kernels, allocator
            one_at_a_time(model, seq_data[:5], args.device)
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            seq, bat = [], []
            for _ in range(args.repeats):  # interleaved
                seq.append(one_at_a_time(model, seq_data, args.device) / len(seq_data))
                bat.append(batched(model, data, width, args.device) / count)
            flops = flops_per_update(model, data)
            per_seq, per_bat = statistics.median(seq), statistics.median(bat)
            row = {"model": name, "clients": count, "width": width, "device": args.device,
                   "updates_per_s_one_at_a_time": 1 / per_seq, "updates_per_s_batched": 1 / per_bat,
                   "speedup": per_seq / per_bat, "gflop_per_update": flops / 1e9,
                   "tflops_batched": flops / per_bat / 1e12}
            if args.peak_tflops:
                row["fraction_of_peak"] = row["tflops_batched"] / args.peak_tflops
            if args.device == "cuda":
                row["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"\n{args.device}, torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else "") + "\n")
    print("| model | clients | lanes | one at a time (updates/s) | batched (updates/s) | speed-up | GFLOP/update "
          "| TFLOP/s batched |" + (" of peak |" if args.peak_tflops else "") +
          (" GPU peak MiB |" if args.device == "cuda" else ""))
    print("|---" * (8 + bool(args.peak_tflops) + (args.device == "cuda")) + "|")
    for r in rows:
        extra = (f" {r['fraction_of_peak']:.1%} |" if args.peak_tflops else "") + \
                (f" {r['peak_gpu_mib']:,.0f} |" if args.device == "cuda" else "")
        print(f"| {r['model']} | {r['clients']} | {r['width']} | {r['updates_per_s_one_at_a_time']:,.1f} | "
              f"{r['updates_per_s_batched']:,.1f} | {r['speedup']:.2f}x | {r['gflop_per_update']:.3f} | "
              f"{r['tflops_batched']:.3f} |" + extra)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
