"""Top-k with error feedback under mpiexec: a run stopped after round 2 and resumed, with its residuals on
disk and on fewer client ranks, is bitwise the uninterrupted run with residuals in RAM."""
from __future__ import annotations

import json

from conftest import MPI_TIMEOUT, rounds_logged, run_mpi, same_model, write_config

from mpifl.storage.hdf5 import Checkpoint

TOPK = """
seed: 4
rounds: 4
clients: {num_clients: 8, per_round: 3}
data: {dataset: synthetic, kwargs: {num_samples: 400, num_features: 8, num_classes: 4}}
model: {name: mlp, kwargs: {hidden: [40]}}
train: {lr: 0.05, batch_size: 8}
strategy: {name: fedavg, update: delta}
compression: {method: topk, fraction: 0.05}
transport: {chunk_mb: 0.0005}
checkpoint: {every: 1, keep: 2}
eval: {every: 0}
output: {progress: false}
"""


def test_a_stopped_and_resumed_topk_run_equals_the_uninterrupted_one_bitwise(tmp_path):
    """Stopped with its residuals on disk, resumed on fewer ranks with them in RAM."""
    cfg = write_config(tmp_path / "topk.yaml", TOPK)
    whole = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "whole"), timeout=MPI_TIMEOUT)
    assert whole.returncode == 0, whole.stderr
    split = tmp_path / "split"  # residuals on disk (residual_ram_mb=0), stopped after round 2
    first = run_mpi(3, "run", str(cfg), "rounds=2", "compression.residual_ram_mb=0", "--run-dir", str(split),
                    timeout=MPI_TIMEOUT)
    assert first.returncode == 0, first.stderr
    with Checkpoint(split / "checkpoints" / "ckpt-r000002.h5") as ckpt:
        assert json.loads(ckpt.file.attrs["residual_files"]) == ["rank00001.h5", "rank00002.h5"]
    rest = run_mpi(2, "run", str(cfg), "--run-dir", str(split), "--resume",
                   timeout=MPI_TIMEOUT)  # one client rank now hosts every client, in RAM: it reads both ranks' files
    assert rest.returncode == 0, rest.stderr
    assert "resume: error-feedback residuals of" in rest.stderr
    assert "the rounds from here differ" not in rest.stderr  # the same chunks: nothing to warn of
    assert rounds_logged(split) == [1, 2, 3, 4]
    assert same_model(tmp_path / "whole" / "model.h5", split / "model.h5")
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == [  # pruned with their checkpoints
        "ckpt-r000003.h5", "ckpt-r000003.residuals", "ckpt-r000004.h5", "ckpt-r000004.residuals"]
    records = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["bytes_received"] == 3 * 4 * 8 * 7  # 3 clients x 4 chunks of 131 values x 8 bytes x k=7


def test_a_resume_of_a_compressed_run_with_another_chunk_size_is_warned_of_naming_the_checkpoints(tmp_path):
    """Top-k selects within each chunk (and int8/int4 quantize each chunk's blocks), so a compressed run resumed with
    another transport.chunk_mb, which a resume may change, goes on to another result than the uninterrupted run:
    rank 0 says so before round 3, naming the checkpoint's chunk size to resume with instead."""
    cfg = write_config(tmp_path / "topk.yaml", TOPK)
    first = run_mpi(3, "run", str(cfg), "rounds=2", "--run-dir", str(tmp_path / "split"), timeout=MPI_TIMEOUT)
    assert first.returncode == 0, first.stderr
    rest = run_mpi(3, "run", str(cfg), "rounds=3", "transport.chunk_mb=0.001", "--run-dir", str(tmp_path / "split"),
                   "--resume", timeout=MPI_TIMEOUT)
    assert rest.returncode == 0, rest.stderr
    assert ("mpifl: warning: transport.chunk_mb: 0.001 (1048-byte chunks) where ckpt-r000002.h5's run had 0.0005 "
            "(524-byte chunks): compression.method 'topk' selects the largest elements within each chunk, so the "
            "rounds from here differ from the uninterrupted run's (unless both chunks hold the whole model); resume "
            "with transport.chunk_mb=0.0005 to keep its result") in rest.stderr, rest.stderr[-2000:]
