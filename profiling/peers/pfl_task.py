"""The shared task (task.py) in Apple's pfl-research: ``FederatedAveraging`` on a ``SimulatedBackend``
with ``PyTorchModel``; several CPU workers through ``torchrun`` (pfl's native torch.distributed
support, gloo backend): each worker trains its share of the cohort and the updates are all-reduced.
Prints ``RESULT {json}`` from worker 0.

    PYTHONPATH=profiling/peers torchrun --standalone --nproc-per-node 2 pfl_task.py --task cnn --rounds 10
"""
import argparse
import json
import time

import numpy as np
import task
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByDatapoints
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.internal.ops.selector import get_framework_module
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel


class Module(torch.nn.Module):
    """pfl's PyTorchModel wants ``loss`` and ``metrics`` on the module."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)

    def loss(self, x, y, eval=False):
        self.train(not eval)
        return torch.nn.functional.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x, y, eval=False):
        self.train(not eval)
        out = self(x)
        return {"loss": Weighted(float(torch.nn.functional.cross_entropy(out, y, reduction="sum")), len(y)),
                "accuracy": Weighted(float((out.argmax(1) == y).sum()), len(y))}


class Clock(TrainingProcessCallback):
    """Round times without evaluation; held-out accuracy after the last round."""

    def __init__(self, model, x_test, y_test, rounds):
        self.model, self.x_test, self.y_test, self.rounds = model, x_test, y_test, rounds
        self.marks, self.acc = [], None

    def on_train_begin(self, *, model):
        self.marks.append((time.time(), time.time()))
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        start = time.time()
        if central_iteration + 1 == self.rounds:
            self.acc = task.accuracy(self.model, self.x_test, self.y_test)
        self.marks.append((start, time.time()))
        return False, Metrics()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="cnn", choices=task.TASKS)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--memory-format", default="contiguous", choices=("contiguous", "channels_last"),
                   help="channels_last: every Conv2d's output in NHWC order (task.nhwc_activations), as mpifl's "
                   "model.memory_format does")
    args = p.parse_args()
    torch.set_num_threads(1)
    x, y, x_test, y_test, writers = task.femnist_data(args.clients, task.TASKS[args.task][1])
    rng = np.random.default_rng(0)

    def user(uid):  # a user's local data, shuffled afresh each time it is sampled
        idx = rng.permutation(writers[uid])
        return Dataset(raw_data=[torch.from_numpy(x[idx]), torch.from_numpy(y[idx])], user_id=uid)

    train_data = FederatedDataset(user, get_user_sampler("minimize_reuse", list(range(args.clients))),
                                  user_id_to_weight={i: len(w) for i, w in enumerate(writers)})
    built = task.build_model(args.task)
    net = Module(task.nhwc_activations(built) if args.memory_format == "channels_last" else built)
    model = PyTorchModel(net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    backend = SimulatedBackend(training_data=train_data, val_data=None, postprocessors=[WeightByDatapoints()])
    clock = Clock(net, x_test, y_test, args.rounds)
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds, evaluation_frequency=args.rounds + 1,
                                           train_cohort_size=args.per_round, val_cohort_size=None),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_num_epochs=1, local_learning_rate=0.05, local_batch_size=10),
        model_eval_params=NNEvalHyperParams(local_batch_size=500), callbacks=[clock])
    ops = get_framework_module()
    if ops.distributed.global_rank == 0:
        rounds = [clock.marks[i][0] - clock.marks[i - 1][1] for i in range(1, len(clock.marks))]
        print("RESULT " + json.dumps(task.summarize(
            rounds, clock.acc, note=f"pfl FedAvg, torchrun, {ops.distributed.world_size} workers (gloo), "
                                    f"{args.memory_format}, trained on {next(net.parameters()).device}")), flush=True)


if __name__ == "__main__":
    main()
