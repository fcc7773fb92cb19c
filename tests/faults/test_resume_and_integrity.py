"""Under mpiexec: resume always does the sensible thing, and checkpoints prove their integrity."""
from __future__ import annotations

import json
import os
import signal

import h5py
import numpy as np
import pytest
from conftest import MPI_TIMEOUT, rounds_logged, run_mpi, same_model, spawn_mpi, wait_for, write_config

from mpifl.storage.checkpointer import checkpoint_name, list_checkpoints

RUN = """
seed: 4
rounds: 4
clients: {num_clients: 4}
data: {dataset: synthetic, kwargs: {num_samples: 400}}
model: {name: mlp, kwargs: {hidden: [16]}}
train: {trainer: "fl_helpers:NoiseTrainer", lr: 0.01}
checkpoint: {every: 1, keep: 4}
eval: {every: 0}
output: {progress: false}
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    base = tmp_path_factory.mktemp("uninterrupted")
    cfg = write_config(base / "c.yaml", RUN)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(base / "run"), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    return cfg, base / "run"


def resume(cfg, run_dir, *extra):
    return run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), "--resume", *extra, timeout=MPI_TIMEOUT)


def test_a_run_killed_before_its_first_checkpoint_starts_fresh_on_resume_keeping_its_metrics(tmp_path, uninterrupted):
    cfg, reference = uninterrupted
    no_checkpoints = write_config(tmp_path / "c.yaml", RUN.replace("every: 1, keep: 4", "every: 0, keep: 4"))
    run_dir = tmp_path / "run"
    proc = spawn_mpi(3, "run", str(no_checkpoints), "--run-dir", str(run_dir), env={"FL_HELPERS_SLEEP": "0.5"})
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and rounds_logged(run_dir) == [1], proc, "round 1")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert not list_checkpoints(run_dir / "checkpoints")
    result = resume(no_checkpoints, run_dir)
    assert result.returncode == 0, result.stderr
    assert "no usable checkpoint" in result.stderr and "starting fresh" in result.stderr
    assert [p.name.startswith("metrics.jsonl.before-") for p in run_dir.iterdir()].count(True) == 1
    assert same_model(run_dir / "model.h5", reference / "model.h5")


def test_resuming_a_finished_run_exits_0_saying_it_is_complete(uninterrupted):
    cfg, run_dir = uninterrupted
    before = (run_dir / "metrics.jsonl").read_text()
    result = resume(cfg, run_dir)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("run already complete") == 1 and "round 4 of rounds=4" in result.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_a_torn_last_metrics_line_is_rebuilt_from_the_checkpoint(tmp_path, uninterrupted):
    cfg, reference = uninterrupted
    first = run_mpi(3, "run", str(cfg), "rounds=2", "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert first.returncode == 0, first.stderr
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-40])  # a crash in the middle of writing round 2's line
    result = resume(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stderr
    assert "metrics.jsonl: line 2 is torn" in result.stderr
    assert rounds_logged(tmp_path / "run") == [1, 2, 3, 4]
    assert same_model(tmp_path / "run" / "model.h5", reference / "model.h5")


def corrupt_a_tensor(path):
    """Write 64 finite floats into a weight dataset through h5py (its own metadata stays consistent)."""
    with h5py.File(path, "r+") as f:
        f["model/1.weight"][0, :16] = np.linspace(-1, 1, 16, dtype=np.float32)


def test_a_corrupted_newest_checkpoint_is_detected_and_resume_falls_back_to_the_one_before(tmp_path, uninterrupted):
    cfg, reference = uninterrupted
    first = run_mpi(3, "run", str(cfg), "rounds=3", "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert first.returncode == 0, first.stderr
    newest = tmp_path / "run" / "checkpoints" / checkpoint_name(3)
    corrupt_a_tensor(newest)
    inspect = run_mpi(1, "inspect", str(newest), "--verify", timeout=MPI_TIMEOUT)
    assert inspect.returncode == 2 and "tensor '1.weight' is corrupt" in inspect.stderr, inspect.stderr
    result = resume(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stderr
    assert "tensor '1.weight' is corrupt" in result.stderr and f"resuming from {checkpoint_name(2)}" in result.stderr
    assert rounds_logged(tmp_path / "run") == [1, 2, 3, 4]
    assert same_model(tmp_path / "run" / "model.h5", reference / "model.h5")


def test_a_stored_hash_is_not_trusted_a_changed_shape_is_named(tmp_path, uninterrupted):
    cfg, reference = uninterrupted
    ckpt = tmp_path / "c.h5"
    ckpt.write_bytes((reference / "model.h5").read_bytes())
    with h5py.File(ckpt, "r+") as f:  # same spec hash attribute, another tensor shape
        del f["model/1.bias"]
        f["model"].create_dataset("1.bias", data=np.zeros(17, dtype=np.float32)).attrs["dtype"] = "float32"
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), f"model.init_from={ckpt}",
                     timeout=MPI_TIMEOUT)
    assert result.returncode != 0
    assert "tensor '1.bias' is [17] float32 there, [16] float32 here" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_metrics_records_keep_the_peak_above_the_current_rss(uninterrupted):
    _, run_dir = uninterrupted
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["server_peak_rss_bytes"] >= record["server_rss_bytes"]


def test_a_full_disk_ends_the_job_in_one_line_naming_the_file_and_keeps_the_last_checkpoint(tmp_path):
    text = RUN.replace("data: {dataset: synthetic, kwargs: {num_samples: 400}}", "data: {dataset: digits}").replace(
        "model: {name: mlp, kwargs: {hidden: [16]}}", 'model: {name: "faults.injectors:file_size_limited_mlp"}')
    cfg = write_config(tmp_path / "c.yaml", text)
    first = run_mpi(3, "run", str(cfg), "rounds=1", "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert first.returncode == 0, first.stderr
    # the server may then write files of at most 4 KiB: round 2's checkpoint cannot be written
    full = run_mpi(3, "run", str(cfg), "rounds=3", "--run-dir", str(tmp_path / "run"), "--resume",
                   env={"FAULT_FSIZE": "4096"}, timeout=MPI_TIMEOUT)
    assert full.returncode != 0
    assert "round 2: could not write checkpoint" in full.stderr, full.stderr[-3000:]
    assert "the newest complete checkpoint is still" in full.stderr
    # no traceback from mpifl's code (h5py may still print its own handle clean-up failures)
    assert not any(line.strip().startswith("File") and "mpifl/" in line for line in full.stderr.splitlines())
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == [checkpoint_name(1)]


def test_an_edited_round_or_a_deleted_integrity_record_is_refused_and_resume_falls_back(tmp_path, uninterrupted):
    cfg, reference = uninterrupted
    first = run_mpi(3, "run", str(cfg), "rounds=3", "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert first.returncode == 0, first.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    with h5py.File(checkpoints / checkpoint_name(3), "r+") as f:  # says round 5: would skip a round on resume
        f.attrs["round"] = 5
    with h5py.File(checkpoints / checkpoint_name(2), "r+") as f:  # no record at all: nothing to check against
        del f["integrity"]
    edited = run_mpi(1, "inspect", str(checkpoints / checkpoint_name(3)), "--verify", timeout=MPI_TIMEOUT)
    assert edited.returncode == 2 and "metadata" in edited.stderr and "fails its checksum" in edited.stderr
    unsealed = run_mpi(1, "inspect", str(checkpoints / checkpoint_name(2)), "--verify", timeout=MPI_TIMEOUT)
    assert unsealed.returncode == 2 and "no integrity record" in unsealed.stderr, unsealed.stderr
    result = resume(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stderr
    skipped = [line for line in result.stderr.splitlines() if "skipping unusable checkpoint" in line]
    assert len(skipped) == 2 and "fails its checksum" in skipped[0] and "no integrity record" in skipped[1]
    assert rounds_logged(tmp_path / "run") == [1, 2, 3, 4]
    assert same_model(tmp_path / "run" / "model.h5", reference / "model.h5")
