"""MOON (Li, He and Song, CVPR 2021) as a plug-in (examples/moon): a stateful algorithm in one file on mpifl.api,
whose per-client previous model mpifl keeps, checkpoints, resumes and lends. It equals a plain single-process PyTorch
MOON written here, and gives the same bits on any number of ranks, on disk, placed per round, and after kill -9."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from results import client_vectors, final_model
from stateful_plugins import assert_same_run, killed_and_resumed, largest_difference, run

from mpifl.api import minibatches
from mpifl.config import load_config
from mpifl.learning.datasets import client_data, load_dataset
from mpifl.learning.models import build_model
from mpifl.learning.partitions import partition
from mpifl.planning.federation import sample_clients
from mpifl.planning.seeds import client_seed

SETTINGS = {
    "seed": 3, "rounds": 3,
    "clients": {"num_clients": 6, "per_round": 4},
    "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
    "model": {"name": "examples.moon.moon:MoonNet", "kwargs": {"hidden": 16, "projection": 8}},
    "train": {"trainer": "examples.moon.moon:MoonTrainer", "kwargs": {"mu": 2.0, "temperature": 0.5},
              "lr": 0.05, "momentum": 0.9, "local_epochs": 1, "batch_size": 16},
    "eval": {"every": 0}, "checkpoint": {"every": 1, "keep": 2},
}


def plain_moon(settings: dict) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    """MOON on whole models in one process: each sampled client copies the global model, trains it on cross-entropy
    plus mu * -log(e^{cos(z, z_glob)/t} / (e^{cos(z, z_glob)/t} + e^{cos(z, z_prev)/t})), z from its own model, z_glob
    from the global model and z_prev from its previous model (the global one the first time), with plain SGD; the
    server averages the trained models weighted by samples, in ascending client id. Returns the final model and each
    client's previous model, flattened."""
    cfg = load_config(None, data=settings)
    torch.set_num_threads(1)
    dataset = load_dataset(cfg.data)
    parts = partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed, dataset.clients)
    global_net = build_model(cfg.model, cfg.seed, dataset.input_shape, dataset.num_classes)
    mu, tau, t = cfg.train.kwargs["mu"], cfg.train.kwargs["temperature"], cfg.train
    previous: dict[int, torch.nn.Module] = {}
    for rnd in range(1, cfg.rounds + 1):
        trained = []
        for client in sample_clients(cfg.seed, rnd, cfg.clients.num_clients, cfg.clients_per_round()):
            data = client_data(dataset, parts[client])
            net, prev = copy.deepcopy(global_net), previous.get(client, copy.deepcopy(global_net))
            optimizer = torch.optim.SGD(net.parameters(), lr=t.lr, momentum=t.momentum)
            batches = minibatches(len(data), t.batch_size, client_seed(cfg.seed, rnd, client))
            for _ in range(math.ceil(len(data) / t.batch_size) * t.local_epochs):
                batch = next(batches)
                x, y = data.x[batch], data.y[batch]
                with torch.no_grad():
                    z_glob = global_net(x, with_representation=True)[1]
                    z_prev = prev(x, with_representation=True)[1]
                scores, z = net(x, with_representation=True)
                sims = torch.stack([torch.cosine_similarity(z, z_glob, dim=-1),
                                    torch.cosine_similarity(z, z_prev, dim=-1)], dim=1) / tau
                contrastive = -torch.log_softmax(sims, dim=1)[:, 0].mean()
                optimizer.zero_grad()
                (torch.nn.functional.cross_entropy(scores, y) + mu * contrastive).backward()
                optimizer.step()
            previous[client] = net
            trained.append((len(data), net))
        total = sum(n for n, _ in trained)
        with torch.no_grad():
            for name, p in global_net.named_parameters():
                p.copy_(sum(n * dict(net.named_parameters())[name] for n, net in trained) / total)
    model = {n: p.detach().numpy() for n, p in global_net.named_parameters()}
    kept = {c: torch.cat([p.detach().flatten() for p in net.parameters()]).numpy() for c, net in previous.items()}
    return model, kept


def marked(vectors: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Each client's previous model without its mark, checking the mark says the client kept one."""
    assert all(v[-1] == 1.0 for v in vectors.values())
    return {c: v[:-1] for c, v in vectors.items()}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return run(tmp_path_factory.mktemp("moon3"), SETTINGS, 4)


def test_one_round_of_the_moon_plugin_is_within_1e6_of_plain_pytorch_moon(tmp_path):
    one = {**SETTINGS, "rounds": 1}
    run_dir = run(tmp_path, one, 3)
    model, kept = plain_moon(one)
    assert largest_difference(final_model(run_dir), model) <= 1e-6
    assert largest_difference(marked(client_vectors(run_dir)), kept) <= 1e-6


def test_three_rounds_stay_with_plain_pytorch_moon(three_ranks):
    model, kept = plain_moon(SETTINGS)
    assert largest_difference(final_model(three_ranks), model) <= 1e-5
    assert largest_difference(marked(client_vectors(three_ranks)), kept) <= 1e-5  # every client sampled kept one


@pytest.mark.parametrize(("ranks", "overrides"), [
    (3, ()),  # 2 client ranks
    (6, ()),  # 5 client ranks
    (4, ("train.state_ram_mb=0",)),  # each rank's previous models in an HDF5 file
    (4, ("clients.placement=per_round",)),  # each client's previous model lent to whichever rank trains it
], ids=["2-ranks", "5-ranks", "on-disk", "per-round"])
def test_moon_gives_the_same_bits_on_any_number_of_ranks_on_disk_and_placed_per_round(tmp_path, three_ranks, ranks,
                                                                                      overrides):
    run_dir = run(tmp_path, SETTINGS, ranks, *overrides)
    assert_same_run(run_dir, three_ranks)
    if "train.state_ram_mb=0" in overrides:
        assert sorted(p.name for p in (run_dir / "state").iterdir()) == ["rank00001.h5", "rank00002.h5",
                                                                         "rank00003.h5"]


def test_moon_killed_with_sigkill_resumes_on_5_ranks_to_the_same_bits(tmp_path):
    slow = {**SETTINGS, "rounds": 4, "train": {**SETTINGS["train"], "trainer": "plugin_helpers:SlowMoonTrainer"}}
    assert_same_run(killed_and_resumed(tmp_path / "killed", slow, 4, 6), run(tmp_path / "whole", slow, 4))
