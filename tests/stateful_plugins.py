"""Running a stateful plug-in algorithm (examples/moon, examples/apfl) as its tests need: on a number of ranks, and
killed with SIGKILL mid-run then resumed; and comparing two runs' final models and kept per-client vectors."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import yaml
from conftest import MPI_TIMEOUT, ROOT, rounds_logged, run_mpi, spawn_mpi, wait_for, write_config
from results import client_vectors, final_model


def run(folder: Path, settings: dict, ranks: int, *overrides: str) -> Path:
    """Run ``settings`` on ``ranks`` ranks (from the repository root, where ``examples`` imports) into
    ``folder/run``; it must succeed."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = write_config(folder / "c.yaml", yaml.safe_dump(settings))
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(folder / "run"), *overrides, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "run"


def killed_and_resumed(folder: Path, settings: dict, ranks: int, resume_ranks: int) -> Path:
    """Run ``settings`` (a trainer slowed by FL_HELPERS_SLEEP) on ``ranks`` ranks, SIGKILL the whole job once two
    rounds are recorded, then resume it on ``resume_ranks`` ranks; the run directory."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = write_config(folder / "c.yaml", yaml.safe_dump(settings))
    run_dir = folder / "run"
    proc = spawn_mpi(ranks, "run", str(cfg), "--run-dir", str(run_dir), cwd=ROOT, env={"FL_HELPERS_SLEEP": "0.3"})
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(rounds_logged(run_dir)) >= 2, proc, "round 2")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert len(rounds_logged(run_dir)) < settings["rounds"]  # killed mid-run, not after it
    resumed = run_mpi(resume_ranks, "run", str(cfg), "--run-dir", str(run_dir), "--resume", cwd=ROOT,
                      timeout=MPI_TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return run_dir


def assert_same_run(got: Path, want: Path) -> None:
    """Two runs' final models and every client's kept vector equal to the bit."""
    model, reference = final_model(got), final_model(want)
    assert model.keys() == reference.keys()
    for name, value in reference.items():
        assert np.array_equal(model[name], value), name
    vectors, expected = client_vectors(got), client_vectors(want)
    assert sorted(vectors) == sorted(expected)
    for client, value in expected.items():
        assert np.array_equal(vectors[client], value), client


def largest_difference(got: dict, want: dict) -> float:
    """The largest absolute difference between two dicts of arrays with the same keys."""
    assert sorted(got) == sorted(want)
    return max(float(np.abs(np.asarray(got[k]) - np.asarray(want[k])).max()) for k in want)
