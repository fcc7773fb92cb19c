"""Under mpiexec: bad input and failing ranks end the job quickly with a clear message."""
from __future__ import annotations

import time

import pytest
from conftest import MPI_TIMEOUT, run_mpi, write_config

BASE = """
rounds: 2
clients: {num_clients: 4}
data: {dataset: synthetic, kwargs: {num_samples: 400}}
model: {name: mlp, kwargs: {hidden: [16]}}
output: {progress: false}
"""


def timed(n, *args):
    start = time.monotonic()
    result = run_mpi(n, *args, timeout=60)
    return result, time.monotonic() - start


@pytest.mark.parametrize("override,message", [
    ("train.lrr=0.1", "unknown key 'train.lrr'; did you mean 'train.lr'?"),
    ("rounds=many", "rounds: expected an integer, got 'many'"),
    ("model.name=missing_pkg.nets:resnet", "model.name: cannot import module 'missing_pkg.nets'"),
])
def test_bad_config_fails_fast_on_every_rank_and_says_why_once(tmp_path, override, message):
    cfg = write_config(tmp_path / "c.yaml", BASE)
    result, seconds = timed(3, "run", str(cfg), override, "--run-dir", str(tmp_path / "run"))
    assert result.returncode != 0
    assert result.stderr.count(message) == 1, result.stderr  # every rank stops; rank 0 says why, on its own line
    assert all(line.startswith("[rank 0] mpifl: config error:")
               for line in result.stderr.splitlines() if message in line)
    assert seconds < 30
    assert not (tmp_path / "run").exists()


def test_a_client_that_raises_aborts_the_job_with_its_traceback(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", BASE)
    result, seconds = timed(3, "run", str(cfg), "train.trainer=fl_helpers:FailingOnRank2",
                            "--run-dir", str(tmp_path / "run"))
    assert result.returncode != 0
    assert "[mpifl rank 2 on" in result.stderr and "deliberate failure" in result.stderr
    assert "Traceback" in result.stderr
    assert seconds < 30


def test_a_plug_in_strategy_that_raises_on_the_server_ends_the_job_saying_the_round_and_strategy_name(tmp_path):
    """A bug in a server half is the plug-in's, not mpifl's: the abort line says where it struck before what it was,
    and the traceback follows."""
    cfg = write_config(tmp_path / "c.yaml", BASE)
    result, seconds = timed(3, "run", str(cfg), "strategy.name=plugin_helpers:step_raises",
                            "--run-dir", str(tmp_path / "run"))
    assert result.returncode != 0
    line = ("[mpifl rank 0 on ", "] failed, aborting the job: round 1: strategy.name 'plugin_helpers:step_raises', "
            "in the server's reduction: RuntimeError: a bug in the server half")
    assert [ln for ln in result.stderr.splitlines() if ln.startswith(line[0]) and line[1] in ln], result.stderr
    assert "Traceback" in result.stderr and seconds < 30


@pytest.mark.parametrize("plugin, where", [
    ("metrics_raises", "round 1: strategy.name 'plugin_helpers:metrics_raises', in round_metrics: KeyError: 'spread'"),
    ("bind_raises", "strategy.name 'plugin_helpers:bind_raises', in bind, before any round: ValueError: 4 "
                    "clients: expected a multiple of 7"),
])
def test_a_bug_in_a_server_halfs_other_hooks_is_named_with_the_hook_too(tmp_path, plugin, where):
    cfg = write_config(tmp_path / "c.yaml", BASE)
    result = run_mpi(3, "run", str(cfg), f"strategy.name=plugin_helpers:{plugin}", "--run-dir",
                     str(tmp_path / "run"), timeout=60)
    assert result.returncode != 0
    assert [ln for ln in result.stderr.splitlines() if ln.startswith("[mpifl rank 0 on ") and where in ln], \
        result.stderr


def test_a_client_with_a_different_model_is_refused_naming_the_tensor(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", BASE)
    result = run_mpi(3, "run", str(cfg), "model.name=fl_helpers:rank_dependent_mlp", "model.kwargs={}",
                     "--run-dir", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2
    assert "rank 2's model differs from the server's: tensor '1.weight'" in result.stderr


def test_one_rank_is_refused(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", BASE)
    result = run_mpi(1, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2 and "needs at least 2 ranks" in result.stderr


def test_more_client_ranks_than_clients_is_refused(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", BASE)
    result = run_mpi(4, "run", str(cfg), "clients.num_clients=2", "--run-dir", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2
    assert "3 client ranks but clients.num_clients=2" in result.stderr


def test_a_run_that_failed_before_recording_a_round_is_still_refused_but_the_refusal_says_resume_starts_it_over(
        tmp_path):
    """A job that failed while it started leaves an empty metrics.jsonl and no checkpoint; its directory is not
    taken over silently (a job starting there now would be written over), but the line says what to do."""
    from mpifl.config import load_config
    from mpifl.storage.checkpointer import RunDirectoryError
    from mpifl.storage.rundir import prepare_run_dir

    cfg = load_config(write_config(tmp_path / "c.yaml", BASE))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(RunDirectoryError) as refused:
        prepare_run_dir(cfg, str(run_dir), None)
    assert str(refused.value) == (f"run directory {str(run_dir)!r} already holds a run that recorded no round "
                                  "(metrics.jsonl is empty, no checkpoint): if no job is running there, add --resume "
                                  "to start it over, or choose another --run-dir")
    path, point = prepare_run_dir(cfg, str(run_dir), None, resume_asked="latest")
    assert (path, point) == (run_dir, None) and not (run_dir / "metrics.jsonl").exists()
    assert [p.name.startswith("metrics.jsonl.before-") for p in run_dir.iterdir() if "metrics" in p.name] == [True]


def test_an_existing_run_is_never_overwritten(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", BASE)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\n')
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), timeout=60)
    assert result.returncode == 2 and "already holds a run" in result.stderr
    assert (run_dir / "metrics.jsonl").read_text() == '{"round": 1}\n'


FAILURES = """
seed: 5
rounds: 3
clients: {num_clients: 8, per_round: 6, accept_failures: true}
data: {dataset: digits, partition: iid}
model: {name: "fl_helpers:tiny_mlp"}
train: {trainer: "fl_helpers:FailingClients", lr: 0.02}
eval: {every: 0}
output: {progress: false}
"""


def run_failures(tmp_path, *overrides: str, raising: str = "", poisoned: str = "", from_round: int = 1):
    cfg = write_config(tmp_path / "f.yaml", FAILURES)
    env = {"FL_HELPERS_RAISE": raising, "FL_HELPERS_NAN": poisoned, "FL_HELPERS_SEED": "5",
           "FL_HELPERS_FROM_ROUND": str(from_round)}
    aborts = "clients.accept_failures=false" in overrides  # its own job: an abort would end the suite's pool
    return run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides, env=env, timeout=MPI_TIMEOUT,
                   fresh=aborts)


@pytest.mark.parametrize("overrides", [
    (),
    # one group per rank: the members' NaN/Inf check is one check of the group's sum, and a sum that is not
    # finite has its members trained again and checked one by one
    ("clients.groups=3",),
], ids=["every-update-travels", "reduction-groups"])
def test_accepted_failures_are_dropped_logged_and_the_rest_is_averaged(tmp_path, overrides):
    import json

    import numpy as np
    import yaml
    from reference import reference_run

    from mpifl.config import load_config
    from mpifl.storage.hdf5 import load_tensors

    result = run_failures(tmp_path, *overrides, raising="3", poisoned="5")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        dropped = {d["client"]: d for d in record["dropped"]}
        assert set(dropped) == {3, 5} & set(record["participants"])
        if 3 in dropped:
            assert dropped[3]["rank"] == 1 + 3 % 3 and "RuntimeError: deliberate failure" in dropped[3]["reason"]
            assert f"round {record['round']}: dropped logical client 3 (rank 1): RuntimeError" in result.stderr
        if 5 in dropped:
            assert "NaN/Inf" in dropped[5]["reason"]
    assert any(r["dropped"] for r in records)
    want = reference_run(load_config(None, list(overrides), data=yaml.safe_load(FAILURES)), drop=frozenset({3, 5}))
    got = load_tensors(tmp_path / "run" / "model.h5")
    for name, value in want.items():
        assert np.array_equal(got[name].float().numpy(), value), name


@pytest.mark.parametrize("kind,overrides", [("raising", ()), ("poisoned", ()), ("poisoned", ("clients.groups=3",))],
                         ids=["raising", "poisoned", "poisoned-in-a-group"])
def test_without_accept_failures_a_bad_client_aborts_the_job_naming_it(tmp_path, kind, overrides):
    start = time.monotonic()
    result = run_failures(tmp_path, "clients.accept_failures=false", *overrides, **{kind: "3"})
    assert result.returncode != 0
    expected = ("deliberate failure of logical client 3" if kind == "raising"
                else "logical client 3 (rank 1): update contains 1 NaN/Inf values (clients.accept_failures=false)")
    assert expected in result.stderr
    if kind == "poisoned":  # mpifl's own check found it: the round in one line, no traceback
        assert "failed, aborting the job: round " in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert time.monotonic() - start < 60


def test_too_few_participants_abort_the_round_and_keep_the_previous_model(tmp_path):
    from mpifl.storage.hdf5 import Checkpoint

    result = run_failures(tmp_path, "clients.min_participants=5", raising="0,1,2,3,4,5,6,7", from_round=2)
    assert result.returncode != 0
    assert "round 2: only 0 of 6 participants sent a usable update, fewer than clients.min_participants=5" \
        in result.stderr
    # a config's rule, not a crash: one line naming the checkpoint to resume from, no traceback
    assert "the model after round 1 is in" in result.stderr and "Traceback" not in result.stderr, result.stderr
    with Checkpoint(tmp_path / "run" / "checkpoints" / "ckpt-r000001.h5") as ckpt:
        assert ckpt.round == 1  # round 1's model was saved before the job stopped
