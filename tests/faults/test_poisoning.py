"""The poisoning faults: ``noise`` (a Gaussian Byzantine update) and ``label_flip`` (a client trained on flipped
labels), asked for in YAML, the same bits on any rank count and chunk size, and refused where they cannot act."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from conftest import MPI_TIMEOUT, run_mpi, same_model, write_config

from mpifl.config import ConfigError, load_config
from mpifl.learning.datasets import ClientData
from mpifl.planning.faults import FaultPlan, flipped_labels
from mpifl.roles.faults import FaultInjector
from mpifl.storage.hdf5 import load_tensors

BASE = """
seed: 4
rounds: 4
clients: {num_clients: 8, per_round: 6, accept_failures: true}
data: {dataset: synthetic, kwargs: {num_samples: 480, num_features: 8, num_classes: 4}}
model: {name: mlp, kwargs: {hidden: [8]}}
train: {lr: 0.1, batch_size: 8}
eval: {every: 1}
output: {progress: false}
"""


def config(faults: str, *overrides: str):
    return load_config(None, list(overrides), data={**yaml.safe_load(BASE), "faults": yaml.safe_load(faults)})


def run(tmp_path, name: str, faults: str, ranks: int, *overrides: str):
    path = write_config(tmp_path / f"{name}.yaml", BASE + f"faults: {faults}\n")
    result = run_mpi(ranks, "run", str(path), "--run-dir", str(tmp_path / name), *overrides, timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()], result.stderr


@pytest.mark.parametrize("faults,overrides,message", [
    ("[{kind: noise, clients: [1], std: 1, stage: send}]", (), "faults[0].stage: a 'noise' fault acts on the client"),
    ("[{kind: scale, clients: [1], std: 1}]", (), "faults[0].std: only a fault of kind 'noise' reads it"),
    ("[{kind: label_flip, clients: [1]}]", ("clients.ranks_per_client=2",),
     "faults[0].kind: a 'label_flip' fault acts where one rank trains its client"),
])
def test_a_poisoning_fault_where_it_cannot_act_is_refused_naming_its_key(faults, overrides, message):
    with pytest.raises(ConfigError) as err:
        config(faults, *overrides)
    assert message in str(err.value)


def test_a_label_flip_on_a_language_model_is_refused_as_it_has_no_classes():
    from conftest import ROOT

    with pytest.raises(ConfigError, match="faults\\[0\\].kind: 'label_flip' flips class labels, and train.trainer "
                                          "'causal_lm' predicts tokens"):
        load_config(ROOT / "configs" / "gpt2.yaml", ["faults=[{kind: label_flip, clients: [1]}]"])


def test_label_flipping_maps_each_class_to_its_mirror():
    assert flipped_labels(np.array([0, 1, 2, 3]), 4).tolist() == [3, 2, 1, 0]


def test_a_label_flip_poisons_only_the_struck_clients_training_data_in_its_rounds():
    plan = FaultPlan(config("[{kind: label_flip, clients: [2], rounds: [3]}]"))
    injector = FaultInjector(plan, rank=1, tick=lambda: None, classes=4)
    data = ClientData(torch.zeros(4, 8), torch.tensor([0, 1, 2, 3]))
    assert injector.poisoned(3, 2, data).y.tolist() == [3, 2, 1, 0]
    assert injector.poisoned(2, 2, data) is data and injector.poisoned(3, 1, data) is data
    assert data.y.tolist() == [0, 1, 2, 3]  # the rank's copy of the data is never changed


def test_noise_draws_the_same_values_on_any_rank_count_and_chunk_size(tmp_path):
    faults = "[{kind: noise, clients: [3, 5], std: 0.5}]"
    three, _ = run(tmp_path, "three", faults, 3)
    five, _ = run(tmp_path, "five", faults, 5, "transport.chunk_mb=0.0001")
    assert same_model(tmp_path / "three" / "model.h5", tmp_path / "five" / "model.h5")
    struck = [sorted(f["client"] for f in r.get("faults", [])) for r in three]
    assert struck == [sorted(c for c in (3, 5) if c in r["participants"]) for r in three]
    assert all(f["kind"] == "noise" and f["std"] == 0.5 and f["outcome"] == "folded"
               for r in three for f in r.get("faults", []))
    run(tmp_path, "clean", "[]", 3)
    assert not same_model(tmp_path / "three" / "model.h5", tmp_path / "clean" / "model.h5")  # FedAvg takes it in


def test_noise_of_std_0_sends_no_change_so_a_federation_of_free_riders_keeps_its_initial_model(tmp_path):
    # deltas: a mean of zeros is zero, where a weighted mean of equal weights may round its last bit
    run(tmp_path, "free", "[{kind: noise, fraction: 1.0, std: 0}]", 3, "rounds=2", "strategy.update=delta")
    run(tmp_path, "start", "[]", 3, "rounds=1", "train.trainer=none", "strategy.update=delta")  # the model as built
    final, start = (load_tensors(tmp_path / name / "model.h5") for name in ("free", "start"))
    assert all(torch.equal(final[name], start[name]) for name in start)


def test_clients_trained_on_flipped_labels_learn_the_mirror_classes(tmp_path):
    poisoned, err = run(tmp_path, "flipped", "[{kind: label_flip, fraction: 1.0}]", 3)
    clean, _ = run(tmp_path, "clean", "[]", 3)
    assert clean[-1]["eval"]["accuracy"] > 0.6 and poisoned[-1]["eval"]["accuracy"] < 0.25  # 4 classes: chance is 0.25
    assert all(f["kind"] == "label_flip" and f["outcome"] == "folded" for r in poisoned for f in r["faults"])
    assert "faults[0]: injecting 'label_flip' into logical client" in err
