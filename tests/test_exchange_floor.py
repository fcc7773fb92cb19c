"""The raw-MPI floor a run times before round 1, and what each round's record makes of it (no MPI needed)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpifl.aggregation.floor import FloorRate
from mpifl.planning.pools import FloorProbe

SPLIT = {"dispatch": 0.02, "client_train": 1.0, "return": 0.05, "aggregate": 0.01, "round": 1.1}


def test_a_round_is_set_against_the_floor_of_its_own_bytes():
    rate = FloorRate(down=1e-9, up=2e-9, probe_bytes=1 << 20, client_ranks=2)
    exchange = rate.exchange(SPLIT, sent=10_000_000, received=20_000_000)
    assert exchange["floor_seconds"] == pytest.approx(0.01 + 0.04)
    assert exchange["seconds"] == pytest.approx(0.02 + 0.05 + 0.01)  # dispatch, return and aggregate: not training
    assert exchange["ratio_to_floor"] == pytest.approx(0.08 / 0.05)
    assert exchange["dispatch_ratio_to_floor"] == pytest.approx(0.02 / 0.01)


def test_a_round_that_moved_nothing_has_no_ratio():
    exchange = FloorRate(down=1e-9, up=1e-9, probe_bytes=4, client_ranks=1).exchange(SPLIT, sent=0, received=0)
    assert exchange == {"seconds": pytest.approx(0.08), "floor_seconds": 0.0}


@pytest.mark.parametrize(("probe_mb", "model_bytes", "ranks", "itemsize", "expected"), [
    (64, 1 << 40, 2, 4, 32 << 20),  # the probe is shared among the client ranks
    (64, 1000, 2, 4, 1000),  # but never more than the model
    (64, 1002, 2, 4, 1000),  # in whole elements
    (1e-9, 1 << 30, 1000, 2, 2),  # at least one element
    (0, 1 << 30, 2, 4, 0),  # 0: no probe
])
def test_the_probe_moves_its_share_of_floor_probe_mb_per_client_rank(probe_mb, model_bytes, ranks, itemsize,
                                                                      expected):
    exchange = SimpleNamespace(model_bytes=model_bytes, chunk_bytes=16 << 20, inflight=4)
    assert FloorProbe.of(exchange, probe_mb, ranks, itemsize).nbytes == expected


def test_the_servers_probe_buffers_stay_near_floor_probe_mb_however_many_client_ranks():
    for ranks in (1, 2, 8, 100, 1000):
        exchange = SimpleNamespace(model_bytes=1 << 40, chunk_bytes=16 << 20, inflight=4)
        probe = FloorProbe.of(exchange, 64, ranks, 2)
        assert probe.chunk_bytes <= probe.nbytes  # no receive slot wider than what a rank sends
        # slots: inflight x the probe; the fp32 accumulator and the buffer sent: one rank's share each
        assert probe.server_bytes <= 4 * (64 << 20) + 3 * probe.nbytes


def test_a_ranks_later_clients_train_in_client_train_not_in_return():
    """Rank 1 trains three clients, 0.1 s each: its first update lands 0.1 s after dispatch, the last 0.3 s, and
    the folding takes 0.05 s of the 0.45 s wait. Before, the 0.2 s of its later clients counted as the wire."""
    from mpifl.roles.records import RoundTimes

    times = RoundTimes(start=0.0, dispatched=1.0, first_update=1.1, reduced=1.45, evaluated=1.5, checkpointed=1.5,
                       end=1.5, aggregate=0.05, training=0.3)
    split = times.split()
    assert split["client_train"] == pytest.approx(0.3) and split["return"] == pytest.approx(0.1)
    assert sum(v for k, v in split.items() if k != "round") == pytest.approx(split["round"])
    # training reported longer than the wait (clocks of different ranks): never more than the wait itself
    late = RoundTimes(0.0, 1.0, 1.1, 1.45, 1.5, 1.5, 1.5, 0.05, training=9.0).split()
    assert late["client_train"] == pytest.approx(0.4) and late["return"] == pytest.approx(0.0)


def test_the_wait_for_a_rank_dropped_past_its_deadline_is_neither_training_nor_the_wire():
    """Rank 1 delivers after 0.2 s of training; rank 2 stalls and is dropped at the 5 s deadline, after which the
    last chunks land and fold by 5.1 s. The 4.8 s spent waiting for rank 2 was booked as `return` before."""
    from mpifl.roles.records import RoundTimes

    times = RoundTimes(start=0.0, dispatched=0.0, first_update=0.2, reduced=5.1, evaluated=5.1, checkpointed=5.1,
                       end=5.1, aggregate=0.05, training=0.2, last_drop=5.0)
    split = times.split()
    assert split["client_train"] == pytest.approx(0.2) and split["dropped_wait"] == pytest.approx(4.8)
    assert split["return"] == pytest.approx(0.05)
    assert sum(v for k, v in split.items() if k != "round") == pytest.approx(split["round"])
    # nobody dropped: no wait for the dropped, and the wire keeps the rest
    assert RoundTimes(0.0, 0.0, 0.2, 5.1, 5.1, 5.1, 5.1, 0.05, training=0.2).split()["dropped_wait"] == 0.0
