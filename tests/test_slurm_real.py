"""The Slurm path on a real Slurm: munged, slurmctld and slurmd on this machine (tests/slurm_cluster.py), as Slurm is
installed (``MpiDefault=none``), with this machine's real CPU count. The scripts are submitted with ``sbatch`` and
run as written: the shipped example unchanged, and the one ``mpifl slurm`` writes for the quick start. Where the
daemons cannot be started (not root, no ``slurm-wlm``), every test here skips, saying why."""
from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT, mpifl_here, run_mpi, write_config
from reference import reference_run
from results import assert_bitwise, final_model
from slurm_cluster import SlurmCluster, single_node_slurm, why_not

from mpifl.config import load_config

pytestmark = pytest.mark.skipif(why_not() is not None, reason=f"no private Slurm here: {why_not()}")

JOB_SECONDS = 240  # the quick start takes about 10 s alone on 2 cores; the suite's other jobs share them


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> SlurmCluster:
    """One private Slurm for this module's tests, stopped by PID after the last; where the daemons are installed
    but cannot start (no name for this host, ports refused), the tests skip with the daemons' own words."""
    with contextlib.ExitStack() as running:
        try:
            cluster = running.enter_context(single_node_slurm(tmp_path_factory.mktemp("slurm")))
        except (RuntimeError, OSError, StopIteration, subprocess.SubprocessError) as err:
            pytest.skip(f"a private Slurm could not start here: {str(err)[-1500:]}")
        yield cluster


@pytest.fixture(scope="module")
def quickstart_last() -> str:
    """The quick start's last line as ``mpiexec`` gives it on this machine, which a Slurm job of it must print too.
    Its losses' last digits depend on the CPU (the README gives two machines' lines: an Intel Xeon's and an AMD
    EPYC's, both with AVX-512), so the reference is this machine's own run, not a line written down elsewhere."""
    with tempfile.TemporaryDirectory() as folder:
        done = run_mpi(3, "run", str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(Path(folder) / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"final round 15: [^;]*", done.stderr)
    assert found, done.stderr[-3000:]
    return found.group(0)


def job_log(directory: Path, job: int) -> str:
    """The job's stdout and stderr (the scripts' ``#SBATCH --output=%x-%j.out``)."""
    found = list(directory.glob(f"*-{job}.out"))
    return found[0].read_text(errors="replace") if found else "(no log)"


def venv_of_this_python() -> str:
    """The venv the suite runs in, for the shipped script's MPIFL_VENV (.venv from the repository root, as `make`
    installs it, unless the suite runs elsewhere)."""
    return ".venv" if Path(sys.executable).parent == ROOT / ".venv" / "bin" else sys.prefix


def test_the_shipped_workstation_script_runs_the_quick_start_unchanged(slurm, tmp_path, quickstart_last):
    """Submitted from the repository root, as its header says: PMI-2 for PyPI's MPICH, the venv's Python by path
    (the script is a login shell's), and 3 ranks sharing the node's CPUs (--overcommit)."""
    run_dir = tmp_path / "run"
    job = slurm.submit(ROOT / "slurm" / "workstation_quickstart.sbatch", cwd=ROOT,
                       export=f"ALL,RUN_DIR={run_dir},MPIFL_VENV={venv_of_this_python()}",
                       options=(f"--output={tmp_path}/%x-%j.out",))
    state = slurm.wait(job, JOB_SECONDS)
    log = job_log(tmp_path, job)
    assert state == "COMPLETED", log[-3000:]
    assert "srun --mpi=pmi2" in log and quickstart_last in log and log.rstrip().endswith("complete")


def test_the_script_mpifl_slurm_writes_for_the_quick_start_runs_and_warns_when_it_could_not_fit(slurm, tmp_path,
                                                                                               quickstart_last):
    """On one node of ``slurm.cpus`` CPUs: one rank more than the CPUs is named before a job would sit pending for
    ever; with --overcommit the same ranks share them and the job completes, with the README's result."""
    ranks = slurm.cpus + 1
    config = str(ROOT / "configs" / "quickstart.yaml")

    def written(name: str, cpus_per_task: int, *more: str):
        return mpifl_here("slurm", config, "--client-ranks", str(ranks - 1), "--ranks-per-node", str(ranks),
                          "--cpus-per-task", str(cpus_per_task), "--gpus-per-node", "0", "--partition", "",
                          "--account", "", "--time", "00:10:00", *more, "-o", str(tmp_path / name))

    with slurm.environment():
        wide = written("wide.sbatch", 1)
        shared = written("q.sbatch", slurm.cpus, "--overcommit")
    assert wide.returncode == 0 and (f"warning: {ranks} ranks per node x 1 CPUs per task = {ranks} CPUs, but the "
                                     f"nodes of partition 'debug' have {slurm.cpus}") in wide.stdout, wide.stdout
    assert shared.returncode == 0 and "warning" not in shared.stdout and "note" not in shared.stdout, shared.stdout
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "quickstart.yaml").write_text(Path(config).read_text())
    job = slurm.submit(tmp_path / "q.sbatch", cwd=tmp_path)
    state = slurm.wait(job, JOB_SECONDS)
    log = job_log(tmp_path, job)
    assert state == "COMPLETED", log[-3000:]
    if ranks == 3:  # the reference is a 3-rank run
        assert quickstart_last in log


def test_an_srun_without_a_pmi_fails_once_naming_srun_mpi(slurm, tmp_path):
    """SRUN_MPI='' leaves srun's default, MpiDefault=none: every task starts alone, and the job's log says why
    once, not once per task, and not with the mpiexec advice of a plain world of one."""
    cfg = write_config(tmp_path / "two.yaml", "name: two\nrounds: 2\nclients: {num_clients: 2}\n"
                       "data: {dataset: synthetic, kwargs: {num_samples: 300}}\noutput: {progress: false}\n")
    with slurm.environment():
        assert mpifl_here("slurm", str(cfg), "--ranks-per-node", "3", "--cpus-per-task", str(slurm.cpus),
                          "--overcommit",
                          "--gpus-per-node", "0", "--partition", "", "--account", "",
                          "-o", str(tmp_path / "two.sbatch")).returncode == 0
    job = slurm.submit(tmp_path / "two.sbatch", cwd=tmp_path, export="ALL,SRUN_MPI=")
    state = slurm.wait(job, JOB_SECONDS)
    log = job_log(tmp_path, job)
    assert state == "FAILED", log[-3000:]
    assert log.count("srun started 3 tasks, but each one's MPI sees a world of 1 rank") == 1, log[-3000:]
    assert "`srun --mpi=pmi2`" in log and "mpiexec -n" not in log


CHAIN = """name: chain
seed: 3
rounds: 100
clients: {num_clients: 4, per_round: 2}
data: {dataset: synthetic, kwargs: {num_samples: 400}}
model: {name: mlp, kwargs: {hidden: [16]}}
train: {lr: 0.05, batch_size: 16}
eval: {every: 0}
checkpoint: {every: 10}
output: {progress: false}
"""


def rounds_recorded(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def cancel_after(slurm: SlurmCluster, job: int, run_dir: Path, rounds: int) -> str:
    """scancel the job once ``rounds`` rounds are recorded (as a user would, or a time limit); its final state."""
    deadline = time.monotonic() + JOB_SECONDS
    while rounds_recorded(run_dir) < rounds and slurm.state(job) in ("PENDING", "RUNNING", "CONFIGURING"):
        assert time.monotonic() < deadline, f"job {job} recorded {rounds_recorded(run_dir)} rounds in time"
        time.sleep(0.2)
    slurm.run("scancel", str(job))
    return slurm.wait(job, JOB_SECONDS)


def test_a_cancelled_job_resubmitted_twice_ends_bitwise_as_an_uninterrupted_run_and_says_where_it_resumed(
        slurm, tmp_path):
    cfg = write_config(tmp_path / "chain.yaml", CHAIN)
    script = tmp_path / "chain.sbatch"
    with slurm.environment():
        assert mpifl_here("slurm", str(cfg), "--ranks-per-node", "3", "--cpus-per-task", str(slurm.cpus),
                          "--overcommit",
                          "--gpus-per-node", "0", "--partition", "", "--account", "", "--time", "00:30:00",
                          "-o", str(script)).returncode == 0
    run_dir = tmp_path / "runs" / "chain"
    states = []
    for cancel_at in (20, 50):  # each 50 rounds or more before the end, a scancel's delay aside
        job = slurm.submit(script, cwd=tmp_path)
        states.append(cancel_after(slurm, job, run_dir, cancel_at))
    last = slurm.submit(script, cwd=tmp_path)
    assert slurm.wait(last, JOB_SECONDS) == "COMPLETED", job_log(tmp_path, last)[-3000:]
    assert all(state in ("CANCELLED", "COMPLETED") for state in states), states
    resumed = [re.search(r"resuming run runs/chain from ckpt-r(\d+)\.h5 \(round (\d+) of 100 done",
                         job_log(tmp_path, j)) for j in (job, last)]
    assert all(resumed), [job_log(tmp_path, j)[:2000] for j in (job, last)]
    assert [int(m.group(1)) for m in resumed if m] == [int(m.group(2)) for m in resumed if m]
    assert rounds_recorded(run_dir) == 100
    assert_bitwise(final_model(run_dir), reference_run(load_config(cfg)))
