"""Why does a client train slower inside mpifl than outside it? The same clients' training, timed alone, beside a
second process training, beside a process folding updates as the server does, and inside an mpifl run.

The cross-device task of ``profiling/peers`` (FEMNIST-like data, lognormal client sizes, batch 10, SGD): the LEAF
CNN (1.69 M parameters, about 20 samples a client) or the 93 MB MLP (about 5 samples a client), in a federation of
``--clients`` clients that all take part in every round. Every scenario trains those same clients (the same sizes:
a client's time grows with its samples) with mpifl's own trainer (``mpifl.learning.trainers.TorchTrainer``, one
torch thread, mpifl's default kernels: ``model.nhwc_pooling``), each from the same global model, so only the
surroundings differ:

- ``alone``: one process, nothing else running;
- ``beside training``: two processes, each training the same clients at the same time (two client ranks);
- ``beside folding``: one process training, another folding fp32 update-sized buffers without pause
  (``acc += w * x``, the server's reduction at its busiest);
- ``inside mpifl``: an mpifl run (server + ``--ranks`` client ranks, ``clients.groups`` = ranks) on the same task;
  a client's time is its rank's training seconds per client from ``metrics.jsonl`` (rounds after the first).

Each scenario's figure is the median seconds per client over ``--repeats`` interleaved repeats; the table gives
each as a ratio to ``alone``. Run from the repository root, on a quiet machine (no other timing at once):

    python profiling/client_slowdown.py --model big_mlp --clients 20 --repeats 3
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
import task  # noqa: E402  (profiling/peers/task.py: the data and models shared with the peers)

SAMPLES = {"leaf_cnn": 20, "big_mlp": 5}


def client_seconds(model_name: str, clients: int, seed: int = 0) -> list[float]:
    """Train every client of a ``clients``-client federation one after another from the same global model (the
    clients an mpifl run of that federation trains each round, every client taking part); seconds each."""
    import torch

    from mpifl.config import TrainConfig
    from mpifl.learning.datasets import ClientData
    from mpifl.learning.models import use_nhwc_pooling
    from mpifl.learning.trainers import TorchTrainer

    torch.set_num_threads(1)
    x, y, _, _, writers = task.femnist_data(clients, SAMPLES[model_name], 0.5, 1.0, seed=0)
    torch.manual_seed(seed)
    model = use_nhwc_pooling(getattr(task, model_name)())  # the kernels an mpifl rank runs (model.nhwc_pooling)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = TorchTrainer(TrainConfig(optimizer="sgd", lr=0.05, batch_size=10, local_epochs=1))
    out = []
    for c in range(clients):
        data = ClientData(torch.from_numpy(x[writers[c]]), torch.from_numpy(y[writers[c]]))
        model.load_state_dict(start)
        began = time.perf_counter()
        trainer.train(model, data, seed + c)
        out.append(time.perf_counter() - began)
    return out


def fold_forever(elements: int, stop) -> None:
    """The server's reduction at its busiest: fold fp32 buffers of an update's size until told to stop."""
    import torch

    torch.set_num_threads(1)
    acc, update = torch.zeros(elements), torch.randn(elements)
    while not stop.is_set():
        acc.add_(update, alpha=0.5)


def _train_into(model_name: str, clients: int, queue) -> None:
    queue.put(client_seconds(model_name, clients))


def beside_training(model_name: str, clients: int) -> list[float]:
    """Two processes training the same clients at once: the first one's seconds per client."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_train_into, args=(model_name, clients, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return results[0] + results[1]


def beside_folding(model_name: str, clients: int) -> list[float]:
    """One process training while another folds update-sized buffers."""
    elements = sum(p.numel() for p in getattr(task, model_name)().parameters())
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    folder = ctx.Process(target=fold_forever, args=(elements, stop))
    folder.start()
    try:
        time.sleep(1.0)  # the folder is up and folding
        return client_seconds(model_name, clients)
    finally:
        stop.set()
        folder.join()


def inside_mpifl(model_name: str, clients: int, ranks: int, rounds: int = 4) -> list[float]:
    """An mpifl run on the same task: each rank's training seconds per client, rounds after the first."""
    with tempfile.TemporaryDirectory(prefix="slowdown-") as work:
        run_dir = Path(work) / "run"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        bin_dir = Path(sys.executable).parent
        subprocess.run([str(bin_dir / "python"), str(HERE / "cross_device.py"), "--model", model_name,
                        "--samples", str(SAMPLES[model_name]), "--clients", str(clients), "--per-round", str(clients),
                        "--ranks", str(ranks),
                        "--groups", str(ranks), "--rounds", str(rounds), "--data", "plugin", "--keep", str(run_dir)],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    return [r["train_seconds"] / r["clients"] for record in records for r in record["ranks"].values()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="big_mlp", choices=tuple(SAMPLES))
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--ranks", type=int, default=2, help="client ranks of the mpifl run")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    scenarios = {"alone": lambda: client_seconds(args.model, args.clients),
                 "beside training": lambda: beside_training(args.model, args.clients),
                 "beside folding": lambda: beside_folding(args.model, args.clients),
                 f"inside mpifl ({args.ranks} client ranks)": lambda: inside_mpifl(args.model, args.clients,
                                                                                  args.ranks)}
    medians: dict[str, list[float]] = {name: [] for name in scenarios}
    for _ in range(args.repeats):  # interleaved: each repeat runs every scenario once
        for name, scenario in scenarios.items():
            medians[name].append(statistics.median(scenario()))
    alone = statistics.median(medians["alone"])
    print(f"{args.model}, {args.clients} clients, median seconds per client over {args.repeats} interleaved "
          f"repeats ({os.cpu_count()} cores):")
    for name, values in medians.items():
        value = statistics.median(values)
        print(f"  {name:<32} {1000 * value:8.1f} ms  {value / alone:5.2f}x alone")
    inside = statistics.median(medians[f"inside mpifl ({args.ranks} client ranks)"])
    beside = statistics.median(medians["beside training"])
    # the plain loop with as many trainers at once as the mpifl run has client ranks (on 2 cores: 2 trainers)
    print(f"  inside mpifl over two plain loops training at once: {inside / beside:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
