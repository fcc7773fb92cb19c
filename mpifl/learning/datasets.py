"""Offline datasets.

A dataset function returns ``(x_train, y_train, x_test, y_test[, clients])`` (tensors or
arrays). Built in: ``digits`` (UCI optical handwritten digits, 1797 8x8 images, shipped with
mpifl), ``synthetic`` (Gaussian class clusters), ``text`` (token blocks for causal-LM
training, ``mpifl.learning.text``), ``idx`` and ``fashion_mnist`` (MNIST-layout IDX files
from a local folder, ``mpifl.learning.idx``), and two datasets stored by client, ``leaf`` and
``table``, which ranks can read client by client (``mpifl.learning.sources``). How samples
are split across clients is ``mpifl.learning.partitions``.
"""
from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpifl.config import Config, DataConfig
from mpifl.learning.idx import FASHION_MNIST, fashion_mnist, folder_problem, idx
from mpifl.learning.leaf import LeafSource, leaf
from mpifl.learning.models import SIZED_BY_DATA
from mpifl.learning.sources import ClientIndex, ClientSource, HeldRows
from mpifl.learning.tables import TableSource, table, table_format
from mpifl.learning.text import text
from mpifl.planning.memory import TABLE_READER_BYTES, DataBytes
from mpifl.plugins import kwargs_problem, resolve


@dataclass(frozen=True)
class Dataset:
    """Train and held-out tensors.

    From a client source (``source`` set), ``x_train`` holds only some clients' rows
    (``HeldRows``, none until ``holding``) and the held-out set is on the server rank only.
    """

    x_train: torch.Tensor | HeldRows
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    clients: tuple[np.ndarray, ...] | None = None  # the data's own split of x_train (``data.partition: natural``)
    source: tuple[ClientSource, ClientIndex] | None = None
    known_classes: int | None = None  # when the labels at hand may not show every class
    tokenizer: str | None = None  # the tokenizer that made token ids, as tokenizer.json's text (data.dataset: text)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one training input (without the sample dimension)."""
        return tuple(self.x_train.shape[1:])

    @property
    def num_classes(self) -> int:
        """How many classes: the declared count, else one more than the largest label seen."""
        if self.known_classes is not None:
            return self.known_classes
        return int(max(self.y_train.max(), self.y_test.max())) + 1

    def natural_name(self, client: int) -> str:
        """How the data itself names ``client`` of its own split (LEAF user 'f0042'), or '' when it does not."""
        return self.source[1].named(client) if self.source is not None else ""

    def holding(self, clients: list[int]) -> Dataset:
        """The same dataset with the inputs of ``clients`` read from its source (itself when it has none)."""
        if self.source is None:
            return self
        source, index = self.source
        return replace(self, x_train=HeldRows(index, source.read_clients(index, clients)))


@dataclass(frozen=True)
class ClientData:
    """One logical client's local training data.

    ``noise_std`` > 0 (``data.feature_noise``): a trainer adds Gaussian noise of that standard deviation to every
    minibatch it reads, drawn afresh each time (mpifl.learning.noise)."""

    x: torch.Tensor
    y: torch.Tensor
    noise_std: float = 0.0

    def __len__(self) -> int:
        return len(self.y)


def digits(test_fraction: float = 0.2, split_seed: int = 0) -> tuple[torch.Tensor, ...]:
    """UCI handwritten digits (8x8, 10 classes), scaled to [0, 1], as (N, 1, 8, 8) images."""
    with resources.files("mpifl").joinpath("data/digits.csv.gz").open("rb") as raw:
        table = np.loadtxt(gzip.open(raw), delimiter=",", dtype=np.float32)
    x = torch.from_numpy(table[:, :64] / 16.0).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(table[:, 64].astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(split_seed).permutation(len(y)))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def synthetic(num_samples: int = 4000, num_features: int = 32, num_classes: int = 10, noise: float = 1.0,
              test_fraction: float = 0.2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Gaussian clusters, one per class, with unit noise around random centres."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 2.0, size=(num_classes, num_features))
    y = rng.integers(0, num_classes, size=num_samples)
    x = centres[y] + noise * rng.normal(size=(num_samples, num_features))
    n_test = int(num_samples * test_fraction)
    as_x = lambda a: torch.from_numpy(a.astype(np.float32))  # noqa: E731
    as_y = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
    return as_x(x[n_test:]), as_y(y[n_test:]), as_x(x[:n_test]), as_y(y[:n_test])


BUILTIN: dict[str, Callable[..., Any]] = {"digits": digits, "synthetic": synthetic, "text": text, "leaf": leaf,
                                          "table": table, "idx": idx, "fashion_mnist": fashion_mnist}
SOURCES = {"leaf": LeafSource, "table": TableSource}  # datasets stored by client: read client by client


def client_source(cfg: DataConfig) -> ClientSource | None:
    """The dataset as a client source, when each rank can read only its own clients: a built-in
    stored by client, split naturally. None otherwise (the whole set is read once and shared)."""
    if cfg.partition != "natural" or cfg.dataset not in SOURCES:
        return None
    return SOURCES[cfg.dataset](**cfg.kwargs)


def surveyed_dataset(source: ClientSource, index: ClientIndex,
                     test: tuple[torch.Tensor, torch.Tensor] | None) -> Dataset:
    """A dataset from a source's index, holding no client's inputs yet; ``test`` only on the server rank."""
    if test is None:
        test = torch.empty((0, *index.input_shape), dtype=index.input_dtype), torch.empty(0, dtype=torch.int64)
    return Dataset(HeldRows(index, {}), torch.from_numpy(np.concatenate(index.labels)), *test,
                   clients=index.ranges(), source=(source, index), known_classes=index.num_classes)


def data_shape(cfg: DataConfig) -> dict[str, Any]:
    """The ``input_shape`` and ``num_classes`` a model is sized from (a client source is only surveyed)."""
    return surveyed_data(cfg)[0]


# One process's surveys of built-in datasets, by what they are read from: ``mpifl plan`` plans a config several times
# (the fit advice re-plans it per layout), and a text dataset's survey trains its tokenizer each time (0.6 s for
# configs/gpt2.yaml). A plug-in dataset function is surveyed every time: it may read anything.
_SURVEYS: dict[str, tuple[dict[str, Any], DataBytes]] = {}


def surveyed_data(cfg: DataConfig) -> tuple[dict[str, Any], DataBytes]:
    """From one read of the data (a client source is only surveyed): the ``input_shape`` and ``num_classes`` a
    model is sized from, and the bytes the ranks will hold (planning.memory counts them per rank)."""
    key = json.dumps(asdict(cfg), sort_keys=True, default=str) if cfg.dataset in BUILTIN else None
    if key is None or key not in _SURVEYS:
        survey = _survey(cfg)
        if key is None:
            return survey
        _SURVEYS[key] = survey
    shape, footprint = _SURVEYS[key]
    return dict(shape), footprint


def _survey(cfg: DataConfig) -> tuple[dict[str, Any], DataBytes]:
    """``surveyed_data``, read now."""
    source = client_source(cfg)
    if source is not None:
        index, (x_test, y_test) = source.survey()
        rows = int(index.starts[-1])
        inputs = rows * math.prod(index.input_shape) * index.input_dtype.itemsize
        footprint = DataBytes(inputs, rows * 8, _nbytes(x_test) + _nbytes(y_test), per_rank=True,
                              noisy_copy=_noisy_copy_bytes(cfg, x_test), test_rows=len(y_test),
                              reader=reader_bytes(cfg))
        return {"input_shape": tuple(index.input_shape), "num_classes": index.num_classes}, footprint
    data = load_dataset(cfg)
    footprint = DataBytes(_nbytes(data.x_train), _nbytes(data.y_train), _nbytes(data.x_test) + _nbytes(data.y_test),
                          per_rank=False, noisy_copy=_noisy_copy_bytes(cfg, data.x_test), test_rows=len(data.y_test),
                          train_rows=len(data.y_train), reader=reader_bytes(cfg))
    return {"input_shape": data.input_shape, "num_classes": data.num_classes}, footprint


def reader_bytes(cfg: DataConfig) -> int:
    """What the library that reads the data adds to a rank that reads it: pyarrow for a table not in npz files."""
    if cfg.dataset != "table" or table_format(Path(str(cfg.kwargs.get("path", "")))) == "npz":
        return 0
    return TABLE_READER_BYTES


def _noisy_copy_bytes(cfg: DataConfig, x_test: torch.Tensor) -> int:
    """The server's noisy float32 copy of the held-out inputs under ``data.feature_noise`` (0 without)."""
    return x_test.numel() * 4 if cfg.feature_noise else 0


def _nbytes(tensor: torch.Tensor | HeldRows) -> int:
    assert isinstance(tensor, torch.Tensor)  # a dataset read whole holds its inputs as one tensor
    return tensor.numel() * tensor.element_size()


def needs_dataset(cfg: Config) -> bool:
    """Whether the run reads data: to size the model, to train or to evaluate (the benchmark blob never does)."""
    if cfg.model.name == "blob":
        return False
    return (cfg.model.name in SIZED_BY_DATA or cfg.train.trainer != "none" or cfg.eval.every > 0
            or cfg.eval.federated_every > 0)


def dataset_problem(cfg: DataConfig) -> str | None:
    """What is wrong with ``data.kwargs`` for the configured dataset function (before MPI starts), or None."""
    if cfg.dataset == "table" and not str(cfg.kwargs.get("path", "")).endswith(".npz"):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            return "data.dataset 'table' reads Parquet and Arrow files with pyarrow: pip install 'mpifl[tables]'"
    problem = kwargs_problem(BUILTIN.get(cfg.dataset) or resolve(cfg.dataset), cfg.kwargs, "data.kwargs")
    if problem is None and cfg.dataset in ("idx", "fashion_mnist"):  # missing files show before MPI starts
        return folder_problem(cfg.dataset, str(cfg.kwargs.get("path", FASHION_MNIST)))
    return problem


def load_dataset(cfg: DataConfig) -> Dataset:
    """Call the configured dataset function and check what it returns."""
    fn = BUILTIN.get(cfg.dataset) or resolve(cfg.dataset)
    parts = fn(**cfg.kwargs)
    if not isinstance(parts, (tuple, list)) or len(parts) not in (4, 5):
        raise TypeError(f"data.dataset {cfg.dataset!r} must return (x_train, y_train, x_test, y_test[, clients])")
    # as given: a natural partition refuses indices that are not integers (learning.partitions.checked_partition)
    clients = tuple(np.asarray(c) for c in parts[4]) if len(parts) == 5 else None
    x_tr, y_tr, x_te, y_te = (torch.as_tensor(p) for p in parts[:4])
    if len(x_tr) != len(y_tr) or len(x_te) != len(y_te):
        raise ValueError(f"data.dataset {cfg.dataset!r}: inputs and labels differ in length")
    return Dataset(x_tr, y_tr.long(), x_te, y_te.long(), clients, tokenizer=getattr(parts, "tokenizer", None))


def client_data(dataset: Dataset, indices: np.ndarray, noise_std: float = 0.0) -> ClientData:
    """One client's slice of the training set (read through noise of ``noise_std`` when > 0)."""
    idx = torch.from_numpy(indices)
    return ClientData(dataset.x_train[idx], dataset.y_train[idx], noise_std)
