"""Models and local training, without MPI."""
import math

import torch

from mpifl.config import load_config
from mpifl.learning.datasets import client_data, load_dataset
from mpifl.learning.models import build_model
from mpifl.learning.partitions import partition
from mpifl.learning.trainers import evaluate, make_loss, make_trainer
from mpifl.wire.flat import FlatModel


def setup(model="cnn", **train):
    cfg = load_config(None, data={"model": {"name": model}, "train": train, "clients": {"num_clients": 4}})
    data = load_dataset(cfg.data)
    flat = FlatModel(build_model(cfg.model, cfg.seed, data.input_shape, data.num_classes))
    mine = client_data(data, partition(cfg.data, data.y_train, 4, cfg.seed)[0])
    return cfg, data, flat, mine


def test_the_cnn_learns_digits_in_its_flat_buffer():
    cfg, data, flat, mine = setup("cnn", lr=0.1, momentum=0.9, local_epochs=5)
    before = evaluate(flat.module, data.x_test, data.y_test, make_loss("cross_entropy"), 256)
    start = flat.buffer.clone()
    result = make_trainer(cfg.train).train(flat.module, mine, seed=7)
    after = evaluate(flat.module, data.x_test, data.y_test, make_loss("cross_entropy"), 256)
    assert not torch.equal(start, flat.buffer)  # training wrote into the exchanged buffer
    assert after["loss"] < before["loss"] and result.num_samples == len(mine)


def test_training_is_a_function_of_the_seed():
    # Ranks train on one thread (runner.py); with several, BLAS may split sums differently run to run.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train_twice_and_compare()
    finally:
        torch.set_num_threads(threads)


def _train_twice_and_compare():
    cfg, _, flat, mine = setup("mlp", optimizer="adam", lr=0.01, local_steps=5)
    start = flat.buffer.clone()
    make_trainer(cfg.train).train(flat.module, mine, seed=3)
    first = flat.buffer.clone()
    flat.buffer.copy_(start)
    make_trainer(cfg.train).train(flat.module, mine, seed=3)
    assert torch.equal(first, flat.buffer)
    flat.buffer.copy_(start)
    make_trainer(cfg.train).train(flat.module, mine, seed=4)
    assert not torch.equal(first, flat.buffer)


def test_the_no_training_trainer_leaves_the_model_alone():
    cfg, _, flat, mine = setup("mlp", trainer="none")
    start = flat.buffer.clone()
    assert make_trainer(cfg.train).train(flat.module, mine, seed=0).num_samples == len(mine)
    assert torch.equal(start, flat.buffer)


def test_fedprox_pulls_local_training_towards_the_global_model():
    drift = {}
    for mu in (0.0, 1.0):
        cfg, _, flat, mine = setup("mlp", lr=0.1, local_epochs=3, prox_mu=mu)
        start = flat.buffer.clone()
        make_trainer(cfg.train).train(flat.module, mine, seed=1)
        drift[mu] = float((flat.buffer.view(torch.float32) - start.view(torch.float32)).norm())
    assert all(map(math.isfinite, drift.values())), drift
    assert drift[1.0] < 0.7 * drift[0.0]
