"""The node-local rank from each launcher's variable (Cray PALS, MPICH, Open MPI, PMI, MVAPICH, Slurm's srun),
and the GPU each rank then sees with MPIFL_GPUS_PER_NODE."""
from __future__ import annotations

import pytest

from mpifl.roles import launch

VARS = ["PALS_LOCAL_RANKID", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"]


@pytest.fixture
def clean(monkeypatch):
    for var in (*VARS, *launch.LOCAL_RANK_VARS, "CUDA_VISIBLE_DEVICES", "MPIFL_GPUS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_the_launchers_are_read_in_order():
    assert list(launch.LOCAL_RANK_VARS) == VARS


@pytest.mark.parametrize("var", VARS)
def test_each_launchers_local_rank_binds_one_gpu(clean, var):
    assert launch.env_local_rank() is None
    clean.setenv(var, "5")
    assert launch.env_local_rank() == 5
    launch.bind_gpu_from_local_rank()  # no MPIFL_GPUS_PER_NODE: nothing bound
    assert "CUDA_VISIBLE_DEVICES" not in launch.os.environ
    clean.setenv("MPIFL_GPUS_PER_NODE", "4")
    launch.bind_gpu_from_local_rank()
    assert launch.os.environ["CUDA_VISIBLE_DEVICES"] == "1"  # 5 mod 4
    clean.setenv("CUDA_VISIBLE_DEVICES", "3")  # already chosen (e.g. srun --gpus-per-task): left alone
    launch.bind_gpu_from_local_rank()
    assert launch.os.environ["CUDA_VISIBLE_DEVICES"] == "3"


def test_an_mpi_launchers_rank_wins_over_the_allocations_slurm_localid(clean):
    clean.setenv("SLURM_LOCALID", "0")  # inherited from the batch step by every rank of an mpiexec
    clean.setenv("MPI_LOCALRANKID", "2")
    assert launch.env_local_rank() == 2
    clean.setenv("PALS_LOCAL_RANKID", "1")
    assert launch.env_local_rank() == 1
