"""Shared test helpers: launch mpifl under mpiexec, always with a timeout."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
MPI_TIMEOUT = 120  # seconds; no test may hang a job


def mpiexec() -> str:
    """The mpiexec next to this interpreter (the venv's PyPI MPICH), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = os.environ.get("MPIFL_MPIEXEC") or (str(local) if local.exists() else shutil.which("mpiexec"))
    if not found:
        pytest.skip("no mpiexec: install the 'mpich' extra or a system MPI")
    return found


def run_mpi(n: int, *args: str, timeout: float = MPI_TIMEOUT, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python -m mpifl ARGS`` and kill the whole process group on timeout."""
    env = dict(os.environ, **(env or {}),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpifl", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=cwd or ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {n} mpifl {' '.join(args)} hung for {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def write_config(path: Path, text: str) -> Path:
    """Write a YAML config for a test and return its path."""
    path.write_text(text)
    return path
