"""Shared test helpers: launch mpifl under mpiexec, always with a timeout."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
MPI_TIMEOUT = 120  # seconds; no test may hang a job
# pytest-xdist runs MPI jobs side by side on the same cores, and each would bind its ranks as if it had the node
# to itself (two servers on core 0, two clients on core 1): the suite's jobs run unbound unless a test asks.
os.environ.setdefault("MPIFL_BIND", "none")


def mpiexec() -> str:
    """The mpiexec next to this interpreter (the venv's PyPI MPICH), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = os.environ.get("MPIFL_MPIEXEC") or (str(local) if local.exists() else shutil.which("mpiexec"))
    if not found:
        pytest.skip("no mpiexec: install the 'mpich' extra or a system MPI")
    return found


def spawn_mpi(n: int, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``mpiexec -n n python -m mpifl ARGS`` in its own session (so it can be killed whole)."""
    env = dict(os.environ, **(env or {}),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpifl", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=cwd or ROOT, start_new_session=True)


def run_mpi(n: int, *args: str, timeout: float = MPI_TIMEOUT, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python -m mpifl ARGS`` and kill the whole process group on timeout."""
    proc = spawn_mpi(n, *args, cwd=cwd, env=env)
    cmd = proc.args
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {n} mpifl {' '.join(args)} hung for {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stopped_and_resumed(tmp_path: Path, cfg: Path, resume_ranks: int = 4) -> subprocess.CompletedProcess:
    """Run ``cfg`` on 3 ranks into ``split/``, stopped after round 2, then resumed on ``resume_ranks`` ranks; both
    runs must succeed. Returns the resume's result. The uninterrupted run on 3 ranks is what each algorithm's
    reference test already checks against the single-process reference, so the resumed run is compared with that
    reference: equal to it bitwise, it equals the uninterrupted run too, with one MPI job fewer per test."""
    first = run_mpi(3, "run", str(cfg), "rounds=2", "--run-dir", str(tmp_path / "split"))
    rest = run_mpi(resume_ranks, "run", str(cfg), "--run-dir", str(tmp_path / "split"), "--resume")
    for result in (first, rest):
        assert result.returncode == 0, result.stderr[-3000:]
    return rest


def write_config(path: Path, text: str) -> Path:
    """Write a YAML config for a test and return its path."""
    path.write_text(text)
    return path


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 60, poll: float = 0.01) -> None:
    """Poll ``condition`` until it holds; fail (killing the job) if the job ends or time runs out first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"never saw {what}: {proc.communicate()[1][-2000:]}")
        time.sleep(poll)


def finish(proc: subprocess.Popen, timeout: float = MPI_TIMEOUT) -> tuple[int, str]:
    """Wait for a spawned job to end (killing it past ``timeout``); its exit status and stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"mpiexec did not end within {timeout} s")
    return proc.returncode, err


def model_bits(path: Path) -> dict:
    """A checkpoint's tensors as raw integers, for bitwise comparison."""
    import torch

    from mpifl.storage.hdf5 import load_tensors

    return {k: v.view(torch.int16 if v.element_size() == 2 else torch.int32) for k, v in load_tensors(path).items()}


def same_model(a: Path, b: Path) -> bool:
    """Whether two checkpoints hold bitwise-identical models."""
    import torch

    x, y = model_bits(a), model_bits(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def rounds_logged(run_dir: Path) -> list[int]:
    """The rounds recorded in a run directory's metrics.jsonl."""
    import json

    return [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
