"""Under mpiexec: bad input and failing ranks end the job quickly with a clear message."""
from __future__ import annotations

import time

import pytest

from conftest import run_mpi, write_config

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
def test_bad_config_fails_fast_on_every_rank(tmp_path, override, message):
    cfg = write_config(tmp_path / "c.yaml", BASE)
    result, seconds = timed(3, "run", str(cfg), override, "--run-dir", str(tmp_path / "run"))
    assert result.returncode != 0
    assert result.stderr.count(message) == 3, result.stderr  # every rank says why it stops
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


def test_an_existing_run_is_never_overwritten(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", BASE)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\n')
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), timeout=60)
    assert result.returncode == 2 and "already holds a run" in result.stderr
    assert (run_dir / "metrics.jsonl").read_text() == '{"round": 1}\n'
