"""Natural client partitions from local files: the LEAF layout, a partition file, a partition plugin."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import MPI_TIMEOUT, rounds_logged, run_mpi, write_config

from mpifl.config import load_config
from mpifl.learning.datasets import load_dataset
from mpifl.learning.partitions import partition, partition_histogram

USERS = {"f0007": 5, "f0001": 3, "f0042": 7, "f0003": 4}  # LEAF users and their sample counts


def write_leaf(root, text: bool = False) -> None:
    """A tiny dataset in LEAF's layout: train/ and test/ JSON files of users, num_samples and user_data."""
    rng = np.random.default_rng(0)
    for split, scale in (("train", 1), ("test", 1)):
        folder = root / split
        folder.mkdir(parents=True)
        data = {}
        for user, n in USERS.items():
            n *= scale
            if text:
                data[user] = {"x": ["to be or not to be, that is the question"[i:i + 8] for i in range(n)],
                              "y": ["abcdefg"[i % 7] for i in range(n)]}
            else:
                data[user] = {"x": rng.random((n, 784)).round(3).tolist(), "y": rng.integers(0, 62, n).tolist()}
        names = sorted(USERS)
        for part, users in enumerate((names[:2], names[2:])):  # LEAF splits users over several files
            table = {"users": users, "num_samples": [len(data[u]["y"]) for u in users],
                     "user_data": {u: data[u] for u in users}}
            (folder / f"all_data_{part}_niid_0_keep_0_{split}_9.json").write_text(json.dumps(table))


def config(**data):
    return load_config(None, data={"data": data, "clients": {"num_clients": 4}, "model": {"name": "cnn"}})


def test_leaf_femnist_users_become_logical_clients_in_name_order(tmp_path):
    write_leaf(tmp_path)
    cfg = config(dataset="leaf", kwargs={"path": str(tmp_path)}, partition="natural")
    data = load_dataset(cfg.data)
    assert data.input_shape == (1, 28, 28) and len(data.y_train) == sum(USERS.values())
    parts = partition(cfg.data, data.y_train, 4, cfg.seed, data.clients)
    assert [len(p) for p in parts] == [USERS[u] for u in sorted(USERS)]  # f0001, f0003, f0007, f0042
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(data.y_train)))
    assert partition_histogram(cfg.data, data, 4, cfg.seed).sum(axis=1).tolist() == [3, 4, 5, 7]


def test_leaf_shakespeare_text_becomes_character_ids(tmp_path):
    write_leaf(tmp_path, text=True)
    data = load_dataset(config(dataset="leaf", kwargs={"path": str(tmp_path)}, partition="natural").data)
    assert data.x_train.shape == (sum(USERS.values()), 8) and data.x_train.dtype.is_floating_point is False
    assert int(data.y_train.max()) < 80 and data.x_train.min() >= 0


def test_a_natural_partition_needs_a_dataset_with_clients_and_enough_of_them(tmp_path):
    synthetic = config(dataset="synthetic", partition="natural")
    with pytest.raises(ValueError, match="'natural' needs a dataset with its own clients"):
        partition(synthetic.data, load_dataset(synthetic.data).y_train, 4, 0)
    write_leaf(tmp_path)
    leaf = config(dataset="leaf", kwargs={"path": str(tmp_path)}, partition="natural")
    data = load_dataset(leaf.data)
    with pytest.raises(ValueError, match="5 clients, but the data has 4"):
        partition(leaf.data, data.y_train, 5, 0, data.clients)


def test_a_partition_file_gives_each_client_its_indices(tmp_path):
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"1": [5, 3], "0": [0, 1, 2], "2": [4], "3": [6, 7]}))
    cfg = config(dataset="synthetic", kwargs={"num_samples": 20}, partition="file", partition_file=str(path))
    parts = partition(cfg.data, load_dataset(cfg.data).y_train, 4, 0)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 5], [4], [6, 7]]
    path.write_text(json.dumps([[0], [1], [99], [2]]))
    with pytest.raises(ValueError, match="client 2 has indices outside the 16 training samples"):
        partition(cfg.data, load_dataset(cfg.data).y_train, 4, 0)


def by_label(labels, num_clients, seed):
    """A partition plugin: client c gets every sample whose label is c mod num_clients."""
    return [np.flatnonzero(labels % num_clients == c) for c in range(num_clients)]


def test_a_partition_plugin_by_import_path(tmp_path):
    cfg = config(dataset="synthetic", partition="test_natural_partitions:by_label")
    labels = load_dataset(cfg.data).y_train
    parts = partition(cfg.data, labels, 4, 0)
    assert all((labels.numpy()[p] % 4 == c).all() for c, p in enumerate(parts))


def test_a_federated_run_on_leaf_users_under_mpiexec(tmp_path):
    write_leaf(tmp_path / "femnist")
    cfg = write_config(tmp_path / "c.yaml", f"""
rounds: 2
clients: {{num_clients: 4, per_round: 3, groups: 2}}
data: {{dataset: leaf, kwargs: {{path: "{tmp_path / 'femnist'}"}}, partition: natural}}
model: {{name: cnn, kwargs: {{channels: [4]}}}}
train: {{lr: 0.05, batch_size: 4}}
output: {{progress: false}}
""")
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert rounds_logged(tmp_path / "run") == [1, 2]
    assert "partition 'natural' of 19 training samples" in result.stderr
