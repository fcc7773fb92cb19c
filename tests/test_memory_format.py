"""model.memory_format: channels_last makes every Conv2d hand on its output in NHWC order, so the layers after it
run on NHWC activations, while the parameters keep their place and layout in the flat buffer. The gradients are
the NCHW ones up to fp32 rounding; a run is, as ever, bitwise the single-process reference's on any number of
ranks; a model without convolutions is refused, naming the key."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import yaml
from conftest import MPI_TIMEOUT, run_mpi, write_config
from reference import one_thread, reference_run
from results import assert_bitwise, final_model

from mpifl.config import ConfigError, ModelConfig, load_config
from mpifl.learning.models import build_model, use_memory_format
from mpifl.wire.flat import FlatModel

CONFIG = """
seed: 4
rounds: 2
clients: {num_clients: 6, per_round: 5}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: cnn, kwargs: {channels: [4, 6]}, memory_format: channels_last}
train: {lr: 0.05, momentum: 0.5, batch_size: 16, local_epochs: 1, device: cpu}
eval: {every: 0}
output: {progress: false}
"""


def leaf_like() -> torch.nn.Module:
    """Convolutions with max pooling, the layers NHWC speeds up on a CPU."""
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(1, 8, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 5, padding=2),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 7 * 7, 10))


def gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_every_convolution_hands_on_nhwc_activations_and_the_gradients_are_the_nchw_ones_up_to_rounding():
    torch.manual_seed(0)
    nchw = leaf_like()
    nhwc = use_memory_format(copy.deepcopy(nchw), "channels_last")
    x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
    conv_out = nhwc[0](x)
    assert conv_out.is_contiguous(memory_format=torch.channels_last) and not conv_out.is_contiguous()
    torch.testing.assert_close(gradients(nhwc, x, y), gradients(nchw, x, y), rtol=1e-5, atol=1e-6)


def test_the_parameters_keep_their_layout_in_the_flat_buffer():
    cfg = ModelConfig(name="cnn", kwargs={"channels": [4]}, memory_format="channels_last")
    flat = FlatModel(build_model(cfg, seed=0, input_shape=(1, 8, 8), num_classes=10))
    assert all(p.is_contiguous() for p in flat.module.parameters())
    assert flat.module(torch.randn(3, 1, 8, 8)).shape == (3, 10)


def test_a_model_without_convolutions_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="model.memory_format: 'channels_last' changes the layout of Conv2d"):
        build_model(ModelConfig(name="mlp", memory_format="channels_last"), seed=0, input_shape=(4,), num_classes=3)


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_run_with_nhwc_activations_is_the_references_bitwise_on_any_number_of_ranks(tmp_path, ranks):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    with one_thread():
        want = reference_run(load_config(None, [], data=yaml.safe_load(CONFIG)))
    assert_bitwise(final_model(tmp_path / "run"), want)
    with one_thread():
        nchw = reference_run(load_config(None, ["model.memory_format=contiguous"], data=yaml.safe_load(CONFIG)))
    assert any(not np.array_equal(want[k], nchw[k]) for k in want)  # the layout reaches the result's last bits
