"""Under mpiexec: the streamed FedAvg equals a plain whole-model numpy reference, bitwise."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import MPI_TIMEOUT, run_mpi, write_config
from mpifl.config import load_config
from mpifl.data import client_data, load_dataset, partition
from mpifl.federation import client_seed, sample_clients
from mpifl.flat import FlatModel
from mpifl.models import build_model
from mpifl.storage import load_tensors
from mpifl.trainers import make_trainer

CONFIG = """
seed: 3
rounds: 3
clients: {{num_clients: 8, per_round: 6}}
data: {{dataset: digits, partition: dirichlet, alpha: 0.5}}
model: {{name: "fl_helpers:tiny_mlp", dtype: {dtype}}}
train: {{trainer: "fl_helpers:NoiseTrainer", lr: 0.01}}
strategy: {{weighting: {weighting}}}
transport: {{chunk_mb: {chunk_mb}}}
eval: {{every: 0}}
output: {{progress: false}}
"""


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round fp32 to bf16 (round to nearest even), returning the 16-bit patterns."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def fma32(acc: np.ndarray, w: float, x: np.ndarray) -> np.ndarray:
    """acc + w*x with a single rounding to fp32, like torch's fused add_(x, alpha=w)."""
    wide = np.longdouble
    return (acc.astype(wide) + wide(w) * x.astype(wide)).astype(np.float32)


def reference_fedavg(updates: list[tuple[float, np.ndarray]]) -> np.ndarray:
    """Whole-model weighted mean in fp32, summed in ascending client id order."""
    (w0, x0), rest = updates[0], updates[1:]
    acc = np.float32(w0) * x0
    for w, x in rest:
        acc = fma32(acc, w, x)
    return acc / np.float32(sum(w for w, _ in updates))


def reference_run(cfg) -> dict[str, np.ndarray]:
    """All client models in memory, averaged per tensor; returns final tensors as raw bits."""
    dataset = load_dataset(cfg.data)
    flat = FlatModel(build_model(cfg.model, cfg.seed, dataset.input_shape, dataset.num_classes))
    parts = partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed)
    trainer = make_trainer(cfg.train)
    bf16 = cfg.model.dtype == "bfloat16"
    for rnd in range(1, cfg.rounds + 1):
        start = flat.buffer.clone()
        updates = []
        for c in sample_clients(cfg.seed, rnd, cfg.clients.num_clients, cfg.clients_per_round()):
            flat.buffer.copy_(start)
            result = trainer.train(flat.module, client_data(dataset, parts[c]), client_seed(cfg.seed, rnd, c))
            weight = float(result.num_samples) if cfg.strategy.weighting == "samples" else 1.0
            updates.append((weight, {n: t.float().numpy().copy() for n, t in flat.tensors()}))
        for name, tensor in flat.tensors():
            mean = reference_fedavg([(w, x[name]) for w, x in updates])
            bits = fp32_to_bf16_bits(mean) if bf16 else mean.view(np.uint32)
            tensor.view(torch.int16 if bf16 else torch.int32).copy_(torch.from_numpy(bits.view(np.int16 if bf16 else np.int32)))
    return {n: t.view(torch.int16 if bf16 else torch.int32).numpy().copy() for n, t in flat.tensors()}


def run_bits(tmp_path, ranks: int, name: str, **params) -> dict[str, np.ndarray]:
    cfg_path = write_config(tmp_path / f"{name}.yaml", CONFIG.format(**params))
    run = run_mpi(ranks, "run", str(cfg_path), "--run-dir", str(tmp_path / name), timeout=MPI_TIMEOUT)
    assert run.returncode == 0, run.stderr
    tensors = load_tensors(tmp_path / name / "model.h5")
    return {n: t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy() for n, t in tensors.items()}


@pytest.mark.parametrize("ranks,dtype,chunk_bytes,weighting", [
    (2, "float32", 3, "samples"),      # 1 client rank hosting all 8 clients; 1-element chunks
    (3, "bfloat16", 10, "samples"),    # bf16 travels as raw bytes; chunks of 5 elements
    (6, "float32", 1000, "equal"),     # 5 client ranks, chunk size dividing nothing
    (3, "float32", 16 * 2**20, "samples"),  # one chunk per segment
])
def test_streamed_fedavg_equals_whole_model_reference_bitwise(tmp_path, ranks, dtype, chunk_bytes, weighting):
    params = dict(dtype=dtype, chunk_mb=chunk_bytes / 2**20, weighting=weighting)
    got = run_bits(tmp_path, ranks, "run", **params)
    cfg = load_config(None, data=__import__("yaml").safe_load(CONFIG.format(**params)))
    expected = reference_run(cfg)
    assert got.keys() == expected.keys()
    for name in expected:
        assert np.array_equal(got[name], expected[name]), f"{name} differs from the reference"


def test_same_config_twice_gives_identical_models_on_any_rank_count(tmp_path):
    params = dict(dtype="float32", chunk_mb=64 / 2**20, weighting="samples")
    first = run_bits(tmp_path, 3, "a", **params)
    second = run_bits(tmp_path, 3, "b", **params)
    third = run_bits(tmp_path, 5, "c", **params)
    for name in first:
        assert np.array_equal(first[name], second[name]) and np.array_equal(first[name], third[name]), name
