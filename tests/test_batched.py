"""Clients trained as lanes of one batched model (``train.batched_clients``, mpifl.learning.batched): each lane
trains its client as the one-at-a-time loop does, within rounding; a client trains to the same bits in any lane,
beside any batch mates; what cannot be a lane is refused by name."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mpifl.config import ConfigError, TrainConfig, load_config
from mpifl.learning.batched import Lane, batched_problem, lane_steps, train_lanes
from mpifl.learning.datasets import ClientData
from mpifl.learning.steps import corrected_steps, split
from mpifl.learning.trainers import TorchTrainer

# One lane against the one-at-a-time loop: the same steps summed in another order (a padded mean, grouped
# kernels). Measured here at up to 6e-7 of the update's norm after 2 local epochs (SGD with momentum, Adam).
TOLERANCE = 1e-5


def clients(sizes: list[int], shape: tuple[int, ...] = (12,), classes: int = 4, seed: int = 0) -> list[ClientData]:
    g = torch.Generator().manual_seed(seed)
    return [ClientData(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g))
            for n in sizes]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 4))


def one_at_a_time(model: nn.Module, data: ClientData, seed: int, cfg: TrainConfig,
                  correction: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], dict, int | None]:
    """``data`` trained alone by the built-in loop from ``model``'s weights (left as they were)."""
    start = {k: v.clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters() if p.requires_grad]
    steps = corrected_steps(params, split(correction, params)) if correction is not None else _nothing()
    with steps:
        result = TorchTrainer(cfg).train(model, data, seed)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_state_dict(start)
    return trained, result.metrics, result.local_steps


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b - start||: how far a lane lands from the loop, against how far the loop moved."""
    num = sum(float(((a[k] - b[k]).double() ** 2).sum()) for k in b)
    den = sum(float(((b[k] - start[k]).double() ** 2).sum()) for k in b)
    return (num / den) ** 0.5


BASE = TrainConfig(optimizer="sgd", lr=0.1, momentum=0.9, batch_size=8, local_epochs=2)


@pytest.mark.parametrize("changes", [
    {},
    {"momentum": 0.0, "weight_decay": 0.01},
    {"optimizer": "adam", "lr": 0.01, "weight_decay": 0.01},
    {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1},
    {"prox_mu": 0.5},
    {"max_grad_norm": 0.5},
    {"grad_accum_steps": 2},
    {"local_steps": 3, "local_epochs": 1},
    {"loss": "mse"},
], ids=["sgd-momentum", "sgd-weight-decay", "adam", "adamw", "fedprox", "clipped", "accumulated", "fixed-steps",
        "mse"])
def test_each_lane_trains_its_client_as_the_one_at_a_time_loop_does_within_rounding(changes):
    cfg = dataclasses.replace(BASE, **changes)
    model, data = mlp(), clients([5, 23, 17, 8])
    if cfg.loss == "mse":  # targets shaped like the output
        data = [ClientData(d.x, nn.functional.one_hot(d.y, 4).float()) for d in data]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    lanes = [Lane(d, 100 + i) for i, d in enumerate(data)]
    for (weights, result), lane in zip(train_lanes(model, lanes, cfg, width=6), lanes):
        want, metrics, steps = one_at_a_time(model, lane.data, lane.seed, cfg)
        assert relative_distance(weights, want, start) < TOLERANCE
        assert result.local_steps == steps == lane_steps(len(lane.data), cfg)
        assert result.num_samples == len(lane.data)
        assert result.metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())  # the model is left as it was


def test_a_convolutional_model_with_feature_noise_trains_as_it_does_alone():
    cfg = dataclasses.replace(BASE, momentum=0.5)
    model = small_cnn()
    data = [dataclasses.replace(d, noise_std=0.3) for d in clients([9, 14, 30], shape=(1, 8, 8))]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    lanes = [Lane(d, 7 + i) for i, d in enumerate(data)]
    for (weights, _), lane in zip(train_lanes(model, lanes, cfg, width=3), lanes):
        assert relative_distance(weights, one_at_a_time(model, lane.data, lane.seed, cfg)[0], start) < TOLERANCE


def test_a_client_trains_to_the_same_bits_in_any_lane_beside_any_batch_mates():
    """What makes a batched run bitwise equal on any number of ranks: the rank count changes who shares a batch,
    never a client's result (for one batch width)."""
    model, cfg = small_cnn(), dataclasses.replace(BASE, optimizer="adam", lr=0.01)
    data = clients([11, 3, 40, 19, 26], shape=(1, 8, 8))
    lane = lambda i: Lane(data[i], 50 + i)  # noqa: E731
    alone = train_lanes(model, [lane(0)], cfg, width=4)[0][0]
    for batch in ([lane(0), lane(1), lane(2)], [lane(3), lane(4), lane(2), lane(0)], [lane(2), lane(0)]):
        position = next(i for i, b in enumerate(batch) if b.seed == 50)
        got = train_lanes(model, batch, cfg, width=4)[position][0]
        assert all(torch.equal(got[n], alone[n]) for n in alone)


def test_a_lane_with_fewer_steps_is_frozen_exactly_while_its_mates_go_on():
    model, cfg = mlp(), dataclasses.replace(BASE, local_epochs=1)
    small, large = clients([4, 64])
    short = train_lanes(model, [Lane(small, 1)], cfg, width=2)[0][0]  # 1 step, alone
    beside = train_lanes(model, [Lane(small, 1), Lane(large, 2)], cfg, width=2)  # then 7 frozen steps
    assert beside[0][1].local_steps == 1 and beside[1][1].local_steps == 8
    assert all(torch.equal(beside[0][0][n], short[n]) for n in short)


def test_scaffolds_lane_correction_steps_as_corrected_steps_do_for_one_client():
    model, cfg = mlp(), dataclasses.replace(BASE, momentum=0.0)
    data = clients([10, 21, 15])
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    size = sum(p.numel() for p in model.parameters())
    corrections = [torch.randn(size, generator=torch.Generator().manual_seed(i)) * 0.1 for i in range(3)]
    lanes = [Lane(d, 30 + i, corrections[i]) for i, d in enumerate(data)]
    for (weights, _), lane in zip(train_lanes(model, lanes, cfg, width=3), lanes):
        want = one_at_a_time(model, lane.data, lane.seed, cfg, lane.correction)[0]
        assert relative_distance(weights, want, start) < TOLERANCE
    uncorrected = train_lanes(model, [Lane(data[0], 30)], cfg, width=3)[0][0]
    assert relative_distance(uncorrected, train_lanes(model, lanes, cfg, width=3)[0][0], start) > 1e-3


@pytest.mark.parametrize("layer,named", [
    (nn.BatchNorm1d(16), "BatchNorm1d"),
    (nn.Dropout(0.2), "Dropout"),
])
def test_a_model_that_draws_or_keeps_running_state_in_training_is_refused_naming_the_module(layer, named):
    model = nn.Sequential(nn.Linear(12, 16), layer, nn.Linear(16, 4))
    problem = batched_problem(model, BASE)
    assert problem is not None and "'1'" in problem and named in problem


def test_layers_that_draw_nothing_in_training_are_accepted():
    model = nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.Dropout(0.0),
                          nn.BatchNorm1d(16, track_running_stats=False), nn.Linear(16, 4))
    assert batched_problem(model, BASE) is None


def test_a_plug_in_loss_without_a_reduction_parameter_is_refused():
    cfg = dataclasses.replace(BASE, loss="torch.nn.functional:kl_div")
    assert batched_problem(mlp(), cfg) is None  # kl_div takes reduction
    cfg = dataclasses.replace(BASE, loss="math:dist")
    assert "reduction" in (batched_problem(mlp(), cfg) or "")


def test_a_batch_takes_one_to_width_clients():
    with pytest.raises(ValueError, match="width 2"):
        train_lanes(mlp(), [Lane(d, i) for i, d in enumerate(clients([3, 3, 3]))], BASE, width=2)


@pytest.mark.parametrize("overrides,key", [
    (["train.ditto_lambda=0.5", "strategy.update=delta"], "train.ditto_lambda"),
    (["strategy.name=feddyn", "strategy.update=delta"], "strategy.name"),
    (["clients.ranks_per_client=2"], "clients.ranks_per_client"),
    (["model.local=['0.*']"], "model.local"),
    (["clock.mode=fedbuff", "clock.buffer=2"], "clock.mode"),
    (["train.step_in_backward=true"], "train.step_in_backward"),
    (["train.trainer=none"], "train.trainer"),
])
def test_what_lanes_cannot_carry_is_refused_naming_its_key(overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}:.*batched_clients"):
        load_config(None, ["train.batched_clients=4", *overrides])


def test_scaffold_fedprox_and_reduction_groups_are_accepted():
    for overrides in (["strategy.name=scaffold", "strategy.update=delta"], ["train.prox_mu=0.1"],
                      ["clients.groups=2"]):
        assert load_config(None, ["train.batched_clients=4", *overrides]).train.batched_clients == 4
