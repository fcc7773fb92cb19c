"""How ranks make up a world: the server, and client ranks in groups of ``clients.ranks_per_client``; which rank
counts a config can run on. Pure arithmetic, shared by ``mpifl run`` and the planning commands."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mpifl.config import Config, ConfigError
from mpifl.config.checks import check_combinations
from mpifl.planning.faults import FaultPlan
from mpifl.units import counted


@dataclass(frozen=True)
class GroupLayout:
    """Which world rank plays which part when each logical client is trained by ``ranks_per_client`` ranks."""

    ranks_per_client: int

    def groups(self, world_size: int) -> int:
        """How many client groups ``world_size`` ranks make (rank 0 is the server)."""
        return (world_size - 1) // self.ranks_per_client

    def problem(self, world_size: int) -> str | None:
        """Why ``world_size`` ranks cannot form whole groups, or None."""
        clients = world_size - 1
        if clients % self.ranks_per_client:
            return (f"clients.ranks_per_client={self.ranks_per_client} needs the client ranks (all but rank 0) in "
                    f"whole groups, but there are {clients}: launch {self.ranks_per_client} x G + 1 ranks (e.g. "
                    f"{self.ranks_per_client * max(1, clients // self.ranks_per_client) + 1})")
        return None

    def group_of(self, rank: int) -> int | None:
        """The client group of world rank ``rank`` (None for the server)."""
        return None if rank == 0 else (rank - 1) // self.ranks_per_client

    def position(self, rank: int) -> int:
        """Where ``rank`` stands in its group: 0 for the leader."""
        return 0 if rank == 0 else (rank - 1) % self.ranks_per_client

    def federation_rank(self, rank: int) -> int:
        """The rank the server knows a group's leader by (its group + 1; the server stays 0)."""
        group = self.group_of(rank)
        return 0 if group is None else group + 1

    def leader_world_rank(self, federation_rank: int) -> int:
        """The world rank of the leader the server knows by ``federation_rank`` (the server stays 0)."""
        return 0 if federation_rank == 0 else 1 + (federation_rank - 1) * self.ranks_per_client

    def leader_of(self, rank: int) -> int:
        """The world rank of ``rank``'s group leader."""
        group = self.group_of(rank)
        return 0 if group is None else 1 + group * self.ranks_per_client


def srun_singleton_problem(size: int, srun_tasks: str | None) -> str | None:
    """Why a world of one rank under an srun of several tasks (``SLURM_STEP_NUM_TASKS``, which srun sets on each
    task and a batch script does not have) cannot run, naming the cause: srun gave the tasks no process-management
    interface that this MPI reads, so each started alone (Slurm's ``MpiDefault=none`` as installed)."""
    if size != 1 or not (srun_tasks or "").isdigit() or int(srun_tasks or 0) < 2:
        return None
    return (f"srun started {srun_tasks} tasks, but each one's MPI sees a world of 1 rank: srun gave them no "
            "process-management interface (PMI) that this MPI reads (Slurm's default MpiDefault=none), so each "
            "started alone. Launch with `srun --mpi=pmi2` for MPICH (PyPI's mpich too), Intel MPI or MVAPICH, "
            "or `srun --mpi=pmix` for Open MPI, or export SLURM_MPI_TYPE to one of them; `srun --mpi=list` names "
            "the plugins this Slurm has, and `mpifl slurm` writes the one for the MPI it finds")


def too_few_ranks(command: str) -> str:
    """What a job of one rank is told: ``mpifl run`` and ``sweep`` need a server and at least one client rank."""
    return ("mpifl needs at least 2 ranks (rank 0 is the server, ranks 1.. are clients): "
            f"launch with e.g. `mpiexec -n 3 mpifl {command} CONFIG`")


def world_problem(size: int, cfg: Config) -> str | None:
    """Why ``size`` ranks (the server and the client ranks) cannot run this config, or None: what ``mpifl run``
    refuses before any round, and ``mpifl plan``, ``pbs`` and ``slurm`` before a job is written (a fault's
    ``ranks`` among them: the config names ranks, the job decides which it has)."""
    if size < 2:
        return too_few_ranks("run")
    layout = GroupLayout(cfg.clients.ranks_per_client)
    problem = layout.problem(size)
    if problem:
        return problem
    hosts, per = layout.groups(size), cfg.clients.ranks_per_client  # a group of ranks hosts as one client rank
    unit = counted(hosts, "client rank") if per == 1 else f"{counted(hosts, 'client group')} of {per} ranks"

    def ranks_for(count: int) -> int:
        return 1 + count * per

    if hosts > cfg.clients.num_clients:
        return (f"{unit} but clients.num_clients={cfg.clients.num_clients}: "
                f"use at most {ranks_for(cfg.clients.num_clients)} ranks or raise clients.num_clients")
    groups = cfg.clients.groups
    if groups and groups < hosts:
        return (f"clients.groups={groups} < {unit}: a group lives on one client rank, so {hosts - groups} of the "
                f"{unit} would hold no group and idle; launch at most {ranks_for(groups)} ranks or raise "
                "clients.groups")
    if cfg.server.state == "disk" and groups and groups > hosts and cfg.transport.reduce != "chain":
        return (f"server.state='disk' takes one update stream per client rank, but clients.groups={groups} "
                f"> {unit}: launch {ranks_for(groups)} ranks, set clients.groups={hosts}, or add the "
                "groups' sums along a chain into one stream (transport.reduce='chain')")
    if cfg.server.state == "disk" and not groups and cfg.clients_per_round() > hosts:
        grouped = f", or sum each rank's participants first with clients.groups={hosts}" \
            if takes(cfg, groups=hosts) else ""
        return (f"server.state='disk' streams one participant per client rank, but "
                f"{cfg.clients_per_round()} clients per round > {unit}: launch "
                f"{ranks_for(cfg.clients_per_round())} ranks{' or' if not grouped else ','} lower "
                f"clients.per_round{grouped}")
    return FaultPlan(cfg).bad_ranks(size - 1)


def takes(cfg: Config, **clients: Any) -> bool:
    """Whether the config passes its checks with these ``clients`` keys changed: a message suggests a fix only
    where the config can take it (a sharded client, say, refuses clients.groups)."""
    try:
        check_combinations(replace(cfg, clients=replace(cfg.clients, **clients)))
    except ConfigError:
        return False
    return True
