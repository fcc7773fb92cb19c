"""``clients.sharding: fsdp``: a logical client whose model is sharded over the R ranks of its group.

The server sees the group's first rank, its leader, exactly as it sees an unsharded client rank: the same headers,
the same chunks of the same flat layout, in the same order, out and back. No rank of the group holds the whole model
or the whole update:

- **Out.** The leader receives each chunk of the global model into a small ring of chunk buffers and broadcasts it
  over the group; every rank copies the bytes it owns (``mpifl.wire.shards``) into its FSDP shard and drops the rest.
- **Training.** Every rank trains on its share of each batch; FSDP gathers one unit's parameters at a time and
  reduce-scatters the gradients (``mpifl.learning.sharding``).
- **Back.** Chunk by chunk, every rank forms its pieces of the update (the delta against the global rows it kept,
  elementwise in the model's dtype as an unsharded client forms it) and the leader gathers them into the chunk it
  sends, while the chunks before it are still in flight to the server.

So the server folds a sharded client's update exactly as it folds an unsharded one's: its result differs from an
unsharded client's only by the training's own rounding (the shares' gradient sums), bitwise the same for a fixed R on
any number of groups. Each rank of a group holds its rows of the parameters, gradients, optimizer state and the
global model, one FSDP unit gathered at a time, and a few chunks.

The group's own orders, the chunks and the pieces travel over the group's MPI communicator (non-blocking calls
waited on with the transport's backoff, so a waiting rank sleeps instead of spinning); FSDP's collectives over the
group's ``torch.distributed`` process group, built once at start-up.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from mpifl.aggregation.strategies import make_strategy
from mpifl.algorithms import model_streams
from mpifl.algorithms.ditto import ShardPersonalModels
from mpifl.config import Config
from mpifl.errors import IN_A_NEW_RUN, JobFailure, entered, noted, plugin_name
from mpifl.learning.datasets import ClientData
from mpifl.learning.device import resolve_device, use_deterministic_kernels
from mpifl.learning.models import build_model
from mpifl.learning.sharding import (
    ShardedParallel,
    build_sharded,
    load_pretrained_rows,
    shard_buffers,
)
from mpifl.learning.steps import own_rows, trainable
from mpifl.learning.trainers import (
    CausalLMTrainer,
    ConfiguredTrainer,
    TorchTrainer,
    Trainer,
    TrainResult,
    local_steps,
    result_problem,
    trainer_name,
)
from mpifl.logs import log
from mpifl.metrics import PERSONAL_DIVERGED, CostMeter
from mpifl.planning.faults import FaultPlan
from mpifl.planning.seeds import client_seed, personal_seed
from mpifl.roles.encoding import UpdateCompressor
from mpifl.roles.faults import FaultInjector, InjectedFault, flip_bits_in_chunk
from mpifl.roles.group import rendezvous_store
from mpifl.roles.launch import startup_limit
from mpifl.roles.local_training import ClientFailure
from mpifl.roles.sharded_chunks import ShardedGroup, ShardedModel, receive_ring, tensors_by_name
from mpifl.roles.sharded_state import ShardedState, every_rank, open_sharded_state, rows_of
from mpifl.storage.rundir import ResumePoint, faults_struck, note_fault_struck
from mpifl.units import format_bytes
from mpifl.wire import protocol
from mpifl.wire.flat import build_spec, split_tensors
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import return_freed_memory
from mpifl.wire.spec import CONTROL, ModelSpec
from mpifl.wire.transport import ProgressReporter, recv_object, send_chunks, send_object

INIT, MODEL, TRAIN, SETTLE, PERSIST, STOP = "init", "model", "train", "settle", "persist", "stop"


@dataclass(frozen=True)
class GroupStep:
    """The leader to its group: what to do together now."""

    kind: str  # INIT: send the freshly built model (the out-of-core server's round 0); MODEL: take the global model;
    # TRAIN: train ``client`` and send its update; SETTLE: a header arrived, put back the ``dropped`` clients'
    # per-client state; PERSIST: publish this rank's per-client state of ``round`` in ``folder``; STOP: the run is over
    client: int = -1
    seed: int = 0
    steps: int | None = None  # the client's own local steps (fedcompass), else the config's
    personal: int = 0  # the seed of the client's personal-model training (train.ditto_lambda)
    dropped: tuple[int, ...] = ()  # SETTLE: the server's note of clients dropped past their deadline
    round: int = -1  # PERSIST, and MODEL: the round served (the members note it in the run directory)
    folder: str = ""  # PERSIST
    interrupted: bool = False  # STOP: the run stopped on request before its last round (protocol.Stop)
    # TRAIN: the error the config's faults give the client, which every rank then treats as refused: a 'raise' (the
    # client does not train, ``trains`` false) or a 'lose' (it trains, and its update is lost on the way)
    refused: str = ""
    trains: bool = True
    scale: tuple[float, ...] = ()  # TRAIN: the factors of the client's 'scale' faults, which every rank applies


class ShardedLeader:
    """The group's first rank: serves the server's rounds as a client rank does, for the whole group."""

    def __init__(self, comm: MPI.Comm, group: ShardedGroup, trainer: Trainer,  # noqa: PLR0913 - keyword-only, each from serve_sharded
                 local_data: Mapping[int, tuple[ClientData | None, ClientData | None]], *, seed: int,
                 accept_failures: bool, parallel: ShardedParallel, state: ShardedState | None,
                 faults: FaultPlan | None = None, note: Callable[[str, int], None] = lambda state, round_: None,
                 run_dir: Path | None = None):
        self.comm, self.group, self.trainer, self.local_data = comm, group, trainer, local_data
        self.seed, self.accept_failures, self.parallel, self.state = seed, accept_failures, parallel, state
        self.faults = faults  # the config's faults: all but scale and corrupt (the config checks)
        self.note = note  # this rank's notes in the run directory (mpifl status)
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.progress = ProgressReporter(comm)
        self.progress.attach(group.model.module)
        # the leader does every strike on the group's clients: the members learn of one only through the steps
        self.injector = FaultInjector(faults, comm.Get_rank(), self.progress.tick, lambda strike: note_fault_struck(
            run_dir, strike.index, strike.round, strike.fault.kind, strike.client, strike.rank)) if faults else None
        self.meter = CostMeter()
        self.first = True

    def order(self, step: GroupStep) -> None:
        """Tell the other ranks of the group what to do now."""
        for member in range(1, self.group.group.Get_size()):
            send_object(self.group.group, step, member, protocol.GROUP)

    def upload_initial(self) -> None:
        """The out-of-core server's round 0: the freshly built model, gathered chunk by chunk."""
        self.order(GroupStep(INIT))
        send_chunks(self.comm, [protocol.SERVER], protocol.INIT, self.group.gathered_chunks(values=True),
                    self.group.plan.inflight)

    def run(self) -> bool:
        """Serve rounds until the server says stop; then release the group. Whether the run stopped on request
        before its last round."""
        while True:
            header = recv_object(self.comm, protocol.SERVER, protocol.HEADER)
            if not isinstance(header, protocol.Header):
                raise RuntimeError(f"rank {self.rank}: the server sent {header!r} where a header belongs")
            if self.state is not None and self.state.journal is not None:  # before anything reads or publishes it
                self.order(GroupStep(SETTLE, dropped=tuple(header.dropped)))
                self.state.settle(header.dropped, self.rank)
            if isinstance(header, protocol.Stop):
                interrupted = header.interrupted
                break
            if isinstance(header, protocol.PersistOrder):
                self.persist(header)
                continue
            if type(header) is not protocol.RoundOrder:  # config checks refuse what would send anything else
                raise RuntimeError(f"rank {self.rank}: the server sent {header!r}, which a sharded client group "
                                   "cannot serve")
            self.note("round", header.round)
            self.progress.start_round(header.round)
            if header.clients:
                self.serve_round(header)
        self.order(GroupStep(STOP, interrupted=interrupted))
        self.progress.close()
        return interrupted

    def persist(self, header: protocol.PersistOrder) -> None:
        """Every rank of the group publishes its rows of its clients' vectors for the checkpoint; the leader
        acknowledges with all their files."""
        assert self.state is not None  # the server asks only with per-client state, which the group then keeps
        self.order(GroupStep(PERSIST, round=header.round, folder=header.folder))
        mine = self.state.persist(Path(header.folder), self.rank, header.round)
        names = self.group.group.gather(mine, root=0)
        send_object(self.comm, names, protocol.SERVER, protocol.RESIDUALS)

    def poison(self, round_: int, client: int) -> str | None:
        """A ``nan`` or ``inf`` fault on ``client`` in ``round_`` (the only kinds a sharded group takes): its value
        in the leader's first row of the trained model, after the client's per-client state was updated (as a
        divergence in what its rule does not read), so that the update is refused; the fault, named, or None."""
        for strike in self.faults.strikes(round_, client, self.comm.Get_rank()) if self.faults else []:
            if strike.fault.kind in ("nan", "inf"):
                log(f"faults[{strike.index}]: injecting {strike.fault.kind!r} into logical client {client} in round "
                    f"{round_} at stage 'train'", rank=self.rank)
                _, first = trainable(self.group.model.module)[0]
                with torch.no_grad():
                    own_rows(first.data).view(-1)[0] = float(strike.fault.kind)
                return f"faults[{strike.index}] ({strike.fault.kind!r})"
        return None

    def struck(self, round_: int, client: int) -> tuple[str, bool]:
        """The config's faults on ``client`` before it trains (stage 'train'): a stall, an exit or a kill is done
        here; a raise or a lost update is the client's error, which the group learns from its step. Returns the
        error ("" for none) and whether the client trains."""
        if self.injector is None:
            return "", True
        try:
            self.injector.before_training(round_, client)
        except InjectedFault as err:
            return f"{type(err).__name__}: {err}", False
        lost = self.injector.lost(round_, client)
        return (f"{type(lost).__name__}: {lost}", True) if lost is not None else ("", True)

    def serve_round(self, header: protocol.RoundOrder) -> None:
        """Take the global model with the group, then train and send each logical client in id order."""
        if self.injector is not None:
            self.injector.before_receive(header.round, header.clients)
        self.order(GroupStep(MODEL, round=header.round))
        self.group.take_model(receive_ring(self.comm, protocol.round_tag(protocol.MODEL, header.round), self.group))
        steps = dict(zip(header.clients, header.steps))
        own = self.trainer.cfg.local_steps if isinstance(self.trainer, ConfiguredTrainer) else None
        meta_tag, update_tag = (protocol.round_tag(kind, header.round) for kind in (protocol.META, protocol.UPDATE))
        for client in header.clients:
            began = time.perf_counter()
            refused, trains = self.struck(header.round, client)
            scale = self.injector.scale_factors(header.round, client) if self.injector is not None else ()
            step = GroupStep(TRAIN, client, client_seed(self.seed, header.round, client), steps.get(client, own),
                             personal=personal_seed(self.seed, header.round, client), refused=refused, trains=trains,
                             scale=scale)
            self.order(step)
            dispatched = time.perf_counter()
            result = train_client(self.group, self.trainer, self.local_data, step, round_=header.round,
                                  rank=self.rank, state=self.state)
            trained = time.perf_counter()
            if self.injector is not None and trains:
                self.injector.slow_down(header.round, client, trained - dispatched)
            injected = self.poison(header.round, client) if trains else None
            error = checked_update(self.group, step, self.accept_failures, self.rank, injected)
            if self.state is not None:
                self.state.checked(client, usable=error is None)
            metrics = {**result.metrics, **self.group.costs(self.meter),
                       "group_setup_seconds": self.parallel.setup_seconds if self.first else 0.0,
                       "group_dispatch_seconds": dispatched - began, "group_train_seconds": trained - dispatched}
            personal = self.state.personal if self.state is not None else None
            if trains and personal is not None and personal.diverged == client:  # named in the round's record
                metrics[PERSONAL_DIVERGED] = True
            self.first = False
            meta = protocol.UpdateMeta(client, result.num_samples, time.perf_counter() - began, metrics, error,
                                       result.local_steps)
            send_object(self.comm, meta, protocol.SERVER, meta_tag)
            residuals = self.state.residuals if self.state is not None else None
            chunks = self.group.update_chunks(client, header.round, residuals, usable=error is None)
            send_chunks(self.comm, [protocol.SERVER], update_tag,
                        self.struck_on_the_way(header.round, client, chunks, corrupt=error is None),
                        self.group.plan.inflight)

    def struck_on_the_way(self, round_: int, client: int, chunks: Iterator[np.ndarray],
                          corrupt: bool) -> Iterator[np.ndarray]:
        """``chunks``, each with the bits the config's ``corrupt`` faults flip in it (of a usable update: after
        every check, as on an unsharded rank), and the faults at stage 'send' done once the first has been handed
        to MPI (the members wait in the gather of the next)."""
        if self.injector is None:
            yield from chunks
            return
        strikes = self.injector.send_strikes(round_, client)
        total = sum(chunk.nbytes for chunk in self.group.plan.wire)
        flips = self.injector.flipped(round_, client, self.seed, total) if corrupt else []
        first = 0
        for index, chunk in enumerate(chunks):
            for bits in flips:
                flip_bits_in_chunk(chunk, first, bits)
            first += chunk.nbytes
            yield chunk
            if index == 0 and strikes:
                self.injector.act(strikes)


class ShardedMember:
    """A sharded group's other rank: do what the leader orders, with the group."""

    def __init__(self, group: ShardedGroup, trainer: Trainer,
                 local_data: Mapping[int, tuple[ClientData | None, ClientData | None]], *, accept_failures: bool,
                 state: ShardedState | None, note: Callable[[str, int], None] = lambda state, round_: None):
        self.group, self.trainer, self.local_data = group, trainer, local_data
        self.accept_failures, self.state, self.note = accept_failures, state, note
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.meter = CostMeter()

    def run(self) -> bool:
        """Follow the leader's steps until it says stop; whether the run stopped on request before its last
        round."""
        while True:
            step = recv_object(self.group.group, 0, protocol.GROUP)
            if not isinstance(step, GroupStep):
                raise RuntimeError(f"rank {self.rank}: the group's leader sent {step!r} where a GroupStep belongs")
            if step.kind == STOP:
                return step.interrupted
            if step.kind in (SETTLE, PERSIST):
                self.keep_state(step)
            elif step.kind == INIT:
                drain(self.group.gathered_chunks(values=True))
            elif step.kind == MODEL:
                self.note("round", step.round)
                self.group.take_model(None)
            else:
                train_client(self.group, self.trainer, self.local_data, step, round_=-1, rank=self.rank,
                             state=self.state)
                error = checked_update(self.group, step, self.accept_failures, self.rank)
                if self.state is not None:
                    self.state.checked(step.client, usable=error is None)
                self.group.costs(self.meter)
                residuals = self.state.residuals if self.state is not None else None
                drain(self.group.update_chunks(step.client, -1, residuals, usable=error is None))

    def keep_state(self, step: GroupStep) -> None:
        """SETTLE: put back the dropped clients' vectors; PERSIST: publish this rank's rows of its clients' vectors
        and hand the file's name to the leader."""
        assert self.state is not None  # the leader orders these only of a group that keeps per-client state
        if step.kind == SETTLE:
            self.state.settle(step.dropped, self.rank)
        else:
            self.group.group.gather(self.state.persist(Path(step.folder), self.rank, step.round), root=0)


def drain(chunks: Iterator[np.ndarray]) -> None:
    """Take part in a gathered stream whose chunks this rank does not send (a member's side)."""
    for _ in chunks:
        pass


def train_client(group: ShardedGroup, trainer: Trainer,
                 local_data: Mapping[int, tuple[ClientData | None, ClientData | None]], step: GroupStep, *,
                 round_: int, rank: int, state: ShardedState | None) -> TrainResult:
    """Every rank: train ``step.client`` with the group from the round's global model, inside its client half
    where the run keeps per-client state, which then keeps the client's new vector over this rank's rows."""
    group.start_client()
    if not step.trains:  # an injected raise: the client fails before it trains, on every rank alike
        return TrainResult(0, {})
    train, _ = local_data.get(step.client, (None, None))
    half = state.half if state is not None else None
    try:
        if state is not None and state.personal is not None:  # Ditto: v_i first, then w from the global model
            state.personal.train(step.client, group.model.module, train, step.personal)
        with local_steps(trainer, step.steps), entered(lambda: half.training(step.client), f"the client half "
                                                       f"{plugin_name(half)}, in training") \
                if half else contextlib.nullcontext():
            result = trainer.train(group.model.module, train, step.seed)
        problem = result_problem(trainer_name(trainer), result)
        if problem is not None:  # every rank of the group trained the same trainer: each ends here
            raise JobFailure(f"round {round_}: logical client {step.client} (rank {rank}, a rank of its sharded "
                             f"group): {problem} (a group cannot go on mid-collective, so the job ends)")
        for factor in step.scale:  # before the client half reads the trained model, as on an unsharded rank
            group.model.scale_update(factor)
        if state is not None and state.half is not None:
            with noted(f"the client half {plugin_name(state.half)}, in update"):
                state.half.update(step.client, result.local_steps or 0, state.weight(protocol.UpdateMeta(
                    step.client, result.num_samples, 0.0, dict(result.metrics), local_steps=result.local_steps)))
        return result
    except JobFailure:
        raise
    except Exception as err:
        when = f" in round {round_}" if round_ >= 0 else ""
        raise ClientFailure(f"logical client {step.client} failed{when} on rank {rank}, a rank of its sharded group "
                            f"(clients.sharding: fsdp): {type(err).__name__}: {err} (a group cannot go on "
                            "mid-collective, so the job ends)") from err


def checked_update(group: ShardedGroup, step: GroupStep, accept_failures: bool, rank: int,
                   injected: str | None = None) -> str | None:
    """Every rank: the update's NaN/Inf values over the group; the client's error under accept_failures, else the
    job ends on every rank of the group. ``injected``: the config's fault that put them there (the leader's). The
    error the config's faults gave the client in its step (``step.refused``) is its error as well: before the check
    where the client did not train (a raise), after it where it did (a lost update), as on an unsharded rank."""
    if step.refused and not step.trains:
        return refused_by_fault(step, accept_failures, rank)
    bad = group.nonfinite()
    if not bad:
        return refused_by_fault(step, accept_failures, rank) if step.refused else None
    error = f"update contains {bad} NaN/Inf values" + (f", put there by {injected}" if injected else "")
    if not accept_failures:
        advice = "drop such clients" if injected else \
            "if its training diverged, lower train.lr or set train.max_grad_norm, or drop such clients"
        raise JobFailure(f"logical client {step.client}, trained by the sharded group of rank {rank}: {error} "
                         f"(clients.accept_failures=false); {advice} with clients.accept_failures=true {IN_A_NEW_RUN}")
    return error


def refused_by_fault(step: GroupStep, accept_failures: bool, rank: int) -> str:
    """Every rank: the error an injected raise or loss gives ``step.client``; the job ends on every rank of the group
    without clients.accept_failures, as it ends on an unsharded rank."""
    if not accept_failures:
        raise JobFailure(f"logical client {step.client}, trained by the sharded group of rank {rank}, failed: "
                         f"{step.refused} (clients.accept_failures=false); drop such clients from their rounds with "
                         f"clients.accept_failures=true {IN_A_NEW_RUN}")
    return step.refused


def serve_sharded(federation: MPI.Comm | None, group_comm: MPI.Comm, cfg: Config, spec: ModelSpec,  # noqa: PLR0913 - keyword-only, each from the runner
                  plan: ExchangeLayout, local: Mapping[int, tuple[ClientData | None, ClientData | None]], *,
                  trainer: Trainer, upload_initial: bool, run_dir: Path | None, resume: ResumePoint | None,
                  note: Callable[[str, int], None] = lambda state, round_: None) -> bool:
    """Every rank of a sharded group (the leader with the ``federation``): join the group's process group, build
    this rank's shard of the model and its rows of the clients' state, then serve the rounds (the leader) or follow
    the leader (the others). Whether the run stopped on request before its last round."""
    rank, size = group_comm.Get_rank(), group_comm.Get_size()
    return_freed_memory()  # memory before speed: what sharding is for (mpifl.wire.memory says why)
    timeout = startup_limit([], spec.total_bytes)
    parallel = ShardedParallel(rank, size)
    device = resolve_device(cfg.train.device)
    if device.type == "cuda" and cfg.train.deterministic:
        use_deterministic_kernels()
    store, address = rendezvous_store(None, size, timeout) if rank == 0 else (None, None)
    address = group_comm.bcast(address, root=0)
    if rank != 0:
        store, _ = rendezvous_store(address, size, timeout)
    assert store is not None
    parallel.start(store, device, timeout)
    began = time.perf_counter()
    module = build_model(cfg.model, cfg.seed, streams=model_streams(cfg.client_rule))
    exchanged, _ = split_tensors(module, cfg.model.exchange == "trainable", cfg.model.local)
    if build_spec(exchanged).hash != spec.hash:
        raise RuntimeError(f"rank {MPI.COMM_WORLD.Get_rank()}: the model built for sharding differs from the "
                           "exchanged layout")
    streams = shard_buffers(module, CONTROL, size, rank) if hasattr(module, CONTROL) else []
    build_sharded(module, cfg.seed, parallel, device)
    if cfg.model.transformers.pretrained:
        assert cfg.model.transformers.path is not None  # config checks refuse pretrained without a path
        load_pretrained_rows(module, cfg.model.transformers.path, size, rank)
    parallel.setup_seconds += time.perf_counter() - began
    assert isinstance(trainer, (TorchTrainer, CausalLMTrainer))  # the config checks allow only these
    trainer.parallel = parallel
    model = ShardedModel(module, spec, plan, rank, size, cfg.strategy.update == "delta", cfg.statistics_as_values,
                         row_buffers=streams)
    tensors = tensors_by_name(module)
    rows = rows_of(model, [tensors[name] for name in streams], every_rank(group_comm))
    pieces = [model.widened_counts(index)[rank] for index in range(len(plan.chunks))]
    state = open_sharded_state(
        cfg, rows, pieces, (rank, size), MPI.COMM_WORLD.Get_rank(), sorted(local), run_dir, resume,
        make_strategy(cfg.strategy).weight_of,
        lambda store: ShardPersonalModels(rows, store, trainer, cfg.train.ditto_lambda, model.reset,
                                          cfg.train.grad_accum_steps))
    compressor = UpdateCompressor(plan, cfg.seed, whole=False) if plan.codec is not None and rank == 0 else None
    group = ShardedGroup(group_comm, model, plan, compressor)
    if federation is None:
        interrupted = ShardedMember(group, trainer, local, accept_failures=cfg.clients.accept_failures, state=state,
                                    note=note).run()
    else:
        if federation.Get_rank() == 1:
            log(f"client groups of {size} ranks shard each client's model with FSDP over "
                f"{parallel.backend}: this rank holds {format_bytes(model.held_bytes)} of the "
                f"{format_bytes(spec.total_bytes)} exchanged (built in {parallel.setup_seconds:.1f} s)", rank=1)
        leader = ShardedLeader(federation, group, trainer, local, seed=cfg.seed,
                               accept_failures=cfg.clients.accept_failures, parallel=parallel, state=state,
                               faults=FaultPlan(cfg, faults_struck(run_dir)) if cfg.faults else None, note=note,
                               run_dir=run_dir)
        if federation.Get_rank() == 1 and upload_initial and cfg.server.state == "disk":
            leader.upload_initial()
        interrupted = leader.run()
    parallel.close()
    return interrupted
