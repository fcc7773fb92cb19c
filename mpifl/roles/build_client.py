"""Building a client rank's parts and serving: the trainer, per-client state, privacy and groups, then the round loop
(``ClientRank``); and a client group's other ranks (``clients.ranks_per_client``)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from mpi4py import MPI
from torch import nn

from mpifl.aggregation.strategies import make_strategy
from mpifl.algorithms import client_algorithm, no_lanes
from mpifl.algorithms.contract import LaneCorrections
from mpifl.algorithms.ditto import GroupPersonalModels, PersonalModels
from mpifl.algorithms.local_layers import PersonalTensors
from mpifl.config import Config, ConfigError
from mpifl.errors import noted
from mpifl.learning.batched import batched_refusal
from mpifl.learning.device import (
    DeviceReplica,
    resolve_device,
    training_replica,
)
from mpifl.learning.models import state_sizes
from mpifl.learning.parallel import DataParallel
from mpifl.learning.trainers import CausalLMTrainer, Evaluator, TorchTrainer, Trainer, make_evaluator, make_trainer
from mpifl.logs import log
from mpifl.planning.faults import FaultPlan
from mpifl.privacy.dp import ClientPrivacy
from mpifl.privacy.secagg import SecureAggregation
from mpifl.roles.batched import BatchedClients
from mpifl.roles.client import ClientParts, ClientRank
from mpifl.roles.client_state import (
    ClientStateParts,
    DeclaredVectors,
    open_client_state,
    state_views,
)
from mpifl.roles.evaluation import FederatedEvaluation
from mpifl.roles.group import GroupLeader, GroupMember
from mpifl.roles.launch import startup_limit
from mpifl.roles.lending import StateLending
from mpifl.roles.local_training import TrainingParts
from mpifl.storage.notes import RankNotes
from mpifl.storage.residuals import (
    Borrowing,
    ResidualStore,
)
from mpifl.storage.rundir import ResumePoint, faults_struck, note_fault_struck
from mpifl.units import MIB
from mpifl.wire import protocol
from mpifl.wire.flat import FlatModel
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import reuse_freed_memory
from mpifl.wire.spec import ModelSpec, is_local
from mpifl.wire.transport import send_chunks


def rank_replica(cfg: Config, flat: FlatModel) -> DeviceReplica | None:
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


def rank_trainer(cfg: Config, module: nn.Module | None) -> Trainer:
    """The client rank's trainer, built once before the ranks agree on the model (``runner._agreed_model``), with
    its ``train.device`` and, under ``train.batched_clients``, its model (``check_batched``; None: a sharded rank's,
    built later) checked: a setting a plug-in trainer's constructor refuses (``train.kwargs``), a GPU this rank
    lacks or a model whose clients cannot train as lanes is then said once and ends every rank with exit status 2,
    before a byte of the model moved, instead of aborting the job from this rank as it starts training. A
    ConfigError or JobFailure naming the key."""
    resolve_device(cfg.train.device)
    if module is not None:  # batched_refusal is None while train.batched_clients is off
        check_batched(cfg, module)
    return make_trainer(cfg.train)


def client_state_parts(cfg: Config, plan: ExchangeLayout, flat: FlatModel, work: FlatModel, rank: int,
                       hosted: list[int], run_dir: Path | None, resume: ResumePoint | None) -> ClientStateParts:
    """The per-client state of the ``hosted`` clients (mpifl.config.client_state), opened, reloaded on a resume,
    and the rules that act on the model that trains (``work``: the host model or its device replica)."""
    kinds = cfg.client_state()
    if kinds is None:
        return ClientStateParts()
    layout = kinds.layout(state_sizes(plan, flat))
    kept = open_client_state(cfg, layout, rank, hosted, run_dir, resume)
    # per_round: each client's state is lent, for the round, to the rank that trains it
    store: ResidualStore = Borrowing(kept) if cfg.lends_client_state else kept
    views = state_views(cfg, layout, store)
    parts = ClientStateParts(store, views)
    algorithm = client_algorithm(cfg.client_rule)
    if views.rule is not None and algorithm is not None:
        with noted(f"the client half {cfg.client_rule!r}, building it: leader(work, store, cfg)"):
            parts.controls = algorithm.leader(work, views.rule, cfg)
        parts.controls_state = algorithm.state
    if views.local is not None:
        parts.personal = PersonalTensors(work, views.local, marked=views.local_marked)
    if views.personal is not None:
        parts.models = PersonalModels(work, plan.chunks, views.personal, make_trainer(cfg.train),
                                      cfg.train.ditto_lambda, with_local=bool(cfg.model.local),
                                      backwards_per_step=cfg.train.grad_accum_steps,
                                      deferred=cfg.clients.accept_failures)
    if kinds.vectors:
        parts.declared = DeclaredVectors(work, kinds.vectors, views.vectors)
    return parts


def serve_as_client(comm: MPI.Comm, cfg: Config, plan: ExchangeLayout, flat: FlatModel, local: Mapping, *,  # noqa: PLR0913 - keyword-only parts, each built once by the runner
                    trainer: Trainer, upload_initial: bool, replica: DeviceReplica | None, state: ClientStateParts,
                    note: RankNotes, group: MPI.Comm | None, classes: int = 0) -> None:
    """Serve as a client rank (a group's leader with ``group``) until the server says stop: upload the fresh model
    for an out-of-core server, build the rank's parts around its ``trainer`` (``rank_trainer``), run the round
    loop."""
    if comm.Get_rank() == 1 and flat.frozen_spec.entries:
        log(f"exchanging {len(plan.spec.entries)} tensors ({plan.spec.total_bytes / MIB:.1f} MiB); "
            f"{kept_tensors_note(flat.frozen_spec, cfg.model.local)}", rank=1)
    if comm.Get_rank() == 1 and upload_initial and cfg.server.state == "disk" and not cfg.model.init_from:
        assert flat.bytes is not None  # a client rank's model is built in host memory (build_flat_model)
        send_chunks(comm, [protocol.SERVER], protocol.INIT, plan.chunk_slices(flat.bytes), plan.inflight)
    federated = cfg.eval.federated_every > 0
    leader = None
    if group is not None:  # clients.ranks_per_client > 1: this rank leads its group
        parallel = _parallel(trainer, group)
        leader = GroupLeader(group, parallel, replica.flat if replica else flat, _group_timeout(flat))
        if state.models is not None:  # Ditto: the personal model trains with the group too
            assert isinstance(state.models.trainer, (TorchTrainer, CausalLMTrainer))  # the config checks'
            state.models.trainer.parallel = parallel
            state.models.starting = leader.dispatch_personal
    if isinstance(state.store, Borrowing):
        state.lending = StateLending(comm, state.store, state.journal)
    training = TrainingParts(
        trainer=trainer, seed=cfg.seed, num_clients=cfg.clients.num_clients,
        accept_failures=cfg.clients.accept_failures, group=leader,
        batched=batched_clients(cfg, replica.flat if replica else flat, local, state),
        faults=FaultPlan(cfg, faults_struck(note.run_dir)) if cfg.faults else None,
        spend_fault=lambda strike: note_fault_struck(note.run_dir, strike.index, strike.round,
                                                     strike.fault.kind, strike.client, strike.rank),
        classes=classes)
    parts = ClientParts(
        plan=plan, training=training, delta=cfg.strategy.update == "delta",
        statistics_as_values=cfg.statistics_as_values, groups=cfg.clients.groups,
        weight=make_strategy(cfg.strategy).weight_of, replica=replica,
        evaluation=FederatedEvaluation(evaluator_for(cfg) if federated else None, cfg.eval.federated_every,
                                       cfg.rounds),
        privacy=ClientPrivacy(cfg.privacy, cfg.seed) if cfg.privacy.mode != "off" else None,
        secagg=SecureAggregation(cfg.secagg, cfg.seed) if cfg.secagg.enabled else None,
        state=state, note=note)
    client = ClientRank(comm, flat, local, parts)
    _reuse_freed_memory(cfg)
    interrupted = client.run()
    if leader is not None:
        leader.release(interrupted)


def batched_clients(cfg: Config, work: FlatModel, local: Mapping, state: ClientStateParts) -> BatchedClients | None:
    """``train.batched_clients``: the rank's batches, or None (the model was checked for lanes with the trainer:
    ``rank_trainer``); a strategy whose client half has no correction a lane can take is refused."""
    if not cfg.train.batched_clients:
        return None
    controls = state.controls
    if controls is not None and not isinstance(controls, LaneCorrections):  # the config checks allow SCAFFOLD
        raise ConfigError(no_lanes(type(controls).__name__))  # an undeclared type (lanes_problem)
    return BatchedClients(cfg.train, cfg.seed, local, controls.correction if controls is not None else None)


def check_batched(cfg: Config, module: nn.Module) -> None:
    """``train.batched_clients`` with a model whose clients cannot train as lanes of one batch (``batched_problem``:
    running statistics, dropout, ...): a ConfigError naming the key and the module. Each client rank checks the
    model it built before the ranks agree on it (``rank_trainer``)."""
    problem = batched_refusal(module, cfg.train)
    if problem is not None:
        raise ConfigError(problem)


def serve_as_member(group: MPI.Comm, cfg: Config, flat: FlatModel, local: Mapping, trainer: Trainer,
                    notes: RankNotes) -> None:
    """A group's other rank (clients.ranks_per_client): train what the leader orders, with the group, on the
    device the leader trains on, with its ``trainer`` (``rank_trainer``)."""
    replica = rank_replica(cfg, flat)
    work = replica.flat if replica else flat
    parallel = _parallel(trainer, group)
    algorithm = client_algorithm(cfg.client_rule)
    with noted(f"the client half {cfg.client_rule!r}, building it: member(work, cfg)"):
        state = algorithm.member(work, cfg) if algorithm is not None else None
    personal = GroupPersonalModels(work, cfg.train.ditto_lambda, cfg.train.grad_accum_steps) \
        if cfg.train.ditto_lambda else None
    member = GroupMember(group, parallel, work, trainer, local, _group_timeout(flat), state, personal, notes)
    _reuse_freed_memory(cfg)
    notes("interrupted" if member.run() else "finished")


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


def evaluator_for(cfg: Config) -> Evaluator:
    """The held-out scorer: perplexity for transformers LMs, accuracy and the training loss otherwise."""
    return make_evaluator(cfg.eval, cfg.train.loss, language_model=cfg.model.name == "transformers")
