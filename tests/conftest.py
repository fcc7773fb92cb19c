"""Shared test helpers: launch mpifl under mpiexec, always with a timeout."""
from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
MPI_TIMEOUT = 120  # seconds; no test may hang a job
# pytest-xdist runs MPI jobs side by side on the same cores, and each would bind its ranks as if it had the node
# to itself (two servers on core 0, two clients on core 1): the suite's jobs run unbound unless a test asks.
os.environ.setdefault("MPIFL_BIND", "none")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the marks (--dist loadgroup)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep the tests of a file that share a module- or class-scoped fixture on one pytest worker (the Makefile's
    ``--dist loadgroup``): spread over two, each worker would build the fixture, often a whole MPI run, once more."""
    for item in items:
        if shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def shares_a_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module- or class-scoped fixture of its own file (not the suite's session ones)."""
    info = getattr(item, "_fixtureinfo", None)
    path = item.nodeid.split("::")[0]
    return info is not None and any(d.scope in ("module", "class") and d.baseid.startswith(path)
                                    for defs in info.name2fixturedefs.values() for d in defs)


def mpiexec() -> str:
    """The mpiexec next to this interpreter (the venv's PyPI MPICH), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = os.environ.get("MPIFL_MPIEXEC") or (str(local) if local.exists() else shutil.which("mpiexec"))
    if not found:
        pytest.skip("no mpiexec: install the 'mpich' extra or a system MPI")
    return found


def mpifl_command(n: int, args: tuple[str, ...]) -> list[str]:
    """``mpiexec -n n python -m mpifl ARGS``."""
    return [mpiexec(), "-n", str(n), sys.executable, "-m", "mpifl", *args]


def mpifl_here(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``mpifl ARGS`` run inside this test process, as ``python -m mpifl ARGS`` would run it: the same exit status,
    stdout and stderr, without a new interpreter importing torch again (about 3 s a call on the suite's 2 cores).
    For the commands that start no MPI job (plan, pbs, slurm, validate, inspect, export, status, report); the
    console entry itself is covered by the tests that launch it."""
    import contextlib
    import io

    from mpifl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's refusals, and SystemExit("message"), which Python prints
            code = exit_.code if isinstance(exit_.code, int) else 1
            if exit_.code is not None and not isinstance(exit_.code, int):
                print(exit_.code, file=err)
    return subprocess.CompletedProcess(["mpifl", *args], code, out.getvalue(), err.getvalue())


def refused_job_option(tmp_path: Path, tool: str, option: str, value: str) -> str:
    """``mpifl pbs|slurm`` (``tool``) of the quick start with ``option value``, which it must refuse: exit status 2
    and no script written. Its stderr, for the message."""
    script = tmp_path / "no-script"
    refused = mpifl_here(tool, str(ROOT / "configs" / "quickstart.yaml"), option, value, "-o", str(script))
    assert refused.returncode == 2 and not script.exists(), refused.stdout + refused.stderr
    return refused.stderr


def rank_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the suite's ranks start in: this process's, plus ``extra``, with tests/ importable (the
    plug-ins in fl_helpers)."""
    return dict(os.environ, **(extra or {}),
                PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))


def note_launch(kind: str, n: int, args: tuple[str, ...], seconds: float | None, **pooled: object) -> None:
    """With ``MPIFL_TEST_LAUNCHES=FILE``: one JSON line per MPI job the suite starts (``kind``: 'pooled', 'fresh'
    or 'spawned', whose end the test itself awaits), with the test, the ranks and the seconds it took, and for a
    pooled job its place in its pool (1: the pool started for it) and whether it ended the pool (a rank aborted);
    what tells how much of the suite's time goes to start-ups (docs/explanation/testing.md)."""
    ledger = os.environ.get("MPIFL_TEST_LAUNCHES")
    if ledger:
        line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], "kind": kind, "ranks": n,
                "command": args[0] if args else "", "seconds": seconds, **pooled}
        with open(ledger, "a") as out:
            out.write(json.dumps(line) + "\n")


def spawn_mpi(n: int, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``mpiexec -n n python -m mpifl ARGS`` in its own session (so it can be killed whole)."""
    note_launch("spawned", n, args, None)
    return _started(n, args, cwd, env)


def _started(n: int, args: tuple[str, ...], cwd: Path | None, env: dict[str, str] | None) -> subprocess.Popen:
    return subprocess.Popen(mpifl_command(n, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=rank_environment(env), cwd=cwd or ROOT, start_new_session=True)


def run_mpi(n: int, *args: str, timeout: float = MPI_TIMEOUT, cwd: Path | None = None,
            env: dict[str, str] | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python -m mpifl ARGS`` and kill the whole process group on timeout.

    An ``mpifl run`` or ``mpifl sweep`` of at most ``POOL_SIZE`` ranks with the suite's own environment goes to
    this worker's job pool (``tests/mpi_pool.py``): the same ranks' code on a communicator of a long-lived MPI job,
    with the same exit status and each rank's output, without paying every rank's start-up again. ``fresh``: a job
    of its own, for what a shared process would change: peak memory, which is the process's; start-up itself; the
    supervisor process each rank of a job of its own runs under."""
    started = time.monotonic()
    if not fresh and set(env or {}) <= POOLED_ENV and args and args[0] in POOLED_COMMANDS and 2 <= n <= POOL_SIZE:
        pool = _job_pool()
        done = pool.run(n, args, timeout, cwd, env or {})
        note_launch("pooled", n, args, time.monotonic() - started, job_in_pool=pool.last_job_in_pool,
                    ended_pool=pool.proc is None)
        return done
    proc = _started(n, args, cwd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_showing_stacks(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {n} mpifl {' '.join(args)} hung for {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    note_launch("fresh", n, args, time.monotonic() - started)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


POOL_SIZE = int(os.environ.get("MPIFL_TEST_POOL_SIZE", "9"))  # 0: every job starts its own mpiexec
# The commands that take the caller's communicator (mpifl.cli.main(argv, comm)); without a supervisor process per
# rank there, as without one in any program that passes its own communicator.
POOLED_COMMANDS = ("run", "sweep")
# Variables a job may set and still run in the pool: the suite's plug-ins (tests/fl_helpers.py: FailingClients,
# Straggling, SlowOnOneRank) read them each time they are called, never at import, and keep nothing in the process
# between jobs.
POOLED_ENV = {"FL_HELPERS_RAISE", "FL_HELPERS_NAN", "FL_HELPERS_SEED", "FL_HELPERS_FROM_ROUND",
              "FL_HELPERS_CLIENT_SECONDS", "FL_HELPERS_SLOW_RANK", "FL_HELPERS_SLOW_CALLS", "FL_HELPERS_SLOW_FACTOR",
              "FL_HELPERS_SLOW_FORWARD"}
JOBS_PER_POOL = 150  # then a new pool: whatever a job left in its processes goes with them


class JobPool:
    """One long-lived ``mpiexec -n POOL_SIZE python tests/mpi_pool.py`` per pytest worker, fed job files."""

    def __init__(self, size: int) -> None:
        self.size, self.proc, self.queue, self.served = size, None, Path(), 0
        self.ids = itertools.count()
        self.environment: dict[str, str] = {}  # the one the pool's ranks started in
        self.last_job_in_pool = 0  # the last job's place in its pool, for the ledger (note_launch)

    def _ready(self) -> subprocess.Popen:
        """The running pool; a new one if there is none, the last retired or died, or the environment changed
        since it started (a test's ``monkeypatch.setenv``, a library's ``setdefault``): a job's ranks start in
        the environment they would get from an ``mpiexec`` of their own."""
        if self.proc is not None and (self.proc.poll() is not None or self.served >= JOBS_PER_POOL
                                      or _environment() != self.environment):
            self.close()
        if self.proc is None:
            self.environment = _environment()
            self.queue, self.served = Path(tempfile.mkdtemp(prefix="mpifl-pool-")), 0
            with open(self.queue / "pool.log", "w") as log:
                self.proc = subprocess.Popen(
                    [mpiexec(), "-n", str(self.size), sys.executable, str(TESTS / "mpi_pool.py"), str(self.queue),
                     str(os.getpid()), str(JOBS_PER_POOL)],
                    stdout=log, stderr=subprocess.STDOUT, env=rank_environment(), cwd=ROOT, start_new_session=True)
        return self.proc

    def run(self, n: int, args: tuple[str, ...], timeout: float, cwd: Path | None,
            env: dict[str, str]) -> subprocess.CompletedProcess:
        proc = self._ready()
        job_id = next(self.ids)
        cmd = mpifl_command(n, args)  # what the test would have launched, for its messages
        staged = self.queue / f"{job_id}.staged"
        staged.write_text(json.dumps(dict(id=job_id, n=n, argv=list(args), cwd=str(cwd or ROOT), env=env)))
        staged.rename(self.queue / f"{job_id}.job")
        self.served += 1
        self.last_job_in_pool = self.served
        result, deadline = self.queue / f"{job_id}.result", time.monotonic() + timeout
        while not result.exists() and proc.poll() is None:
            if time.monotonic() > deadline:
                kill_showing_stacks(proc.pid)  # each rank's stack goes to the job's files, read next
                out, err = self._outputs(job_id, n)
                self.close()
                pytest.fail(f"mpiexec -n {n} mpifl {' '.join(args)} hung for {timeout}s (in the job pool)\n"
                            f"stdout:\n{out}\nstderr:\n{err}")
            time.sleep(0.005)
        out, err = self._outputs(job_id, n)
        if result.exists():
            statuses = json.loads(result.read_text())
            status = next((s for s in statuses if s), 0)
        else:  # a rank aborted, which ends the pool's mpiexec as it ends a job's own: its status is the job's
            status = proc.wait()
            err += (self.queue / "pool.log").read_text()
            self.close()
        return subprocess.CompletedProcess(cmd, status, out, err)

    def _outputs(self, job_id: int, n: int) -> tuple[str, str]:
        def read(suffix: str) -> str:
            files = [self.queue / f"{job_id}.rank{r}.{suffix}" for r in range(n)]
            return "".join(f.read_text(errors="replace") for f in files if f.exists())
        return read("out"), read("err")

    def close(self) -> None:
        if self.proc is None:
            return
        (self.queue / "stop").touch()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        shutil.rmtree(self.queue, ignore_errors=True)


_POOL: list[JobPool] = []


# Variables that code sets in the test process with os.environ.setdefault when a test first uses it, each to the
# value the same code sets in any rank that uses it (mpifl.learning.hf.stay_offline, mpifl.trackers, tensorboardX's
# crc32c, torch's inductor cache directory): they do not change what a job's ranks do, so a change in them does not
# retire the pool, whose restart starts POOL_SIZE interpreters (about 14 CPU-seconds; six a suite before).
SET_WHEN_USED = {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_DISABLE_TELEMETRY",
                 "WANDB_SILENT", "WANDB_DISABLE_GIT", "WANDB_DISABLE_CODE", "WANDB_ERROR_REPORTING", "CRC32C_SW_MODE",
                 "TORCHINDUCTOR_CACHE_DIR"}


def _environment() -> dict[str, str]:
    """The environment a job's ranks would inherit, less the variable pytest changes for every test and those
    in ``SET_WHEN_USED``."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST" and k not in SET_WHEN_USED}


def _job_pool() -> JobPool:
    if not _POOL:
        _POOL.append(JobPool(POOL_SIZE))
        atexit.register(_POOL[0].close)
    return _POOL[0]


def stopped_and_resumed(tmp_path: Path, cfg: Path, resume_ranks: int = 4,
                        first_overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``cfg`` (with ``first_overrides``) on 3 ranks into ``split/``, stopped after round 2, then resumed on
    ``resume_ranks`` ranks without them; both runs must succeed. Returns the resume's result. The uninterrupted run
    on 3 ranks is what each algorithm's reference test already checks against the single-process reference, so the
    resumed run is compared with that reference: equal to it bitwise, it equals the uninterrupted run too, with one
    MPI job fewer per test."""
    first = run_mpi(3, "run", str(cfg), "rounds=2", *first_overrides, "--run-dir", str(tmp_path / "split"))
    rest = run_mpi(resume_ranks, "run", str(cfg), "--run-dir", str(tmp_path / "split"), "--resume")
    for result in (first, rest):
        assert result.returncode == 0, result.stderr[-3000:]
    return rest


def killed_and_resumed(cfg: Path, run_dir: Path, ranks: int, resume_ranks: int, *overrides: str
                       ) -> subprocess.CompletedProcess:
    """Run ``cfg`` with ``overrides`` (which name its ``rounds=``) on ``ranks`` ranks into ``run_dir``, SIGKILL the
    whole job once two rounds are recorded, then resume it on ``resume_ranks`` ranks; the kill must come mid-run
    and the resume must succeed. Returns the resume's result."""
    rounds = next(int(o.split("=", 1)[1]) for o in overrides if o.startswith("rounds="))
    proc = spawn_mpi(ranks, "run", str(cfg), "--run-dir", str(run_dir), *overrides)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(rounds_logged(run_dir)) >= 2, proc, "round 2")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert len(rounds_logged(run_dir)) < rounds  # killed mid-run
    resumed = run_mpi(resume_ranks, "run", str(cfg), "--run-dir", str(run_dir), "--resume", *overrides,
                      timeout=MPI_TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return resumed


def ran(tmp_path: Path, config: str, ranks: int, *overrides: str) -> Path:
    """Run the YAML ``config`` (with ``overrides``) on ``ranks`` ranks into ``tmp_path/run``; it must succeed.
    Returns the run directory."""
    cfg = write_config(tmp_path / "c.yaml", config)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "run"


def write_config(path: Path, text: str) -> Path:
    """Write a YAML config for a test and return its path."""
    path.write_text(text)
    return path


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = MPI_TIMEOUT, poll: float = 0.01
             ) -> None:
    """Poll ``condition`` until it holds; fail (killing the job, each rank's stack shown) if the job ends or
    time runs out first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            ended = proc.poll() is not None
            kill_showing_stacks(proc.pid)
            why = f"the job ended ({proc.returncode})" if ended else f"{timeout:.0f} s passed"
            pytest.fail(f"never saw {what}: {why}\n{proc.communicate()[1][-6000:]}")
        time.sleep(poll)


STACK_DUMP_PAUSE = 0.2  # seconds between two ranks' stack dumps (each rank's supervisor ignores its own)


def kill_showing_stacks(group: int, grace: float = 1.0) -> None:
    """Kill the process group ``group`` (a job started by ``spawn_mpi``), first asking each of its ranks for
    every thread's Python stack (SIGUSR1: mpifl.roles.launch.StopRequest.install), which reaches the job's
    stderr: a test that fails on a hung job then says where each rank was."""
    ranks = [pid for pid in _group_members(group) if b"mpifl" in _cmdline(pid) or b"mpi_pool" in _cmdline(pid)]
    for pid in ranks:  # one after another: dumps written at once reach the job's stderr with their lines cut
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_PAUSE)
    if ranks:
        time.sleep(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)


def _group_members(group: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            if int(fields[2]) == group:  # state, ppid, pgrp
                members.append(int(stat.parent.name))
    return members


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def finish(proc: subprocess.Popen, timeout: float = MPI_TIMEOUT) -> tuple[int, str]:
    """Wait for a spawned job to end (killing it past ``timeout``); its exit status and stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_showing_stacks(proc.pid)
        pytest.fail(f"mpiexec did not end within {timeout} s\n{proc.communicate()[1][-6000:]}")
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
