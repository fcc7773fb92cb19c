"""Why does a client train slower inside mpifl than outside it? The same clients' training, timed alone, beside a
second process training, beside a process folding updates as the server does, and inside an mpifl run.

The cross-device task of ``profiling/peers`` (FEMNIST-like data, lognormal client sizes, batch 10, SGD): the LEAF
CNN (1.69 M parameters, about 20 samples a client) or the 93 MB MLP (about 5 samples a client), in a federation of
``--clients`` clients that all take part in every round. Every scenario trains those same clients (the same sizes:
a client's time grows with its samples) with mpifl's own trainer (``mpifl.learning.trainers.TorchTrainer``, one
torch thread, mpifl's default kernels: ``model.nhwc_pooling``), each from the same global model, so only the
surroundings differ:

- ``alone``: one process, nothing else running: a plain loop as a user writes it;
- ``beside training``: two processes, each training the same clients at the same time (two client ranks);
- ``beside folding``: one process training, another folding fp32 update-sized buffers without pause
  (``acc += w * x``, the server's reduction at its busiest);
- ``inside mpifl``: an mpifl run (server + ``--ranks`` client ranks, ``clients.groups`` = ranks) on the same task;
  a client's time is its rank's training seconds per client from ``metrics.jsonl`` (rounds after the first);
- "reused" / "returned": the same with glibc keeping freed memory for the next allocation, as mpifl's client
  ranks do by default (``train.reuse_freed_memory``), or handing it back to the kernel, as a plain process does.
  The plain loops also count each client's minor page faults.

Each scenario's figure is the median seconds per client over ``--repeats`` interleaved repeats; the table gives
each as a ratio to ``alone``. Run from the repository root, on a quiet machine (no other timing at once):

    python profiling/client_slowdown.py --model big_mlp --clients 20 --repeats 3
    python profiling/client_slowdown.py --model leaf_cnn --device cuda --ranks 1   # on a GPU: alone and inside

With ``--device cuda`` the clients train on the GPU, with mpifl's deterministic kernels (``train.deterministic``),
and only ``alone`` and ``inside mpifl`` run: the CPU scenarios' contention is not a GPU's.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
import task  # noqa: E402  (profiling/peers/task.py: the data and models shared with the peers)

SAMPLES = {"leaf_cnn": 20, "big_mlp": 5}


def client_costs(model_name: str, clients: int, seed: int = 0, reuse_freed: bool = False,
                 device: str = "cpu") -> list[tuple[float, int]]:
    """Train every client of a ``clients``-client federation one after another from the same global model (the
    clients an mpifl run of that federation trains each round, every client taking part); seconds and minor page
    faults each. ``reuse_freed``: glibc keeps freed memory for reuse first, as mpifl's client ranks do
    (``train.reuse_freed_memory``); irreversible, so call it in a process of its own."""
    import resource

    import torch

    from mpifl.config import TrainConfig
    from mpifl.learning.datasets import ClientData
    from mpifl.learning.device import use_deterministic_kernels
    from mpifl.learning.models import use_nhwc_pooling
    from mpifl.learning.trainers import TorchTrainer
    from mpifl.wire.memory import reuse_freed_memory

    torch.set_num_threads(1)
    x, y, _, _, writers = task.femnist_data(clients, SAMPLES[model_name], 0.5, 1.0, seed=0)
    torch.manual_seed(seed)
    if device == "cuda":
        use_deterministic_kernels()  # as an mpifl rank on a GPU (train.deterministic)
    model = use_nhwc_pooling(getattr(task, model_name)())  # the kernels an mpifl rank runs (model.nhwc_pooling)
    model.to(device)  # the data stays on the host; the trainer moves each batch, as in mpifl
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = TorchTrainer(TrainConfig(optimizer="sgd", lr=0.05, batch_size=10, local_epochs=1))
    if reuse_freed:
        reuse_freed_memory()
    out = []
    for c in range(clients):
        data = ClientData(torch.from_numpy(x[writers[c]]), torch.from_numpy(y[writers[c]]))
        model.load_state_dict(start)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        began = time.perf_counter()
        trainer.train(model, data, seed + c)
        if device == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - began, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    return out


def fold_forever(elements: int, stop) -> None:
    """The server's reduction at its busiest: fold fp32 buffers of an update's size until told to stop."""
    import torch

    torch.set_num_threads(1)
    acc, update = torch.zeros(elements), torch.randn(elements)
    while not stop.is_set():
        acc.add_(update, alpha=0.5)


def _train_into(model_name: str, clients: int, reuse_freed: bool, device: str, queue) -> None:
    queue.put(client_costs(model_name, clients, reuse_freed=reuse_freed, device=device))


Costs = list[tuple[float, int | None]]  # per client: seconds, and minor page faults where counted


def plain_loops(model_name: str, clients: int, loops: int = 1, reuse_freed: bool = False,
                device: str = "cpu") -> Costs:
    """``loops`` processes each training the same clients at once (2: what two client ranks on 2 cores are); every
    loop's clients. Each in a process of its own, so that ``reuse_freed`` leaves this one as it was."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_train_into, args=(model_name, clients, reuse_freed, device, queue))
             for _ in range(loops)]
    for p in procs:
        p.start()
    results = [cost for _ in procs for cost in queue.get()]
    for p in procs:
        p.join()
    return results


def beside_folding(model_name: str, clients: int) -> Costs:
    """One process training while another folds update-sized buffers."""
    elements = sum(p.numel() for p in getattr(task, model_name)().parameters())
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    folder = ctx.Process(target=fold_forever, args=(elements, stop))
    folder.start()
    try:
        time.sleep(1.0)  # the folder is up and folding
        return plain_loops(model_name, clients)
    finally:
        stop.set()
        folder.join()


def inside_mpifl(model_name: str, clients: int, ranks: int, rounds: int = 4, reuse_freed: bool = True,
                 device: str = "cpu") -> Costs:
    """An mpifl run on the same task: each rank's training seconds per client, rounds after the first
    (``reuse_freed``: ``train.reuse_freed_memory``, on by default)."""
    with tempfile.TemporaryDirectory(prefix="slowdown-") as work:
        run_dir = Path(work) / "run"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        bin_dir = Path(sys.executable).parent
        subprocess.run([str(bin_dir / "python"), str(HERE / "cross_device.py"), "--model", model_name,
                        "--samples", str(SAMPLES[model_name]), "--clients", str(clients), "--per-round", str(clients),
                        "--ranks", str(ranks), "--reuse-freed-memory", str(reuse_freed).lower(),
                        "--groups", str(ranks), "--rounds", str(rounds), "--device", device, "--data", "plugin",
                        "--keep", str(run_dir)],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    return [(r["train_seconds"] / r["clients"], None) for record in records for r in record["ranks"].values()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="big_mlp", choices=tuple(SAMPLES))
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--ranks", type=int, default=2, help="client ranks of the mpifl run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    m, n = args.model, args.clients
    inside = f"inside mpifl ({args.ranks} client ranks)"
    scenarios: dict[str, Callable[[], Costs]] = {
        "alone": lambda: plain_loops(m, n),
        "alone, freed memory reused": lambda: plain_loops(m, n, reuse_freed=True),
        "beside training": lambda: plain_loops(m, n, loops=2),
        "beside training, reused": lambda: plain_loops(m, n, loops=2, reuse_freed=True),
        "beside folding": lambda: beside_folding(m, n),
        inside: lambda: inside_mpifl(m, n, args.ranks),
        f"{inside}, freed memory returned": lambda: inside_mpifl(m, n, args.ranks, reuse_freed=False)}
    if args.device == "cuda":
        scenarios = {"alone": lambda: plain_loops(m, n, device="cuda"),
                     inside: lambda: inside_mpifl(m, n, args.ranks, device="cuda")}
    seconds: dict[str, list[float]] = {name: [] for name in scenarios}
    faults: dict[str, list[float]] = {name: [] for name in scenarios}
    for _ in range(args.repeats):  # interleaved: each repeat runs every scenario once
        for name, scenario in scenarios.items():
            costs = scenario()
            seconds[name].append(statistics.median(s for s, _ in costs))
            counted = [f for _, f in costs if f is not None]
            if counted:
                faults[name].append(statistics.median(counted))
    alone = statistics.median(seconds["alone"])
    print(f"{m}, {n} clients on {args.device}, median seconds per client over {args.repeats} interleaved repeats "
          f"({os.cpu_count()} cores); 'reused': glibc keeps freed memory (train.reuse_freed_memory, mpifl's default):")
    width = max(map(len, seconds))
    for name, values in seconds.items():
        value = statistics.median(values)
        counted = f"{statistics.median(faults[name]):8.0f} page faults" if faults[name] else ""
        print(f"  {name:<{width}} {1000 * value:8.1f} ms  {value / alone:5.2f}x alone {counted}")
    # the plain loops with as many trainers at once as the mpifl run has client ranks (on 2 cores: 2 trainers)
    for plain in ("beside training", "beside training, reused") if args.device == "cpu" else ():
        print(f"  inside mpifl over two plain loops training at once ({plain}): "
              f"{statistics.median(seconds[inside]) / statistics.median(seconds[plain]):5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
