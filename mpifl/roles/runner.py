"""What every rank does for ``mpifl run``: build, agree on the model, then serve or train.

This is the one place that reads the whole config: each role gets only its own parts.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from mpi4py import MPI

from mpifl.aggregation.floor import FloorRate, measure_floor
from mpifl.aggregation.strategies import Strategy, make_strategy
from mpifl.aggregation.updates import Mixing
from mpifl.clock.planners import clock_sampler, task_samples
from mpifl.config import Config, DataConfig
from mpifl.errors import JobFailure
from mpifl.learning.datasets import (
    ClientData,
    Dataset,
    client_data,
    client_source,
    load_dataset,
    needs_dataset,
    surveyed_dataset,
)
from mpifl.learning.device import (
    DeviceReplica,
    EvaluationCopy,
    resolve_device,
    training_replica,
    use_deterministic_kernels,
)
from mpifl.learning.models import build_flat_model, model_spec, read_init_from
from mpifl.learning.noise import client_noise_std, score_over_levels, validation_inputs
from mpifl.learning.parallel import DataParallel
from mpifl.learning.partitions import partition, partition_histogram, partition_table, split_validation
from mpifl.learning.sources import HeldRows
from mpifl.learning.trainers import CausalLMTrainer, Evaluator, TorchTrainer, Trainer, make_evaluator, make_trainer
from mpifl.logs import log
from mpifl.metrics import JsonLines
from mpifl.planning.binding import Binding, core_ranges, describe
from mpifl.planning.federation import Placement, clients_of_rank, placement_for
from mpifl.planning.pools import FloorProbe, floor_probe_dtype
from mpifl.planning.world import GroupLayout, world_problem
from mpifl.privacy.dp import ClientPrivacy, ServerPrivacy
from mpifl.privacy.secagg import RingSum, SecureAggregation
from mpifl.roles.client import ClientParts, ClientRank
from mpifl.roles.client_state import DeclaredVectors, StateViews, open_client_state, state_sizes, state_views
from mpifl.roles.control import ClientControls, ClientDynamics, GroupCorrections, GroupDynamics
from mpifl.roles.group import GroupLeader, GroupMember, split_world
from mpifl.roles.launch import SetupError, StopRequest, agree, bind_rank, gather_within, startup_limit
from mpifl.roles.lending import StateLending
from mpifl.roles.personal import GroupPersonalModels, PersonalModels, PersonalTensors
from mpifl.roles.records import log_final, memory_warning_line
from mpifl.roles.residuals import ResidualPublisher
from mpifl.roles.server import Evaluation, Server, ServerParts
from mpifl.storage.checkpointer import CHECKPOINTS, METRICS, Checkpointer, checkpoint_attrs, checkpoint_name
from mpifl.storage.hdf5 import Checkpoint
from mpifl.storage.residuals import (
    Borrowing,
    ResidualStore,
    UndoJournal,
)
from mpifl.storage.rundir import RankNotes, ResumePoint, read_metrics
from mpifl.storage.stores import open_store
from mpifl.trackers import Trackers, open_trackers
from mpifl.units import MIB, format_bytes
from mpifl.wire import doorbell, protocol
from mpifl.wire.flat import DTYPES, FlatModel
from mpifl.wire.late import DroppedClients
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import reuse_freed_memory
from mpifl.wire.shared import node_communicator, share_on_node
from mpifl.wire.spec import ModelSpec, is_local
from mpifl.wire.transport import recv_chunks, recv_object, send_chunks, send_object, use_doorbells
from mpifl.wire.watchdog import RunDeadlines, StragglerRule


def check_world(size: int, cfg: Config) -> None:
    """Refuse rank counts that cannot run this config (``planning.world.world_problem``)."""
    problem = world_problem(size, cfg)
    if problem:
        raise SetupError(problem)


def layout_warnings(cfg: Config) -> list[str]:
    """Legal settings whose results depend on the layout of the ranks, which is otherwise never the case: said
    once, by rank 0, so that a comparison across rank counts (or a resume on another count) is not a surprise."""
    found = []
    if cfg.train.threads != 1 and cfg.train.device != "cuda":  # "auto": the CPU where no GPU is seen
        auto = ", which 'auto' takes from the cores per rank, and so on the number of ranks per node" \
            if cfg.train.threads == "auto" else ""
        found.append(f"train.threads={cfg.train.threads!r}: training on the CPU, torch's kernels split their sums by "
                     f"thread, so the results depend on the thread count{auto}; train.threads=1 keeps them bitwise "
                     "equal on any number of ranks")
    return found


def record_ranks(comm: MPI.Comm, run_dir: Path | None, bound: Binding) -> None:
    """Where every rank runs (host, pid) and what it is bound to (node-local rank, cores, GPU, threads), in
    ``ranks.txt``: the launcher's report of a killed process names only its pid."""
    where = comm.gather((socket.gethostname(), os.getpid(), bound), root=0)
    if comm.Get_rank() != 0:
        return
    assert where is not None  # gather returns every rank's value on the root
    table = "".join(f"{rank} {host} {pid} {b.local_rank} {core_ranges(b.cores)} {b.gpu or '-'} {b.threads}\n"
                    for rank, (host, pid, b) in enumerate(where))
    if run_dir is not None:
        (run_dir / "ranks.txt").write_text("rank host pid local_rank cores gpu threads\n" + table)
    if len(where) <= 16:  # in MPICH's own words (BAD TERMINATION ... PID p RUNNING AT host), to search the log
        log("ranks: " + "; ".join(f"rank {r} PID {p} RUNNING AT {h} (local rank {b.local_rank}, cores "
                                   f"{core_ranges(b.cores)}, GPU {b.gpu or '-'})" for r, (h, p, b) in enumerate(where)),
            rank=0)
    else:
        log(f"ranks: {len(where)}, each rank's PID, host, cores and GPU in "
            f"{run_dir / 'ranks.txt' if run_dir else 'ranks.txt'}", rank=0)
    log(f"binding: {describe([b for _, _, b in where])}", rank=0)


def vocabulary_problem(flat: FlatModel, dataset: Dataset) -> str | None:
    """Token ids must fit the transformers model's embedding: what is wrong, or None."""
    language_model: Any = flat.module  # a transformers model (the caller checks): its methods are not nn.Module's
    rows = language_model.get_input_embeddings().num_embeddings
    largest = max(_largest_id(dataset.x_train), _largest_id(dataset.x_test))
    if largest >= rows:
        return (f"data: token id {largest} does not fit the model's {rows}-row embedding; raise "
                "model.transformers.config's vocab_size or lower data.kwargs.vocab_size")
    return None


def _largest_id(rows: torch.Tensor | HeldRows) -> int:
    """The largest token id in ``rows``; from a client source, in the rows this rank holds (every rank checks
    its own and agree_on_spec shares any problem)."""
    if isinstance(rows, torch.Tensor):
        return int(rows.max()) if rows.numel() else -1
    return max((int(t.max()) for t in rows.held.values() if t.numel()), default=-1)


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


@dataclass(frozen=True)
class RunOutcome:
    """What rank 0 knows when the run ends: the metrics history, and whether a signal (SIGTERM: walltime, or the
    launcher cleaning up after a rank that left) stopped it before its last round."""

    history: list[dict]
    interrupted: bool


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
        notes("failed", reason=f"{type(err).__name__}: {err}"[:2000])
        raise


def _run_rank(comm: MPI.Comm, cfg: Config, run_dir: Path | None, resume: ResumePoint | None,
              notes: RankNotes, open_while_running: contextlib.ExitStack) -> RunOutcome | None:
    stop = StopRequest().install()
    bound = bind_rank(comm, cfg.train.threads)  # the cores (and GPU) of this rank's node-local slot
    torch.set_num_threads(bound.threads)  # 1 by default: torch's CPU reductions split their work by thread
    record_ranks(comm, run_dir, bound)
    dataset = _shared_dataset(comm, cfg.data) if needs_dataset(cfg) else None
    shape = dict(input_shape=dataset.input_shape, num_classes=dataset.num_classes) if dataset else {}
    building = time.monotonic()
    out_of_core = comm.Get_rank() == 0 and cfg.server.state == "disk"
    if out_of_core:  # the out-of-core server never allocates the model
        spec, flat = model_spec(cfg.model, cfg.seed, control_variates=cfg.control_variates, **shape)[0], None
    else:
        flat = build_flat_model(cfg.model, cfg.seed, read_init=False, control_variates=cfg.control_variates,
                                **shape)
        spec = flat.spec
    built = time.monotonic() - building
    problem = None
    if dataset is not None and flat is not None and cfg.model.name == "transformers":  # it reads token ids
        problem = vocabulary_problem(flat, dataset)
    agree_on_spec(comm, spec, problem, built, comparable=not out_of_core)
    plan = ExchangeLayout.build(spec, cfg.transport, cfg.compression, cfg.strategy.wire_dtype,
                                cfg.clients.groups > 0)
    if cfg.model.init_from:  # rank 0 checks it is this model's; then every rank reads it
        init_path = Path(cfg.model.init_from)
        agree(comm, lambda: _open_checkpoint(init_path, spec).close())
        if flat is not None:
            read_init_from(flat, cfg.model.init_from)
    opened: dict[str, Checkpoint] = {}  # rank 0 opens the resume checkpoint once: checked here, loaded by the store
    if resume is not None:  # rank 0 checks; every rank learns whether it fits
        agree(comm, lambda: opened.setdefault("ckpt", _open_checkpoint(resume.path, spec)) and None)
    layout, group = GroupLayout(cfg.clients.ranks_per_client), None
    if layout.ranks_per_client > 1:  # the server and the groups' leaders go on as if each group were one rank
        federation, group = split_world(comm, layout)
        if federation is None:
            assert group is not None and flat is not None  # a group's other ranks are client ranks
            local = _local_data(cfg, dataset, layout.federation_rank(comm.Get_rank()), layout.groups(comm.Get_size()))
            del dataset  # like its leader, a member keeps only its group's clients' samples
            _serve_as_member(group, cfg, flat, local, notes)
            return None
        comm = federation
    floor = _floor_probe(comm, cfg, plan)  # raw MPI: before the doorbells
    bells = open_while_running.enter_context(doorbell.opened(comm, cfg.transport.doorbells))
    open_while_running.enter_context(use_doorbells(bells))
    if comm.Get_rank() != 0:
        local = _local_data(cfg, dataset, comm.Get_rank(), comm.Get_size() - 1)
        del dataset  # a client rank keeps only its own clients' samples
        assert flat is not None  # only rank 0's out-of-core server builds no model
        replica = _training_replica(cfg, flat)
        work = replica.flat if replica else flat  # the model that trains, which per-client state's rules act on
        hosted = sorted(local) if not cfg.lends_client_state else \
            clients_of_rank(comm.Get_rank(), cfg.clients.num_clients, comm.Get_size() - 1)  # homes: state_home
        kinds, views, state = cfg.client_state(), StateViews(), None
        if kinds is not None:
            state_layout = kinds.layout(state_sizes(plan, flat))
            kept = open_client_state(cfg, state_layout, comm.Get_rank(), hosted, run_dir, resume)
            # per_round: each client's state is lent, for the round, to the rank that trains it
            state = Borrowing(kept) if cfg.lends_client_state else kept
            views = state_views(cfg, state_layout, state)
        controls: ClientControls | ClientDynamics | None = None
        if views.rule is not None and cfg.control_variates:
            controls = ClientControls(work, views.rule, cfg.train.lr)
        elif views.rule is not None:
            controls = ClientDynamics(work, views.rule, cfg.strategy.alpha, cfg.train.grad_accum_steps)
        personal = PersonalTensors(work, views.local, marked=views.local_marked) if views.local is not None else None
        models = None
        if views.personal is not None:
            models = PersonalModels(work, plan.chunks, views.personal, make_trainer(cfg.train), cfg.train.ditto_lambda,
                                    with_local=bool(cfg.model.local), backwards_per_step=cfg.train.grad_accum_steps)
        declared = DeclaredVectors(work, kinds.vectors, views.vectors) if kinds is not None and kinds.vectors else None
        _serve_as_client(comm, cfg, plan, flat, local, upload_initial=resume is None, replica=replica,
                         residuals=views.residuals, state=state, controls=controls, personal=personal,
                         personal_models=models, declared=declared, note=notes, group=group, journal=views.journal)
        return None
    return _serve_as_server(comm, cfg, plan, flat, dataset, run_dir, resume, opened.get("ckpt"), stop, notes, floor)


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


def _shared_dataset(comm: MPI.Comm, cfg: DataConfig) -> Dataset:
    """The data every rank starts from: read once on rank 0 and shared; or, from a client source,
    only its index shared (labels, shapes), each client rank reading its own clients' inputs later."""
    source = client_source(cfg)
    if source is None:
        return _read_on_a_client_rank(comm, lambda: load_dataset(cfg))
    surveyed: dict = {}
    index = agree(comm, lambda: surveyed.setdefault("survey", source.survey())[0])
    return surveyed_dataset(source, index, surveyed["survey"][1] if comm.Get_rank() == 0 else None)


def _read_on_a_client_rank(comm: MPI.Comm, load: Callable[[], Dataset]) -> Dataset:
    """The dataset read once, on rank 1, and shared with every client rank; the server gets its labels and the
    held-out set only (``server_view``), so it never holds the training inputs it does not train on, not even
    while they are read. A reading error is a SetupError on every rank, as ``agree`` makes it."""
    rank = comm.Get_rank()
    clients = comm.Split(MPI.UNDEFINED if rank == 0 else 0, rank)
    try:
        if rank == 0:
            got = recv_object(comm, 1, protocol.DATASET)
            assert isinstance(got, tuple)  # rank 1 sends (server view or None, error or None)
            dataset, error = got
        else:
            dataset, error = None, None
            if rank == 1:
                try:
                    dataset = load()
                except (OSError, ValueError, SetupError) as err:
                    error = str(err)
                send_object(comm, (server_view(dataset) if dataset is not None else None, error), protocol.SERVER,
                            protocol.DATASET)
            dataset, error = _share_with_client_ranks(cast(MPI.Intracomm, clients), dataset, error)
    finally:
        if clients != MPI.COMM_NULL:
            clients.Free()
    if error:
        raise SetupError(error)
    assert dataset is not None  # without an error, rank 1 read it
    return dataset


def _share_with_client_ranks(clients: MPI.Intracomm, dataset: Dataset | None,
                             error: str | None) -> tuple[Dataset | None, str | None]:
    """Rank 1's dataset (``clients``' first rank) on every client rank, held once per node: it travels to the
    first client rank of each node, which puts its tensors in shared-memory windows that the node's other client
    ranks map (wire.shared). Every rank gets tensors with the same bytes, so results do not change."""
    node = node_communicator(clients)
    leaders = clients.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, clients.Get_rank())
    try:
        if leaders != MPI.COMM_NULL:
            dataset, error = leaders.bcast((dataset, error), root=0)
        error = node.bcast(error, root=0)
        if error:
            return None, error
        lead = node.Get_rank() == 0
        held = dataset if lead else None
        none = torch.empty(0)  # the tensors travel in windows, the rest as an object
        skeleton = node.bcast(replace(held, x_train=none, y_train=none, x_test=none, y_test=none) if held else None,
                              root=0)
        x_train, y_train, x_test, y_test = (share_on_node(node, getattr(held, n) if held else None)
                                            for n in ("x_train", "y_train", "x_test", "y_test"))
        return replace(skeleton, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test), None
    finally:
        if leaders != MPI.COMM_NULL:
            leaders.Free()
        node.Free()


def server_view(dataset: Dataset) -> Dataset:
    """What the server keeps of a dataset: labels (partition, sizes), the held-out set and the inputs' shape."""
    x = dataset.x_train
    return replace(dataset, x_train=torch.empty((0, *x.shape[1:]), dtype=x.dtype))


def _training_replica(cfg: Config, flat: FlatModel) -> DeviceReplica | None:
    """The replica of the host model that this client rank trains on its device, or None to train the host model."""
    return training_replica(flat, cfg.train.device, cfg.train.device_copy, cfg.model.exchange == "trainable",
                            cfg.train.deterministic)


def kept_tensors_note(frozen: ModelSpec, local: Sequence[str]) -> str:
    """What the tensors that never travel are, for the start-up log: frozen ones, the same on every rank, and
    model.local ones, one copy per client."""
    parts = []
    for kind, entries, where in (
            ("frozen", [e for e in frozen.entries if not is_local(e.name, local)], "stay on every rank"),
            ("local (model.local)", [e for e in frozen.entries if is_local(e.name, local)],
             "never travel: each client keeps its own copy on the rank hosting it")):
        if entries:
            parts.append(f"{len(entries)} {kind} tensors ({sum(e.nbytes for e in entries) / MIB:.1f} MiB) {where}")
    return "; ".join(parts)


def _serve_as_client(comm: MPI.Comm, cfg: Config, plan: ExchangeLayout, flat: FlatModel, local: Mapping,
                     upload_initial: bool, replica: DeviceReplica | None = None,
                     residuals: ResidualStore | None = None, state: ResidualStore | None = None,
                     controls: ClientControls | ClientDynamics | None = None, personal: PersonalTensors | None = None,
                     personal_models: PersonalModels | None = None, declared: DeclaredVectors | None = None,
                     note: RankNotes | None = None,
                     group: MPI.Comm | None = None, journal: UndoJournal | None = None) -> None:
    if comm.Get_rank() == 1 and flat.frozen_spec.entries:
        log(f"exchanging {len(plan.spec.entries)} tensors ({plan.spec.total_bytes / MIB:.1f} MiB); "
            f"{kept_tensors_note(flat.frozen_spec, cfg.model.local)}", rank=1)
    if comm.Get_rank() == 1 and upload_initial and cfg.server.state == "disk" and not cfg.model.init_from:
        assert flat.bytes is not None  # a client rank's model is built in host memory (build_flat_model)
        send_chunks(comm, [protocol.SERVER], protocol.INIT, plan.chunk_slices(flat.bytes), plan.inflight)
    federated = cfg.eval.federated_every > 0
    trainer = make_trainer(cfg.train)
    leader = None
    if group is not None:  # clients.ranks_per_client > 1: this rank leads its group
        parallel = _parallel(trainer, group)
        leader = GroupLeader(group, parallel, replica.flat if replica else flat, _group_timeout(flat))
        if personal_models is not None:  # Ditto: the personal model trains with the group too
            assert isinstance(personal_models.trainer, (TorchTrainer, CausalLMTrainer))  # the config checks'
            personal_models.trainer.parallel = parallel
            personal_models.starting = leader.dispatch_personal
    parts = ClientParts(
        plan=plan, trainer=trainer, seed=cfg.seed, num_clients=cfg.clients.num_clients,
        delta=cfg.strategy.update == "delta", statistics_as_values=cfg.statistics_as_values,
        accept_failures=cfg.clients.accept_failures, groups=cfg.clients.groups,
        weight=make_strategy(cfg.strategy).weight_of, replica=replica,
        evaluate=_evaluator(cfg) if federated else None, evaluate_every=cfg.eval.federated_every,
        rounds=cfg.rounds, privacy=ClientPrivacy(cfg.privacy, cfg.seed) if cfg.privacy.mode != "off" else None,
        secagg=SecureAggregation(cfg.secagg, cfg.seed) if cfg.secagg.enabled else None, residuals=residuals,
        state=state, controls=controls, personal=personal, personal_models=personal_models, declared=declared,
        note=note or RankNotes(None, comm.Get_rank()), group=leader,
        lending=StateLending(comm, state, journal) if isinstance(state, Borrowing) else None, journal=journal)
    client = ClientRank(comm, flat, local, parts)
    _reuse_freed_memory(cfg)
    client.run()
    if leader is not None:
        leader.release()


def _serve_as_member(group: MPI.Comm, cfg: Config, flat: FlatModel, local: Mapping, notes: RankNotes) -> None:
    """A group's other rank (clients.ranks_per_client): train what the leader orders, with the group, on the
    device the leader trains on."""
    replica = _training_replica(cfg, flat)
    work = replica.flat if replica else flat
    trainer = make_trainer(cfg.train)
    parallel = _parallel(trainer, group)
    dynamic = cfg.client_rule == "dynamic_regularizer"
    state = GroupCorrections(work) if cfg.control_variates else \
        GroupDynamics(work, cfg.strategy.alpha, cfg.train.grad_accum_steps) if dynamic else None
    personal = GroupPersonalModels(work, cfg.train.ditto_lambda, cfg.train.grad_accum_steps) \
        if cfg.train.ditto_lambda else None
    member = GroupMember(group, parallel, work, trainer, local, _group_timeout(flat), state, personal)
    _reuse_freed_memory(cfg)
    member.run()
    notes("finished")


def _reuse_freed_memory(cfg: Config) -> None:
    """Once a client rank's long-lived buffers exist: what its training steps free serves their next allocations
    (``train.reuse_freed_memory``; mpifl.wire.memory.reuse_freed_memory says why)."""
    if cfg.train.reuse_freed_memory:
        reuse_freed_memory()


def _parallel(trainer: Trainer, group: MPI.Comm) -> DataParallel:
    """The rank's place in its client group, given to the trainer (a built-in one: config checks)."""
    assert isinstance(trainer, (TorchTrainer, CausalLMTrainer))  # _check_ranks_per_client allows only these
    trainer.parallel = DataParallel(group.Get_rank(), group.Get_size())
    return trainer.parallel


def _group_timeout(flat: FlatModel) -> float:
    """How long a group's rank waits for the others in a collective: the start-up allowance for this model."""
    return startup_limit([], flat.spec.total_bytes + flat.frozen_spec.total_bytes)


def _serve_as_server(comm: MPI.Comm, cfg: Config, plan: ExchangeLayout, flat: FlatModel | None,
                     dataset: Dataset | None, run_dir: Path | None, resume: ResumePoint | None,
                     resumed: Checkpoint | None, stop: StopRequest, notes: RankNotes,
                     floor: FloorRate | None = None) -> RunOutcome:
    strategy = _strategy(cfg)
    strategy.bind(plan.spec, cfg.clients.num_clients)
    _warn_stacked_models(cfg, strategy, comm.Get_size() - 1)
    _warn_statistics(cfg, plan.spec)
    if flat is None and run_dir is None:
        raise JobFailure("server.state='disk' needs a run directory for its HDF5 state")
    directory = run_dir / CHECKPOINTS if run_dir else None
    if directory:
        directory.mkdir(parents=True, exist_ok=True)
    attrs = checkpoint_attrs(cfg)

    def path_of(round_: int) -> Path:
        # a store writes only with a directory: saves need one, and disk state without a run directory is refused
        assert directory is not None
        return directory / checkpoint_name(round_)

    store = open_store(plan, flat, path_of, int(cfg.server.window_mb * MIB),
                       strategy.state_init, read_previous=strategy.needs_previous_global,
                       map_windows=cfg.server.map_windows)
    if dataset is not None and resume is None:
        _report_partition(cfg, dataset, run_dir)
    start, history = (resume.round, resume.metrics) if resume is not None else (0, [])
    store.start(resumed, cfg.model.init_from, {**attrs, "round": 0},
                lambda bufs: recv_chunks(comm, 1, protocol.INIT, bufs, plan.inflight))
    if cfg.model.local and cfg.eval.every:
        log(f"model.local {cfg.model.local}: the server evaluates the averaged tensors with the local ones as "
            "built; eval.federated_every measures each client with its own", rank=0)
    score = None
    if dataset is not None and flat is not None:
        score = _score(cfg, flat, dataset)
    needs_sizes = cfg.clients.placement != "round_robin" or cfg.clock.mode != "off"
    parts_ = _partition(cfg, dataset) if needs_sizes else None
    placement = _placement(cfg, parts_, comm.Get_size() - 1)
    sizes = [len(split_validation(p, cfg.data.val_fraction, cfg.seed, c)[0]) for c, p in enumerate(parts_)] \
        if parts_ is not None else None
    samples = task_samples(sizes, cfg.clients.num_clients, cfg.train.local_epochs, cfg.train.local_steps,
                           cfg.train.batch_size)
    try:
        sampler = clock_sampler(cfg, placement, samples, plan.model_bytes, plan.update_bytes)
    except (ValueError, OSError) as err:
        raise JobFailure(f"cannot plan the virtual-time schedule: {err}") from None
    asynchronous = cfg.clock.asynchronous
    chain = cfg.clients.groups > 0 and cfg.transport.reduce == "chain"  # a rank there waits on the one before it
    deadlines = RunDeadlines(cfg.timeouts, plan.chunk_bytes, plan.inflight, derive=not chain)
    feedback = cfg.client_state() is not None  # its checkpoints carry the client ranks' per-client state
    dropped = DroppedClients()  # named in each rank's next header, a round's or a checkpoint's
    checkpointer = Checkpointer(store, directory, cfg.checkpoint, cfg.rounds, attrs,
                                sampler.needed_versions if asynchronous and directory else None,
                                persist=ResidualPublisher(comm, deadlines, dropped).publish if feedback else None)
    if asynchronous and directory and resume is None:  # version 0, for a resume that retrains from it
        checkpointer.round_ended(0, [], stopping=False)
    privacy = None
    if cfg.privacy.mode != "off":
        privacy = ServerPrivacy(cfg.privacy, cfg.seed, cfg.clients.num_clients, cfg.clients_per_round(), history)
        try:
            log(f"privacy: {cfg.privacy.mode} DP, noise multiplier {cfg.privacy.noise_multiplier}, clip "
                f"{privacy.clip:.4g}; epsilon after all {cfg.rounds} rounds {privacy.epsilon(cfg.rounds):.3f} "
                f"at delta {cfg.privacy.delta}", rank=0)
        except ImportError as err:
            raise JobFailure(str(err)) from None
    # opened last, so that no setup error above leaves a tracker's run open (MLflow's RUNNING, W&B's unfinished)
    trackers = _trackers(cfg, run_dir, start, history, resume is not None)
    sink = JsonLines(run_dir / METRICS if run_dir else None, also=trackers)
    try:
        parts = ServerParts(plan=plan, sampler=sampler, strategy=strategy, store=store, checkpointer=checkpointer,
                            evaluation=Evaluation(score, cfg.eval.every, cfg.rounds), sink=sink, deadlines=deadlines,
                            privacy=privacy,
                            secagg=SecureAggregation(cfg.secagg, cfg.seed) if cfg.secagg.enabled else None, note=notes,
                            stragglers=_straggler_rule(cfg), dropped=dropped,
                            floor=floor, lends_state=cfg.lends_client_state)
        history = Server(comm, parts, cfg.transport, stop, cfg.output.progress,
                         cfg.clients.min_participants).run(start, history)
    finally:
        sink.close()
    if run_dir and cfg.output.save_model and history and history[-1]["round"] == cfg.rounds:
        checkpointer.link_final_model(run_dir)
    log_final(history, cfg.rounds, str(run_dir) if run_dir else "(no run directory)")
    reached = history[-1]["round"] if history else 0
    interrupted = stop.requested and reached < cfg.rounds
    notes("interrupted" if interrupted else "finished", reached)
    return RunOutcome(history, interrupted=interrupted)


def _trackers(cfg: Config, run_dir: Path | None, start: int, kept: list[dict], resumed: bool) -> list[Trackers]:
    """``output.trackers``, opened on rank 0 before the first round (none without a run directory to write in);
    ``kept``: the records a resume keeps, for the rounds a tracker lost when the job before was killed."""
    if not cfg.output.trackers or run_dir is None:
        return []
    if resumed:  # the rewound metrics.jsonl's records: the checkpoint's copy of its own round predates its timing
        kept = read_metrics(run_dir / METRICS) or kept
    return [open_trackers(cfg.output.trackers, run_dir, cfg.name, cfg.to_dict(), start, resumed,
                          notes=lambda record: [memory_warning_line(w) for w in record.get("memory_warning", ())],
                          warn=lambda message: log(message, rank=0), kept=kept)]


def _score(cfg: Config, flat: FlatModel, dataset: Dataset) -> Callable[[], dict]:
    """The server's held-out evaluation of the global model in ``flat``: on the CPU, in the host buffer itself, or on
    the server rank's GPU (``eval.device``), in a copy refreshed before each evaluation."""
    evaluate = _evaluator(cfg)
    device = resolve_device(cfg.eval.device, "eval.device")
    current: Callable[[], torch.nn.Module] = lambda: flat.module  # noqa: E731
    if device.type != "cpu":
        if cfg.train.deterministic:
            use_deterministic_kernels()
        current = EvaluationCopy(flat, device, cfg.model.exchange == "trainable").refreshed
        log(f"eval.device {cfg.eval.device}: the server evaluates on {torch.cuda.get_device_name(device)}", rank=0)
    scale, x_test, y_test = cfg.data.feature_noise, dataset.x_test, dataset.y_test

    def score() -> dict:
        module = current()
        if not scale:
            return evaluate(module, x_test, y_test)
        # data.feature_noise: the held-out set at every client's noise level, as NIID-Bench scores it
        return score_over_levels(lambda x: evaluate(module, x, y_test), x_test, scale, cfg.clients.num_clients,
                                 cfg.seed)
    return score


def _evaluator(cfg: Config) -> Evaluator:
    """The held-out scorer: perplexity for transformers LMs, accuracy and the training loss otherwise."""
    return make_evaluator(cfg.eval, cfg.train.loss, language_model=cfg.model.name == "transformers")


def _straggler_rule(cfg: Config) -> StragglerRule | None:
    """clients.accept_failures: when a rank still training is dropped from its round. Under a strategy whose
    clients keep state matched by the server's (Capabilities.client_state: SCAFFOLD's c_i and c, FedDyn's g_i and
    h), a dropped rank has already folded its clients' deltas into their state when it learns of the drop from
    its next header; that state is put back then, by the rank or, under per_round placement, by each client's home
    rank (storage.residuals.UndoJournal)."""
    return StragglerRule(cfg.timeouts.straggler) if cfg.clients.accept_failures else None


def _strategy(cfg: Config) -> Strategy:
    """The configured strategy, with the stage a run mode replaces: FedAsync mixes each update in
    (``Mixing``); secure aggregation sums masked fixed-point updates in the ring (``RingSum``)."""
    strategy = make_strategy(cfg.strategy)
    if cfg.clock.mode != "fedasync" and not cfg.secagg.enabled:
        strategy.statistics_absolute = cfg.statistics_as_values
        return strategy
    twin = strategy.substituted(RingSum(cfg.strategy) if cfg.secagg.enabled else None,
                                Mixing(cfg.strategy) if cfg.clock.mode == "fedasync" else None)
    twin.statistics_absolute = cfg.statistics_as_values
    return twin


def _warn_stacked_models(cfg: Config, strategy: Strategy, client_ranks: int) -> None:
    if strategy.stacked and cfg.clients_per_round() > client_ranks:
        log(f"strategy {cfg.strategy.name}: {cfg.clients_per_round()} participants per round on "
            f"{client_ranks} client ranks: a rank's participants arrive one after another, so the server "
            "stacks every participant's whole model (participants x model x 4 bytes); one client rank per "
            "participant keeps it at participants x chunk", rank=0)


def _warn_statistics(cfg: Config, spec: ModelSpec) -> None:
    """DP noises every exchanged element, a BatchNorm's running variance too, which noise can take below zero (NaN
    evaluations): say so once, with the ways out."""
    names = [e.name for e in spec.entries if e.statistic]
    if names and cfg.privacy.mode != "off":
        log(f"privacy.mode {cfg.privacy.mode!r}: the model's statistics ({names[0]}"
            f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}) are clipped and noised with the rest, and "
            "a noised running variance can go below zero; a model with GroupNorm or LayerNorm, or model.local for "
            "its BatchNorm layers (FedBN), keeps them out of the noise", rank=0)


def _report_partition(cfg: Config, dataset: Dataset, run_dir: Path | None) -> None:
    """Print the clients x labels table; keep it as partition.csv in the run directory."""
    with _partition_errors():
        histogram = partition_histogram(cfg.data, dataset, cfg.clients.num_clients, cfg.seed)
    log(f"partition '{cfg.data.partition}' of {len(dataset.y_train)} training samples:\n"
        + partition_table(histogram), rank=0)
    if cfg.data.feature_noise:
        n, scale = cfg.clients.num_clients, cfg.data.feature_noise
        log(f"data.feature_noise {scale:g}: client k reads its inputs through Gaussian noise of std {scale:g} * k / "
            f"{n - 1} (from 0 for client 0 to {scale:g} for client {n - 1}), drawn afresh for every minibatch; the "
            f"held-out set is scored at each of the {n} levels", rank=0)
    if run_dir is not None:
        header = "samples," + ",".join(f"class{k}" for k in range(histogram.shape[1]))
        np.savetxt(run_dir / "partition.csv", np.column_stack([histogram.sum(axis=1), histogram]), fmt="%d",
                   delimiter=",", header=header, comments="")


@contextlib.contextmanager
def _partition_errors() -> Iterator[None]:
    """A partition that cannot be made (too few samples, a bad partition file) ends the job in one line."""
    try:
        yield
    except (ValueError, OSError) as err:
        raise JobFailure(f"cannot partition the data: {err}") from None


def _open_checkpoint(path: Path, spec: ModelSpec) -> Checkpoint:
    ckpt = Checkpoint(path)
    ckpt.check_spec(spec)
    return ckpt


def _partition(cfg: Config, dataset: Dataset | None) -> list | None:
    """Every client's training indices (the same on every rank), or None without data."""
    if dataset is None:
        return None
    with _partition_errors():
        return partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed, dataset.clients)


def _placement(cfg: Config, parts: list | None, client_ranks: int) -> Placement:
    """``clients.placement``: by work, samples x epochs (fixed local_steps make every client's work equal)."""
    work = None
    if parts is not None and cfg.clients.placement != "round_robin" and not cfg.train.local_steps:
        work = [float(len(p) * cfg.train.local_epochs) for p in parts]
    return placement_for(cfg.clients, client_ranks, work)


def _local_data(cfg: Config, dataset: Dataset | None, rank: int, client_ranks: int) -> Mapping:
    parts = _partition(cfg, dataset)
    mine = _placement(cfg, parts, client_ranks).clients_of(rank, cfg.clients.num_clients)
    if dataset is None:
        return {c: (None, None) for c in mine}
    assert parts is not None  # _partition returns None only without a dataset
    if cfg.clients.placement == "per_round":  # any client may train here: slice its data when it does
        assert dataset.source is None  # cli.commands.check_plugins refuses per_round with a client source
        return ClientSlices(dataset, parts, cfg.data.val_fraction, cfg.seed, cfg.data.feature_noise)
    if dataset.source is not None:  # from a client source: read only now, and only these clients
        dataset = dataset.holding(mine)
        held = sum(len(parts[c]) for c in mine)
        log(f"read {held} of {len(dataset.y_train)} training samples: its {len(mine)} clients' "
            f"({cfg.data.dataset} files under {cfg.data.kwargs.get('path')})", rank=rank)
    slices = ClientSlices(dataset, parts, cfg.data.val_fraction, cfg.seed, cfg.data.feature_noise)
    return {c: slices[c] for c in mine}


class ClientSlices(Mapping):
    """Every client's (training, validation) data, sliced from the rank's copy of the training set when asked:
    ``clients.placement: per_round`` may hand a rank any client, and copying all of them up front would hold the
    training set twice. With ``feature_noise`` (``data.feature_noise``) client c's data carries its noise level,
    and its validation split is noised once (mpifl.learning.noise)."""

    def __init__(self, dataset: Dataset, parts: list, val_fraction: float, seed: int, feature_noise: float = 0.0):
        self.dataset, self.parts, self.val_fraction, self.seed = dataset, parts, val_fraction, seed
        self.feature_noise = feature_noise

    def __getitem__(self, client: int) -> tuple[ClientData, ClientData | None]:
        """Client ``client``'s training data and (when it has one) validation data."""
        if not 0 <= client < len(self.parts):
            raise KeyError(client)
        train, val = split_validation(self.parts[client], self.val_fraction, self.seed, client)
        std = client_noise_std(self.feature_noise, client, len(self.parts))
        val_data = client_data(self.dataset, val) if len(val) else None
        if val_data is not None and std:
            val_data = ClientData(validation_inputs(val_data.x, std, self.seed, client), val_data.y)
        return client_data(self.dataset, train, std), val_data

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.parts)))

    def __len__(self) -> int:
        return len(self.parts)
