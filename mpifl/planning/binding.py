"""Which GPU and which CPU cores each rank takes: the ones of its node-local slot. Pure functions of their inputs
(an environment mapping, a /proc or /sys folder, the node's affinity sets), so the rule is tested without MPI and
``mpifl plan`` prints it; ``mpifl.roles.launch`` applies it to the running rank.

The rule:

- **slot**: the rank's node-local rank, from the first launcher variable set (``LAUNCHERS``' order), when the
  node's ranks hold exactly 0..n-1 in it (and its size variable, if set, says n); else its rank in the node's
  shared-memory communicator (``MPI.COMM_TYPE_SHARED``).
- **GPU**: the node offers ``CUDA_VISIBLE_DEVICES`` as the scheduler set it, else 0..G-1 for
  ``MPIFL_GPUS_PER_NODE=G``, else one per entry of ``/proc/driver/nvidia/gpus``. Slot r takes GPU r mod count.
- **cores**: kept when the launcher bound the node's ranks to disjoint sets; else the node's cores are split in
  contiguous blocks, one per slot, whole physical cores first (hardware threads of a core stay together); with
  fewer cores than slots, slots share them round-robin.
- ``MPIFL_BIND=none``: no binding at all (for users who bind by hand): the rank keeps what it was given.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpifl.units import range_list

PROC_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU, listed without starting CUDA
SYS_CPUS = Path("/sys/devices/system/cpu")

# Where launchers put a rank's node-local rank, first found wins, with the variable that says how many ranks the
# node has. SLURM_LOCALID comes last: srun sets it per task, but under an mpiexec inside an allocation every rank
# inherits the batch step's (or its node proxy's) value.
LAUNCHERS = (("PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE"),  # Cray PALS (Polaris, Aurora)
             ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH Hydra, Intel MPI
             ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
             ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),  # Cray PMI
             ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),  # MVAPICH
             ("SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"))  # srun; its size is per node: '2(x3),1'
LOCAL_RANK_VARS = tuple(rank for rank, _ in LAUNCHERS)
SPLIT = "shared-memory split"  # the source of a slot no launcher variable gave
BIND_VALUES = ("auto", "none")


@dataclass(frozen=True)
class LocalRank:
    """A rank's node-local rank, the ranks on its node (None: not said) and where both came from."""

    rank: int
    size: int | None
    source: str


@dataclass(frozen=True)
class Binding:
    """What one rank runs on: its slot, the cores and GPU it took, and its compute threads."""

    local_rank: int
    source: str  # the launcher variable (or the shared-memory split) that gave the slot
    cores: tuple[int, ...]
    cores_from: str  # 'launcher' (disjoint sets, kept), 'split' (mpifl's blocks) or 'MPIFL_BIND=none'
    gpu: str | None  # as CUDA_VISIBLE_DEVICES names it; None: no GPU
    threads: int


def launcher_local_rank(env: Mapping[str, str]) -> LocalRank | None:
    """The node-local rank (and ranks on the node) from the first launcher variable set, or None."""
    for rank_var, size_var in LAUNCHERS:
        if env.get(rank_var, "").isdigit():
            size = _slurm_tasks_here(env) if rank_var == "SLURM_LOCALID" else _count(env.get(size_var, ""))
            return LocalRank(int(env[rank_var]), size, rank_var)
    return None


def _count(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) > 0 else None


def _slurm_tasks_here(env: Mapping[str, str]) -> int | None:
    """The tasks srun started on this node: its entry, by SLURM_NODEID, of '2(x3),1' (2, 2, 2, 1)."""
    counts = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not found:
            return None
        counts += [int(found[1])] * int(found[2] or 1)
    if len(set(counts)) == 1:  # the same on every node: SLURM_NODEID not needed
        return _count(str(counts[0]))
    node = env.get("SLURM_NODEID", "")
    return _count(str(counts[int(node)])) if node.isdigit() and int(node) < len(counts) else None


def local_slot(launcher: LocalRank | None, launcher_ranks: Sequence[int | None], node_rank: int) -> LocalRank:
    """The rank's slot: the launcher's when the node's ranks (``launcher_ranks``, in node order) hold exactly
    0..n-1 and its size agrees; else the rank in the shared-memory communicator, saying why."""
    size = len(launcher_ranks)
    if launcher is not None and sorted(r for r in launcher_ranks if r is not None) == list(range(size)) \
            and launcher.size in (None, size):
        return LocalRank(launcher.rank, size, launcher.source)
    why = f" ({launcher.source} does not number the node's {size} ranks 0..{size - 1})" if launcher else ""
    return LocalRank(node_rank, size, SPLIT + why)


def bind_requested(env: Mapping[str, str]) -> bool:
    """Whether mpifl binds ranks (MPIFL_BIND unset or 'auto') or leaves them as launched ('none')."""
    value = env.get("MPIFL_BIND", "").strip() or "auto"
    if value not in BIND_VALUES:
        raise ValueError(f"MPIFL_BIND={value!r} is not allowed; use 'auto' (bind each rank to its node-local "
                         "slot's cores and GPU, the default) or 'none' (leave the launcher's binding as it is)")
    return value == "auto"


def node_gpus(env: Mapping[str, str], proc: Path | None = None) -> list[str]:
    """The GPUs this node offers the job, as CUDA_VISIBLE_DEVICES names them: the scheduler's list when it set one,
    else 0..G-1 for MPIFL_GPUS_PER_NODE=G, else one per entry of ``proc`` (counted without starting CUDA, which
    would read CUDA_VISIBLE_DEVICES once and never again; default PROC_GPUS)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return _visible(env["CUDA_VISIBLE_DEVICES"])
    given = env.get("MPIFL_GPUS_PER_NODE", "").strip()
    if given:
        if not given.isdigit():
            raise ValueError(f"MPIFL_GPUS_PER_NODE={given!r}: expected the number of GPUs per node (0: none)")
        return [str(i) for i in range(int(given))]
    try:
        return [str(i) for i in range(sum(1 for _ in (proc or PROC_GPUS).iterdir()))]
    except OSError:  # no NVIDIA driver
        return []


def _visible(text: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES' devices: CUDA stops at the first invalid entry ('-1', Slurm's 'NoDevFiles')."""
    out = []
    for name in (n.strip() for n in text.split(",")):
        if not name or name.startswith("-") or name == "NoDevFiles":
            break
        out.append(name)
    return out


def slot_gpu(gpus: Sequence[str], local_rank: int) -> str | None:
    """The GPU of slot ``local_rank``: GPU local rank mod count; None without GPUs."""
    return gpus[local_rank % len(gpus)] if gpus else None


def disjoint(sets: Iterable[frozenset[int]]) -> bool:
    """Whether no core is in two of ``sets`` (the launcher bound each rank of the node to its own cores)."""
    seen: set[int] = set()
    for cores in sets:
        if seen & cores:
            return False
        seen |= cores
    return True


def core_block(cpus: Iterable[int], slot: int, slots: int, core_of: Mapping[int, int] | None = None
               ) -> tuple[int, ...]:
    """Slot ``slot``'s contiguous share of ``cpus`` among ``slots``: blocks of whole physical cores (``core_of``:
    cpu -> its core; default, each cpu its own) differing by at most one, else of hardware threads when there are
    fewer cores than slots; with fewer cpus than slots, slot s shares cpu s mod count."""
    core_of = core_of or {}
    units: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        units.setdefault(core_of.get(cpu, cpu), []).append(cpu)
    blocks = [units[core] for core in sorted(units)]
    if len(blocks) < slots:
        blocks = [[cpu] for block in blocks for cpu in block]
    if not blocks:
        return ()
    if len(blocks) < slots:  # fewer cpus than slots: shared round-robin
        return tuple(blocks[slot % len(blocks)])
    slot %= slots
    n = len(blocks)
    return tuple(sorted(cpu for block in blocks[slot * n // slots:(slot + 1) * n // slots] for cpu in block))


def thread_siblings(cpus: Iterable[int], sys_path: Path = SYS_CPUS) -> dict[int, int]:
    """Each cpu's physical core, named by its first hardware thread (from Linux's thread_siblings_list)."""
    out = {}
    for cpu in cpus:
        try:
            out[cpu] = min(parse_ranges((sys_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()))
        except (OSError, ValueError):  # no topology: the cpu is its own core
            out[cpu] = cpu
    return out


def core_ranges(cores: Iterable[int]) -> str:
    """Cores as a compact range list: '0-3,8' ('-' for none)."""
    return range_list(cores) or "-"


def parse_ranges(text: str) -> list[int]:
    """The inverse of ``core_ranges`` (Linux's cpu lists): '0-3,8' -> [0, 1, 2, 3, 8]."""
    out: list[int] = []
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        out += range(int(low), int(high or low) + 1)
    return out


def thread_count(setting: int | str, cores: int) -> int:
    """train.threads for a slot of ``cores`` cores: the number given, or 'auto': one per core."""
    return max(1, cores) if setting == "auto" else int(setting)


def choose(env: Mapping[str, str], node: Sequence[tuple[int | None, frozenset[int]]], node_rank: int,
           threads: int | str = 1, proc: Path | None = None, core_of: Mapping[int, int] | None = None) -> Binding:
    """A rank's binding, from its environment and its node's ranks' (launcher local rank, affinity) in node
    order; ``node_rank``: its place in that list."""
    slot = local_slot(launcher_local_rank(env), [r for r, _ in node], node_rank)
    mine, gpus = node[node_rank][1], node_gpus(env, proc)
    if not bind_requested(env):
        return Binding(slot.rank, slot.source, tuple(sorted(mine)), "MPIFL_BIND=none", ",".join(gpus) or None,
                       thread_count(threads, len(mine)))
    union = frozenset().union(*(c for _, c in node))
    if len(node) > 1 and disjoint(cores for _, cores in node):
        cores, cores_from = tuple(sorted(mine)), "launcher"
    elif len(union) < len(node):  # pinning would stack ranks on some cores while others idle: leave it to the OS
        cores, cores_from = tuple(sorted(mine)), "shared"
    else:
        cores, cores_from = core_block(union, slot.rank, len(node), core_of), "split"
    return Binding(slot.rank, slot.source, cores, cores_from, slot_gpu(gpus, slot.rank),
                   thread_count(threads, len(cores)))


def node_layout(ranks_per_node: int, cores_per_node: int, gpus_per_node: int,
                core_of: Mapping[int, int] | None = None) -> list[tuple[str, str]]:
    """What the rule gives each slot of a node nobody bound: (cores, GPU or '-') per local rank."""
    cpus, gpus = range(cores_per_node), [str(i) for i in range(gpus_per_node)]
    shared = cores_per_node < ranks_per_node  # as choose: fewer cores than ranks are left to the OS, unbound
    return [(core_ranges(cpus) if shared else core_ranges(core_block(cpus, r, ranks_per_node, core_of)),
             slot_gpu(gpus, r) or "-") for r in range(ranks_per_node)]


def describe(bindings: Sequence[Binding]) -> str:
    """Where the ranks' slots and cores came from, in one line for the log."""
    how = {"launcher": "cores as the launcher bound them",
           "split": "cores split among each node's ranks by mpifl (MPIFL_BIND=none: leave them as launched)",
           "shared": "fewer cores than ranks on a node: each rank may run on all of them (the OS schedules)",
           "MPIFL_BIND=none": "cores and GPUs as launched (MPIFL_BIND=none)"}
    sources = ", ".join(sorted({b.source for b in bindings}))
    cores = "; ".join(how[c] for c in sorted({b.cores_from for b in bindings}))
    threads = "/".join(str(t) for t in sorted({b.threads for b in bindings}))
    return f"local ranks from {sources}; {cores}; {threads} compute thread(s) per rank (train.threads)"
