"""FedDyn (Acar et al. 2021): each client's gradient state g_i kept on the rank that hosts it, the server's h
kept like any server state; equal to the paper's rule computed on whole models, bitwise, on any number of ranks,
with reduction groups, with g_i on disk, and across a resume on another number of ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from conftest import run_mpi, stopped_and_resumed, write_config
from reference import feddyn_reference
from results import assert_bitwise, final_model

from mpifl.config import ConfigError, load_config
from mpifl.learning.steps import regularized_gradients as dynamic_regularizer

CONFIG = """
seed: 7
rounds: 3
clients: {num_clients: 8, per_round: 6}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [9]}}
train: {lr: 0.05, momentum: 0.5, batch_size: 16, local_epochs: 1, device: cpu}
strategy: {name: feddyn, update: delta, weighting: equal, alpha: 0.1}
eval: {every: 0}
output: {progress: false}
"""


def reference(*overrides: str) -> dict[str, np.ndarray]:
    return feddyn_reference(load_config(None, list(overrides), data=yaml.safe_load(CONFIG)))


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),  # 2 client ranks, 3 participants each, one after the other
    (5, ("transport.chunk_mb=0.00001",)),  # 4 client ranks, 1 or 2 participants each, 10-byte chunks
    (4, ("clients.groups=3",)),  # the groups' partial sums of the deltas
    (4, ("strategy.control_ram_mb=0", "server.state=disk", "clients.per_round=3")),  # g_i and h on disk
    (3, ("train.device_copy=true",)),  # the GPU path's copies on the CPU: g_i and the regulariser on the replica
    (3, ("train.grad_accum_steps=2", "train.batch_size=8")),  # two backward passes a step, the term once a step
], ids=["2-client-ranks", "4-client-ranks-tiny-chunks", "reduction-groups", "on-disk", "device-replica",
        "gradient-accumulation"])
def test_feddyn_equals_the_papers_rule_on_whole_models_bitwise_on_any_number_of_ranks(tmp_path, ranks, overrides):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_bitwise(final_model(tmp_path / "run"), reference(*overrides))


def test_feddyn_is_not_fedavg():
    fedavg = load_config(None, ["strategy.name=fedavg"], data=yaml.safe_load(CONFIG))
    from reference import reference_run
    plain, dynamic = reference_run(fedavg), reference()
    assert any(not np.array_equal(plain[n], dynamic[n]) for n in plain)


def test_a_resumed_feddyn_run_on_another_number_of_ranks_equals_the_uninterrupted_one_bitwise(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    rest = stopped_and_resumed(tmp_path, cfg)
    assert "resume: FedDyn gradient states of" in rest.stderr
    assert_bitwise(final_model(tmp_path / "split"), reference())


def test_the_dynamic_regulariser_adds_alpha_times_the_drift_minus_the_gradient_state():
    w = torch.nn.Parameter(torch.tensor([2.0, -1.0]))
    anchor, state = torch.tensor([1.0, 1.0]), torch.tensor([0.5, -0.5])
    with dynamic_regularizer([w], [anchor], [state], alpha=0.25):
        (3 * w).sum().backward()
    # 3 + 0.25 * (w - x) - g_i = 3 + (0.25, -0.5) - (0.5, -0.5)
    assert torch.equal(w.grad, torch.tensor([2.75, 3.0]))


def test_with_gradient_accumulation_the_regulariser_counts_once_per_optimizer_step():
    w = torch.nn.Parameter(torch.tensor([2.0, -1.0]))
    anchor, state = torch.tensor([1.0, 1.0]), torch.tensor([0.5, -0.5])
    with dynamic_regularizer([w], [anchor], [state], alpha=0.25, backwards_per_step=2):
        for _ in range(2):  # two micro-batches, each loss divided by 2 as the trainer does
            ((3 * w).sum() / 2).backward()
    assert torch.equal(w.grad, torch.tensor([2.75, 3.0]))  # what one backward pass of the whole batch gives


@pytest.mark.parametrize("overrides,message", [
    (("strategy.weighting=samples",), "strategy.weighting: strategy .feddyn. averages the participants equally"),
    (("strategy.update=weights",), "strategy.update: strategy 'feddyn' keeps a vector per client"),
    (("secagg.enabled=true",), "secagg.enabled"),
    (("strategy.wire_dtype=float16",), "strategy.wire_dtype: a float16 update loses low bits of the delta .* g_i"),
])
def test_feddyn_refuses_what_it_cannot_take(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*overrides], data=yaml.safe_load(CONFIG))


def test_the_plan_sizes_each_g_i_by_the_parameters_that_train_not_batchnorms_statistics():
    from mpifl.cli.plan import model_bytes
    from mpifl.learning.datasets import load_dataset
    from mpifl.learning.models import build_model
    from mpifl.planning.memory import client_state_elements

    cfg = load_config(None, ["model.name=cnn", "model.kwargs={channels: [4, 8]}"], data=yaml.safe_load(CONFIG))
    digits = load_dataset(cfg.data)
    model = build_model(cfg.model, cfg.seed, digits.input_shape, digits.num_classes)
    assert any(n.endswith("running_mean") for n, _ in model.named_buffers())
    assert client_state_elements(cfg, model_bytes(cfg)) == sum(p.numel() for p in model.parameters())
