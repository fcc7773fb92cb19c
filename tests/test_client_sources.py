"""Datasets stored by client: a rank reads only the clients it hosts, and gets exactly the samples
it would get from reading everything (LEAF FEMNIST/Shakespeare/Sent140, Parquet, npz, saved
Hugging Face datasets)."""
from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MPI_TIMEOUT, ROOT, mpifl_here, run_mpi, same_model, write_config
from test_natural_partitions import USERS, write_leaf

from mpifl.config import load_config
from mpifl.learning import leaf as leaf_module
from mpifl.learning.datasets import client_data, client_source, load_dataset, surveyed_dataset
from mpifl.learning.leaf import PAD, UNKNOWN, LeafSource
from mpifl.learning.tables import TableSource

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

TWEETS = {"alice": ["I love it!", "love love it"], "bob": ["hate it.", "it is what it is", "meh"],
          "carol": ["Love, not hate"]}


def write_sent140(root) -> None:
    """Sent140 in LEAF's layout: x rows are raw records [id, date, query, user, text], y are 0/1."""
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
        data = {u: {"x": [[str(i), "Mon Apr 06", "NO_QUERY", u, t] for i, t in enumerate(texts)],
                    "y": [int("love" in t.lower()) for t in texts]} for u, texts in TWEETS.items()}
        table = {"users": list(TWEETS), "num_samples": [len(t) for t in TWEETS.values()], "user_data": data}
        (root / split / f"all_data_{split}.json").write_text(json.dumps(table))


def table_columns(rows: int = 40) -> dict:
    """A table whose clients' rows are interleaved in the file, with a list column and a scalar one."""
    rng = np.random.default_rng(1)
    return {"client_id": rng.choice(["w07", "w02", "w13", "w05"], size=rows),
            "label": rng.integers(0, 5, rows), "pixels": rng.random((rows, 16)).astype(np.float32),
            "bias": rng.random(rows)}


def arrow_table(columns: dict):
    return pa.table({k: list(v) if v.ndim == 2 else v for k, v in columns.items()})


def save_to_disk(table, folder) -> None:
    """The layout of Hugging Face ``Dataset.save_to_disk``: Arrow stream shards plus state.json."""
    folder.mkdir(parents=True)
    with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as stream:
        stream.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                   "_fingerprint": "0", "_format_columns": None,
                                                   "_format_kwargs": {}, "_format_type": None,
                                                   "_output_all_columns": False, "_split": None}))
    (folder / "dataset_info.json").write_text("{}")


def write_table(tmp_path, kind: str) -> dict:
    """A train (and test) table in one format; the data kwargs that read it."""
    train, test = table_columns(), table_columns(10)
    if kind == "parquet":
        pq.write_table(arrow_table(train), tmp_path / "train.parquet", row_group_size=8)
        pq.write_table(arrow_table(test), tmp_path / "test.parquet")
        return {"path": str(tmp_path / "train.parquet"), "test_path": str(tmp_path / "test.parquet")}
    if kind == "npz":
        np.savez(tmp_path / "train.npz", **train)
        np.savez(tmp_path / "test.npz", **test)
        return {"path": str(tmp_path / "train.npz"), "test_path": str(tmp_path / "test.npz")}
    if kind == "arrow":
        save_to_disk(arrow_table(train), tmp_path / "train")
        save_to_disk(arrow_table(test), tmp_path / "test")
        return {"path": str(tmp_path / "train"), "test_path": str(tmp_path / "test")}
    root = tmp_path / "dict"  # a DatasetDict: train and test splits in one folder
    save_to_disk(arrow_table(train), root / "train")
    save_to_disk(arrow_table(test), root / "test")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    return {"path": str(root)}


def data_config(dataset: str, kwargs: dict, partition: str = "natural"):
    return load_config(None, data={"data": {"dataset": dataset, "kwargs": kwargs, "partition": partition},
                                   "clients": {"num_clients": 3}, "model": {"name": "mlp"}}).data


def sources():
    """(name, writer) for every built-in client-source layout."""
    def leaf_writer(kind):
        def write(tmp_path):
            {"femnist": lambda p: write_leaf(p), "shakespeare": lambda p: write_leaf(p, text=True),
             "sent140": write_sent140}[kind](tmp_path / kind)
            return "leaf", {"path": str(tmp_path / kind)}
        return write

    def table_writer(kind):
        return lambda tmp_path: ("table", write_table(tmp_path, kind))

    return [(f"leaf-{k}", leaf_writer(k)) for k in ("femnist", "shakespeare", "sent140")] + \
        [(f"table-{k}", table_writer(k)) for k in ("parquet", "npz", "arrow", "arrow-dict")]


@pytest.mark.parametrize("name,write", sources(), ids=[n for n, _ in sources()])
def test_a_rank_reading_its_clients_gets_exactly_the_samples_of_reading_everything(tmp_path, name, write):
    dataset, kwargs = write(tmp_path)
    cfg = data_config(dataset, kwargs)
    whole = load_dataset(cfg)
    source = client_source(cfg)
    index, test = source.survey()
    server = surveyed_dataset(source, index, test)
    rank = surveyed_dataset(client_source(cfg), index, None).holding([0, 2])
    assert rank.input_shape == whole.input_shape and rank.num_classes == whole.num_classes
    assert torch.equal(rank.y_train, whole.y_train) and rank.x_test.shape[0] == 0
    assert torch.equal(server.x_test, whole.x_test) and torch.equal(server.y_test, whole.y_test)
    assert sorted(rank.x_train.held) == [0, 2]  # client 1's inputs were never read
    for c in (0, 2):
        mine, full = client_data(rank, rank.clients[c]), client_data(whole, whole.clients[c])
        assert mine.x.dtype == full.x.dtype and torch.equal(mine.x, full.x) and torch.equal(mine.y, full.y)
    with pytest.raises(KeyError, match="client 1 are not held on this rank"):
        rank.x_train[torch.from_numpy(rank.clients[1])]


def test_a_rank_opens_only_the_leaf_files_that_hold_its_clients(tmp_path, monkeypatch):
    write_leaf(tmp_path)  # users f0001, f0003 in one file; f0007, f0042 in the other
    source = LeafSource(str(tmp_path))
    index, _ = source.survey()
    opened = []
    real = leaf_module.read_file
    monkeypatch.setattr(leaf_module, "read_file", lambda path: opened.append(path.name) or real(path))
    held = source.read_clients(index, [3])  # f0042
    assert list(held) == [3] and len(held[3]) == USERS["f0042"]
    assert opened == ["all_data_1_niid_0_keep_0_train_9.json"]


def spoil(file, change) -> None:
    """Rewrite a LEAF JSON file through ``change(table)``."""
    table = json.loads(file.read_text())
    change(table)
    file.write_text(json.dumps(table))


FIRST = "all_data_0_niid_0_keep_0_train_9.json"  # users f0001 and f0003
SPOILED = {
    "garbage after the JSON": (lambda f: f.write_text(f.read_text() + "]]"), r"not a JSON file \(Extra data"),
    "a user without user_data": (lambda f: spoil(f, lambda t: t["users"].append("f0002")),
                                 "user 'f0002' is listed in 'users' but has no 'user_data' entry"),
    "a user listed twice": (lambda f: spoil(f, lambda t: t["users"].append("f0001")),
                            "user 'f0001' is listed 2 times in 'users'"),
    "a row of another length": (lambda f: spoil(f, lambda t: t["user_data"]["f0003"]["x"][1].extend([0.0] * 9)),
                                "user 'f0003': input row 1 has 793 values, but user 'f0001' .* has rows of 784"),
    "one label fewer than inputs": (lambda f: spoil(f, lambda t: t["user_data"]["f0003"]["y"].pop()),
                                    r"user 'f0003' has 4 inputs \(x\) but 3 labels \(y\)"),
    "a label that is no class": (lambda f: spoil(f, lambda t: t["user_data"]["f0003"]["y"].__setitem__(0, "cat")),
                                 r"user 'f0003': labels \(y\)"),
    "a num_samples that is not the user's": (lambda f: spoil(f, lambda t: t["num_samples"].__setitem__(1, 40)),
                                             "user 'f0003': num_samples says 40 but its user_data holds 4 samples"),
    "a num_samples per user missing": (lambda f: spoil(f, lambda t: t["num_samples"].pop()),
                                       "num_samples has 1 entry, but 'users' lists 2 users"),
}


@pytest.mark.parametrize("spoiled", SPOILED)
def test_bad_leaf_content_is_refused_by_the_survey_naming_the_file_and_the_user(tmp_path, spoiled):
    write_leaf(tmp_path)
    change, error = SPOILED[spoiled]
    change(tmp_path / "train" / FIRST)
    with pytest.raises(ValueError, match=rf"^data.kwargs.path: {tmp_path / 'train' / FIRST}: {error}") as refused:
        LeafSource(str(tmp_path)).survey()
    assert "\n" not in str(refused.value)


def test_a_leaf_user_in_two_files_is_refused_naming_both_not_cut_to_one(tmp_path):
    write_leaf(tmp_path)
    spoil(tmp_path / "train" / "all_data_1_niid_0_keep_0_train_9.json",
          lambda t: (t["users"].append("f0001"), t["user_data"].__setitem__("f0001", {"x": [[0.5] * 784], "y": [3]})))
    with pytest.raises(ValueError, match=rf"^data.kwargs.path: {tmp_path / 'train'}: user 'f0001' is in {FIRST} and "
                                         "in all_data_1_niid_0_keep_0_train_9.json; a user's samples must be in one "
                                         "file"):
        LeafSource(str(tmp_path)).survey()


def test_an_input_the_survey_does_not_read_is_refused_by_the_rank_reading_it_in_one_line(tmp_path):
    from mpifl.errors import JobFailure
    from mpifl.roles.data import local_data

    write_leaf(tmp_path)
    spoil(tmp_path / "train" / FIRST, lambda t: t["user_data"]["f0003"]["x"][2].__setitem__(5, "n/a"))
    cfg = load_config(None, data={"data": {"dataset": "leaf", "kwargs": {"path": str(tmp_path)},
                                           "partition": "natural"}, "clients": {"num_clients": 4},
                                  "model": {"name": "mlp"}})
    source = client_source(cfg.data)
    dataset = surveyed_dataset(source, *source.survey())
    with pytest.raises(JobFailure, match=rf"^cannot read its clients' data: data.kwargs.path: {tmp_path / 'train'}/"
                                         rf"{FIRST}: user 'f0003': inputs \(x\): could not convert string to float"):
        local_data(cfg, dataset, 2, 2)  # the client rank hosting f0003 (client 1)
    assert sorted(local_data(cfg, dataset, 1, 2)) == [0, 2]  # the other rank's clients read


def test_sent140_tweets_become_word_ids_over_the_training_vocabulary(tmp_path):
    write_sent140(tmp_path)
    x, y, x_test, _, clients = leaf_module.leaf(str(tmp_path), vocab_size=3, max_words=4)
    # training words by count: "it" 5, "love" 3 ("Love" is another word), then "hate" and "is" 2 (ties by word)
    assert leaf_module.vocabulary(Counter(w for texts in TWEETS.values() for t in texts
                                          for w in leaf_module.WORD.findall(t)), 3, None) == \
        {"it": 2, "love": 3, "hate": 4}
    alice = x[torch.from_numpy(clients[0])]
    assert alice.tolist() == [[UNKNOWN, 3, 2, UNKNOWN], [3, 3, 2, PAD]]  # "I love it !", "love love it"
    assert y[torch.from_numpy(clients[0])].tolist() == [1, 1] and x.dtype == torch.int64
    words = tmp_path / "glove.txt"
    words.write_text("hate 0.1 0.2\nmeh 0.3 0.4\n")  # a GloVe-style word list: the first token of each line
    x, *_ = leaf_module.leaf(str(tmp_path), max_words=2, vocab_file=str(words))
    assert x[2].tolist() == [2, UNKNOWN] and x[4].tolist() == [3, PAD]  # bob's "hate it." and "meh"
    assert x[5].tolist() == [UNKNOWN, UNKNOWN]  # carol's "Love, not hate"


def test_table_columns_become_inputs_shaped_as_asked(tmp_path):
    kwargs = write_table(tmp_path, "parquet")
    source = TableSource(kwargs["path"], feature_columns=["pixels"], shape=[1, 4, 4])
    index, (x_test, _) = source.survey()
    assert index.ids == ("w02", "w05", "w07", "w13") and index.input_shape == (1, 4, 4)
    assert x_test.shape == (0, 1, 4, 4)  # no test_path: an empty held-out set
    x = load_dataset(data_config("table", kwargs, partition="iid")).x_train
    assert x.shape == (40, 17) and x.dtype == torch.float32  # pixels (16) and bias side by side


def test_table_mistakes_name_the_file_and_the_column(tmp_path):
    kwargs = write_table(tmp_path, "npz")
    with pytest.raises(ValueError, match="no column 'digit'.*client_id, label, pixels, bias"):
        TableSource(kwargs["path"], label_column="digit").survey()
    (tmp_path / "data.csv").write_text("client_id,label\n")
    with pytest.raises(ValueError, match="data.csv: unknown table format"):
        TableSource(str(tmp_path / "data.csv")).survey()


def with_null(columns: dict, name: str, row: int = 29):
    """The table of ``columns`` with one null in column ``name`` (a list column: one null element)."""
    table = arrow_table(columns)
    values = table.column(name).to_pylist()
    if isinstance(values[row], list):
        values[row][3] = None
    else:
        values[row] = None
    return table.set_column(table.column_names.index(name), name, pa.array(values, type=table.schema.field(name).type))


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
@pytest.mark.parametrize("column", ["label", "client_id", "pixels", "bias"])
def test_a_null_in_a_table_is_refused_by_the_survey_naming_the_file_and_the_column(tmp_path, kind, column):
    table = with_null(table_columns(), column)  # row 29: not the first client's, whose inputs the survey reads
    path = tmp_path / "train.parquet" if kind == "parquet" else tmp_path / "train"
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=8)
    else:
        save_to_disk(table, path)
    with pytest.raises(ValueError, match=rf"^{path}: column '{column}' has 1 null value \(a missing label"):
        TableSource(str(path)).survey()


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("where", ["path", "test_path"])
def test_a_nan_or_infinity_in_an_npz_array_is_refused_by_the_survey_naming_the_file_and_the_array(tmp_path, value,
                                                                                                   where):
    kwargs = write_table(tmp_path, "npz")
    arrays = dict(np.load(kwargs[where]))
    arrays["pixels"][7, 3] = value  # row 7: not the first client's only (the survey reads every row's features)
    np.savez(kwargs[where], **arrays)
    with pytest.raises(ValueError, match=rf"^{kwargs[where]}: array 'pixels' has a NaN or infinite value in row 7 "
                                         r"\(a feature that is not a number"):
        TableSource(**kwargs).survey()


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
@pytest.mark.parametrize("column", ["pixels", "bias"])
def test_a_nan_in_a_table_s_float_column_is_refused_where_its_rows_are_read_naming_the_file_and_the_column(
        tmp_path, kind, column):
    """Parquet's statistics count nulls, not NaN: a NaN feature (a value, not a null) is refused where the rows are
    read, by the survey for the held-out split and by the rank that reads a client's rows, before round 1."""
    kwargs = write_table(tmp_path, kind)
    columns = table_columns()
    row = next(r for r in range(20, 40) if columns["client_id"][r] != min(columns["client_id"]))
    # not the first client's (in id order), whose inputs the survey reads
    if columns[column].ndim == 2:
        columns[column][row, 3] = np.nan
    else:
        columns[column][row] = np.nan
    path = Path(kwargs["path"])
    if kind == "parquet":
        pq.write_table(arrow_table(columns), path, row_group_size=8)
    else:
        for file in path.iterdir():
            file.unlink()
        path.rmdir()
        save_to_disk(arrow_table(columns), path)
    source = TableSource(**kwargs)
    index, _ = source.survey()
    client = index.ids.index(columns["client_id"][row])
    with pytest.raises(ValueError, match=rf"^{path}: column '{column}' has a NaN or infinite value in row \d+ of the "
                                         r"rows read for 1 client id \(a feature that is not a number"):
        source.read_clients(index, [client])
    others = [c for c in range(len(index.ids)) if c != client]
    assert sorted(source.read_clients(index, others)) == others  # the other clients' rows are clean
    test = table_columns(10)
    test["bias"][4] = np.inf
    if kind == "parquet":
        pq.write_table(arrow_table(test), kwargs["test_path"])
    else:
        shutil.rmtree(kwargs["test_path"])
        save_to_disk(arrow_table(test), Path(kwargs["test_path"]))
    with pytest.raises(ValueError, match=rf"^{kwargs['test_path']}: column 'bias' has a NaN or infinite value in "
                                         r"row 4 \("):
        TableSource(**kwargs).survey()


def test_a_null_in_a_dataset_dict_s_test_split_is_refused_naming_the_split(tmp_path):
    kwargs = write_table(tmp_path, "dict")
    test = tmp_path / "dict" / "test"
    for file in test.iterdir():
        file.unlink()
    test.rmdir()
    save_to_disk(with_null(table_columns(10), "bias", 4), test)
    with pytest.raises(ValueError, match=rf"^{test}: column 'bias' has 1 null value"):
        TableSource(**kwargs).survey()
    save_to_disk(with_null(table_columns(), "pixels"), tmp_path / "other" / "train")
    (tmp_path / "other" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'other' / 'train'}: column 'pixels' has 1 null value"):
        TableSource(str(tmp_path / "other")).survey()


def bad_leaf(tmp_path) -> list[str]:
    write_leaf(tmp_path)
    spoil(tmp_path / "train" / FIRST, lambda t: t["num_samples"].__setitem__(1, 40))
    return ["data.dataset=leaf", f"data.kwargs={{path: {tmp_path}}}"]


def bad_npz(tmp_path) -> list[str]:
    kwargs = write_table(tmp_path, "npz")
    arrays = dict(np.load(kwargs["path"]))
    arrays["bias"][30] = np.nan
    np.savez(kwargs["path"], **arrays)
    return ["data.dataset=table", f"data.kwargs={{path: {kwargs['path']}}}"]


def bad_dict(tmp_path) -> list[str]:
    kwargs = write_table(tmp_path, "dict")
    save_to_disk(with_null(table_columns(10), "label", 2), tmp_path / "dict" / "validation")
    (tmp_path / "dict" / "test").rename(tmp_path / "spare")
    (tmp_path / "dict" / "validation").rename(tmp_path / "dict" / "test")
    return ["data.dataset=table", f"data.kwargs={{path: {kwargs['path']}}}"]


@pytest.mark.parametrize("command", ["validate", "partition"])
@pytest.mark.parametrize("write,error", [
    (bad_leaf, "data: cannot read the data .*: data.kwargs.path: .*/train/{first}: user 'f0003': num_samples says 40 "
               "but its user_data holds 4 samples"),
    (bad_npz, r"data: cannot read the data .*: .*/train.npz: array 'bias' has a NaN or infinite value in row 30"),
    (bad_dict, r"data: cannot read the data .*: .*/dict/test: column 'label' has 1 null value"),
    (lambda tmp_path: ["data.dataset=test_natural_partitions:own_split", "data.kwargs={kind: float}"],
     r"cannot partition the data: data.partition 'natural' \(the clients of data.dataset "
     r"'test_natural_partitions:own_split'\): client 1's indices are a float64 array"),
])
def test_validate_and_partition_refuse_bad_data_in_one_line_naming_the_file_and_the_fault(tmp_path, command, write,
                                                                                           error):
    result = mpifl_here(command, str(ROOT / "configs" / "quickstart.yaml"), *write(tmp_path),
                        "data.partition=natural", "clients.num_clients=3", "clients.per_round=2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.match(r"^mpifl: config error: " + error.format(first=FIRST), result.stderr)
    assert len(result.stderr.splitlines()) == 1 and "valid" not in result.stdout


def test_a_missing_table_file_names_the_data_kwargs_key(tmp_path):
    kwargs = write_table(tmp_path, "parquet")
    with pytest.raises(FileNotFoundError, match=rf"^data.kwargs.path: no file or folder '{tmp_path}/nowhere.parquet'"):
        TableSource(str(tmp_path / "nowhere.parquet")).survey()
    with pytest.raises(FileNotFoundError, match=rf"^data.kwargs.test_path: no file or folder '{tmp_path}/t.parquet'"):
        TableSource(kwargs["path"], test_path=str(tmp_path / "t.parquet")).survey()


def test_a_federation_reading_clients_per_rank_equals_one_reading_everything(tmp_path):
    """Natural split: each client rank reads only its clients. The same split given as a partition
    file makes every rank read everything. The final models are bitwise equal."""
    kwargs = write_table(tmp_path, "parquet")
    whole = load_dataset(data_config("table", kwargs, partition="iid"))
    (tmp_path / "split.json").write_text(json.dumps([p.tolist() for p in whole.clients]))
    runs = {}
    for name, split in (("per_rank", "partition: natural"),
                        ("whole", f"partition: file, partition_file: '{tmp_path / 'split.json'}'")):
        cfg = write_config(tmp_path / f"{name}.yaml", f"""
rounds: 2
clients: {{num_clients: 4, per_round: 3}}
data: {{dataset: table, kwargs: {json.dumps(kwargs)}, {split}}}
model: {{name: mlp, kwargs: {{hidden: [8]}}}}
train: {{lr: 0.05, batch_size: 4}}
output: {{progress: false}}
""")
        runs[name] = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / name), timeout=MPI_TIMEOUT)
        assert runs[name].returncode == 0, runs[name].stderr
    assert same_model(tmp_path / "per_rank" / "model.h5", tmp_path / "whole" / "model.h5")
    held = [line for line in runs["per_rank"].stderr.splitlines() if "training samples: its" in line]
    assert len(held) == 2 and all("of 40 training samples" in line for line in held)
    assert "training samples: its" not in runs["whole"].stderr
