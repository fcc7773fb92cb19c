"""Offline datasets and partitioners.

A dataset function returns ``(x_train, y_train, x_test, y_test)`` (tensors or arrays).
Built in: ``digits`` (UCI optical handwritten digits, 1797 8x8 images, shipped with
mpifl), ``synthetic`` (Gaussian class clusters) and ``text`` (token blocks for causal-LM
training, :mod:`mpifl.learning.text`). Partitioners split the training
indices across logical clients deterministically from the seed.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from mpifl.config import Config, DataConfig
from mpifl.learning.leaf import LeafSource, leaf
from mpifl.learning.sources import ClientIndex, ClientSource, HeldRows
from mpifl.learning.tables import TableSource, table
from mpifl.learning.text import text
from mpifl.plugins import is_import_path, kwargs_problem, resolve
from mpifl.roles.federation import PARTITION, derive_seed


@dataclass(frozen=True)
class Dataset:
    """Train and held-out tensors.

    From a client source (``source`` set), ``x_train`` holds only some clients' rows
    (:class:`HeldRows`, none until :meth:`holding`) and the held-out set is on the server rank only.
    """

    x_train: torch.Tensor | HeldRows
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    clients: tuple[np.ndarray, ...] | None = None  # the data's own split of x_train (``data.partition: natural``)
    source: tuple[ClientSource, ClientIndex] | None = None
    known_classes: int | None = None  # when the labels at hand may not show every class

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def num_classes(self) -> int:
        if self.known_classes is not None:
            return self.known_classes
        return int(max(self.y_train.max(), self.y_test.max())) + 1

    def holding(self, clients: list[int]) -> Dataset:
        """This dataset with the inputs of ``clients`` read from its source (itself when it has none)."""
        if self.source is None:
            return self
        source, index = self.source
        return replace(self, x_train=HeldRows(index, source.read_clients(index, clients)))


@dataclass(frozen=True)
class ClientData:
    """One logical client's local training data."""

    x: torch.Tensor
    y: torch.Tensor

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


BUILTIN = {"digits": digits, "synthetic": synthetic, "text": text, "leaf": leaf, "table": table}
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


def needs_dataset(cfg: Config) -> bool:
    """Whether the run reads data: to size the model, to train or to evaluate (the benchmark blob never does)."""
    if cfg.model.name == "blob":
        return False
    return (cfg.model.name in ("mlp", "cnn") or cfg.train.trainer != "none" or cfg.eval.every > 0
            or cfg.eval.federated_every > 0)


def dataset_problem(cfg: DataConfig) -> str | None:
    """What is wrong with ``data.kwargs`` for the configured dataset function (before MPI starts), or None."""
    if cfg.dataset == "table" and not str(cfg.kwargs.get("path", "")).endswith(".npz"):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            return "data.dataset 'table' reads Parquet and Arrow files with pyarrow: pip install 'mpifl[tables]'"
    return kwargs_problem(BUILTIN.get(cfg.dataset) or resolve(cfg.dataset), cfg.kwargs, "data.kwargs")


def load_dataset(cfg: DataConfig) -> Dataset:
    """Call the configured dataset function and check what it returns."""
    fn = BUILTIN.get(cfg.dataset) or resolve(cfg.dataset)
    parts = fn(**cfg.kwargs)
    if not isinstance(parts, (tuple, list)) or len(parts) not in (4, 5):
        raise TypeError(f"data.dataset {cfg.dataset!r} must return (x_train, y_train, x_test, y_test[, clients])")
    clients = tuple(np.asarray(c, dtype=np.int64) for c in parts[4]) if len(parts) == 5 else None
    x_tr, y_tr, x_te, y_te = (torch.as_tensor(p) for p in parts[:4])
    if len(x_tr) != len(y_tr) or len(x_te) != len(y_te):
        raise ValueError(f"data.dataset {cfg.dataset!r}: inputs and labels differ in length")
    return Dataset(x_tr, y_tr.long(), x_te, y_te.long(), clients)


def iid_partition(num_samples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and deal indices into near-equal parts."""
    return [np.sort(part) for part in np.array_split(rng.permutation(num_samples), num_clients)]


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator,
                        min_size: int = 1) -> list[np.ndarray]:
    """Label skew: each class is split across clients by proportions drawn from Dir(alpha)."""
    if len(labels) < num_clients * min_size:
        raise ValueError(f"{len(labels)} samples cannot give {num_clients} clients {min_size} each")
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha))) * len(idx)).astype(int)[:-1]
        for client, piece in enumerate(np.split(idx, cuts)):
            parts[client].extend(piece.tolist())
    # Clients left with too few samples take them from the largest (keeps every weight > 0).
    for client in range(num_clients):
        while len(parts[client]) < min_size:
            donor = max(range(num_clients), key=lambda c: len(parts[c]))
            parts[client].append(parts[donor].pop())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def shard_partition(labels: np.ndarray, num_clients: int, classes_per_client: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    """Pathological label skew: every client holds exactly k classes, consecutive in a seeded
    cyclic order of the classes (so all classes are used when clients x k >= classes); each
    class is dealt evenly among the clients holding it."""
    classes = rng.permutation(np.unique(labels))
    k = min(classes_per_client, len(classes))
    held = [{classes[(c * k + i) % len(classes)] for i in range(k)} for c in range(num_clients)]
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for cls in classes:
        owners = [c for c in range(num_clients) if cls in held[c]]
        idx = rng.permutation(np.flatnonzero(labels == cls))
        for owner, piece in zip(owners, np.array_split(idx, len(owners))):
            parts[owner].extend(piece.tolist())
    if any(len(p) == 0 for p in parts):
        raise ValueError(f"shards: {num_clients} clients x {k} classes leave a client with no samples")
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def unbalanced_partition(num_samples: int, num_clients: int, sigma: float,
                         rng: np.random.Generator) -> list[np.ndarray]:
    """Quantity skew: client sizes proportional to lognormal(0, sigma) draws (at least 1), labels IID."""
    if num_samples < num_clients:
        raise ValueError(f"{num_samples} training samples cannot be split across {num_clients} clients")
    share = rng.lognormal(0.0, sigma, size=num_clients)
    sizes = 1 + np.floor(share / share.sum() * (num_samples - num_clients)).astype(int)
    sizes[np.argmax(sizes)] += num_samples - sizes.sum()
    cuts = np.cumsum(sizes)[:-1]
    return [np.sort(part) for part in np.split(rng.permutation(num_samples), cuts)]


def partition(cfg: DataConfig, labels: torch.Tensor, num_clients: int, seed: int,
              natural: tuple[np.ndarray, ...] | None = None) -> list[np.ndarray]:
    """The configured partition of the training set (identical on every rank).

    ``natural`` is the dataset's own split (LEAF users, say), for ``data.partition: natural``.
    """
    if cfg.partition == "natural":
        return natural_partition(natural, num_clients, cfg.dataset)
    if cfg.partition == "file":
        return checked_partition(read_partition_file(cfg.partition_file), len(labels), num_clients,
                                 f"data.partition_file {cfg.partition_file!r}")
    if is_import_path(cfg.partition):
        parts = resolve(cfg.partition)(labels.numpy(), num_clients, derive_seed(seed, PARTITION))
        return checked_partition(parts, len(labels), num_clients, f"data.partition {cfg.partition!r}")
    rng = np.random.default_rng(derive_seed(seed, PARTITION))
    if len(labels) < num_clients:
        raise ValueError(f"clients.num_clients: {len(labels)} training samples cannot be split across "
                         f"{num_clients} clients (every client needs at least one)")
    if cfg.partition == "iid":
        return iid_partition(len(labels), num_clients, rng)
    if cfg.partition == "shards":
        return shard_partition(labels.numpy(), num_clients, cfg.classes_per_client, rng)
    if cfg.partition == "unbalanced":
        return unbalanced_partition(len(labels), num_clients, cfg.size_sigma, rng)
    return dirichlet_partition(labels.numpy(), num_clients, cfg.alpha, rng)


def natural_partition(natural: tuple[np.ndarray, ...] | None, num_clients: int, dataset: str) -> list[np.ndarray]:
    """The dataset's own clients, the first ``num_clients`` of them."""
    if natural is None:
        raise ValueError(f"data.partition: 'natural' needs a dataset with its own clients (e.g. 'leaf'); "
                         f"{dataset!r} has none")
    if num_clients > len(natural):
        raise ValueError(f"clients.num_clients: {num_clients} clients, but the data has {len(natural)}")
    return [np.sort(p) for p in natural[:num_clients]]


def read_partition_file(path: str) -> list[np.ndarray]:
    """A partition file: JSON, a list of index lists (client c's is the c-th) or {"client id": [indices]}."""
    table = json.loads(Path(path).read_text())
    if isinstance(table, dict):
        table = [table[k] for k in sorted(table, key=int)]
    return [np.asarray(p, dtype=np.int64) for p in table]


def checked_partition(parts: list, num_samples: int, num_clients: int, where: str) -> list[np.ndarray]:
    """A user's partition, checked: one index array per client, every index a training sample."""
    parts = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    if len(parts) < num_clients:
        raise ValueError(f"{where}: {len(parts)} clients, but clients.num_clients={num_clients}")
    bad = next((c for c, p in enumerate(parts[:num_clients]) if len(p) and (p.min() < 0 or p.max() >= num_samples)), None)
    if bad is not None:
        raise ValueError(f"{where}: client {bad} has indices outside the {num_samples} training samples")
    return parts[:num_clients]


def split_validation(indices: np.ndarray, fraction: float, seed: int, client: int) -> tuple[np.ndarray, np.ndarray]:
    """A client's (train, validation) indices: a seeded ``fraction`` held out (none when 0)."""
    if fraction == 0 or len(indices) < 2:
        return indices, indices[:0]
    rng = np.random.default_rng(derive_seed(seed, PARTITION, client))
    order = rng.permutation(len(indices))
    n_val = max(1, int(round(fraction * len(indices))))
    return np.sort(indices[order[n_val:]]), np.sort(indices[order[:n_val]])


def label_histogram(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Clients x classes sample counts."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts]) if parts else np.zeros((0, 0))


def partition_histogram(cfg: DataConfig, dataset: Dataset, num_clients: int, seed: int) -> np.ndarray:
    """Clients x classes sample counts of the configured partition."""
    parts = partition(cfg, dataset.y_train, num_clients, seed, dataset.clients)
    return label_histogram(parts, dataset.y_train.numpy(), dataset.num_classes)


def partition_table(histogram: np.ndarray, max_rows: int = 20) -> str:
    """The partition as a text table: one row per client (samples, then per-class counts)."""
    num_classes = histogram.shape[1]
    width = max(5, len(str(int(histogram.max(initial=0)))) + 1)
    head = f"{'client':>6} {'samples':>8} " + "".join(f"{f'c{k}':>{width}}" for k in range(num_classes))
    rows = [head]
    shown = range(len(histogram)) if len(histogram) <= max_rows else [*range(max_rows // 2),
                                                                       *range(len(histogram) - max_rows // 2,
                                                                              len(histogram))]
    previous = -1
    for c in shown:
        if c != previous + 1:
            rows.append(f"{'...':>6}")
        rows.append(f"{c:>6} {int(histogram[c].sum()):>8} " + "".join(f"{int(n):>{width}}" for n in histogram[c]))
        previous = c
    sizes = histogram.sum(axis=1)
    rows.append(f"{len(histogram)} clients, samples per client min {sizes.min()} / median {int(np.median(sizes))} / "
                f"max {sizes.max()}, classes per client (>0 samples) mean {(histogram > 0).sum(axis=1).mean():.1f}")
    return "\n".join(rows)


def plot_partition(histogram: np.ndarray, path: str) -> None:
    """A stacked bar chart of each client's label counts (needs matplotlib: the 'plot' extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(histogram) + 2), 3.5))
    bottom = np.zeros(len(histogram))
    for k in range(histogram.shape[1]):
        ax.bar(range(len(histogram)), histogram[:, k], bottom=bottom, label=f"class {k}", width=0.85)
        bottom += histogram[:, k]
    ax.set_xlabel("logical client")
    ax.set_ylabel("training samples")
    ax.legend(fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def client_data(dataset: Dataset, indices: np.ndarray) -> ClientData:
    """One client's slice of the training set."""
    idx = torch.from_numpy(indices)
    return ClientData(dataset.x_train[idx], dataset.y_train[idx])
