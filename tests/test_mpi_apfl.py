"""APFL (Deng, Kamani and Mahdavi 2020) as a plug-in (examples/apfl): per-client state of two new kinds, a personal
model and a mixing weight of the trainer's own meaning, kept by mpifl. It equals a plain single-process PyTorch APFL
written here, and gives the same bits on any number of ranks, placed per round, and after kill -9."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from results import client_vectors, final_model
from stateful_plugins import assert_same_run, killed_and_resumed, largest_difference, run
from torch.func import functional_call

from mpifl.api import minibatches
from mpifl.config import load_config
from mpifl.learning.datasets import client_data, load_dataset
from mpifl.learning.models import build_model
from mpifl.learning.partitions import partition
from mpifl.planning.federation import sample_clients
from mpifl.planning.seeds import client_seed

SETTINGS = {
    "seed": 2, "rounds": 3,
    "clients": {"num_clients": 6, "per_round": 4},
    "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.3},
    "model": {"name": "mlp", "kwargs": {"hidden": [12]}},
    "train": {"trainer": "examples.apfl.apfl:APFLTrainer", "kwargs": {"alpha": 0.4, "alpha_lr": 0.5},
              "lr": 0.1, "momentum": 0.5, "local_epochs": 1, "batch_size": 16},
    "eval": {"every": 0}, "checkpoint": {"every": 1, "keep": 2},
}


def plain_apfl(settings: dict) -> tuple[dict, dict, dict]:
    """APFL on whole models in one process: each sampled client copies the global model w and, every step on one
    minibatch, takes the gradients of its personalised model alpha v + (1 - alpha) w (v its personal model, the
    global one the first time) with respect to v and alpha, steps w with SGD on its own loss, then v -= lr grad_v and
    alpha -= alpha_lr grad_alpha clipped to [0, 1]; the server averages the w weighted by samples. Returns the final
    model, each client's personal model flattened, and each client's alpha."""
    cfg = load_config(None, data=settings)
    torch.set_num_threads(1)
    dataset = load_dataset(cfg.data)
    parts = partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed, dataset.clients)
    global_net = build_model(cfg.model, cfg.seed, dataset.input_shape, dataset.num_classes)
    t, kw = cfg.train, cfg.train.kwargs
    personal: dict[int, list[torch.Tensor]] = {}
    alphas: dict[int, torch.Tensor] = {}
    for rnd in range(1, cfg.rounds + 1):
        trained = []
        for client in sample_clients(cfg.seed, rnd, cfg.clients.num_clients, cfg.clients_per_round()):
            data = client_data(dataset, parts[client])
            net = copy.deepcopy(global_net)
            names = [n for n, _ in net.named_parameters()]
            v = personal.get(client) or [p.detach().clone() for p in net.parameters()]
            alpha = alphas.get(client, torch.tensor(kw["alpha"]))
            optimizer = torch.optim.SGD(net.parameters(), lr=t.lr, momentum=t.momentum)
            batches = minibatches(len(data), t.batch_size, client_seed(cfg.seed, rnd, client))
            for _ in range(math.ceil(len(data) / t.batch_size) * t.local_epochs):
                batch = next(batches)
                x, y = data.x[batch], data.y[batch]
                vs = [p.clone().requires_grad_() for p in v]
                a = alpha.clone().requires_grad_()
                mixed = {n: a * vi + (1 - a) * w.detach() for n, vi, w in zip(names, vs, net.parameters())}
                grads = torch.autograd.grad(torch.nn.functional.cross_entropy(functional_call(net, mixed, (x,)), y),
                                            [*vs, a])
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()
                with torch.no_grad():
                    v = [vi - t.lr * g for vi, g in zip(v, grads[:-1])]
                    alpha = (alpha - kw["alpha_lr"] * grads[-1]).clamp(0.0, 1.0)
            personal[client], alphas[client] = v, alpha
            trained.append((len(data), net))
        total = sum(n for n, _ in trained)
        with torch.no_grad():
            for name, p in global_net.named_parameters():
                p.copy_(sum(n * dict(net.named_parameters())[name] for n, net in trained) / total)
    model = {n: p.detach().numpy() for n, p in global_net.named_parameters()}
    return (model, {c: torch.cat([p.flatten() for p in v]).numpy() for c, v in personal.items()},
            {c: a.reshape(1).numpy() for c, a in alphas.items()})


def kept(run_dir) -> tuple[dict, dict]:
    """Each client's personal model and alpha from the run's last checkpoint: its vector is the personal model and
    its mark, then alpha and its mark."""
    personal, alphas = {}, {}
    for client, vector in client_vectors(run_dir).items():
        assert vector[-3] == 1.0 and vector[-1] == 1.0  # both kept
        personal[client], alphas[client] = vector[:-3], vector[-2:-1]
    return personal, alphas


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return run(tmp_path_factory.mktemp("apfl3"), SETTINGS, 4)


def test_one_round_of_the_apfl_plugin_is_within_1e6_of_plain_pytorch_apfl(tmp_path):
    one = {**SETTINGS, "rounds": 1}
    run_dir = run(tmp_path, one, 3)
    model, personal, alphas = plain_apfl(one)
    got_personal, got_alphas = kept(run_dir)
    assert largest_difference(final_model(run_dir), model) <= 1e-6
    assert largest_difference(got_personal, personal) <= 1e-6
    assert largest_difference(got_alphas, alphas) <= 1e-6
    assert any(abs(float(a[0]) - 0.4) > 1e-3 for a in got_alphas.values())  # alpha adapted


def test_three_rounds_stay_with_plain_pytorch_apfl(three_ranks):
    model, personal, alphas = plain_apfl(SETTINGS)
    got_personal, got_alphas = kept(three_ranks)
    assert largest_difference(final_model(three_ranks), model) <= 1e-5
    assert largest_difference(got_personal, personal) <= 1e-5
    assert largest_difference(got_alphas, alphas) <= 1e-5


@pytest.mark.parametrize(("ranks", "overrides"), [
    (6, ()),  # 5 client ranks
    (3, ("clients.placement=per_round", "train.state_ram_mb=0")),  # lent whole to the rank that trains the client
], ids=["5-ranks", "per-round-on-disk"])
def test_apfl_gives_the_same_bits_on_any_number_of_ranks_and_placed_per_round(tmp_path, three_ranks, ranks,
                                                                            overrides):
    assert_same_run(run(tmp_path, SETTINGS, ranks, *overrides), three_ranks)


def test_apfl_killed_with_sigkill_resumes_on_2_ranks_to_the_same_bits(tmp_path):
    slow = {**SETTINGS, "rounds": 4, "train": {**SETTINGS["train"], "trainer": "plugin_helpers:SlowAPFLTrainer"}}
    assert_same_run(killed_and_resumed(tmp_path / "killed", slow, 6, 3), run(tmp_path / "whole", slow, 4))


def test_apfls_personalised_model_is_scored_on_each_clients_validation_split_leaving_its_training_bitwise(tmp_path):
    """With eval.federated_every, the plug-in's personalized() puts alpha v + (1 - alpha) w in the model and mpifl
    scores it on the client's validation split (federated_eval.personal_*) beside the received global model; the
    run's model and every client's vectors are bitwise those of the same run without federated evaluation."""
    import json

    split = {**SETTINGS, "rounds": 2, "data": {**SETTINGS["data"], "val_fraction": 0.3}}
    scored = run(tmp_path / "scored", {**split, "eval": {"every": 0, "federated_every": 1}}, 3)
    assert_same_run(scored, run(tmp_path / "plain", split, 3))
    records = [json.loads(line) for line in (scored / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        federated = record["federated_eval"]
        assert {"accuracy", "personal_accuracy", "personal_loss"} <= set(federated)
        assert federated["personal_accuracy"] != federated["accuracy"]  # the mixture, not the received model
