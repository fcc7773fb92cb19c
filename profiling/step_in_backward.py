"""What ``train.step_in_backward`` is worth: one training step of the LEAF FEMNIST CNN (batch 10) and of the
93 MB MLP (batch 10) on one torch thread, with each parameter's optimizer step taken inside backward
(``mpifl.learning.trainers.steps_in_backward``) and with one ``optimizer.step()`` after backward. Interleaved
repeats; medians; the weights of the two are checked to be bitwise equal. Run from the repository root, nothing
else timing at once:

    python profiling/step_in_backward.py [--steps 200 --repeats 5]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import task  # profiling/peers/task.py: the models the peer comparison uses

from mpifl.config import TrainConfig
from mpifl.learning.trainers import make_optimizer, steps_in_backward

MODELS = {"leaf_cnn": (task.leaf_cnn, (1, 28, 28)), "big_mlp": (task.big_mlp, (1, 28, 28))}
PLACES = ("after backward", "inside backward")


def train(model_name: str, place: str, steps: int, warmup: int = 20) -> tuple[float, torch.nn.Module]:
    """Milliseconds per SGD step (after ``warmup`` steps) and the trained model."""
    build, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    cfg = TrainConfig(optimizer="sgd", lr=0.05)
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, *shape, generator=generator), torch.randint(0, task.CLASSES, (10,), generator=generator)
    inside = place == "inside backward"
    optimizer = None if inside else make_optimizer(params, cfg)
    with steps_in_backward(params, cfg) if inside else contextlib.nullcontext():
        for i in range(warmup + steps):
            if i == warmup:
                began = time.perf_counter()
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if optimizer is not None:
                optimizer.step()
    return 1000 * (time.perf_counter() - began) / steps, model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"one torch thread, batch 10, SGD, torch {torch.__version__}; medians of {args.repeats} interleaved repeats")
    print("| model | step after backward, ms | step inside backward, ms | ratio | weights bitwise equal |")
    print("|---|---|---|---|---|")
    for name in args.models:
        times: dict[str, list[float]] = {place: [] for place in PLACES}
        models = {}
        for _ in range(args.repeats):
            for place in PLACES:
                ms, models[place] = train(name, place, args.steps)
                times[place].append(ms)
        equal = all(torch.equal(a, b) for a, b in zip(*(models[place].parameters() for place in PLACES)))
        after, inside = (statistics.median(times[place]) for place in PLACES)
        print(f"| {name} | {after:.2f} | {inside:.2f} | {inside / after:.2f}x | {equal} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
