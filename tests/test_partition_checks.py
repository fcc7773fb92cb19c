"""A partition that cannot be made is one line, exit 2, from ``mpifl validate`` and ``mpifl partition``; settings
a partition does not read are warned of; and the clients x labels table counts what each client trains on, its
validation samples apart."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROOT, mpifl_here
from test_natural_partitions import write_leaf, write_leaf_user

from mpifl.config import config_warnings, load_config
from mpifl.learning.datasets import load_dataset
from mpifl.learning.partitions import partition, partition_counts, partition_csv, split_validation

QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def bad_partition_file(tmp_path) -> str:
    path = tmp_path / "split.json"
    path.write_text(json.dumps([[0, 1], [2, 3], [4, 99999]]))
    return str(path)


@pytest.mark.parametrize("command", ["validate", "partition"])
@pytest.mark.parametrize("overrides,error", [
    (["data.partition=file", "clients.num_clients=3"],
     "mpifl: config error: cannot partition the data: data.partition_file '{file}': client 2 has indices outside "
     "the 1438 training samples: 99999"),
    (["clients.num_clients=2000"],
     "mpifl: config error: cannot partition the data: clients.num_clients: 1438 training samples cannot be split "
     "across 2000 clients"),
    (["data.partition=shards", "data.classes_per_client=12"],
     "mpifl: config error: cannot partition the data: data.classes_per_client: 12 classes per client, but the "
     "training labels have only 10 classes"),
])
def test_a_partition_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, command, overrides, error):
    file = bad_partition_file(tmp_path)
    result = mpifl_here(command, QUICKSTART, *overrides, f"data.partition_file={file}" if "file" in overrides[0]
                        else "data.alpha=1.0")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().startswith(error.format(file=file)) and len(result.stderr.splitlines()) == 1
    assert "Traceback" not in result.stderr and "valid" not in result.stdout


def test_validate_builds_the_partition_of_any_data_and_surveys_a_dataset_stored_by_client(tmp_path, monkeypatch):
    from mpifl.cli import preflight
    from mpifl.learning.leaf import LeafSource

    write_leaf(tmp_path)
    read = []
    monkeypatch.setattr(LeafSource, "read_clients", lambda *args: read.append(args))
    leaf = load_config(None, data={"data": {"dataset": "leaf", "kwargs": {"path": str(tmp_path)},
                                            "partition": "natural"}, "clients": {"num_clients": 4},
                                   "model": {"name": "cnn"}})
    assert preflight.check_partition(leaf) == [3, 4, 5, 7]  # every user's labels, from the survey
    assert read == []  # no inputs read: the run's ranks read their own clients' files
    assert preflight.check_partition(load_config(None, data={"model": {"name": "blob"},
                                                             "train": {"trainer": "none"},
                                                             "eval": {"every": 0}})) is None


@pytest.mark.parametrize("command", ["validate", "partition"])
def test_validate_and_partition_name_an_empty_client_of_a_natural_split_and_its_user_in_one_line(tmp_path, command):
    write_leaf(tmp_path)
    write_leaf_user(tmp_path, "f9999", [], [])
    result = mpifl_here(command, QUICKSTART, "data.dataset=leaf", f"data.kwargs={{path: {tmp_path}}}",
                        "data.partition=natural", "clients.num_clients=5", "clients.per_round=2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == ("mpifl: config error: cannot partition the data: data.partition 'natural' (the "
                                     "clients of data.dataset 'leaf'): client 4 (LEAF user 'f9999') holds no "
                                     "samples (every client needs at least one)")


@pytest.mark.parametrize("data,warned", [
    ({"partition": "iid", "alpha": 0.1}, "data.alpha: 0.1 is read only by data.partition dirichlet, and "
                                         "data.partition is 'iid': ignored"),
    ({"partition": "dirichlet", "classes_per_client": 3}, "data.classes_per_client: 3 is read only by "
                                                          "data.partition shards or labels"),
    ({"partition": "shards", "size_sigma": 2.0}, "data.size_sigma: 2.0 is read only by data.partition unbalanced"),
])
def test_a_partition_setting_the_partition_does_not_read_is_warned_of(data, warned):
    found = [w for w in config_warnings(load_config(None, data={"data": data})) if w.startswith("data.")]
    assert len(found) == 1 and found[0].startswith(warned) and found[0].endswith("': ignored")


@pytest.mark.parametrize("data", [{"partition": "dirichlet", "alpha": 0.1}, {"partition": "labels",
                                                                              "classes_per_client": 3},
                                  {"partition": "shards", "classes_per_client": 3},
                                  {"partition": "unbalanced", "size_sigma": 2.0}, {"partition": "iid"}])
def test_a_partition_s_own_settings_and_the_defaults_are_not_warned_of(data):
    assert not [w for w in config_warnings(load_config(None, data={"data": data})) if w.startswith("data.")]


def test_the_table_counts_what_each_client_trains_on_and_its_validation_samples_apart():
    cfg = load_config(QUICKSTART, ["data.val_fraction=0.2"])
    dataset = load_dataset(cfg.data)
    train, validation = partition_counts(cfg.data, dataset, 8, cfg.seed)
    parts = partition(cfg.data, dataset.y_train, 8, cfg.seed)
    splits = [split_validation(p, 0.2, cfg.seed, c) for c, p in enumerate(parts)]  # as the client ranks split
    assert train.sum(axis=1).tolist() == [len(t) for t, _ in splits]
    assert validation.tolist() == [len(v) for _, v in splits] and validation.min() > 0
    assert (train.sum(axis=1) + validation).tolist() == [len(p) for p in parts]
    labels = dataset.y_train.numpy()
    assert train.tolist() == [np.bincount(labels[t], minlength=10).tolist() for t, _ in splits]
    rows = partition_csv(train, validation).splitlines()
    assert rows[0] == "client,train_samples,validation_samples," + ",".join(f"train_class{k}" for k in range(10))
    assert [int(n) for n in rows[3].split(",")] == [2, int(train[2].sum()), int(validation[2]), *train[2]]
    assert partition_csv(train, np.zeros(8, dtype=np.int64)).splitlines()[0].startswith("client,train_samples,"
                                                                                        "train_class0,")


def test_mpifl_partition_prints_train_and_validation_columns():
    result = mpifl_here("partition", QUICKSTART, "data.val_fraction=0.2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["client", "train", "val", "c0"]
    assert "more held out for validation (data.val_fraction), not in the class counts" in lines[-1]
    row = [int(n) for n in lines[1].split()]
    assert row[1] == sum(row[3:]) and row[2] > 0
