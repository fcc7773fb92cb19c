"""Partitions: how the training samples are split across logical clients, deterministically
from the seed (identical on every rank), and the clients x labels report of a split.

Built in: ``iid``, ``dirichlet`` (label skew), ``shards`` (k classes per client),
``unbalanced`` (lognormal sizes), ``natural`` (the data's own clients), ``file`` (a JSON list
of per-client indices); or a plugin ``fn(labels, num_clients, seed)``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from mpifl.config import DataConfig
from mpifl.learning.datasets import Dataset
from mpifl.planning.seeds import PARTITION, derive_seed
from mpifl.plugins import is_import_path, resolve


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
        assert cfg.partition_file is not None  # config checks require it exactly when partition is 'file'
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
    bad = next((c for c, p in enumerate(parts[:num_clients])
                if len(p) and (p.min() < 0 or p.max() >= num_samples)), None)
    if bad is not None:
        raise ValueError(f"{where}: client {bad} has indices outside the {num_samples} training samples")
    return parts[:num_clients]


def split_validation(indices: np.ndarray, fraction: float, seed: int, client: int) -> tuple[np.ndarray, np.ndarray]:
    """A client's (train, validation) indices: a seeded ``fraction`` held out (none when 0), at least one and never
    every sample, so that a client with 2 or more samples always has one to train on (a 2-sample client with
    fraction 0.75 holds out 1, not 2)."""
    if fraction == 0 or len(indices) < 2:
        return indices, indices[:0]
    rng = np.random.default_rng(derive_seed(seed, PARTITION, client))
    order = rng.permutation(len(indices))
    n_val = min(len(indices) - 1, max(1, int(round(fraction * len(indices)))))
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
