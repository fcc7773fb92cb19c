"""Partitions: how the training samples are split across logical clients, deterministically
from the seed (identical on every rank), and the clients x labels report of a split.

Built in: ``iid``, ``dirichlet`` (label skew), ``shards`` (k classes per client, from fixed groups of
consecutive classes), ``labels`` (NIID-Bench's #C=k label-quantity skew), ``unbalanced`` (lognormal sizes),
``natural`` (the data's own clients), ``file`` (a JSON list of per-client indices); or a plugin
``fn(labels, num_clients, seed)``.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mpifl.config import DataConfig
from mpifl.learning.datasets import Dataset
from mpifl.planning.seeds import PARTITION, derive_seed
from mpifl.plugins import call_problem, is_import_path, resolve
from mpifl.units import range_list


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
    """Pathological label skew from fixed class groups: the classes in a seeded cyclic order, client c holding
    the k consecutive ones from position c * k (mod the number of classes), so all classes are used when
    clients x k >= classes; each class is dealt evenly among the clients holding it. When k divides the number
    of classes C, the groups are C / k fixed disjoint blocks and clients c and c + C / k hold the same one (with
    10 classes, k = 2 and 10 clients: 5 pairs of classes, each held by two clients); not NIID-Bench's #C=k,
    which is ``label_quantity_partition``."""
    classes = rng.permutation(np.unique(labels))
    k = checked_classes_per_client(classes_per_client, len(classes), "shards")
    held = [{classes[(c * k + i) % len(classes)] for i in range(k)} for c in range(num_clients)]
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for cls in classes:
        owners = [c for c in range(num_clients) if cls in held[c]]
        idx = rng.permutation(np.flatnonzero(labels == cls))
        for owner, piece in zip(owners, np.array_split(idx, len(owners))):
            parts[owner].extend(piece.tolist())
    refuse_empty_clients(parts, "shards", k)
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def label_quantity_partition(labels: np.ndarray, num_clients: int, classes_per_client: int,
                             rng: np.random.Generator) -> list[np.ndarray]:
    """NIID-Bench's #C=k label-quantity skew (Li et al., ICDE 2022; its ``noniid-#label<k>``): client i holds
    class i mod C and k - 1 more distinct classes drawn at random; each class's samples, shuffled, are cut into
    near-equal runs among the clients holding it. A class no client holds (fewer clients than classes) is left
    out. Every draw comes from ``rng``."""
    classes, codes = np.unique(labels, return_inverse=True)
    k = checked_classes_per_client(classes_per_client, len(classes), "labels")
    contain = ([list(range(len(classes)))] * num_clients if k == len(classes)  # every class: nothing to draw
               else label_sets(num_clients, k, len(classes), lambda: int(rng.integers(len(classes)))))
    parts = deal_label_runs(codes, contain, rng.shuffle, len(classes))
    refuse_empty_clients(parts, "labels", k)
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def label_sets(n_parties: int, num: int, num_classes: int, draw: Callable[[], int]) -> list[list[int]]:
    """NIID-Bench's #C=k label choice: party i holds label i mod K, then labels from ``draw()`` (the caller's
    generator) until it holds ``num`` distinct ones, in the order drawn."""
    contain = []
    for i in range(n_parties):
        current = [i % num_classes]
        while len(current) < num:
            ind = draw()
            if ind not in current:
                current.append(ind)
        contain.append(current)
    return contain


def deal_label_runs(labels: np.ndarray, contain: list[list[int]], shuffle: Callable[[np.ndarray], None],
                    num_classes: int) -> list[list[int]]:
    """Each label 0..K-1's samples, shuffled in place by ``shuffle`` in label order, cut into near-equal runs
    (``np.array_split``), one per party holding the label, in party order; a party's indices are its labels' runs
    in label order. A label no party holds is shuffled all the same (the draws stay in step) and left out."""
    labels = np.asarray(labels)
    parts: list[list[int]] = [[] for _ in contain]
    for k in range(num_classes):
        idx_k = np.where(labels == k)[0]
        shuffle(idx_k)
        holders = [j for j, held in enumerate(contain) if k in held]
        for j, run in zip(holders, np.array_split(idx_k, len(holders)) if holders else []):
            parts[j] += run.tolist()
    return parts


def checked_classes_per_client(k: int, num_classes: int, name: str) -> int:
    """``data.classes_per_client``, refused when there are not that many classes to hold."""
    if k > num_classes:
        raise ValueError(f"data.classes_per_client: {k} classes per client, but the training labels have only "
                         f"{num_classes} classes (data.partition {name!r} gives each client k distinct ones); "
                         f"set it to at most {num_classes}")
    return k


def refuse_empty_clients(parts: list[list[int]], name: str, k: int) -> None:
    """A label split that leaves a client no samples (its classes have fewer samples than holders) is refused."""
    empty = [c for c, p in enumerate(parts) if not p]
    if empty:
        raise ValueError(f"data.partition {name!r}: client{'s' if len(empty) > 1 else ''} {range_list(empty)} "
                         f"get no samples: {len(parts)} clients x data.classes_per_client={k} share classes among "
                         "more clients than they have samples; use fewer clients or more classes per client")


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


def partition_problem(cfg: DataConfig) -> str | None:
    """Why a plug-in ``data.partition`` cannot be imported or called as mpifl calls it, ``fn(labels, num_clients,
    seed)``, or None: before MPI, instead of a traceback on every rank that splits the data."""
    if not is_import_path(cfg.partition):
        return None
    try:
        fn = resolve(cfg.partition)
    except ImportError as err:
        return f"data.partition: {err}"
    if not callable(fn):
        return f"data.partition: {cfg.partition!r} names a {type(fn).__name__!r} object, not a function " \
            "fn(labels, num_clients, seed)"
    problem = call_problem(fn, "partition(labels, num_clients, seed)", ("labels", "num_clients", "seed"))
    return f"data.partition {cfg.partition!r}: {problem}" if problem else None


def partition(cfg: DataConfig, labels: torch.Tensor, num_clients: int, seed: int,
              natural: tuple[np.ndarray, ...] | None = None,
              named: Callable[[int], str] | None = None) -> list[np.ndarray]:
    """The configured partition of the training set (identical on every rank).

    ``natural`` is the dataset's own split (LEAF users, say), for ``data.partition: natural``; ``named(c)`` how the
    data names its client c in messages ("LEAF user 'f0042'"; Dataset.natural_name).
    """
    if cfg.partition == "natural":
        return natural_partition(natural, len(labels), num_clients, cfg.dataset, named)
    if cfg.partition == "file":
        assert cfg.partition_file is not None  # config checks require it exactly when partition is 'file'
        return checked_partition(read_partition_file(cfg.partition_file, num_clients), len(labels), num_clients,
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
    if cfg.partition == "labels":
        return label_quantity_partition(labels.numpy(), num_clients, cfg.classes_per_client, rng)
    if cfg.partition == "unbalanced":
        return unbalanced_partition(len(labels), num_clients, cfg.size_sigma, rng)
    return dirichlet_partition(labels.numpy(), num_clients, cfg.alpha, rng)


def natural_partition(natural: tuple[np.ndarray, ...] | None, num_samples: int, num_clients: int,
                      dataset: str, named: Callable[[int], str] | None = None) -> list[np.ndarray]:
    """The dataset's own clients, the first ``num_clients`` of them, checked as a partition file is
    (``checked_partition``): none empty, every index a training sample, no sample held twice; a refused client is
    named as the data names it too (``named``)."""
    if natural is None:
        raise ValueError(f"data.partition: 'natural' needs a dataset with its own clients (e.g. 'leaf'); "
                         f"{dataset!r} has none")
    if num_clients > len(natural):
        raise ValueError(f"clients.num_clients: {num_clients} clients, but the data has {len(natural)}")
    return checked_partition(list(natural[:num_clients]), num_samples, num_clients,
                             f"data.partition 'natural' (the clients of data.dataset {dataset!r})", named)


def read_partition_file(path: str, num_clients: int) -> list:
    """A partition file's per-client index lists, client c's the c-th, unchecked (``checked_partition``): JSON, a
    list of index lists or {"client id": indices} whose keys are the client ids 0, 1, ..., num_clients - 1 (and
    perhaps more, which are left out as a list's extra entries are)."""
    where = f"data.partition_file {path!r}"
    try:
        table = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if isinstance(table, dict):
        return _by_client_id(table, num_clients, where)
    if not isinstance(table, list):
        raise ValueError(f"{where}: a JSON list of per-client index lists, or an object {{\"client id\": "
                         f"[indices]}}, not a {type(table).__name__}")
    return table


def _by_client_id(table: dict, num_clients: int, where: str) -> list:
    """A {"client id": indices} table as a list by id: its keys must be the ids 0, 1, ... (no renumbering)."""
    odd = [k for k in table if not re.fullmatch(r"0|[1-9][0-9]*", k)]
    if odd:
        raise ValueError(f"{where}: keys are client ids 0 to {num_clients - 1}; "
                         f"{', '.join(map(repr, odd[:5]))} {'is' if len(odd) == 1 else 'are'} not")
    ids = {int(k): v for k, v in table.items()}
    missing = [c for c in range(num_clients) if c not in ids]
    if missing:
        raise ValueError(f"{where}: no entry for client{'s' if len(missing) > 1 else ''} {range_list(missing)} "
                         f"(keys are client ids 0 to {num_clients - 1}, for clients.num_clients={num_clients}; "
                         f"the file has {range_list(ids)})")
    return [ids[c] for c in range(num_clients)]


def checked_partition(parts: list, num_samples: int, num_clients: int, where: str,
                      named: Callable[[int], str] | None = None) -> list[np.ndarray]:
    """A user's partition, checked: one list of integer indices per client, each a training sample, none
    empty, and no sample held twice. Entries past ``num_clients`` are left out. A refused client is 'client c',
    followed by ``named(c)`` in brackets when that is not empty (the data's own name for it)."""
    if not isinstance(parts, (list, tuple)):
        raise ValueError(f"{where}: one index list per client, not a {type(parts).__name__}")
    if len(parts) < num_clients:
        raise ValueError(f"{where}: {len(parts)} clients, but clients.num_clients={num_clients}")
    who = (lambda c: client_text(c, named)) if named else client_text
    arrays = [_client_indices(p, who(c), num_samples, where) for c, p in enumerate(parts[:num_clients])]
    owner = np.full(num_samples, -1, dtype=np.int64)
    for client, idx in enumerate(arrays):
        twice = idx[1:][idx[1:] == idx[:-1]]
        if len(twice):
            raise ValueError(f"{where}: {who(client)} lists sample {twice[0]} twice")
        held = idx[owner[idx] >= 0]
        if len(held):
            raise ValueError(f"{where}: sample {held[0]} is held by {who(int(owner[held[0]]))} and {who(client)} "
                             "(a sample belongs to one client)")
        owner[idx] = client
    return arrays


def client_text(client: int, named: Callable[[int], str] | None = None) -> str:
    """'client 3', or 'client 3 (LEAF user 'f0042')' when ``named`` gives the data's own name for it."""
    name = named(client) if named else ""
    return f"client {client} ({name})" if name else f"client {client}"


def _client_indices(indices: object, who: str, num_samples: int, where: str) -> np.ndarray:
    """One client's entry (``who``) as sorted int64 indices: a non-empty list of integers below ``num_samples``."""
    if isinstance(indices, np.ndarray) and indices.ndim == 1 and np.issubdtype(indices.dtype, np.integer):
        return _integer_indices(indices, who, num_samples, where)  # a natural split's: checked at numpy speed
    if isinstance(indices, np.ndarray) and indices.size and indices.dtype.kind in "fcb":
        # a whole array at once: its values would be converted silently (5.7 to 5), whole numbers or not
        raise ValueError(f"{where}: {who}'s indices are a {indices.dtype} array; sample indices must have an "
                         "integer dtype (whole-number floats such as 3.0 are refused too: cast them with "
                         ".astype(np.int64) where they are made)")
    values = indices if isinstance(indices, (list, tuple)) else np.asarray(indices).tolist()
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{where}: {who}'s entry is {values!r}, not a list of sample indices")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, np.integer))]
    if bad:
        raise ValueError(f"{where}: {who}'s index {bad[0]!r} is not an integer")
    # integers, in an object array where one is past int64, which the range check then names
    return _integer_indices(np.asarray(values) if values else np.empty(0, dtype=np.int64), who, num_samples, where)


def _integer_indices(indices: np.ndarray, who: str, num_samples: int, where: str) -> np.ndarray:
    """One client's (``who``) integer indices, sorted as int64: none empty, each a training sample; checked without
    a Python loop (a natural split may hold millions)."""
    if not len(indices):
        raise ValueError(f"{where}: {who} holds no samples (every client needs at least one)")
    outside = indices[(indices < 0) | (indices >= num_samples)]
    if len(outside):
        raise ValueError(f"{where}: {who} has indices outside the {num_samples} training samples: {outside[0]}")
    return np.sort(indices.astype(np.int64))


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


def partition_counts(cfg: DataConfig, dataset: Dataset, num_clients: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """What each client trains on, by class (clients x classes), and how many samples it holds out for validation
    (``data.val_fraction``; zeros without it): the split ``split_validation`` makes on the client ranks."""
    parts = partition(cfg, dataset.y_train, num_clients, seed, dataset.clients, dataset.natural_name)
    return counts_of(parts, cfg, dataset, seed)


def counts_of(parts: list, cfg: DataConfig, dataset: Dataset, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``partition_counts`` of a partition already made (``parts``: each client's training indices), so that a
    rank which made it for its sampler does not draw it again to report it."""
    splits = [split_validation(p, cfg.val_fraction, seed, c) for c, p in enumerate(parts)]
    train = label_histogram([t for t, _ in splits], dataset.y_train.numpy(), dataset.num_classes)
    return train, np.array([len(v) for _, v in splits], dtype=np.int64)


def partition_table(histogram: np.ndarray, max_rows: int = 20, validation: np.ndarray | None = None) -> str:
    """The partition as a text table: one row per client (samples, then per-class counts). With ``validation``
    (each client's held-out count), ``histogram`` counts what the clients train on and a column the held out."""
    num_classes = histogram.shape[1]
    held_out = validation is not None and bool(validation.any())
    width = max(5, len(str(int(histogram.max(initial=0)))) + 1)
    head = (f"{'client':>6} {'train':>8} {'val':>6} " if held_out else f"{'client':>6} {'samples':>8} ")
    rows = [head + "".join(f"{f'c{k}':>{width}}" for k in range(num_classes))]
    shown = range(len(histogram)) if len(histogram) <= max_rows else [*range(max_rows // 2),
                                                                       *range(len(histogram) - max_rows // 2,
                                                                              len(histogram))]
    previous = -1
    for c in shown:
        if c != previous + 1:
            rows.append(f"{'...':>6}")
        val = f"{int(validation[c]):>6} " if held_out and validation is not None else ""
        rows.append(f"{c:>6} {int(histogram[c].sum()):>8} {val}" + "".join(f"{int(n):>{width}}" for n in histogram[c]))
        previous = c
    sizes = histogram.sum(axis=1)
    what = "training samples" if held_out else "samples"
    rows.append(f"{len(histogram)} clients, {what} per client min {sizes.min()} / median {int(np.median(sizes))} / "
                f"max {sizes.max()}, classes per client (>0 samples) mean {(histogram > 0).sum(axis=1).mean():.1f}"
                + (f"; {int(validation.sum())} more held out for validation (data.val_fraction), not in the class "
                   "counts" if held_out and validation is not None else ""))
    return "\n".join(rows)


def partition_csv(histogram: np.ndarray, validation: np.ndarray) -> str:
    """partition.csv: a row per client: its id, the samples it trains on, its validation samples (a column only
    when some client holds any out), then its training samples by class."""
    held_out = bool(validation.any())
    header = ["client", "train_samples", *(["validation_samples"] if held_out else []),
              *(f"train_class{k}" for k in range(histogram.shape[1]))]
    rows = [",".join(header)]
    for c, counts in enumerate(histogram):
        rows.append(",".join(map(str, [c, int(counts.sum()), *([int(validation[c])] if held_out else []),
                                       *(int(n) for n in counts)])))
    return "\n".join(rows) + "\n"


def plot_partition(histogram: np.ndarray, path: str, validation: np.ndarray | None = None) -> None:
    """A stacked bar chart of each client's training samples by label, its validation samples (``validation``)
    on top in grey (needs matplotlib: the 'plot' extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(histogram) + 2), 3.5))
    bottom = np.zeros(len(histogram))
    for k in range(histogram.shape[1]):
        ax.bar(range(len(histogram)), histogram[:, k], bottom=bottom, label=f"class {k}", width=0.85)
        bottom += histogram[:, k]
    held_out = validation is not None and bool(validation.any())
    if validation is not None and held_out:
        ax.bar(range(len(histogram)), validation, bottom=bottom, label="validation", width=0.85, color="0.85",
               hatch="//", edgecolor="0.5")
    ax.set_xlabel("logical client")
    ax.set_ylabel("training + validation samples" if held_out else "training samples")
    ax.legend(fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
