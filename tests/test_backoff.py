"""How a waiting rank polls (mpifl.wire.transport.Backoff): it spins for a moment, then sleeps, each sleep twice the
last up to a cap, so a long wait (the server waiting out its ranks' training) wakes rarely on the cores they train
on, while progress makes the next wait quick again. No MPI: time.sleep is recorded instead of slept."""
from __future__ import annotations

import pytest

from mpifl.wire import transport
from mpifl.wire.transport import LONGEST_SLEEP_SECONDS, RUNG_LONGEST_SLEEP_SECONDS, SLEEP_SECONDS, Backoff


@pytest.fixture
def sleeps(monkeypatch):
    """The sleeps a Backoff asks for, with a clock that has left the spin phase after the first poll."""
    asked: list[float] = []
    clock = iter(i * 1.0 for i in range(1000))
    monkeypatch.setattr(transport.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(transport.time, "sleep", asked.append)
    return asked


def test_an_idle_wait_sleeps_twice_as_long_each_time_up_to_the_cap(sleeps):
    backoff = Backoff()
    for _ in range(8):
        backoff.pause()
    assert sleeps[0] == SLEEP_SECONDS  # the first poll only starts the clock; then 0.2, 0.4, 0.8, 1.6 ms, 2 ms ...
    assert sleeps == [min(SLEEP_SECONDS * 2 ** i, LONGEST_SLEEP_SECONDS) for i in range(7)]
    assert max(sleeps) == LONGEST_SLEEP_SECONDS == 2e-3


def test_progress_makes_the_next_wait_spin_then_sleep_briefly_again(sleeps):
    backoff = Backoff()
    for _ in range(6):
        backoff.pause()
    backoff.reset()
    backoff.pause()  # spinning: no sleep
    backoff.pause()
    assert sleeps[-1] == SLEEP_SECONDS and len(sleeps) == 6


class FakeDoorbells:
    """Doorbells that record the naps asked of them; every ``rung_every``-th nap is cut short by a ring."""

    def __init__(self, asked: list[float], rung_every: int = 0, everyone: bool = True):
        self.asked, self.rung_every, self.everyone = asked, rung_every, everyone

    def nap(self, seconds: float) -> bool:
        self.asked.append(seconds)
        return bool(self.rung_every) and len(self.asked) % self.rung_every == 0


def test_a_rung_nap_makes_the_wait_spin_and_sleep_briefly_again(sleeps):
    """A ring says a message is on its way: the wait spins until MPI hands it over, and does not keep its long
    sleep (with doorbells, mpifl.wire.doorbell)."""
    naps: list[float] = []
    with transport.use_doorbells(FakeDoorbells(naps, rung_every=2)):
        backoff = Backoff()
        for _ in range(7):
            backoff.pause()
    assert not sleeps  # naps on the doorbells replace time.sleep
    assert naps == [SLEEP_SECONDS, 2 * SLEEP_SECONDS, SLEEP_SECONDS, 2 * SLEEP_SECONDS]


@pytest.mark.parametrize("everyone,cap", [(True, RUNG_LONGEST_SLEEP_SECONDS), (False, LONGEST_SLEEP_SECONDS)])
def test_a_wait_that_every_rank_can_ring_looks_less_often(sleeps, everyone, cap):
    """On one node every message rings its receiver awake, so an idle wait may sleep up to 20 ms between looks and
    wake the cores others train on less often; with ranks on other nodes, which cannot ring, it keeps the 2 ms cap."""
    naps: list[float] = []
    with transport.use_doorbells(FakeDoorbells(naps, everyone=everyone)):
        backoff = Backoff()
        for _ in range(12):
            backoff.pause()
    assert max(naps) == cap and naps == [min(SLEEP_SECONDS * 2 ** i, cap) for i in range(11)]
    assert RUNG_LONGEST_SLEEP_SECONDS == 20e-3
