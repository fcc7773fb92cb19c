"""Noise-based feature skew (``data.feature_noise``, NIID-Bench's "noise-based feature imbalance"): client k of n
trains on its inputs plus fresh Gaussian noise of std scale * k / (n - 1), its validation split is noised once, the
server scores the held-out set at every client's level, and a run stays bitwise the same on any number of ranks,
equal to the whole-model reference, and across a resume."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from conftest import run_mpi, stopped_and_resumed, write_config
from reference import one_thread, reference_run
from results import assert_bitwise, final_model
from torch import nn

from mpifl.config import ConfigError, TrainConfig, load_config
from mpifl.config.checks import config_warnings
from mpifl.learning.datasets import ClientData, Dataset, surveyed_data
from mpifl.learning.noise import batch_noise, client_noise_std, noise_generator, score_over_levels
from mpifl.learning.parallel import share_of
from mpifl.learning.trainers import TorchTrainer
from mpifl.planning.memory import server_data_bytes
from mpifl.roles.data import ClientSlices

CONFIG = """
seed: 5
rounds: 3
clients: {num_clients: 6, per_round: 4}
data: {dataset: digits, partition: iid, feature_noise: 0.3}
model: {name: "fl_helpers:tiny_mlp"}
train: {lr: 0.05, batch_size: 16, local_epochs: 1}
eval: {every: 0}
output: {progress: false}
"""


class Recorder(nn.Module):
    """A linear classifier that keeps every input batch it is given."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.linear, self.seen = nn.Linear(features, 3), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.detach().clone())
        return self.linear(x)


def inputs_seen(noise_std: float, epochs: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Train a recorder for ``epochs`` passes over 8 zero inputs in one batch; the inputs and what it saw."""
    x, y = torch.zeros(8, 64), torch.arange(8) % 3
    model = Recorder(64)
    TorchTrainer(TrainConfig(lr=0.1, batch_size=8, local_epochs=epochs)).train(model, ClientData(x, y, noise_std), 7)
    return x, model.seen


def test_the_levels_run_from_clean_inputs_to_the_full_scale():
    assert [client_noise_std(0.1, k, 10) for k in (0, 9)] == [0.0, 0.1]
    assert client_noise_std(0.1, 3, 10) == pytest.approx(0.1 * 3 / 9)


def test_a_client_without_noise_trains_on_its_inputs_exactly():
    x, seen = inputs_seen(0.0)
    assert torch.equal(seen[0], x)


def test_a_noisy_client_sees_gaussian_noise_of_its_level_drawn_afresh_for_every_batch():
    _, seen = inputs_seen(0.5, epochs=2)
    first, second = seen  # the same 8 samples, once per epoch
    assert float(first.std()) == pytest.approx(0.5, rel=0.1) and abs(float(first.mean())) < 0.05
    assert not torch.equal(first, second)
    _, again = inputs_seen(0.5, epochs=2)
    assert all(torch.equal(a, b) for a, b in zip(seen, again))  # the client's training seed decides the draws


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_ranks_of_one_client_add_the_slices_of_one_batchs_noise(ranks):
    whole = batch_noise(10, (1, 4, 4), 0.2, noise_generator(42))
    shares = [batch_noise(10, (1, 4, 4), 0.2, noise_generator(42), lambda t, r=r: share_of(t, r, ranks))
              for r in range(ranks)]
    assert torch.equal(torch.cat(shares), whole)


def digits_slices(scale: float, val_fraction: float = 0.25) -> ClientSlices:
    x, y = torch.rand(60, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(60) % 10
    dataset = Dataset(x, y, x[:5], y[:5])
    parts = np.array_split(np.arange(60), 4)
    return ClientSlices(dataset, parts, val_fraction, seed=1, feature_noise=scale)


def test_each_client_carries_its_level_and_its_validation_split_is_noised_once():
    noisy, clean = digits_slices(0.3), digits_slices(0.0)
    assert [noisy[c][0].noise_std for c in range(4)] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert torch.equal(noisy[0][1].x, clean[0][1].x)  # client 0's level is 0
    assert not torch.equal(noisy[3][1].x, clean[3][1].x)
    assert float((noisy[3][1].x - clean[3][1].x).std()) == pytest.approx(0.3, rel=0.2)
    assert torch.equal(noisy[3][1].x, digits_slices(0.3)[3][1].x)  # the same inputs at every evaluation
    assert torch.equal(noisy[3][0].x, clean[3][0].x)  # training inputs are noised batch by batch, not here


def test_the_held_out_set_is_scored_at_every_clients_level_and_averaged():
    x = torch.zeros(2000, 8)
    stds = []
    score = score_over_levels(lambda copy: stds.append(float(copy.std())) or {"std": stds[-1]}, x, 0.4, 5, root_seed=2)
    assert stds == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4], abs=0.01)
    assert score["std"] == pytest.approx(sum(stds) / 5)
    again = score_over_levels(lambda copy: {"sum": float(copy.sum())}, x, 0.4, 5, root_seed=2)
    assert again == score_over_levels(lambda copy: {"sum": float(copy.sum())}, x, 0.4, 5, root_seed=2)


def test_the_plan_counts_the_servers_noisy_copy_of_the_held_out_inputs():
    cfg = load_config(None, [], data=yaml.safe_load(CONFIG))
    _, noisy = surveyed_data(cfg.data)
    _, plain = surveyed_data(load_config(None, ["data.feature_noise=0"], data=yaml.safe_load(CONFIG)).data)
    assert server_data_bytes(noisy) - server_data_bytes(plain) == noisy.noisy_copy > 0
    held_out = plain.test // (64 * 4 + 8)  # each held-out sample: 8x8 float32 inputs and an int64 label
    assert noisy.noisy_copy == held_out * 64 * 4


@pytest.mark.parametrize("overrides,message", [
    (("train.trainer=none",), "data.feature_noise: the built-in 'torch' trainer adds the noise"),
    (("clients.num_clients=1", "clients.per_round=1"), "data.feature_noise: the levels run from 0"),
    (("data.feature_noise=-0.1",), "data.feature_noise"),
])
def test_a_setting_that_cannot_add_the_noise_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, list(overrides), data=yaml.safe_load(CONFIG))


def test_many_clients_with_frequent_held_out_evaluations_are_warned_of_the_cost():
    many = load_config(None, ["clients.num_clients=500", "eval.every=1"], data=yaml.safe_load(CONFIG))
    assert any(w.startswith("data.feature_noise: each held-out evaluation") and "500 evaluations in one" in w
               for w in config_warnings(many))
    assert not any("feature_noise" in w for w in config_warnings(load_config(None, ["eval.every=1"],
                                                                               data=yaml.safe_load(CONFIG))))


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),
    (5, ("transport.chunk_mb=0.00001",)),
    (4, ("clients.placement=per_round", "clients.groups=3", "clients.group_by=cost")),
], ids=["2-client-ranks", "4-client-ranks-tiny-chunks", "per-round-placement-groups"])
def test_a_noisy_run_equals_the_whole_model_reference_bitwise_on_any_number_of_ranks(tmp_path, ranks, overrides):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    with one_thread():  # as every rank trains
        want = reference_run(load_config(cfg, list(overrides)))
    assert_bitwise(final_model(tmp_path / "run"), want)


def test_the_noise_changes_what_clients_learn():
    noisy = reference_run(load_config(None, [], data=yaml.safe_load(CONFIG)))
    clean = reference_run(load_config(None, ["data.feature_noise=0"], data=yaml.safe_load(CONFIG)))
    assert any(not np.array_equal(noisy[n], clean[n]) for n in noisy)


def test_a_resumed_noisy_run_equals_the_uninterrupted_one_bitwise(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    stopped_and_resumed(tmp_path, cfg, resume_ranks=4)
    with one_thread():
        want = reference_run(load_config(cfg, []))
    assert_bitwise(final_model(tmp_path / "split"), want)


def test_the_server_scores_every_level_and_a_clean_run_scores_higher(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace("eval: {every: 0}", "eval: {every: 3}")
                       .replace("feature_noise: 0.3", "feature_noise: 3.0"))
    for name, extra in (("noisy", ()), ("clean", ("data.feature_noise=0",))):
        result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / name), *extra)
        assert result.returncode == 0, result.stderr[-3000:]
    import json
    accuracy = {name: json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])["eval"]["accuracy"]
                for name in ("noisy", "clean")}
    assert accuracy["clean"] > accuracy["noisy"] > 0.0
