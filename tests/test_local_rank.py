"""Binding from the allocation: the node-local slot from each launcher's variables (Cray PALS, MPICH, Open MPI,
Cray PMI, MVAPICH, Slurm's srun) or the shared-memory split, and the GPU, cores and threads the slot then takes;
the rule's pure functions without MPI, then one run under mpiexec that records it in ranks.txt."""
from __future__ import annotations

import os

import pytest
from conftest import ROOT, run_mpi

from mpifl.config import ConfigError, load_config
from mpifl.planning import binding
from mpifl.planning.binding import SPLIT, Binding, choose, core_block, core_ranges, node_gpus, parse_ranges
from mpifl.roles import launch

VARS = ["PALS_LOCAL_RANKID", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"]


SIZES = ["PALS_LOCAL_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_LOCAL_SIZE",
         "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE"]
ALL_CORES = frozenset(range(8))


@pytest.fixture
def no_gpus(tmp_path):
    """A /proc/driver/nvidia/gpus that does not exist: a node without NVIDIA's driver."""
    return tmp_path / "no-driver"


@pytest.fixture
def clean(monkeypatch, no_gpus):
    for var in (*VARS, *SIZES, "SLURM_NODEID", "CUDA_VISIBLE_DEVICES", "MPIFL_GPUS_PER_NODE", "MPIFL_BIND"):
        # set, then deleted: monkeypatch then restores the variable as it was before the test even where the code
        # under test sets it (bind_gpu_from_local_rank sets CUDA_VISIBLE_DEVICES), so no GPU leaks into later tests
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(binding, "PROC_GPUS", no_gpus)
    return monkeypatch


def test_the_launchers_are_read_in_order():
    assert list(binding.LOCAL_RANK_VARS) == VARS
    assert [size for _, size in binding.LAUNCHERS] == SIZES


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


def unbound(ranks: int, cores: frozenset[int] = ALL_CORES, local=None) -> list[tuple[int | None, frozenset[int]]]:
    """A node of ``ranks`` ranks that all may run on every core, numbered by the launcher as ``local`` says."""
    return [(local[r] if local else r, cores) for r in range(ranks)]


def launcher_env(rank_var: str, size_var: str, rank: int, size: int, **extra: str) -> dict[str, str]:
    """What a launcher sets for a rank, with the size in its own format (srun's is per node: '2(x3)')."""
    return {rank_var: str(rank), size_var: f"{size}(x3)" if size_var.startswith("SLURM") else str(size), **extra}


@pytest.mark.parametrize("rank_var, size_var", binding.LAUNCHERS)
def test_each_launchers_local_rank_and_size_bind_the_slots_gpu_and_cores(rank_var, size_var, no_gpus):
    env = launcher_env(rank_var, size_var, 1, 2, MPIFL_GPUS_PER_NODE="2")
    assert binding.launcher_local_rank(env) == binding.LocalRank(1, 2, rank_var)
    assert choose(env, unbound(2), 1, proc=no_gpus) == Binding(1, rank_var, (4, 5, 6, 7), "split", "1", 1)
    # the launcher's number wins over the order of the node's communicator
    assert choose(env, unbound(2, local=[1, 0]), 0, proc=no_gpus).cores == (4, 5, 6, 7)


@pytest.mark.parametrize("rank_var, size_var", binding.LAUNCHERS)
def test_a_launcher_size_that_is_not_the_nodes_falls_back_to_the_shared_memory_split(rank_var, size_var, no_gpus):
    env = launcher_env(rank_var, size_var, 1, 4)  # 4 ranks said, 2 share the node's memory
    chosen = choose(env, unbound(2), 0, proc=no_gpus)
    assert chosen.local_rank == 0 and chosen.source.startswith(SPLIT) and rank_var in chosen.source


def test_an_inherited_slurm_localid_falls_back_to_the_shared_memory_split(no_gpus):
    env = {"SLURM_LOCALID": "0"}  # every rank of an mpiexec inside an allocation inherits the batch step's
    node = unbound(3, local=[0, 0, 0])
    assert [choose(env, node, r, proc=no_gpus).local_rank for r in range(3)] == [0, 1, 2]
    assert choose(env, node, 2, proc=no_gpus).source == f"{SPLIT} (SLURM_LOCALID does not number the node's 3 " \
                                                         "ranks 0..2)"


def test_without_a_launcher_variable_the_shared_memory_split_gives_the_slot(no_gpus):
    node = unbound(4, local=[None] * 4)
    assert [choose({}, node, r, proc=no_gpus).cores for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert choose({}, node, 3, proc=no_gpus).source == SPLIT


def test_srun_tasks_per_node_are_read_for_this_node():
    tasks = {"SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}
    assert binding.launcher_local_rank({**tasks, "SLURM_NODEID": "3"}).size == 1
    assert binding.launcher_local_rank({**tasks, "SLURM_NODEID": "1"}).size == 2
    assert binding.launcher_local_rank(tasks).size is None  # nodes differ and none is named: the node decides


def test_the_schedulers_cuda_visible_devices_wins_over_the_count(tmp_path):
    driver = tmp_path / "gpus"
    for i in range(8):
        (driver / f"0000:0{i}:00.0").mkdir(parents=True)
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "MPIFL_GPUS_PER_NODE": "2"}  # srun --gpus-per-node=4
    assert node_gpus(env, driver) == ["4", "5", "6", "7"]
    assert binding.slot_gpu(node_gpus(env, driver), 5) == "5"
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f3a"}, driver) == ["GPU-8f3a"]  # --gpus-per-task: kept
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, driver) == ["0"]  # CUDA stops at the first invalid one
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, driver) == node_gpus({"CUDA_VISIBLE_DEVICES": ""},
                                                                                 driver) == []


def test_gpus_are_counted_from_the_drivers_folder_without_starting_cuda(tmp_path):
    driver = tmp_path / "gpus"
    for i in range(3):
        (driver / f"0000:0{i}:00.0").mkdir(parents=True)
    assert node_gpus({}, driver) == ["0", "1", "2"]
    assert node_gpus({}, tmp_path / "no-driver") == []
    assert node_gpus({"MPIFL_GPUS_PER_NODE": "0"}, driver) == []  # said: CPU only
    assert node_gpus({"MPIFL_GPUS_PER_NODE": "4"}, driver) == ["0", "1", "2", "3"]
    with pytest.raises(ValueError, match="MPIFL_GPUS_PER_NODE='four'"):
        node_gpus({"MPIFL_GPUS_PER_NODE": "four"}, driver)
    assert [choose({"MPI_LOCALRANKID": str(r)}, unbound(4), r, proc=driver).gpu for r in range(4)] == \
        ["0", "1", "2", "0"]


def test_without_gpus_nothing_is_set(clean):
    clean.setenv("MPI_LOCALRANKID", "1")
    launch.bind_gpu_from_local_rank()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert choose(dict(os.environ), unbound(2), 1).gpu is None


def test_cores_the_launcher_bound_to_disjoint_sets_are_kept(no_gpus):
    node = [(0, frozenset({0, 1})), (1, frozenset({4, 5})), (2, frozenset({2}))]  # srun --cpu-bind, PALS depth
    chosen = choose({"PALS_LOCAL_RANKID": "1"}, node, 1, proc=no_gpus)
    assert chosen.cores == (4, 5) and chosen.cores_from == "launcher"


def test_overlapping_affinities_are_split_into_contiguous_blocks_of_their_union(no_gpus):
    node = [(0, frozenset({0, 1, 2})), (1, frozenset({2, 3, 4})), (2, frozenset({5, 6, 7}))]  # rank 0 and 1 share 2
    assert [choose({}, node, r, proc=no_gpus).cores for r in range(3)] == [(0, 1), (2, 3, 4), (5, 6, 7)]
    assert {choose({}, node, r, proc=no_gpus).cores_from for r in range(3)} == {"split"}


def test_the_hardware_threads_of_one_core_stay_in_one_block(tmp_path):
    for cpu in range(8):  # Linux's numbering: cpu c and c + 4 are one core's two threads
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(f"{cpu % 4},{cpu % 4 + 4}\n")
    core_of = binding.thread_siblings(range(8), tmp_path)
    assert core_of == {0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1, 6: 2, 7: 3}
    assert [core_block(range(8), r, 2, core_of) for r in range(2)] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert [core_block(range(8), r, 8, core_of) for r in range(3)] == [(0,), (4,), (1,)]  # more ranks than cores
    assert binding.thread_siblings([0], tmp_path / "none") == {0: 0}  # no topology: each cpu its own core


def test_fewer_cores_than_ranks_are_left_to_the_os_rather_than_stacked(no_gpus):
    node = [(r, frozenset({0, 1})) for r in range(3)]  # 3 ranks on 2 cores: pinning would put two on core 0
    assert [choose({}, node, r, proc=no_gpus).cores for r in range(3)] == [(0, 1)] * 3
    assert {choose({}, node, r, proc=no_gpus).cores_from for r in range(3)} == {"shared"}
    # the block rule itself, where it is asked for more blocks than cpus, goes round-robin
    assert [core_block({0, 1}, r, 3) for r in range(3)] == [(0,), (1,), (0,)]
    assert [core_block({2, 7}, r, 5) for r in range(5)] == [(2,), (7,), (2,), (7,), (2,)]


def test_mpifl_bind_none_leaves_cores_and_gpus_as_launched(clean):
    clean.setenv("MPIFL_BIND", "none")
    clean.setenv("MPI_LOCALRANKID", "1")
    clean.setenv("MPIFL_GPUS_PER_NODE", "4")
    launch.bind_gpu_from_local_rank()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    chosen = choose(dict(os.environ), unbound(2), 1)
    assert chosen == Binding(1, "MPI_LOCALRANKID", tuple(sorted(ALL_CORES)), "MPIFL_BIND=none", "0,1,2,3", 1)


def test_a_bad_mpifl_bind_names_the_allowed_values(clean):
    clean.setenv("MPIFL_BIND", "cores")
    clean.setenv("MPI_LOCALRANKID", "1")
    clean.setenv("MPIFL_GPUS_PER_NODE", "4")
    launch.bind_gpu_from_local_rank()  # before MPI: binds nothing, says nothing (bind_rank says it on every rank)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with pytest.raises(ValueError, match="MPIFL_BIND='cores' is not allowed; use 'auto'.*or 'none'"):
        choose(dict(os.environ), unbound(2), 1)


def test_core_lists_read_and_write_as_linux_writes_them():
    assert core_ranges([8, 0, 1, 2, 3]) == "0-3,8" and core_ranges([5]) == "5" and core_ranges([]) == "-"
    assert parse_ranges("0-3,8\n") == [0, 1, 2, 3, 8]
    assert core_ranges(parse_ranges("0,2-4,9-10")) == "0,2-4,9-10"


def test_train_threads_is_one_by_default_a_whole_number_or_auto(no_gpus):
    assert load_config(None).train.threads == 1
    assert load_config(None, ["train.threads=4"]).train.threads == 4
    assert load_config(None, ["train.threads=auto"]).train.threads == "auto"
    assert choose({}, unbound(2), 1, threads="auto", proc=no_gpus).threads == 4  # one per core of its slot
    assert choose({}, unbound(2), 1, threads=3, proc=no_gpus).threads == 3


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "many", "true", "[2]"])
def test_a_bad_train_threads_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"train\.threads: .*(>= 1|'auto')"):
        load_config(None, [f"train.threads={value}"])


def test_the_plan_shows_each_local_ranks_cores_and_gpu():
    assert binding.node_layout(4, 64, 4) == [("0-15", "0"), ("16-31", "1"), ("32-47", "2"), ("48-63", "3")]
    assert binding.node_layout(3, 2, 0) == [("0-1", "-")] * 3  # fewer cores than ranks: shared, unbound
    from mpifl.cli.plan import binding_line

    line = binding_line(2, 8, 1)
    assert "2 ranks per node, 8 cores and 1 GPUs" in line and "0: cores 0-3, GPU 0; 1: cores 4-7, GPU 0" in line


def test_a_run_records_each_ranks_binding_in_ranks_txt(tmp_path):
    """Three ranks under mpiexec (MPICH sets MPI_LOCALRANKID and binds nothing): each takes its block of the cores
    this machine gives (on fewer than 3 cores, all of them, unbound), its GPU if any, and one thread."""
    run_dir = tmp_path / "run"
    done = run_mpi(3, "run", str(ROOT / "configs" / "quickstart.yaml"), "rounds=1", "output.progress=false",
                   "--run-dir", str(run_dir), env={"MPIFL_BIND": "auto"})
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in (run_dir / "ranks.txt").read_text().splitlines()]
    assert rows[0] == ["rank", "host", "pid", "local_rank", "cores", "gpu", "threads"]
    mine = os.sched_getaffinity(0)
    core_of = binding.thread_siblings(mine)
    gpus = node_gpus(os.environ)
    cores = [core_ranges(mine) if len(mine) < 3 else core_ranges(core_block(mine, r, 3, core_of)) for r in range(3)]
    expected = [[str(r), str(r), cores[r], binding.slot_gpu(gpus, r) or "-", "1"] for r in range(3)]
    assert [[row[0], *row[3:]] for row in rows[1:]] == expected
    if len(mine) >= 3:
        assert len({row[4] for row in rows[1:]}) == 3  # enough cores: no two ranks share one
    assert "binding: local ranks from MPI_LOCALRANKID" in done.stderr and "RUNNING AT" in done.stderr
