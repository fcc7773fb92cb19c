"""What ``mpifl slurm`` learns from the machine it runs on: the ``srun --mpi`` plugin that the MPI found here reads,
and whether the job fits the partition, as ``sinfo`` describes it.

Why: under Slurm's default ``MpiDefault=none``, srun starts every task as an MPI singleton, a world of one rank
(Slurm's MPI Users Guide, https://slurm.schedmd.com/mpi_guide.html; the same trap with Open MPI is
open-mpi/ompi#13523). MPICH-derived MPIs, PyPI's ``mpich`` wheel among them, read PMI-2 and cannot read PMIx (MPICH
aborts with "Runtime environment uses unsupported PMI version PMIx"); Open MPI 5 reads only PMIx. And a job that
asks a node for more CPUs than it has is accepted by sbatch, then stays pending for ever with
``Reason=PartitionConfig``: saying so when the script is written saves a wait in the queue.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass

from mpifl.cli.job_options import slurm_seconds

SINFO_SECONDS = 10.0  # a login node's sinfo answers in well under a second; a dead slurmctld must not hang us


def srun_mpi_plugin(library_version: str) -> str:
    """The ``srun --mpi`` plugin for an MPI, from ``MPI_Get_library_version``'s text: ``pmix`` for Open MPI and
    Cray MPICH, ``pmi2`` for MPICH and what derives from it (MVAPICH, Intel MPI, PyPI's mpich), '' (srun's own
    default) for an MPI this does not know."""
    text = library_version.lower()
    if "open mpi" in text or "cray mpich" in text:
        return "pmix"
    if any(name in text for name in ("mpich", "mvapich", "intel(r) mpi")):
        return "pmi2"
    return ""


LIBRARY_PROBE = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
                 "print(MPI.Get_library_version().strip().splitlines()[0])")


def mpi_library() -> str:
    """The first line of the MPI library version that this Python's mpi4py loads; '' when it cannot tell. Asked
    in a child process, without initialising MPI: a login node may not allow it, and this process (a test's, say)
    may still want MPI initialised on its own first import."""
    try:
        out = subprocess.run([sys.executable, "-c", LIBRARY_PROBE], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return ""
    return " ".join(out.stdout.split()) if out.returncode == 0 else ""


@dataclass(frozen=True)
class Partition:
    """A partition's limits as sinfo prints them: the smallest node's CPUs and memory, the node count, and the
    time limit (None: infinite)."""

    name: str
    cpus: int
    memory_mb: int
    nodes: int
    max_seconds: int | None


def parse_sinfo(text: str, wanted: str) -> tuple[Partition | None, list[str]]:
    """The partition ``wanted`` ('' for the default, the one sinfo marks with ``*``) from the lines of
    ``sinfo -h -o '%P|%c|%m|%D|%l'``, and the names of all partitions listed. A partition over several lines
    (nodes of different sizes) keeps the smallest node and adds up the nodes."""
    found: Partition | None = None
    names: list[str] = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, cpus, memory, nodes, limit = fields
        default = name.endswith("*")
        name = name.rstrip("*")
        if name not in names:
            names.append(name + ("*" if default else ""))
        if name != wanted and not (not wanted and default):
            continue
        try:
            part = Partition(name, int(cpus.rstrip("+")), int(memory.rstrip("+")), int(nodes),
                             None if limit in ("infinite", "UNLIMITED") else slurm_seconds(limit))
        except ValueError:
            continue
        if found is not None:
            part = Partition(name, min(found.cpus, part.cpus), min(found.memory_mb, part.memory_mb),
                             found.nodes + part.nodes, found.max_seconds)
        found = part
    return found, names


@dataclass(frozen=True)
class JobShape:
    """What the script asks of each node and of the partition."""

    nodes: int
    ranks_per_node: int
    cpus_per_task: int
    overcommit: bool
    seconds: int | None
    memory_mb: float | None  # --mem per node; None or 0: none or all of the node's


def fit_problems(job: JobShape, part: Partition) -> list[str]:
    """Why the job would never start on the partition; empty when it fits."""
    found = []
    cpus = job.cpus_per_task if job.overcommit else job.ranks_per_node * job.cpus_per_task
    if cpus > part.cpus:
        asked = (f"--cpus-per-task {job.cpus_per_task} with --overcommit" if job.overcommit else
                 f"{job.ranks_per_node} ranks per node x {job.cpus_per_task} CPUs per task = {cpus} CPUs")
        found.append(f"{asked}, but the nodes of partition '{part.name}' have {part.cpus}: the job would stay "
                     "pending (Reason=PartitionConfig); use fewer --ranks-per-node or --cpus-per-task, or "
                     "--overcommit to let a node's ranks share its CPUs")
    if job.nodes > part.nodes:
        found.append(f"{job.nodes} nodes, but partition '{part.name}' has {part.nodes}")
    if job.seconds is not None and part.max_seconds is not None and job.seconds > part.max_seconds:
        found.append(f"--time of {job.seconds} s, past partition '{part.name}''s limit of {part.max_seconds} s")
    if job.memory_mb and job.memory_mb > part.memory_mb:
        found.append(f"--mem of {job.memory_mb:g} MB per node, but the nodes of partition '{part.name}' have "
                     f"{part.memory_mb} MB")
    return found


def fit_warnings(job: JobShape, partition: str) -> list[str]:
    """The job against the partition as this machine's ``sinfo`` sees it: warnings, or one note when there is
    no sinfo to ask (the script is still written either way)."""
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return ["note: no sinfo on this machine: whether the job fits the partition was not checked"]
    try:
        out = subprocess.run([sinfo, "-h", "-o", "%P|%c|%m|%D|%l"], capture_output=True, text=True,
                             timeout=SINFO_SECONDS)
    except subprocess.TimeoutExpired:
        return [f"note: sinfo gave no answer in {SINFO_SECONDS:g} s: whether the job fits was not checked"]
    if out.returncode != 0:
        detail = " ".join(out.stderr.split())[:120]
        return [f"note: sinfo failed, so whether the job fits was not checked ({detail})"]
    part, names = parse_sinfo(out.stdout, partition)
    if part is None:
        which = f"partition '{partition}'" if partition else "a default partition"
        return [f"warning: sinfo lists no {which} (it lists: {', '.join(names) or 'none'}); sbatch will refuse "
                "the job"]
    return [f"warning: {problem}" for problem in fit_problems(job, part)]
