"""Natural client partitions from local files: the LEAF layout, a partition file, a partition plugin."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from conftest import MPI_TIMEOUT, mpifl_here, rounds_logged, run_mpi, write_config

from mpifl.config import load_config
from mpifl.learning.datasets import client_source, load_dataset, surveyed_dataset
from mpifl.learning.partitions import checked_partition, partition, partition_counts

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
    assert partition_counts(cfg.data, data, 4, cfg.seed)[0].sum(axis=1).tolist() == [3, 4, 5, 7]


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


def write_leaf_user(root, user: str, x: list, y: list, file: str = "extra.json") -> None:
    """One more training file of one LEAF user (``x`` and ``y`` as given)."""
    (root / "train" / file).write_text(json.dumps({"users": [user], "num_samples": [len(y)],
                                                   "user_data": {user: {"x": x, "y": y}}}))


def test_a_natural_split_with_an_empty_client_is_refused_as_a_partition_file_s_would_be_naming_the_user(tmp_path):
    write_leaf(tmp_path)
    write_leaf_user(tmp_path, "f9999", [], [])  # the fifth user in name order: client 4
    leaf = config(dataset="leaf", kwargs={"path": str(tmp_path)}, partition="natural")
    source = client_source(leaf.data)
    data = surveyed_dataset(source, *source.survey())  # as the run's ranks and mpifl validate have it
    assert len(partition(leaf.data, data.y_train, 4, 0, data.clients, data.natural_name)) == 4  # f9999 left out
    with pytest.raises(ValueError, match=r"^data.partition 'natural' \(the clients of data.dataset 'leaf'\): "
                                         r"client 4 \(LEAF user 'f9999'\) holds no samples"):
        partition(leaf.data, data.y_train, 5, 0, data.clients, data.natural_name)


def test_a_natural_split_names_a_refused_client_as_the_data_does_too():
    named = {0: "table client id 'w02'", 1: "", 2: "table client id 7"}.get
    with pytest.raises(ValueError, match=r"^here: sample 3 is held by client 0 \(table client id 'w02'\) and "
                                         r"client 2 \(table client id 7\) \(a sample"):
        checked_partition([np.array([0, 3]), np.array([1]), np.array([2, 3])], 4, 3, "here", named)
    with pytest.raises(ValueError, match=r"^here: client 1 lists sample 1 twice"):  # no name: the number only
        checked_partition([np.array([0]), np.array([1, 1]), np.array([2])], 4, 3, "here", named)


def own_split(kind: str = "ok"):
    """A dataset plug-in with its own split (the fifth item): 4 clients of 10 samples, one empty, one sample held
    twice, or one client's indices floats, when ``kind`` says so."""
    rng = np.random.default_rng(0)
    parts = [np.arange(10 * c, 10 * c + 10) for c in range(4)]
    if kind == "empty":
        parts[2] = np.array([], dtype=np.int64)
    if kind == "dup":
        parts[3] = np.append(parts[3], 0)
    if kind == "float":  # whole numbers, but floats: 10.0, 11.0, ...
        parts[1] = parts[1].astype(np.float64)
    if kind == "fraction":
        parts[2] = [20, 21.5, 22]
    return (rng.random((40, 3)).astype(np.float32), rng.integers(0, 3, 40), rng.random((5, 3)).astype(np.float32),
            rng.integers(0, 3, 5), parts)


@pytest.mark.parametrize("kind,error", [
    ("empty", "client 2 holds no samples"),
    ("dup", "sample 0 is held by client 0 and client 3"),
    ("float", r"client 1's indices are a float64 array; sample indices must have an integer dtype \(whole-number "
              r"floats such as 3.0 are refused too"),
    ("fraction", "client 2's indices are a float64 array"),
])
def test_a_dataset_plugin_s_own_split_is_checked_as_a_partition_file_is(kind, error):
    cfg = config(dataset="test_natural_partitions:own_split", kwargs={"kind": kind}, partition="natural")
    data = load_dataset(cfg.data)
    with pytest.raises(ValueError, match=r"^data.partition 'natural' \(the clients of data.dataset "
                                         rf"'test_natural_partitions:own_split'\): {error}"):
        partition(cfg.data, data.y_train, 4, 0, data.clients)
    ok = config(dataset="test_natural_partitions:own_split", partition="natural")
    assert [len(p) for p in partition(ok.data, load_dataset(ok.data).y_train, 4, 0, load_dataset(ok.data).clients)] \
        == [10, 10, 10, 10]


def test_the_run_s_partition_line_counts_the_samples_of_the_users_taken_of_how_many(tmp_path):
    from mpifl.roles.data import partition_scope

    write_leaf(tmp_path)
    leaf = config(dataset="leaf", kwargs={"path": str(tmp_path)}, partition="natural")
    source = client_source(leaf.data)
    data = surveyed_dataset(source, *source.survey())
    taken = replace(leaf, clients=replace(leaf.clients, num_clients=3))  # f0001, f0003, f0007: 3 + 4 + 5 samples
    histogram, validation = partition_counts(taken.data, data, 3, 0)
    assert partition_scope(taken, data, histogram, validation) == ("12 training samples: those of the first 3 of the "
                                                                   "data's 4 clients (LEAF users), 19 samples in all")
    assert partition_scope(leaf, data, *partition_counts(leaf.data, data, 4, 0)) == "19 training samples"


def test_a_partition_file_gives_each_client_its_indices(tmp_path):
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"1": [5, 3], "0": [0, 1, 2], "2": [4], "3": [6, 7]}))
    cfg = config(dataset="synthetic", kwargs={"num_samples": 20}, partition="file", partition_file=str(path))
    parts = partition(cfg.data, load_dataset(cfg.data).y_train, 4, 0)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 5], [4], [6, 7]]
    path.write_text(json.dumps([[0], [1], [99], [2]]))
    with pytest.raises(ValueError, match="client 2 has indices outside the 16 training samples"):
        partition(cfg.data, load_dataset(cfg.data).y_train, 4, 0)


def file_partition(tmp_path, table, num_clients: int = 4):
    """The partition of ``table`` written as a partition file, over 16 synthetic training samples."""
    path = tmp_path / "split.json"
    path.write_text(table if isinstance(table, str) else json.dumps(table))
    cfg = config(dataset="synthetic", kwargs={"num_samples": 20}, partition="file", partition_file=str(path))
    return partition(cfg.data, load_dataset(cfg.data).y_train, num_clients, 0)


def test_a_partition_file_keyed_from_1_is_refused_not_renumbered(tmp_path):
    with pytest.raises(ValueError, match=r"split.json': no entry for client 0 \(keys are client ids 0 to 3, for "
                                         r"clients.num_clients=4; the file has 1-4\)"):
        file_partition(tmp_path, {"1": [0], "2": [1], "3": [2], "4": [3]})
    with pytest.raises(ValueError, match="no entry for clients 1,3"):
        file_partition(tmp_path, {"0": [0], "2": [1], "4": [2], "5": [3]})


def test_a_partition_file_s_keys_must_be_client_ids(tmp_path):
    with pytest.raises(ValueError, match=r"keys are client ids 0 to 3; 'alice', '01' are not"):
        file_partition(tmp_path, {"0": [0], "alice": [1], "01": [2], "3": [3]})


def test_a_partition_file_s_clients_past_num_clients_are_left_out_as_a_list_s_are(tmp_path):
    by_id = file_partition(tmp_path, {"0": [0], "1": [1], "2": [2], "3": [3], "4": [4]})
    assert [p.tolist() for p in by_id] == [[0], [1], [2], [3]]
    assert [p.tolist() for p in file_partition(tmp_path, [[0], [1], [2], [3], [4]])] == [[0], [1], [2], [3]]


@pytest.mark.parametrize("table,error", [
    ([[0], [1, 5.5], [2], [3]], "client 1's index 5.5 is not an integer"),
    ([[0], [1, "7"], [2], [3]], "client 1's index '7' is not an integer"),
    ([[0], [1, True], [2], [3]], "client 1's index True is not an integer"),
    ([[0, 3], [1], [2, 3], [4]], "sample 3 is held by client 0 and client 2"),
    ([[0], [1, 1], [2], [3]], "client 1 lists sample 1 twice"),
    ([[0], [], [2], [3]], "client 1 holds no samples"),
    ({"0": [0], "1": [1], "2": [], "3": [3]}, "client 2 holds no samples"),
    ([[0], [1], [2], 3], "client 3's entry is 3, not a list of sample indices"),
    ([[0], [1], [2], [10**30]], f"client 3 has indices outside the 16 training samples: {10**30}"),
    ([[0], [1], [2]], "3 clients, but clients.num_clients=4"),
    ({"0": [0]}, "no entry for clients 1-3"),
    ('{"0": [0], ', "not JSON"),
    ('"0 1 2 3"', "a JSON list of per-client index lists"),
])
def test_a_partition_file_is_refused_in_one_line_naming_the_file_and_the_client(tmp_path, table, error):
    with pytest.raises(ValueError, match=r"^data.partition_file '.*split.json': ") as refused:
        file_partition(tmp_path, table)
    assert error in str(refused.value) and "\n" not in str(refused.value)


def test_a_partition_plugin_s_split_is_checked_as_a_file_s_is(tmp_path):
    cfg = config(dataset="synthetic", partition="test_natural_partitions:overlapping")
    with pytest.raises(ValueError, match="data.partition 'test_natural_partitions:overlapping': sample 0 is held "
                                         "by client 0 and client 1"):
        partition(cfg.data, load_dataset(cfg.data).y_train, 4, 0)


def overlapping(labels, num_clients, seed):
    """A partition plugin that gives sample 0 to every client."""
    return [np.array([0, c + 1]) for c in range(num_clients)]


def by_label(labels, num_clients, seed):
    """A partition plugin: client c gets every sample whose label is c mod num_clients."""
    return [np.flatnonzero(labels % num_clients == c) for c in range(num_clients)]


def test_a_partition_plugin_by_import_path(tmp_path):
    cfg = config(dataset="synthetic", partition="test_natural_partitions:by_label")
    labels = load_dataset(cfg.data).y_train
    parts = partition(cfg.data, labels, 4, 0)
    assert all((labels.numpy()[p] % 4 == c).all() for c, p in enumerate(parts))


def split_without_a_seed(labels, num_clients):
    """A partition plugin written without the seed mpifl passes."""
    return np.array_split(np.arange(len(labels)), num_clients)


@pytest.mark.parametrize("path, says", [
    ("test_natural_partitions:split_without_a_seed", "data.partition 'test_natural_partitions:split_without_a_seed'"
     ": split_without_a_seed(labels, num_clients) cannot take mpifl's call partition(labels, num_clients, seed): "
     "too many positional arguments"),
    ("test_natural_partitions:USERS", "data.partition: 'test_natural_partitions:USERS' names a 'dict' object, not a "
     "function fn(labels, num_clients, seed)"),
    ("test_natural_partitions:by_labels", "data.partition: module 'test_natural_partitions' has no attribute "
     "'by_labels' (from 'test_natural_partitions:by_labels'); did you mean 'by_label'?"),
])
def test_validate_refuses_a_partition_plugin_it_cannot_call_in_one_line_naming_the_key(tmp_path, path, says):
    """It used to pass the checks and end validate (and every rank of a run) with a TypeError traceback."""
    cfg = write_config(tmp_path / "c.yaml", f"""
clients: {{num_clients: 4}}
data: {{dataset: synthetic, partition: "{path}"}}
model: {{name: mlp, kwargs: {{hidden: [4]}}}}
""")
    result = mpifl_here("validate", str(cfg))
    assert result.returncode == 2
    assert result.stderr.strip() == f"mpifl: config error: {says}"


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


def test_a_run_on_a_natural_split_with_an_empty_client_ends_in_one_line_with_exit_status_2(tmp_path):
    """Not a client failure when the empty client is first sampled, after checkpoints: the split is refused as
    rank 0 partitions it before round 1, and every rank leaves with it (no abort)."""
    write_leaf(tmp_path / "femnist")
    write_leaf_user(tmp_path / "femnist", "f9999", [], [])
    cfg = write_config(tmp_path / "c.yaml", f"""
rounds: 2
clients: {{num_clients: 5, per_round: 5}}
data: {{dataset: leaf, kwargs: {{path: "{tmp_path / 'femnist'}"}}, partition: natural}}
model: {{name: mlp, kwargs: {{hidden: [4]}}}}
train: {{lr: 0.05, batch_size: 4}}
output: {{progress: false}}
""")
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert result.returncode == 2 and "Traceback" not in result.stderr and "MPI_Abort" not in result.stderr
    refused = [line for line in result.stderr.splitlines() if "cannot partition the data" in line]
    assert len(refused) == 1 and all(line.endswith("data.partition 'natural' (the clients of data.dataset 'leaf'): "
                                                   "client 4 (LEAF user 'f9999') holds no samples (every client "
                                                   "needs at least one)")
                                     for line in refused)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    status = mpifl_here("status", str(tmp_path / "run"))  # a resume on the same data would be refused the same way
    assert "fix what rank 0 names first (the data, the config or the launch): a --resume as it stands fails the " \
        "same way" in status.stdout and "continue with --resume" not in status.stdout
