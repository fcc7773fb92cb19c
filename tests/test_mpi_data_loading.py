"""Who reads the data: rank 1 reads a dataset once and shares it with the client ranks, one copy per node in
shared memory; the server gets the labels and the held-out set only, so it never holds the training inputs it does
not train on. A reading error still ends the job on every rank with one message."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from conftest import MPI_TIMEOUT, ROOT, TESTS, mpiexec, run_mpi, write_config

from mpifl.learning.datasets import Dataset, digits
from mpifl.roles.data import server_view

CONFIG = """
rounds: 1
clients: {{num_clients: 4}}
data: {{dataset: "test_mpi_data_loading:recorded_digits", kwargs: {{folder: "{folder}"}}}}
model: {{name: mlp, kwargs: {{hidden: [8]}}}}
train: {{local_steps: 1, device: cpu}}
eval: {{every: 1}}
output: {{progress: false}}
"""


def recorded_digits(folder: str) -> tuple[torch.Tensor, ...]:
    """The digits, noting which rank read them (a file per reading rank)."""
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK", "?")
    (Path(folder) / f"read-by-{rank}").touch()
    return digits()


def unreadable(folder: str) -> tuple[torch.Tensor, ...]:
    raise OSError(f"{folder}/train.idx: no such file")


def test_only_rank_1_reads_the_data_and_the_run_evaluates_on_the_server(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG.format(folder=tmp_path))
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("read-by-*")) == ["read-by-1"]
    assert "accuracy" in result.stderr  # the server still scores the held-out set


def test_a_reading_error_on_rank_1_ends_the_job_on_every_rank_with_one_message(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG.format(folder=tmp_path).replace("recorded_digits", "unreadable"))
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.count("train.idx: no such file") == 1


def test_the_servers_view_keeps_labels_held_out_set_and_input_shape_but_no_inputs():
    x, y, x_test, y_test = digits()
    view = server_view(Dataset(x, y, x_test, y_test))
    assert view.x_train.shape == (0, *x.shape[1:]) and view.input_shape == tuple(x.shape[1:])
    assert view.y_train is y and view.x_test is x_test and view.num_classes == 10


def test_a_node_holds_one_copy_of_the_shared_tensors_and_every_rank_reads_the_same_bytes():
    result = subprocess.run([mpiexec(), "-n", "3", sys.executable, str(TESTS / "node_sharing.py")],
                            capture_output=True, text=True, timeout=MPI_TIMEOUT, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    # the launcher forwards each rank's output as it comes, so lines of different ranks may run together
    assert sorted(re.findall(r"rank (\d): ok, node of 3", result.stdout)) == ["0", "1", "2"], result.stdout


def test_shared_data_reaches_every_node_bit_for_bit_and_no_rank_holds_it_more_than_once_beyond_what_it_read():
    """Rank 1's tensors go straight into each node's shared windows (two nodes made of one machine's ranks): each
    client rank's peak grows by the shared copy only, where a pickled broadcast of the dataset grew it by 3x. The
    server gets the labels and held-out set as raw bytes, the same as read, its peak growing by about them once (a
    pickled object: 3x)."""
    result = subprocess.run([mpiexec(), "-n", "4", sys.executable, str(TESTS / "data_sharing.py")],
                            capture_output=True, text=True, timeout=MPI_TIMEOUT, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"rank (\d): ok", result.stdout)) == ["0", "1", "2", "3"], result.stdout
