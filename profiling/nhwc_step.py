"""What ``model.memory_format: channels_last`` and ``model.nhwc_pooling`` are worth: one training step of the LEAF
FEMNIST CNN (batch 10, SGD, one torch thread) with NCHW activations and PyTorch's own pooling, with NCHW
activations pooled by the NHWC kernel (``model.nhwc_pooling``, bitwise the same weights), and with NHWC
activations; the max-pooling kernel's time per call in each, from torch.profiler. Interleaved repeats; medians.
Run from the repository root, nothing else timing at once:

    python profiling/nhwc_step.py [--steps 300 --repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import task  # profiling/peers/task.py: the LEAF CNN the peer comparison uses

from mpifl.learning.models import use_memory_format, use_nhwc_pooling

LAYOUTS = ("contiguous", "nhwc_pooling", "channels_last")


def model_in(layout: str) -> torch.nn.Module:
    """The LEAF CNN, seeded: as written (contiguous), with its max pooling by the NHWC kernel (nhwc_pooling, the
    default of model.nhwc_pooling), or with mpifl's NHWC hooks on its convolutions (channels_last)."""
    torch.manual_seed(0)
    if layout == "nhwc_pooling":
        return use_nhwc_pooling(task.leaf_cnn())
    return use_memory_format(task.leaf_cnn(), layout)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One SGD step, as mpifl's trainer takes it."""
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    loss.item()


def ms_per_step(layout: str, steps: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """Milliseconds per training step, after 30 warm-up steps."""
    model = model_in(layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(30):
        step(model, optimizer, x, y)
    began = time.perf_counter()
    for _ in range(steps):
        step(model, optimizer, x, y)
    return 1000 * (time.perf_counter() - began) / steps


def pooling_ms_per_call(layout: str, x: torch.Tensor, y: torch.Tensor) -> float:
    """The max-pooling forward kernel's mean self time per call over 100 steps (torch.profiler)."""
    model = model_in(layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(30):
        step(model, optimizer, x, y)
    with torch.profiler.profile() as prof:
        for _ in range(100):
            step(model, optimizer, x, y)
    pool = next(e for e in prof.key_averages() if e.key == "aten::max_pool2d_with_indices")  # either kernel
    return pool.self_cpu_time_total / pool.count / 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    x, y = torch.randn(10, 1, 28, 28), torch.randint(0, 62, (10,))
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for _ in range(args.repeats):
        for layout in LAYOUTS:
            times[layout].append(ms_per_step(layout, args.steps, x, y))
    print(f"LEAF CNN, batch 10, one thread, torch {torch.__version__}; medians of {args.repeats} interleaved repeats")
    print("| layout | ms per training step | max pooling, ms per call |\n|---|---|---|")
    for layout in LAYOUTS:
        print(f"| {layout} | {statistics.median(times[layout]):.1f} | {pooling_ms_per_call(layout, x, y):.2f} |")
    for layout in LAYOUTS[1:]:
        ratio = statistics.median(times["contiguous"]) / statistics.median(times[layout])
        print(f"{layout} steps {ratio:.2f}x as fast as contiguous")
    return 0


if __name__ == "__main__":
    sys.exit(main())
