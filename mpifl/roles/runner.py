"""What every rank does for ``mpifl run``, in order: bind, read and share the data, build the model, agree on it, then
serve or train.

The launch sequence alone: where the data goes is ``roles.data``, and each role is built and served by its builder,
``roles.build_client`` (a client rank, a client group's other ranks) and ``roles.build_server`` (rank 0).
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from mpi4py import MPI

from mpifl.aggregation.floor import FloorRate, measure_floor
from mpifl.algorithms import model_streams
from mpifl.config import Config, ConfigError
from mpifl.errors import InputRefused, JobFailure
from mpifl.learning.datasets import (
    Dataset,
    needs_dataset,
)
from mpifl.learning.models import build_flat_model, model_spec, read_init_from
from mpifl.learning.trainers import Trainer, load_optimizer_machinery
from mpifl.logs import SUPERVISOR_PID, log, name_ranks_by_world, same_rank
from mpifl.planning.binding import Binding, core_ranges, describe
from mpifl.planning.federation import clients_of_rank
from mpifl.planning.pools import FloorProbe, floor_probe_dtype
from mpifl.planning.world import GroupLayout, srun_singleton_problem, world_problem
from mpifl.roles.build_client import client_state_parts, rank_replica, rank_trainer, serve_as_client, serve_as_member
from mpifl.roles.build_server import RoundsPlan, RunOutcome, open_checkpoint, plan_rounds, serve_as_server
from mpifl.roles.data import local_data, shared_dataset, vocabulary_problem
from mpifl.roles.group import split_world
from mpifl.roles.launch import SetupError, StopRequest, agree, bind_rank, gather_within, startup_limit
from mpifl.roles.sharded import serve_sharded
from mpifl.storage.hdf5 import Checkpoint
from mpifl.storage.notes import RankNotes
from mpifl.storage.rundir import ResumePoint
from mpifl.units import format_bytes
from mpifl.wire import doorbell, protocol
from mpifl.wire.flat import DTYPES, FlatModel
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.spec import ModelSpec
from mpifl.wire.transport import use_doorbells


def check_world(size: int, cfg: Config) -> None:
    """Refuse rank counts that cannot run this config (``planning.world.world_problem``), and the singletons of
    an srun without a PMI with their cause (``planning.world.srun_singleton_problem``)."""
    problem = srun_singleton_problem(size, os.environ.get("SLURM_STEP_NUM_TASKS")) or world_problem(size, cfg)
    if problem:
        raise SetupError(problem)


def record_ranks(comm: MPI.Comm, run_dir: Path | None, bound: Binding) -> None:
    """Where every rank runs (host, pid) and what it is bound to (node-local rank, cores, GPU, threads), in
    ``ranks.txt``: the launcher's report of a killed process names only its pid."""
    where = comm.gather((socket.gethostname(), os.getpid(), bound, launched_pid()), root=0)
    if comm.Get_rank() != 0:
        return
    assert where is not None  # gather returns every rank's value on the root
    table = "".join(f"{rank} {host} {pid} {b.local_rank} {core_ranges(b.cores)} {b.gpu or '-'} {b.threads}\n"
                    for rank, (host, pid, b, _) in enumerate(where))
    if run_dir is not None:
        (run_dir / "ranks.txt").write_text("rank host pid local_rank cores gpu threads\n" + table)
    if len(where) <= 16:  # in MPICH's own words (BAD TERMINATION ... PID p RUNNING AT host), to search the log
        log("ranks: " + "; ".join(f"rank {r} PID {p} RUNNING AT {h} ({launched_as(p, s)}local rank {b.local_rank}, "
                                   f"cores {core_ranges(b.cores)}, GPU {b.gpu or '-'})"
                                   for r, (h, p, b, s) in enumerate(where)), rank=0)
    else:
        log(f"ranks: {len(where)}, each rank's PID, host, cores and GPU in "
            f"{run_dir / 'ranks.txt' if run_dir else 'ranks.txt'}", rank=0)
    log(f"binding: {describe([b for _, _, b, _ in where])}", rank=0)


def launched_pid() -> int:
    """The PID of the process the launcher started for this rank: its supervisor's (mpifl.cli.supervisor), which
    the launcher's reports name, or this process's own."""
    return int(os.environ.get(SUPERVISOR_PID, os.getpid()))


def launched_as(pid: int, launched: int) -> str:
    """The launched process's PID, where it is not the rank's own, for the ranks line."""
    return f"launched as PID {launched}, " if launched != pid else ""


def agree_on_spec(comm: MPI.Comm, spec: ModelSpec, problem: str | None = None, built_seconds: float = 0.0,
                  comparable: bool = True) -> None:
    """Compare every client's model with the server's (and share any local problem); all ranks fail together.

    Rank 0 gathers the specs point to point, waiting for a rank only as long as the others took to build
    (``gather_within``): a rank stuck building its model ends the job, named, instead of hanging it."""
    gathered = gather_within(comm, (spec, problem), "model build", built_seconds, spec.total_bytes,
                             tag=protocol.STARTUP, comparable=comparable)
    first = None
    for rank, (theirs, local) in enumerate(gathered or []):
        if local is None and theirs.hash != spec.hash:
            local = (f"rank {rank}'s model differs from the server's: {theirs.first_difference(spec)} "
                     f"(client spec hash != server {spec.hash})")
        first = first or local
    first = comm.bcast(first, root=0)
    if first:
        raise SetupError(first)


def run_rank(comm: MPI.Comm, cfg: Config, run_dir: Path | None, resume: ResumePoint | None = None
             ) -> RunOutcome | None:
    """Run one rank's part of the experiment; rank 0 returns the outcome, the other ranks None. Every rank notes
    in the run directory what it is doing (``ranks/``), and a failure with its reason, for ``mpifl status``."""
    notes = RankNotes(run_dir, comm.Get_rank())
    notes("started", resume.round if resume is not None else 0)
    try:
        with contextlib.ExitStack() as open_while_running:
            return _run_rank(comm, cfg, run_dir, resume, notes, open_while_running)
    except BaseException as err:
        notes.failed(f"{type(err).__name__}: {err}"[:2000])
        raise


def _run_rank(comm: MPI.Comm, cfg: Config, run_dir: Path | None, resume: ResumePoint | None,
              notes: RankNotes, open_while_running: contextlib.ExitStack) -> RunOutcome | None:
    stop = StopRequest().install()
    if comm.Get_rank() != 0:  # before any stage the server times
        load_optimizer_machinery()
    bound = bind_rank(comm, cfg.train.threads)  # the cores (and GPU) of this rank's node-local slot
    torch.set_num_threads(bound.threads)  # 1 by default: torch's CPU reductions split their work by thread
    record_ranks(comm, run_dir, bound)
    dataset = shared_dataset(comm, cfg.data) if needs_dataset(cfg) else None
    classes = dataset.num_classes if dataset else 0  # a label_flip fault flips labels among them
    spec, flat, trainer = _agreed_model(comm, cfg, dataset)
    plan = ExchangeLayout.build(spec, cfg.transport, cfg.compression, cfg.strategy.wire_dtype,
                                cfg.clients.groups > 0)
    resumed = _opened_starting_points(comm, cfg, spec, flat, resume)
    layout, group = GroupLayout(cfg.clients.ranks_per_client), None
    rounds = _planned_rounds(comm, cfg, spec, plan, flat, dataset, layout.groups(comm.Get_size()))
    if layout.ranks_per_client > 1:  # the server and the groups' leaders go on as if each group were one rank
        federation, group = split_world(comm, layout)
        # messages and records name the leaders by their own MPI ranks, for this run only: a process that runs
        # several (mpifl sweep, a caller's communicator) may run the next with one rank per client
        name_ranks_by_world(layout.leader_world_rank)
        open_while_running.callback(name_ranks_by_world, same_rank)
        if federation is None:
            assert group is not None  # a group's other ranks are client ranks
            local = local_data(cfg, dataset, layout.federation_rank(comm.Get_rank()), layout.groups(comm.Get_size()))
            del dataset  # like its leader, a member keeps only its group's clients' samples
            _serve_as_group_member(group, cfg, spec, plan, flat, local, trainer, run_dir, resume, notes)
            return None
        comm = federation
    floor = _floor_probe(comm, cfg, plan)  # raw MPI: before the doorbells
    bells = open_while_running.enter_context(doorbell.opened(comm, cfg.transport.doorbells))
    open_while_running.enter_context(use_doorbells(bells))
    if comm.Get_rank() != 0:
        local = local_data(cfg, dataset, comm.Get_rank(), comm.Get_size() - 1)
        del dataset  # a client rank keeps only its own clients' samples
        _serve_as_client_rank(comm, group, cfg, spec, plan, flat, local, trainer, run_dir, resume, notes, classes)
        return None
    assert rounds is not None  # rank 0 planned them
    return serve_as_server(comm, cfg, plan, flat, dataset, run_dir, resume, resumed, rounds, stop, notes, floor)


def _agreed_model(comm: MPI.Comm, cfg: Config, dataset: Dataset | None
                  ) -> tuple[ModelSpec, FlatModel | None, Trainer | None]:
    """The rank's model, built from the config and the seed, and its spec, checked to be every rank's: no model
    (None) on the out-of-core server, which never allocates it, nor on a sharded client rank, whose group builds
    it later in shards. A client rank's trainer (None on rank 0) is built here too, so that what it refuses is
    agreed on with the model."""
    shape = dict(input_shape=dataset.input_shape, num_classes=dataset.num_classes) if dataset else {}
    building = time.monotonic()
    out_of_core = comm.Get_rank() == 0 and cfg.server.state == "disk"
    sharded = comm.Get_rank() != 0 and cfg.clients.sharding == "fsdp"  # built later, by its group, in shards
    if out_of_core or sharded:
        spec, flat = model_spec(cfg.model, cfg.seed, streams=model_streams(cfg.client_rule), **shape)[0], None
    else:
        flat = build_flat_model(cfg.model, cfg.seed, read_init=False, streams=model_streams(cfg.client_rule),
                                **shape)
        spec = flat.spec
    built = time.monotonic() - building
    trainer, problem = _client_trainer(comm, cfg, flat)
    if dataset is not None and flat is not None and cfg.model.name == "transformers":  # it reads token ids
        problem = problem or vocabulary_problem(flat, dataset, cfg.data)
    agree_on_spec(comm, spec, problem, built, comparable=not out_of_core)
    return spec, flat, trainer


def _client_trainer(comm: MPI.Comm, cfg: Config, flat: FlatModel | None) -> tuple[Trainer | None, str | None]:
    """A client rank's trainer (``rank_trainer``, which checks its model too), or what it refuses, naming the rank;
    (None, None) on rank 0."""
    if comm.Get_rank() == 0:
        return None, None
    try:
        return rank_trainer(cfg, flat.module if flat is not None else None), None
    except (ConfigError, JobFailure) as err:
        return None, f"rank {comm.Get_rank()}: {err}"


def _opened_starting_points(comm: MPI.Comm, cfg: Config, spec: ModelSpec, flat: FlatModel | None,
                            resume: ResumePoint | None) -> Checkpoint | None:
    """model.init_from, checked by rank 0 to hold this model and then read by every rank that holds one; and on
    rank 0 the resume checkpoint, opened once and checked here, loaded later by the store. Every rank learns
    whether either check failed."""
    if cfg.model.init_from:
        init_path = Path(cfg.model.init_from)
        agree(comm, lambda: open_checkpoint(init_path, spec).close())
        if flat is not None:
            read_init_from(flat, cfg.model.init_from)
    opened: dict[str, Checkpoint] = {}
    if resume is not None:
        agree(comm, lambda: opened.setdefault("ckpt", open_checkpoint(resume.path, spec)) and None)
    return opened.get("ckpt")


def _planned_rounds(comm: MPI.Comm, cfg: Config, spec: ModelSpec, plan: ExchangeLayout,
                    flat: FlatModel | None, dataset: Dataset | None, client_ranks: int) -> RoundsPlan | None:
    """Rank 0's plan of the rounds (``plan_rounds``: the partition, the strategy, the sampler), None elsewhere. The
    other ranks wait for it, so that what it refuses (InputRefused) ends every rank alike, in one line with exit
    status 2 and no abort, before any rank has moved a byte of the model or written a record."""
    planned: list[RoundsPlan] = []
    agree(comm, lambda: planned.append(plan_rounds(cfg, spec, plan, flat, dataset, client_ranks)),
          refusals=(InputRefused,))
    return planned[0] if planned else None


def _serve_as_group_member(group: MPI.Comm, cfg: Config, spec: ModelSpec, plan: ExchangeLayout,  # noqa: PLR0913 - the rank's parts, built by _run_rank
                           flat: FlatModel | None, local: Mapping, trainer: Trainer | None, run_dir: Path | None,
                           resume: ResumePoint | None, notes: RankNotes) -> None:
    """Serve as one of a client group's ranks other than its leader: a shard of a sharded client, or a replica
    that trains a share of each batch."""
    assert trainer is not None  # built on every client rank (_client_trainer)
    if cfg.clients.sharding == "fsdp":
        stopped = serve_sharded(None, group, cfg, spec, plan, local, trainer=trainer, upload_initial=False,
                                run_dir=run_dir, resume=resume, note=notes)
        notes("interrupted" if stopped else "finished")
        return
    assert flat is not None  # built for every rank but a sharded one and the out-of-core server
    serve_as_member(group, cfg, flat, local, trainer, notes)


def _serve_as_client_rank(comm: MPI.Comm, group: MPI.Comm | None, cfg: Config, spec: ModelSpec,  # noqa: PLR0913 - the rank's parts, built by _run_rank
                          plan: ExchangeLayout, flat: FlatModel | None, local: Mapping, trainer: Trainer | None,
                          run_dir: Path | None, resume: ResumePoint | None, notes: RankNotes, classes: int) -> None:
    """Serve as a client rank (a group's leader too) until the last round or a stop: a sharded client's leader, or
    a rank that trains its clients with their per-client state."""
    assert trainer is not None  # built on every client rank (_client_trainer)
    if cfg.clients.sharding == "fsdp":
        assert group is not None  # the config checks: sharding needs clients.ranks_per_client > 1
        stopped = serve_sharded(comm, group, cfg, spec, plan, local, trainer=trainer, upload_initial=resume is None,
                                run_dir=run_dir, resume=resume, note=notes)
        notes("interrupted" if stopped else "finished")
        return
    assert flat is not None  # only rank 0's out-of-core server and sharded ranks build no model here
    replica = rank_replica(cfg, flat)
    work = replica.flat if replica else flat  # the model that trains, which per-client state's rules act on
    hosted = sorted(local) if not cfg.lends_client_state else \
        clients_of_rank(comm.Get_rank(), cfg.clients.num_clients, comm.Get_size() - 1)  # homes: state_home
    state = client_state_parts(cfg, plan, flat, work, comm.Get_rank(), hosted, run_dir, resume)
    serve_as_client(comm, cfg, plan, flat, local, trainer=trainer, upload_initial=resume is None, replica=replica,
                    state=state,
                    note=notes, group=group, classes=classes)


def _floor_probe(comm: MPI.Comm, cfg: Config, plan: ExchangeLayout) -> FloorRate | None:
    """``transport.floor_probe_mb``: the server and its client ranks time the raw-MPI floor once, before round 1
    (rank 0 gets the rates and logs them; each round's record then holds its exchange against them)."""
    dtype = DTYPES[floor_probe_dtype(cfg, plan.grouped)]
    probe = FloorProbe.of(plan, cfg.transport.floor_probe_mb, comm.Get_size() - 1, dtype.itemsize)
    rate = measure_floor(comm, probe, dtype, startup_limit([], plan.model_bytes))
    if rate is not None:
        log(f"exchange floor (raw chunked Isend/Irecv, {format_bytes(probe.nbytes)} with each of {rate.client_ranks} "
            f"client ranks): {format_bytes(1 / rate.down)}/s out, {format_bytes(1 / rate.up)}/s back and folded",
            rank=0)
    return rate


