"""Whole-job kills at random moments, then the generated PBS script resubmitted with RESUME=auto until it
succeeds: the final model equals the uninterrupted run's, bitwise. ``pytest -m sweep`` runs 20 seeded kills."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MPI_TIMEOUT, TESTS, mpiexec, mpifl_here, rounds_logged, run_mpi, same_model, write_config

CONFIG = """
name: sweep
seed: 11
rounds: 6
clients: {num_clients: 4}
data: {dataset: synthetic, kwargs: {num_samples: 400}}
model: {name: mlp, kwargs: {hidden: [16]}}
train: {trainer: "fl_helpers:NoiseTrainer", lr: 0.01}
checkpoint: {every: 2, keep: 2}
eval: {every: 0}
output: {progress: false}
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The config, its generated PBS script, and the uninterrupted run's model."""
    base = tmp_path_factory.mktemp("pbs")
    cfg = write_config(base / "sweep.yaml", CONFIG)
    reference = run_mpi(3, "run", str(cfg), "--run-dir", str(base / "reference"))
    assert reference.returncode == 0, reference.stderr
    script = base / "sweep.pbs"
    made = mpifl_here("pbs", str(cfg), "--client-ranks", "2", "--ranks-per-node", "3", "--gpus-per-node", "0",
                      "-o", str(script))
    assert made.returncode == 0, made.stderr
    (base / "nodefile").write_text("localhost\n")
    return script, base / "reference" / "model.h5"


def submit(script: Path, workdir: Path, kill_after: float | None, sleep: float = 0.2,
           **extra: str) -> tuple[int | None, str]:
    """Run the job script as PBS would; SIGKILL the whole job after ``kill_after`` seconds (None: let it end). Each
    client's training sleeps ``sleep`` seconds, so that the rounds spread over the time a kill may land in."""
    env = dict(os.environ, PBS_NODEFILE=str(script.parent / "nodefile"), PBS_O_WORKDIR=str(workdir),
               MPIEXEC=mpiexec(), FL_HELPERS_SLEEP=str(sleep), **extra,
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=workdir, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=kill_after if kill_after is not None else MPI_TIMEOUT)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, "killed"


def resubmit_until_done(script: Path, workdir: Path, kills: list[float]) -> list[int | None]:
    """Submit with each kill delay in turn, then once more to the end (no kill to spread its rounds for: no
    sleep); what each submission returned."""
    codes = [submit(script, workdir, delay)[0] for delay in kills]
    code, err = submit(script, workdir, None, sleep=0)
    assert code == 0, err[-3000:]
    return codes + [code]


def test_a_kill_before_the_first_checkpoint_and_a_finished_job_both_resubmit_cleanly(tmp_path, job):
    script, reference = job
    codes = resubmit_until_done(script, tmp_path, kills=[1.0])  # start-up alone takes longer: nothing saved
    assert codes[0] is None
    run_dir = tmp_path / "runs" / "sweep"
    assert same_model(run_dir / "model.h5", reference) and rounds_logged(run_dir) == list(range(1, 7))
    code, err = submit(script, tmp_path, None, sleep=0)  # a chained job (qsub -W depend=afterany) after the end
    assert code == 0 and "run already complete" in err


@pytest.mark.sweep
@pytest.mark.parametrize("seed", range(20))
def test_seeded_whole_job_kills_resubmitted_with_resume_auto_end_bitwise_equal(tmp_path, job, seed):
    script, reference = job
    rng = random.Random(seed)
    kills = [rng.uniform(0.5, 9.0) for _ in range(rng.randint(1, 3))]  # before the first checkpoint .. after the last
    start = time.monotonic()
    resubmit_until_done(script, tmp_path, kills)
    run_dir = tmp_path / "runs" / "sweep"
    assert same_model(run_dir / "model.h5", reference), f"seed {seed}: kills after {kills}"
    assert rounds_logged(run_dir) == list(range(1, 7))
    assert time.monotonic() - start < 300


@pytest.mark.parametrize("attempt", range(3))  # MPICH's exit status after the kill is a race: try it repeatedly
def test_a_job_whose_rank_left_through_c_exit0_never_ends_with_status_0(tmp_path, attempt):
    cfg = write_config(tmp_path / "sweep.yaml", CONFIG.replace("fl_helpers:NoiseTrainer", "faults.injectors:Injected"))
    script = tmp_path / "sweep.pbs"
    made = mpifl_here("pbs", str(cfg), "--client-ranks", "2", "--ranks-per-node", "3", "--gpus-per-node", "0",
                      "-o", str(script))
    assert made.returncode == 0, made.stderr
    (tmp_path / "nodefile").write_text("localhost\n")
    code, err = submit(script, tmp_path, None, FAULT="c_exit0", FAULT_CALL="2")
    assert code not in (0, None), err[-3000:]  # rank 2 left in round 1 of 6: the job must not say it succeeded
    note = json.loads((tmp_path / "runs" / "sweep" / "ranks" / "rank00002.json").read_text())
    assert note["state"] == "round" and note["round"] == 1  # its last word: in round 1, never finished
