"""Sampling, placement and seeds: pure functions of the config, never of the rank count."""
import numpy as np
import pytest
import torch

from mpifl.learning.datasets import digits, synthetic
from mpifl.learning.partitions import dirichlet_partition, iid_partition
from mpifl.planning.federation import clients_of_rank, group_by_rank, sample_clients
from mpifl.planning.seeds import client_seed


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


def test_shards_give_every_client_exactly_k_classes_and_use_every_class():
    from mpifl.learning.partitions import shard_partition

    labels = np.repeat(np.arange(10), 40)
    parts = shard_partition(labels, 8, 3, np.random.default_rng(1))
    assert sorted(np.concatenate(parts).tolist()) == list(range(400))
    assert [len(np.unique(labels[p])) for p in parts] == [3] * 8
    assert set(np.unique(labels[np.concatenate(parts)])) == set(range(10))


def test_shards_are_fixed_groups_of_consecutive_classes_so_with_10_classes_k_2_clients_c_and_c_plus_5_match():
    from mpifl.learning.partitions import shard_partition

    labels = np.repeat(np.arange(10), 40)
    held = [frozenset(labels[p].tolist()) for p in shard_partition(labels, 10, 2, np.random.default_rng(3))]
    assert all(held[c] == held[c + 5] for c in range(5)) and len(set(held)) == 5  # 5 disjoint pairs
    assert len(frozenset().union(*held)) == 10


def niid_bench_label_quantity(labels, n, k, rng):
    """NIID-Bench's noniid-#label<k> (utils.partition_data), written out with ``rng`` for both of its streams."""
    contain = []
    for i in range(n):
        current = [i % 10]
        while len(current) < k:
            drawn = int(rng.integers(10))
            if drawn not in current:
                current.append(drawn)
        contain.append(current)
    parts = [[] for _ in range(n)]
    for label in range(10):
        idx = np.where(labels == label)[0]
        rng.shuffle(idx)
        holders = [j for j in range(n) if label in contain[j]]
        for j, run in zip(holders, np.array_split(idx, len(holders))):
            parts[j] += run.tolist()
    return [sorted(p) for p in parts]


@pytest.mark.parametrize("k", [1, 2, 3, 10])
def test_labels_is_niid_bench_s_label_quantity_skew_drawn_from_the_partition_seed(k):
    from mpifl.learning.partitions import label_quantity_partition

    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]))
    parts = label_quantity_partition(labels, 10, k, np.random.default_rng(7))
    if k < 10:
        assert [p.tolist() for p in parts] == niid_bench_label_quantity(labels, 10, k, np.random.default_rng(7))
    held = [sorted(set(labels[p].tolist())) for p in parts]
    assert all(len(h) == k and i % 10 in h for i, h in enumerate(held))  # label i mod 10 and k - 1 more
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(labels)))  # each sample once
    for label in range(10):  # a label's samples cut into near-equal runs among its holders
        sizes = [int(np.sum(labels[p] == label)) for p, h in zip(parts, held) if label in h]
        assert max(sizes) - min(sizes) <= 1


def test_labels_with_10_classes_and_k_2_does_not_pair_clients_as_shards_does():
    from mpifl.config import load_config
    from mpifl.learning.partitions import partition

    cfg = load_config(None, data={"data": {"partition": "labels", "classes_per_client": 2}})
    labels = torch.from_numpy(np.repeat(np.arange(10), 50))
    parts = partition(cfg.data, labels, 10, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition(cfg.data, labels, 10, seed=0)))  # every rank
    held = [frozenset(labels.numpy()[p].tolist()) for p in parts]
    assert len(set(held)) > 5 and any(held[c] != held[c + 5] for c in range(5))
    assert [sorted(h) for h in held] != [sorted(frozenset(labels.numpy()[p].tolist()))
                                         for p in partition(cfg.data, labels, 10, seed=1)]


@pytest.mark.parametrize("name", ["shards", "labels"])
def test_more_classes_per_client_than_classes_is_refused_not_made_iid(name):
    from mpifl.config import load_config
    from mpifl.learning.partitions import partition

    cfg = load_config(None, data={"data": {"partition": name, "classes_per_client": 12}})
    with pytest.raises(ValueError, match=r"^data.classes_per_client: 12 classes per client, but the training labels "
                                         r"have only 10 classes"):
        partition(cfg.data, torch.from_numpy(np.repeat(np.arange(10), 20)), 4, seed=0)


def test_labels_refuses_a_split_that_leaves_a_client_no_samples():
    from mpifl.learning.partitions import label_quantity_partition

    with pytest.raises(ValueError, match=r"data.partition 'labels': clients 6-9 get no samples: 10 clients x "
                                         r"data.classes_per_client=1"):
        label_quantity_partition(np.repeat(np.arange(3), 2), 10, 1, np.random.default_rng(0))


def test_unbalanced_sizes_vary_widely_and_cover_the_data():
    from mpifl.learning.partitions import unbalanced_partition

    parts = unbalanced_partition(1000, 20, 1.5, np.random.default_rng(0))
    sizes = sorted(map(len, parts))
    assert sum(sizes) == 1000 and sorted(np.concatenate(parts).tolist()) == list(range(1000))
    assert sizes[0] >= 1 and sizes[-1] > 5 * sizes[len(sizes) // 2] / 2
    equal = unbalanced_partition(1000, 20, 0.0, np.random.default_rng(0))
    assert max(map(len, equal)) - min(map(len, equal)) <= 1


def test_validation_split_is_seeded_disjoint_and_optional():
    from mpifl.learning.partitions import split_validation

    idx = np.arange(100, 200)
    train, val = split_validation(idx, 0.2, seed=0, client=3)
    assert len(val) == 20 and not set(train) & set(val) and sorted([*train, *val]) == idx.tolist()
    assert np.array_equal(val, split_validation(idx, 0.2, seed=0, client=3)[1])
    assert not np.array_equal(val, split_validation(idx, 0.2, seed=0, client=4)[1])
    assert len(split_validation(idx, 0.0, seed=0, client=3)[1]) == 0


@pytest.mark.parametrize("samples,fraction,held_out", [(2, 0.75, 1), (2, 0.9, 1), (3, 0.9, 2), (10, 0.9, 9),
                                                        (1, 0.9, 0), (4, 0.1, 1)])
def test_a_validation_split_holds_out_at_least_one_sample_and_always_leaves_one_to_train_on(samples, fraction,
                                                                                            held_out):
    from mpifl.learning.partitions import split_validation

    train, val = split_validation(np.arange(samples), fraction, seed=0, client=0)
    assert len(val) == held_out and len(train) == samples - held_out


def test_partition_table_shows_samples_and_label_counts_per_client():
    from mpifl.learning.partitions import label_histogram, partition_table

    labels = np.array([0, 0, 1, 2, 2, 2])
    table = partition_table(label_histogram([np.array([0, 1, 2]), np.array([3, 4, 5])], labels, 3))
    lines = table.splitlines()
    assert lines[0].split() == ["client", "samples", "c0", "c1", "c2"]
    assert lines[1].split() == ["0", "3", "2", "1", "0"] and lines[2].split() == ["1", "3", "0", "0", "3"]
    assert "2 clients" in lines[-1]


def test_balanced_placement_puts_the_heaviest_work_first_on_the_least_loaded_rank():
    from mpifl.planning.federation import balanced_ranks

    work = [10, 1, 1, 1, 1, 9, 2, 3]
    ranks = balanced_ranks(work, 2)
    loads = [sum(w for w, r in zip(work, ranks) if r == rank) for rank in (1, 2)]
    assert ranks == balanced_ranks(work, 2)  # deterministic
    assert abs(loads[0] - loads[1]) <= 1 and sorted(set(ranks)) == [1, 2]
    # with groups, a group (client mod G) moves as a whole
    grouped = balanced_ranks(work, 2, groups=4)
    assert all(grouped[c] == grouped[c % 4] for c in range(len(work)))


def test_round_robin_placement_is_the_default_and_matches_rank_of_client():
    from mpifl.config import load_config
    from mpifl.planning.federation import placement_for, rank_of_client

    placement = placement_for(load_config(None).clients, 3, None)
    assert [placement.rank_of(c) for c in range(8)] == [rank_of_client(c, 3) for c in range(8)]
