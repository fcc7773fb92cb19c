"""Virtual time, in process: devices and the cost model, availability, staleness, and the planned
synchronous rounds and asynchronous steps depend on the config and the seed only."""
from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest

from mpifl.clock.availability import Availability
from mpifl.clock.devices import devices_for, read_trace
from mpifl.clock.schedule import SyncClock, held_updates, plan_async
from mpifl.clock.staleness import staleness_weight
from mpifl.config import ConfigError, load_config
from mpifl.planning.federation import sample_clients


def clock(**kw):
    return load_config(None, data={"clock": kw, "clients": {"num_clients": 200}}).clock


def durations(cfg, n=200, seed=0, samples=40, nbytes=2_000_000):
    devices = devices_for(cfg, n, seed)
    return lambda round_, c: devices.task_seconds(c, samples, nbytes, nbytes)


def test_a_task_takes_its_transfers_over_the_link_plus_its_samples_over_the_speed(tmp_path):
    trace = tmp_path / "devices.json"  # FedScale's layout: ms per sample, kbps
    trace.write_text(json.dumps({"7": {"computation": 20.0, "communication": 8000.0},
                                 "3": {"computation": 5.0, "communication": 1000.0}}))
    devices = devices_for(clock(trace=str(trace)), 3, seed=0)
    # entries sorted by client id: client 0 takes "3", client 1 takes "7", client 2 cycles back to "3"
    assert devices.task_seconds(0, samples=100, bytes_down=125_000, bytes_up=250_000) == pytest.approx(
        1.0 + 100 * 0.005 + 2.0)
    assert devices.task_seconds(1, 10, 0, 0) == pytest.approx(0.2)
    assert devices.task_seconds(2, 10, 0, 0) == devices.task_seconds(0, 10, 0, 0)


def test_a_json_traces_client_ids_are_taken_in_numeric_order_as_a_pickles_are(tmp_path):
    """JSON keys are strings: in string order client "10" would come before "9", and client 0 would get the device
    of the trace's eleventh id."""
    ids = range(12)
    as_json = tmp_path / "t.json"
    as_json.write_text(json.dumps({str(i): {"computation": i + 1, "communication": 100} for i in ids}))
    as_pickle = tmp_path / "t.pkl"
    as_pickle.write_bytes(pickle.dumps({i: {"computation": i + 1, "communication": 100} for i in ids}))
    assert [ms for ms, _ in read_trace(str(as_json))] == [float(i + 1) for i in ids] == [
        ms for ms, _ in read_trace(str(as_pickle))]


def test_a_trace_entry_without_numbers_is_named(tmp_path):
    trace = tmp_path / "devices.json"
    trace.write_text(json.dumps({"12": {"computation": 1.0}}))
    with pytest.raises(ValueError, match="client '12' needs numbers 'computation'"):
        read_trace(str(trace))


def test_seeded_devices_are_lognormal_around_the_configured_medians_and_repeat():
    cfg = clock(seconds_per_sample=0.02, bandwidth_mbps=50, speed_sigma=0.5, bandwidth_sigma=0.8)
    a, b = devices_for(cfg, 5000, seed=3), devices_for(cfg, 5000, seed=3)
    assert np.array_equal(a.seconds_per_sample, b.seconds_per_sample)
    assert np.median(a.seconds_per_sample) == pytest.approx(0.02, rel=0.05)
    assert np.median(a.bits_per_second) == pytest.approx(50e6, rel=0.08)
    assert not np.array_equal(a.bits_per_second, devices_for(cfg, 5000, seed=4).bits_per_second)


def test_diurnal_clients_are_online_their_fraction_of_the_period_and_the_next_change_is_exact():
    avail = Availability(clock(availability="diurnal", online_fraction=0.25, period=100.0), 4000, seed=1)
    fractions = [avail.online(t).mean() for t in np.linspace(0, 100, 11)]
    assert all(f == pytest.approx(0.25, abs=0.03) for f in fractions)
    t = 37.0
    later = avail.next_change(t)
    assert (avail.online(later) & ~avail.online(t)).any()  # someone new is online then
    assert not (avail.online((t + later) / 2) & ~avail.online(t)).any()


def test_fedasync_staleness_functions():
    assert staleness_weight(clock(staleness="constant"), 9) == 1.0
    assert staleness_weight(clock(staleness="polynomial", staleness_a=0.5), 3) == pytest.approx(0.5)
    hinge = clock(staleness="hinge", staleness_a=2.0, staleness_b=4)
    assert staleness_weight(hinge, 4) == 1.0 and staleness_weight(hinge, 6) == pytest.approx(1 / 5)


def test_without_deadline_or_over_selection_virtual_rounds_sample_exactly_as_real_time_rounds():
    cfg = clock(mode="sync")
    sync = SyncClock(5, 10, Availability(cfg, 200, 5), durations(cfg), None, 0.0)
    for r in range(1, 6):
        assert list(sync.round(r).kept) == sample_clients(5, r, 200, 10) and not sync.round(r).stragglers


def test_a_deadline_and_over_selection_keep_the_first_k_to_finish_in_time():
    cfg = clock(mode="sync", availability="diurnal", period=50.0)
    took = durations(cfg)
    avail = Availability(cfg, 200, 0)
    sync = SyncClock(0, 10, avail, took, deadline=9.0, over_selection=0.5)
    previous_end = 0.0
    for r in range(1, 9):
        planned = sync.round(r)
        assert planned.start >= previous_end and len(planned.selected) == math.ceil(10 * 1.5)
        assert all(avail.online(planned.start)[c] for c in planned.selected)  # only online clients are sampled
        assert len(planned.kept) <= 10 and all(took(0, c) <= 9.0 for c in planned.kept)
        assert set(planned.kept) | set(planned.stragglers) == set(planned.selected)
        slowest_kept = max((took(0, c) for c in planned.kept), default=0.0)
        assert all(took(0, c) >= slowest_kept for c in planned.stragglers)
        assert planned.end - planned.start == pytest.approx(slowest_kept if len(planned.kept) == 10 else 9.0)
        assert planned.wasted_seconds == pytest.approx(sum(min(took(0, c), planned.end - planned.start)
                                                           for c in planned.stragglers))
        previous_end = planned.end


@pytest.mark.parametrize("buffer", [1, 4, 15])
def test_asynchronous_steps_apply_updates_in_arrival_order_with_their_staleness(buffer):
    cfg = clock(availability="diurnal", period=30.0, online_fraction=0.6)
    took, avail = durations(cfg), Availability(cfg, 200, 2)
    plan = plan_async(2, 40, buffer, 12, 200, avail, took)
    assert plan.steps == plan_async(2, 40, buffer, 12, 200, avail, took).steps  # config and seed only
    trained_at: dict[int, set] = {}
    last = 0.0
    for step in plan.steps:
        trained_at[step.step] = set(step.train)
        assert len(step.arrivals) == buffer and step.time >= last
        assert [a.arrived for a in step.arrivals] == sorted(a.arrived for a in step.arrivals)
        assert len({a.client for a in step.arrivals}) == buffer
        for a in step.arrivals:
            assert a.staleness == step.step - 1 - a.version >= 0
            assert a.arrived == pytest.approx(a.dispatched + took(0, a.client))
            assert avail.online(a.dispatched)[a.client]
            assert a.client in trained_at[a.version + 1]  # trained when its version was current
        last = step.time
    bound = held_updates(plan, lambda c: 1 + c % 3)
    # never more held updates than clients in flight and updates waiting in the buffer
    assert sum(held_updates(plan, lambda c: 0).values()) <= 12 + buffer - 1
    assert max(bound.values()) <= 12 + buffer - 1


def test_virtual_time_settings_that_cannot_run_are_refused_naming_the_key():
    base = {"clients": {"num_clients": 8}}
    with pytest.raises(ConfigError, match="'fedbuff' averages the buffered clients' deltas"):
        load_config(None, data={**base, "clock": {"mode": "fedbuff"}, "strategy": {"update": "weights"}})
    with pytest.raises(ConfigError, match="'fedasync' mixes each client's trained weights"):
        load_config(None, data={**base, "clock": {"mode": "fedasync"}, "strategy": {"name": "fedavgm"}})
    with pytest.raises(ConfigError, match="clients.groups"):
        load_config(None, data={"clients": {"num_clients": 8, "groups": 2}, "clock": {"mode": "fedasync"}})
    # a buffer larger than the clients in flight fills: each arrival dispatches another client (the doc's rule)
    assert load_config(None, data={**base, "clock": {"mode": "fedbuff", "concurrency": 2},
                                   "strategy": {"update": "delta"}}).clock.buffer == 5
    with pytest.raises(ConfigError, match="in-memory server only"):
        load_config(None, data={**base, "clock": {"mode": "sync"}, "server": {"state": "disk"}, "eval": {"every": 0}})


def test_fedcompass_gives_fast_clients_more_steps_so_that_a_group_arrives_together():
    from mpifl.clock.compass import plan_compass

    cfg = clock(speed_sigma=0.8, bandwidth_mbps=1000)
    devices = devices_for(cfg, 200, seed=1)

    def duration(client, steps):
        return devices.task_seconds(client, steps * 16, 100_000, 100_000)

    plan = plan_compass(1, 30, 8, 200, Availability(cfg, 200, 1), duration, 4, 40, 1.3)
    assert len(plan.steps) == 30 and plan.steps == plan_compass(1, 30, 8, 200, Availability(cfg, 200, 1), duration,
                                                                4, 40, 1.3).steps
    members = {a.client for s in plan.steps for a in s.arrivals}
    assert len(members) == 8  # the same clients stay in the federation, reassigned after each application
    for step in plan.steps:
        assert all(4 <= a.local_steps <= 40 for a in step.arrivals)
        assert all(a.arrived == pytest.approx(a.dispatched + duration(a.client, a.local_steps)) for a in step.arrivals)
        assert all(a.arrived <= step.time + 1e-9 for a in step.arrivals)
    faster = min(members, key=lambda c: duration(c, 1) - duration(c, 0))
    slower = max(members, key=lambda c: duration(c, 1) - duration(c, 0))
    given = {c: [a.local_steps for s in plan.steps for a in s.arrivals if a.client == c] for c in (faster, slower)}
    assert sum(given[faster]) / len(given[faster]) > sum(given[slower]) / len(given[slower])


class _RunsCode:
    """Unpickling this calls os.system: what a hostile trace file would do."""

    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/mpifl-trace-ran-code",))


def test_a_pickled_trace_is_read_as_data_and_one_that_would_run_code_is_refused(tmp_path):
    import pickle

    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({0: {"computation": 12.5, "communication": 800.0}, 1: {"computation": 3,
                                                                                          "communication": 90}}))
    assert read_trace(str(plain)) == [(12.5, 800.0), (3.0, 90.0)]
    hostile = tmp_path / "hostile.pkl"
    hostile.write_bytes(pickle.dumps({0: _RunsCode()}))
    marker = Path("/tmp/mpifl-trace-ran-code")
    marker.unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"neither JSON nor a pickle of plain data \(refusing posix.system"):
        read_trace(str(hostile))
    assert not marker.exists()


def in_flight_versions(plan, step: int) -> set[int]:
    """What a resume after ``step`` retrains from under ``plan`` (AsyncSampler.in_flight): the versions of the
    updates applied after ``step`` that were trained by then."""
    return {a.version for s in plan.steps[step:] for a in s.arrivals if a.version + 1 <= step}


def fedcompass_plan(steps: int):
    from mpifl.clock.compass import plan_compass

    cfg = clock(speed_sigma=0.8, bandwidth_mbps=1000)
    devices = devices_for(cfg, 200, seed=1)
    return plan_compass(1, steps, 8, 200, Availability(cfg, 200, 1),
                        lambda client, steps_: devices.task_seconds(client, steps_ * 16, 100_000, 100_000), 4, 40, 1.3)


@pytest.mark.parametrize("mode", ["fedasync", "fedbuff", "fedcompass"])
def test_the_open_versions_after_a_step_hold_whatever_a_resume_retrains_from_even_with_rounds_raised(mode):
    cfg = clock(availability="diurnal", period=30.0, online_fraction=0.6)
    took, avail = durations(cfg), Availability(cfg, 200, 2)
    planned = {n: fedcompass_plan(n) if mode == "fedcompass" else
               plan_async(2, n, 1 if mode == "fedasync" else 4, 12, 200, avail, took) for n in (20, 45)}
    short, long = planned[20], planned[45]
    assert [s.arrivals for s in long.steps[:20]] == [s.arrivals for s in short.steps]  # a longer run's first steps
    for step in range(1, 21):
        opened = set(short.steps[step - 1].open_versions)
        assert in_flight_versions(short, step) <= opened and in_flight_versions(long, step) <= opened
        assert max(opened, default=0) < step
    # the run that ends after step 20 applies nothing in flight then, but one raised to 45 steps retrains them
    assert not in_flight_versions(short, 20) and in_flight_versions(long, 20)


def trace_file(tmp_path, clients: int) -> Path:
    """Client c online only in [100 + 50c, 120 + 50c]: one client at a time, then nobody for ever."""
    path = tmp_path / "avail.json"
    path.write_text(json.dumps({str(c): [[100 + 50 * c, 120 + 50 * c]] for c in range(clients)}))
    return path


def test_a_sync_schedule_whose_availability_trace_runs_out_is_refused_by_validate_naming_the_key_and_round(tmp_path):
    from conftest import mpifl_here, write_config

    trace = trace_file(tmp_path, 20)
    cfg = write_config(tmp_path / "c.yaml", "rounds: 27\nclients: {num_clients: 20, per_round: 3}\n"
                       "data: {dataset: synthetic, kwargs: {num_samples: 800}}\n"
                       f"clock: {{mode: sync, availability: trace, availability_trace: {trace}, "
                       "seconds_per_sample: 1}\n")
    refused = mpifl_here("validate", str(cfg))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith(f"mpifl: config error: cannot plan the virtual-time schedule: "
                                     f"clock.availability_trace '{trace}': no client is online at or after virtual "
                                     "time ")
    assert refused.stderr.endswith(", when round 26 ended: the trace runs out at round 27\n")
    assert mpifl_here("validate", str(cfg), "rounds=26").returncode == 0
    fedbuff = mpifl_here("validate", str(cfg), "clock.mode=fedbuff", "strategy.update=delta")
    assert fedbuff.returncode == 2 and f"clock.availability_trace '{trace}'" in fedbuff.stderr


def test_a_sync_round_keeping_fewer_than_min_cohort_withholds_the_on_time_clients_not_as_stragglers():
    cfg = clock()
    took = lambda r, c: 1.0 + (c % 7)  # noqa: E731 - clients 0, 7, 14... finish first
    avail = Availability(cfg, 200, 0)
    secagg = SyncClock(0, 2, avail, took, deadline=1.5, over_selection=1.0, min_cohort=2)
    plain = SyncClock(0, 2, avail, took, deadline=1.5, over_selection=1.0)
    floor = SyncClock(0, 2, avail, took, deadline=1.5, over_selection=1.0, min_participants=2)
    lone = [r for r in range(1, 40) if len(plain.round(r).kept) == 1]
    assert lone  # some round keeps one client in time
    for r in lone:
        kept = plain.round(r).kept
        assert secagg.round(r).kept == () and secagg.round(r).withheld == kept
        assert not set(kept) & set(secagg.round(r).stragglers)
        assert secagg.round(r).end == plain.round(r).end
        assert floor.round(r).withheld == () and set(kept) <= set(floor.round(r).stragglers)  # no secagg: no withheld
    full = [r for r in range(1, 40) if len(plain.round(r).kept) == 2]
    assert full and all(secagg.round(r).kept == plain.round(r).kept and secagg.round(r).withheld == () for r in full)


def test_validate_says_what_an_asynchronous_step_applies_and_how_many_train_at_once_not_clients_per_round(tmp_path):
    from conftest import mpifl_here, write_config

    cfg = write_config(tmp_path / "c.yaml", "rounds: 12\nclients: {num_clients: 10}\n"
                       "data: {dataset: synthetic, kwargs: {num_samples: 300}}\n"
                       "clock: {mode: fedbuff, concurrency: 4, buffer: 2}\n")
    said = {mode: mpifl_here("validate", str(cfg), f"clock.mode={mode}").stdout
            for mode in ("fedbuff", "fedasync", "fedcompass", "sync")}
    assert ("(12 fedbuff server steps, each applying 2 buffered updates (clock.buffer), 4 of 10 clients training "
            "at once (clock.concurrency), model") in said["fedbuff"]
    assert "12 fedasync server steps, each applying 1 update, 4 of 10" in said["fedasync"]
    assert "12 fedcompass server steps, each applying an arrival group, 4 of 10" in said["fedcompass"]
    assert all("per round" not in said[mode] for mode in ("fedbuff", "fedasync", "fedcompass"))
    assert "(12 rounds, 10 of 10 clients per round, model" in said["sync"]


def test_a_fedbuff_buffer_divides_by_the_updates_it_applies_so_a_dropped_one_does_not_shrink_the_step():
    """FedBuff's K is the updates the buffer applies: of K = 3 buffered, one dropped (clients.accept_failures)
    leaves the staleness-weighted sum of two divided by 2, not 3; too few usable say how many were usable."""
    from mpifl.aggregation.round_task import BelowQuorum, ReductionRound, checked_totals
    from mpifl.aggregation.strategies import make_strategy
    from mpifl.wire.protocol import UpdateMeta

    strategy = make_strategy(load_config(None, data={"strategy": {"update": "delta"}}).strategy)
    metas = {c: UpdateMeta(c, 10, 0.0, {}, "InjectedFault" if c == 1 else None) for c in range(3)}
    task = ReductionRound(5, {1: [0, 1, 2]}, layout=None, weights={0: 1.0, 1: 0.5, 2: 0.25},  # type: ignore[arg-type]
                          divisor=3.0)
    assert checked_totals(strategy, metas, task, [0, 1, 2])[0] == 2.0
    assert checked_totals(strategy, {c: UpdateMeta(c, 10, 0.0, {}) for c in range(3)}, task, [0, 1, 2])[0] == 3.0
    with pytest.raises(BelowQuorum) as below:
        checked_totals(strategy, metas, ReductionRound(5, {1: [0, 1, 2]}, layout=None,  # type: ignore[arg-type]
                                                       weights=task.weights, divisor=3.0, min_participants=3),
                       [0, 1, 2])
    assert below.value.usable == 2 and "only 2 of 3 participants sent a usable update" in str(below.value)


def test_the_stacked_models_warning_counts_the_updates_a_buffered_step_applies_not_the_clients_per_round():
    """A robust rule under FedBuff stacks the buffer's updates (clock.buffer), not clients.per_round's clients."""
    from mpifl.config import load_config
    from mpifl.roles.build_server import stacked_models_warning

    def said(*overrides: str) -> str | None:
        return stacked_models_warning(load_config(None, ["strategy.name=median", "clients.num_clients=10",
                                                         "clients.per_round=10", *overrides]), 2)

    assert said().startswith("strategy median: 10 participants per round on 2 client ranks: a rank's participants")
    buffered = said("clock.mode=fedbuff", "strategy.update=delta", "clock.buffer=5")
    assert buffered.startswith("strategy median: 5 updates per server step (clock.buffer) on 2 client ranks")
    assert said("clock.mode=fedbuff", "strategy.update=delta", "clock.buffer=2") is None
    grouped = said("clock.mode=fedcompass", "strategy.update=delta", "clock.concurrency=4")
    assert grouped.startswith("strategy median: up to 4 updates per server step (an arrival group, at most "
                              "clock.concurrency) on 2 client ranks")


def test_a_fault_on_a_client_never_dispatched_in_its_steps_is_named_with_the_steps_it_does_train_in():
    """Under an asynchronous clock a fault strikes a client in the step it is dispatched in: one whose steps dispatch
    none of its clients would never strike them, silently, so each such client is named."""
    from mpifl.clock.planners import unstruck_targets
    from mpifl.clock.schedule import AsyncStep
    from mpifl.config import load_config

    cfg = load_config(None, ["rounds=4", "clock.mode=fedbuff", "clock.buffer=2",
                             "faults=[{kind: scale, clients: [0, 5], factor: -1, rounds: [2, 3]}]"])
    steps = [AsyncStep(1, 1.0, (), (0, 1, 5)), AsyncStep(2, 2.0, (), (5,)), AsyncStep(3, 3.0, (), ()),
             AsyncStep(4, 4.0, (), (0,))]
    (said,) = unstruck_targets(cfg, steps)
    assert said.startswith("faults[0]: logical client 0 is dispatched in none of the steps it strikes in (fedbuff:")
    assert said.endswith("so it never strikes it; the schedule dispatches it in steps 1, 4")
