"""Models and local training, without MPI."""
import math
import subprocess
import sys

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


def _trained(model="cnn", **train):
    """The weights (parameters and buffers, one flat fp32 tensor) after one client's local training with these
    train settings, on one thread; its result; the trainer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg, _, flat, mine = setup(model, **train)
        trainer = make_trainer(cfg.train)
        result = trainer.train(flat.module, mine, seed=5)
        return _weights(flat.module), result, trainer
    finally:
        torch.set_num_threads(threads)


def _weights(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().float().flatten() for t in module.state_dict().values()])


def test_stepping_inside_backward_gives_bitwise_the_weights_of_one_step_after_backward():
    for optimizer, extra in (("sgd", {}), ("sgd", {"momentum": 0.9, "weight_decay": 1e-3}), ("adam", {}),
                             ("adamw", {"weight_decay": 0.01}), ("sgd", {"prox_mu": 0.5})):
        settings = dict(optimizer=optimizer, lr=0.01, local_steps=6, batch_size=8, **extra)
        inside, _, trainer = _trained(step_in_backward=True, **settings)
        after, _, classic = _trained(step_in_backward=False, **settings)
        assert trainer.steps_in_backward() and not classic.steps_in_backward()
        assert torch.equal(inside, after), (optimizer, extra)


def test_steps_stay_after_backward_where_a_step_needs_every_gradient_first():
    from torch.optim.optimizer import register_optimizer_step_post_hook

    assert not _trained("mlp", local_steps=1)[2].steps_in_backward()  # off by default
    assert not _trained("mlp", local_steps=1, step_in_backward=True, grad_accum_steps=2)[2].steps_in_backward()
    assert not _trained("mlp", local_steps=1, step_in_backward=True, max_grad_norm=1.0)[2].steps_in_backward()
    handle = register_optimizer_step_post_hook(lambda *_: None)  # what SCAFFOLD's correction registers
    try:
        assert not _trained("mlp", local_steps=1, step_in_backward=True)[2].steps_in_backward()
    finally:
        handle.remove()
    assert _trained("mlp", local_steps=1, step_in_backward=True)[2].steps_in_backward()


def test_accumulating_two_half_batches_is_one_step_on_their_mean_gradient():
    # within one shuffled pass (3 steps of 16 samples), the same samples in the same order: equal to rounding
    whole, whole_result, _ = _trained("mlp", lr=0.1, batch_size=16, local_steps=3)
    halves, halves_result, _ = _trained("mlp", lr=0.1, batch_size=8, grad_accum_steps=2, local_steps=3)
    assert halves_result.local_steps == whole_result.local_steps == 3  # optimizer steps, not micro-batches
    assert not torch.equal(halves, whole)  # summed in another order
    assert torch.allclose(halves, whole, rtol=1e-4, atol=1e-6)


def test_an_epoch_of_accumulated_steps_counts_samples_per_step_as_batch_size_times_micro_batches():
    _, result, _ = _trained("mlp", batch_size=8, grad_accum_steps=2)
    assert result.local_steps == math.ceil(len(setup("mlp")[3]) / 16)


def test_clipping_bounds_every_step_by_the_gradient_norm():
    start = _weights(setup("mlp")[2].module)
    free, _, _ = _trained("mlp", lr=0.1, local_steps=4)
    clipped, _, _ = _trained("mlp", lr=0.1, local_steps=4, max_grad_norm=1e-3)
    assert float((clipped - start).norm()) <= 4 * 0.1 * 1e-3 * (1 + 1e-4)
    assert float((free - start).norm()) > 100 * float((clipped - start).norm())


class ScaledTwice(torch.nn.Module):
    """Uses its scale detached early in forward (a saved view its backward needs after the scale has stepped)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(64, 10)
        self.scale = torch.nn.Parameter(torch.ones(10))

    def forward(self, x):
        return self.first(x.flatten(1)) * self.scale.detach() * self.scale


def test_a_model_that_needs_a_stepped_parameter_in_backward_names_the_setting_that_trains_it():
    import pytest

    from mpifl.config import TrainConfig
    from mpifl.learning.datasets import ClientData
    from mpifl.learning.trainers import TorchTrainer

    data = ClientData(torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))
    with pytest.raises(RuntimeError, match=r"set train\.step_in_backward: false"):
        TorchTrainer(TrainConfig(batch_size=4, step_in_backward=True)).train(ScaledTwice(), data, seed=0)
    assert TorchTrainer(TrainConfig(batch_size=4, step_in_backward=False)).train(ScaledTwice(), data, seed=0)


def test_lenet_is_sized_from_28x28_images_and_learns_them():
    from mpifl.config import ModelConfig
    from mpifl.learning.datasets import ClientData

    model = build_model(ModelConfig(name="lenet"), 0, (1, 28, 28), 10)
    assert sum(p.numel() for p in model.parameters()) == 44_426  # NIID-Bench's simple CNN on (Fashion-)MNIST
    generator = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 10
    x = torch.rand(200, 1, 28, 28, generator=generator) * 0.3
    for label in range(10):  # each class lights its own rows of the image
        x[y == label, :, 2 * label + 4:2 * label + 6, :] += 0.7
    cfg = load_config(None, data={"train": {"lr": 0.05, "momentum": 0.9, "local_epochs": 15, "batch_size": 20}})
    before = evaluate(model, x, y, make_loss("cross_entropy"), 200)
    make_trainer(cfg.train).train(model, ClientData(x, y), seed=1)
    after = evaluate(model, x, y, make_loss("cross_entropy"), 200)
    assert after["loss"] < before["loss"] / 4 and after["accuracy"] > 0.95


def test_lenet_on_images_too_small_to_pool_twice_is_refused_before_mpi_starts():
    from mpifl.cli.preflight import check_model
    from mpifl.config import ConfigError

    cfg = load_config(None, ["model.name=lenet", "data.dataset=digits"])  # 8x8 images
    try:
        check_model(cfg)
    except ConfigError as err:
        assert "inputs of 8x8 are too small" in str(err) and "model.name" in str(err)
    else:
        raise AssertionError("lenet on 8x8 digits was accepted")


def test_after_start_up_a_ranks_first_optimizer_imports_nothing_so_round_one_trains_without_a_silent_pause():
    # torch's first optimizer imports torch._dynamo (seconds of CPU); a client rank loads it before round 1, where
    # the silence would count against the watchdog's first-update deadline
    script = """
import sys
import torch
from mpifl.config import TrainConfig
from mpifl.learning.trainers import load_optimizer_machinery, make_optimizer
load_optimizer_machinery()
before = set(sys.modules)
for name in ("sgd", "adam", "adamw"):
    make_optimizer([torch.zeros(3, requires_grad=True)], TrainConfig(optimizer=name))
print(sorted(set(sys.modules) - before))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_each_rank_of_a_client_group_draws_its_own_dropout_masks_and_one_rank_draws_the_clients():
    """Two ranks with equal shares of a batch would otherwise drop the same units of different samples."""
    from types import SimpleNamespace

    from mpifl.learning.trainers import model_randomness_seed, seed_model_randomness

    def mask(parallel) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            seed_model_randomness(model_randomness_seed(7, parallel), torch.device("cpu"))
            return torch.nn.functional.dropout(torch.ones(64), 0.5)

    ranks = [mask(SimpleNamespace(rank=r, size=2)) for r in range(2)]
    assert not torch.equal(ranks[0], ranks[1])
    assert torch.equal(ranks[1], mask(SimpleNamespace(rank=1, size=2)))  # the same on any number of groups
    assert model_randomness_seed(7, None) == 7
