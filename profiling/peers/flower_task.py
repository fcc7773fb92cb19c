"""The shared task (task.py) in Flower's simulation engine: ServerApp + ClientApp, Message API,
``flwr.serverapp.strategy.FedAvg``, ``flwr.simulation.run_simulation`` on the Ray backend with
``--workers`` client actors (num_cpus 1 each, Ray given that many CPUs). Prints ``RESULT {json}``.

    PYTHONPATH=profiling/peers python flower_task.py --task cnn --rounds 10
"""
import argparse
import json
import os
import time
from functools import lru_cache

import numpy as np
import task
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

# Ray's actors inherit the driver's environment: the settings travel that way.
CFG = json.loads(os.environ.get("PEER_CFG", "{}"))


@lru_cache(1)
def data():
    return task.femnist_data(CFG["clients"], task.TASKS[CFG["task"]][1])


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    x, y, _, _, writers = data()
    cid = int(context.node_config["partition-id"])
    model = task.build_model(CFG["task"])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=CFG["lr"])
    idx = np.random.default_rng([cid, msg.content["config"].get("server-round", 0)]).permutation(writers[cid])
    model.train()
    for i in range(0, len(idx), CFG["batch"]):
        b = idx[i:i + CFG["batch"]]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x[b])), torch.from_numpy(y[b])).backward()
        opt.step()
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(idx)})}), reply_to=msg)


class CountingFedAvg(FedAvg):
    """FedAvg that counts each round's successful replies (a failing ClientApp only logs)."""
    replies: list = []

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.replies.append(sum(not m.has_error() for m in replies))
        return super().aggregate_train(server_round, replies)


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    torch.set_num_threads(1)
    model = task.build_model(CFG["task"])
    _, _, x_test, y_test, _ = data()
    marks, acc = [], []  # (start, end) of each evaluate_fn call: round r is marks[r].start - marks[r-1].end

    def evaluate(rnd: int, arrays: ArrayRecord):
        start = time.time()
        if rnd == CFG["rounds"]:
            model.load_state_dict(arrays.to_torch_state_dict())
            acc.append(task.accuracy(model, x_test, y_test))
        marks.append((start, time.time()))
        return MetricRecord({"accuracy": acc[-1]}) if acc else None

    strategy = CountingFedAvg(fraction_train=CFG["per_round"] / CFG["clients"], fraction_evaluate=0.0,
                      min_train_nodes=CFG["per_round"], min_available_nodes=CFG["clients"])
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=CFG["rounds"],
                   evaluate_fn=evaluate)
    rounds = [marks[i][0] - marks[i - 1][1] for i in range(1, len(marks))]
    print("RESULT " + json.dumps(task.summarize(
        rounds, acc[-1], min_clients_per_round=min(strategy.replies),
        note=f"flwr run_simulation, Ray, {CFG['workers']} client actors")), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="cnn", choices=task.TASKS)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    CFG.update(task=args.task, clients=args.clients, per_round=args.per_round, rounds=args.rounds,
               workers=args.workers, lr=0.05, batch=10)
    os.environ["PEER_CFG"] = json.dumps(CFG)
    import flower_task  # the apps from an importable module: Ray unpickles them in its actors by name
    run_simulation(server_app=flower_task.server, client_app=flower_task.client, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": args.workers}})
