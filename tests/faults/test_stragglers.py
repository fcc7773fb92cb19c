"""Under mpiexec, with clients.accept_failures: a rank past its deadline is dropped from the round, bitwise.

Streams are tagged by round (protocol.round_tag), so what a dropped rank still sends can never be
taken for the next round's updates; rank 0 drains it meanwhile and the rank rejoins at the next round.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import run_mpi, write_config
from reference import reference_run

from mpifl.config import load_config
from mpifl.storage.hdf5 import load_tensors
from mpifl.wire import protocol
from mpifl.wire.watchdog import STRAGGLER_FACTOR, STRAGGLER_FLOOR_SECONDS, StragglerRule

STRAGGLING = """
seed: 3
rounds: 3
clients: {num_clients: 6, per_round: 6, accept_failures: true}
data: {dataset: digits, partition: iid}
model: {name: "fl_helpers:tiny_mlp"}
train: {trainer: "fl_helpers:Straggling", lr: 0.02}
timeouts: {straggler: 2}
eval: {every: 0}
output: {progress: false}
"""
CLIENT_SECONDS = 0.25  # each logical client's training; rank 2's (clients 1 and 4) is 10x that in round 2


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("groups", [0, 3], ids=["per-client streams", "reduction groups"])
def test_a_rank_ten_times_slower_for_a_round_is_dropped_from_it_and_rejoins_the_next(tmp_path, groups):
    text = STRAGGLING.replace("accept_failures: true", f"accept_failures: true, groups: {groups}")
    cfg = write_config(tmp_path / "s.yaml", text)
    env = {"FL_HELPERS_CLIENT_SECONDS": str(CLIENT_SECONDS), "FL_HELPERS_SLOW_RANK": "2",
           "FL_HELPERS_SLOW_CALLS": "3,4"}  # rank 2 trains clients 1 and 4 each round: calls 3 and 4 are round 2
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"), env=env, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    by_round = {r["round"]: r for r in records(tmp_path / "run")}
    assert [d["client"] for d in by_round[2]["dropped"]] == [1, 4]
    for dropped in by_round[2]["dropped"]:
        assert dropped["rank"] == 2
        assert "past the straggler deadline of 2 s (timeouts.straggler)" in dropped["reason"]
        assert "it rejoins at the next round" in dropped["reason"]
    assert by_round[2]["time"]["round"] < 2 * CLIENT_SECONDS * 10  # the round did not wait for rank 2
    assert by_round[1]["dropped"] == by_round[3]["dropped"] == []  # the next round took it back
    assert {1, 4} <= set(by_round[3]["participants"])
    assert "round 2: rank 2's late updates of logical clients [1, 4] arrived" in result.stderr
    want = reference_run(load_config(None, data=yaml.safe_load(text)), dropped_in={2: {1, 4}})
    got = load_tensors(tmp_path / "run" / "model.h5")
    for name, value in want.items():
        assert np.array_equal(got[name].float().numpy(), value), name


def test_without_accept_failures_nobody_is_dropped_for_being_slow(tmp_path):
    cfg = write_config(tmp_path / "s.yaml", STRAGGLING.replace("accept_failures: true", "accept_failures: false"))
    env = {"FL_HELPERS_CLIENT_SECONDS": "0.05", "FL_HELPERS_SLOW_RANK": "2", "FL_HELPERS_SLOW_CALLS": "3,4"}
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"), "timeouts.straggler=0.2", env=env,
                     timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(r["dropped"] == [] for r in records(tmp_path / "run"))
    want = reference_run(load_config(None, data=yaml.safe_load(STRAGGLING)))
    got = load_tensors(tmp_path / "run" / "model.h5")
    assert all(np.array_equal(got[name].float().numpy(), value) for name, value in want.items())


def test_round_tags_never_meet_each_other_or_the_fixed_tags_and_fit_every_mpi():
    kinds = (protocol.MODEL, protocol.META, protocol.UPDATE, protocol.REDUCE_META, protocol.REDUCE)
    fixed = {protocol.HEADER, protocol.INIT, protocol.RESIDUALS, protocol.STARTUP, protocol.PROGRESS}
    tags = [protocol.round_tag(k, r) for r in range(protocol.ROUND_TAG_CYCLE) for k in kinds]
    assert len(set(tags)) == len(tags)
    assert not fixed & set(tags)
    assert max(tags) <= 32767  # the least MPI_TAG_UB the standard allows
    assert protocol.round_tag(protocol.UPDATE, 7) != protocol.round_tag(protocol.UPDATE, 8)


@pytest.mark.parametrize("fixed,finished,ranks,limit", [
    (5.0, [], 4, 5.0),  # timeouts.straggler: that, from the start
    (None, [], 4, None),  # derived: nothing measured yet
    (None, [1.0], 4, None),  # fewer than half the ranks have finished
    (None, [1.0, 2.0], 4, STRAGGLER_FLOOR_SECONDS),  # half have: 3x the slowest, but never under the floor
    (None, [100.0, 30.0], 3, STRAGGLER_FACTOR * 100.0),
])
def test_the_straggler_deadline_is_set_or_derived_from_the_ranks_that_finished(fixed, finished, ranks, limit):
    assert StragglerRule(fixed).limit(finished, ranks) == limit
