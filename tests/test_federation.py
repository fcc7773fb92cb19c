"""Sampling, placement and seeds: pure functions of the config, never of the rank count."""
import numpy as np
import torch

from mpifl.data import dirichlet_partition, digits, iid_partition, synthetic
from mpifl.federation import client_seed, clients_of_rank, group_by_rank, sample_clients


def test_sampling_is_seeded_sorted_and_without_repeats():
    a = sample_clients(0, 3, 100, 10)
    assert a == sample_clients(0, 3, 100, 10) and a == sorted(set(a)) and len(a) == 10
    assert a != sample_clients(0, 4, 100, 10) and a != sample_clients(1, 3, 100, 10)


def test_every_client_lives_on_exactly_one_rank():
    for ranks in (1, 2, 5):
        owned = [c for r in range(1, ranks + 1) for c in clients_of_rank(r, 11, ranks)]
        assert sorted(owned) == list(range(11))
        grouped = group_by_rank([0, 3, 4, 9], ranks)
        assert sorted(c for cl in grouped.values() for c in cl) == [0, 3, 4, 9]
        assert all(cl == sorted(cl) for cl in grouped.values())


def test_client_seed_depends_on_seed_round_and_client_only():
    assert client_seed(0, 1, 2) == client_seed(0, 1, 2)
    assert len({client_seed(0, r, c) for r in range(5) for c in range(5)}) == 25


def test_iid_partition_is_a_disjoint_cover():
    parts = iid_partition(103, 4, np.random.default_rng(0))
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_dirichlet_partition_skews_labels_and_leaves_no_client_empty():
    labels = np.repeat(np.arange(10), 50)
    parts = dirichlet_partition(labels, 20, 0.05, np.random.default_rng(0))
    assert sorted(np.concatenate(parts).tolist()) == list(range(500))
    assert min(map(len, parts)) >= 1
    distinct = [len(np.unique(labels[p])) for p in parts]
    assert np.mean(distinct) < 5  # strong skew at small alpha


def test_builtin_datasets_load_offline():
    x, y, xt, yt = digits()
    assert x.shape[1:] == (1, 8, 8) and len(x) + len(xt) == 1797 and int(y.max()) == 9
    assert float(x.max()) <= 1.0
    x, y, xt, yt = synthetic(num_samples=100, num_features=4)
    assert x.shape == (80, 4) and xt.dtype == torch.float32
