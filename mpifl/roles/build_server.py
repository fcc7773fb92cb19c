"""Building the server's parts and serving: the strategy, the store, the checkpointer, evaluation, trackers and the
straggler rule, then the round loop (``Server``); what the run came to (``RunOutcome``)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from mpi4py import MPI

from mpifl.aggregation.distances import DistanceRule
from mpifl.aggregation.floor import FloorRate
from mpifl.aggregation.strategies import Strategy, make_strategy
from mpifl.aggregation.updates import Mixing
from mpifl.clock.planners import clock_sampler, task_samples
from mpifl.config import Config, ConfigError
from mpifl.errors import InputRefused, JobFailure, noted
from mpifl.learning.datasets import (
    Dataset,
)
from mpifl.learning.device import (
    EvaluationCopy,
    resolve_device,
    use_deterministic_kernels,
)
from mpifl.learning.noise import score_over_levels
from mpifl.learning.partitions import split_validation
from mpifl.logs import log
from mpifl.metrics import JsonLines
from mpifl.planning.faults import FaultPlan
from mpifl.planning.federation import Sampler
from mpifl.privacy.dp import ServerPrivacy
from mpifl.privacy.secagg import RingSum, SecureAggregation, config_range_problem
from mpifl.roles.build_client import evaluator_for
from mpifl.roles.data import client_partition, keep_tokenizer, placement_of, report_partition
from mpifl.roles.launch import StopRequest
from mpifl.roles.records import fault_line, log_final, memory_warning_line, secagg_summary
from mpifl.roles.residuals import ResidualPublisher
from mpifl.roles.server import Evaluation, Server, ServerParts, stopped_on_request
from mpifl.storage.checkpointer import CHECKPOINTS, METRICS, Checkpointer, checkpoint_attrs, checkpoint_name
from mpifl.storage.hdf5 import Checkpoint
from mpifl.storage.notes import RankNotes
from mpifl.storage.rundir import (
    BUDGET_SPENT,
    ResumePoint,
    faults_struck,
    note_fault_struck,
    read_metrics,
)
from mpifl.storage.stores import GlobalStore, open_store
from mpifl.trackers import Trackers, open_trackers
from mpifl.units import MIB
from mpifl.wire import protocol
from mpifl.wire.flat import FlatModel
from mpifl.wire.late import DroppedClients
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.spec import ModelSpec
from mpifl.wire.transport import recv_chunks
from mpifl.wire.watchdog import RunDeadlines, StragglerRule


@dataclass(frozen=True)
class RunOutcome:
    """What rank 0 knows when the run ends: the metrics history, and whether a signal (SIGTERM: walltime, or the
    launcher cleaning up after a rank that left) stopped it before its last round (a run that a spent privacy
    budget ended is complete, not interrupted)."""

    history: list[dict]
    interrupted: bool


@dataclass(frozen=True)
class RoundsPlan:
    """What rank 0 settles before the ranks go on to round 1 (``plan_rounds``): the strategy bound to the model,
    and who trains in each round (and when, under virtual time), from the clients' partition, kept to be reported
    (None without data)."""

    strategy: Strategy
    sampler: Sampler
    partition: list | None = None


def plan_rounds(cfg: Config, spec: ModelSpec, plan: ExchangeLayout, flat: FlatModel | None,
                dataset: Dataset | None, client_ranks: int) -> RoundsPlan:
    """The strategy bound to the model and the rounds' sampler, from the clients' partition, which is made here
    first: what only the data read or the model built after MPI started can refuse (a split that cannot be made, a
    virtual-time schedule or a secure-aggregation range the clients' sizes rule out, an ``eval.device`` this rank
    does not see) is an InputRefused, which the runner shares with every rank before round 1 (an exit with status 2
    in one line, as a config error before MPI). What a client rank refuses of its own model and trainer is agreed on
    earlier, with the model (``runner._client_trainer``)."""
    parts = client_partition(cfg, dataset)
    strategy = _bound_strategy(cfg, spec, client_ranks)
    if dataset is not None and flat is not None:  # the rank that evaluates must see the device it evaluates on
        try:
            resolve_device(cfg.eval.device, "eval.device")
        except JobFailure as err:
            raise InputRefused(str(err)) from None
    try:
        sampler = _sampler(cfg, plan, strategy, parts, client_ranks)
    except ConfigError as err:
        raise InputRefused(f"config error: {err}") from None
    return RoundsPlan(strategy, sampler, parts)


def serve_as_server(comm: MPI.Comm, cfg: Config, plan: ExchangeLayout, flat: FlatModel | None,  # noqa: PLR0913 - the server's parts, each built once by the runner
                     dataset: Dataset | None, run_dir: Path | None, resume: ResumePoint | None,
                     resumed: Checkpoint | None, rounds: RoundsPlan, stop: StopRequest, notes: RankNotes,
                     floor: FloorRate | None = None) -> RunOutcome:
    """Serve as rank 0 until the last round or a stop: with the strategy and the sampler ``plan_rounds`` made, the
    global store (from the resumed checkpoint, or fresh), the checkpointer, evaluation, trackers and the straggler
    rule, then the rounds; what the run came to. Of the parts built here only the out-of-core store talks to a
    client rank before the rounds: a fresh run's initial model arrives from rank 1 (``store.start``), which never
    builds it on rank 0."""
    strategy, sampler = rounds.strategy, rounds.sampler
    if flat is None and run_dir is None:
        raise JobFailure("server.state='disk' needs a run directory for its HDF5 state")
    directory = run_dir / CHECKPOINTS if run_dir else None
    attrs = checkpoint_attrs(cfg)
    store = _global_store(cfg, plan, flat, directory, strategy)
    if dataset is not None and rounds.partition is not None and resume is None:
        report_partition(cfg, dataset, rounds.partition, run_dir)
    if dataset is not None:
        keep_tokenizer(dataset, run_dir)
    start, history = (resume.round, resume.metrics) if resume is not None else (0, [])
    store.start(resumed, cfg.model.init_from, {**attrs, "round": 0},
                lambda bufs: recv_chunks(comm, 1, protocol.INIT, bufs, plan.inflight))
    if cfg.model.local and cfg.eval.every:
        log(f"model.local {cfg.model.local}: the server evaluates the averaged tensors with the local ones as "
            "built; eval.federated_every measures each client with its own", rank=0)
    score = _score(cfg, flat, dataset) if dataset is not None and flat is not None else None
    chain = cfg.clients.groups > 0 and cfg.transport.reduce == "chain"  # a rank there waits on the one before it
    deadlines = RunDeadlines(cfg.timeouts, plan.chunk_bytes, plan.inflight, derive=not chain)
    dropped = DroppedClients()  # named in each rank's next header, a round's or a checkpoint's
    publisher = ResidualPublisher(comm, deadlines, dropped)
    checkpointer = _checkpointer(cfg, store, directory, attrs, sampler, publisher)
    if cfg.clock.asynchronous and directory and resume is None:  # version 0, for a resume that retrains from it
        checkpointer.round_ended(0, [], stopping=False)
    privacy = _server_privacy(cfg, history)
    # opened last, so that no setup error above leaves a tracker's run open (MLflow's RUNNING, W&B's unfinished)
    trackers = _trackers(cfg, run_dir, start, history, resume is not None)
    sink = JsonLines(run_dir / METRICS if run_dir else None, also=trackers)
    try:
        parts = ServerParts(plan=plan, sampler=sampler, strategy=strategy, store=store, checkpointer=checkpointer,
                            evaluation=Evaluation(score, cfg.eval.every, cfg.rounds), sink=sink, deadlines=deadlines,
                            privacy=privacy, note=notes, dropped=dropped, floor=floor,
                            **_configured_parts(cfg, run_dir))
        server = Server(comm, parts, cfg.transport, stop, cfg.output.progress, cfg.clients.min_participants)
        publisher.listen(server.heard)
        history = server.run(start, history, _wrap_up(cfg, run_dir, checkpointer, stop, notes))
    finally:
        sink.close()
    return RunOutcome(history, interrupted=stopped_on_request(history, cfg.rounds, stop, server.budget_spent))


def _bound_strategy(cfg: Config, spec: ModelSpec, client_ranks: int) -> Strategy:
    """The configured strategy bound to the model (a plug-in's error there names the strategy), with the warnings
    its choice calls for."""
    strategy = strategy_for(cfg)
    with noted(f"strategy.name {strategy.name!r}, in bind, before any round"):
        strategy.bind(spec, cfg.clients.num_clients)
    _warn_stacked_models(cfg, strategy, client_ranks)
    warn_statistics(cfg, spec)
    return strategy


def _global_store(cfg: Config, plan: ExchangeLayout, flat: FlatModel | None, directory: Path | None,
                  strategy: Strategy) -> GlobalStore:
    """The global model and the strategy's server state: in ``flat`` (memory) or, with ``flat`` None, window by
    window in the round's checkpoint under ``directory`` (server.state 'disk')."""
    if directory:
        directory.mkdir(parents=True, exist_ok=True)

    def path_of(round_: int) -> Path:
        # a store writes only with a directory: saves need one, and disk state without a run directory is refused
        assert directory is not None
        return directory / checkpoint_name(round_)

    return open_store(plan, flat, path_of, int(cfg.server.window_mb * MIB), strategy.state_init,
                      read_previous=strategy.needs_previous_global, map_windows=cfg.server.map_windows)


def _sampler(cfg: Config, plan: ExchangeLayout, strategy: Strategy, parts: list | None,
             client_ranks: int) -> Sampler:
    """Who trains in each round, and when under virtual time, from the clients' partition ``parts`` (None without
    data): their sizes count only where the placement, the clock or secure aggregation's range needs them. A config
    that the sizes rule out is a ConfigError naming the key."""
    needs_sizes = cfg.clients.placement != "round_robin" or cfg.clock.mode != "off" or cfg.secagg.enabled
    sized = parts if needs_sizes else None
    placement = placement_of(cfg, sized, client_ranks)
    sizes = [len(split_validation(p, cfg.data.val_fraction, cfg.seed, c)[0]) for c, p in enumerate(sized)] \
        if sized is not None else None
    _check_secagg_range(cfg, strategy, sizes)
    samples = task_samples(sizes, cfg.clients.num_clients, cfg.train.local_epochs, cfg.train.local_steps,
                           cfg.train.batch_size)
    try:
        return clock_sampler(cfg, placement, samples, plan.model_bytes, plan.update_bytes)
    except (ValueError, OSError) as err:  # a trace too short for the rounds: as validate says it
        raise ConfigError(f"cannot plan the virtual-time schedule: {err}") from None


def _checkpointer(cfg: Config, store: GlobalStore, directory: Path | None, attrs: dict, sampler: Sampler,
                  publisher: ResidualPublisher) -> Checkpointer:
    """The checkpointer; under a strategy whose clients keep state, its checkpoints also collect that state from
    the client ranks (``publisher``)."""
    kept = cfg.client_state()
    return Checkpointer(store, directory, cfg.checkpoint, cfg.rounds, attrs,
                        sampler.open_versions if cfg.clock.asynchronous and directory else None,
                        persist=publisher.publish if kept is not None else None,
                        persisted=kept.what if kept is not None else "per-client state")


def _server_privacy(cfg: Config, history: list[dict]) -> ServerPrivacy | None:
    """Differential privacy's server half (privacy.mode), with the epsilon the whole run will spend said once;
    None without DP. ``history``: the rounds a resume keeps, whose spending the accountant counts again."""
    if cfg.privacy.mode == "off":
        return None
    privacy = ServerPrivacy(cfg.privacy, cfg.seed, cfg.clients.num_clients, cfg.clients_per_round(), history)
    try:
        log(f"privacy: {cfg.privacy.mode} DP, noise multiplier {cfg.privacy.noise_multiplier}, clip "
            f"{privacy.clip:.4g}; epsilon after all {cfg.rounds} rounds {privacy.epsilon(cfg.rounds):.3f} "
            f"at delta {cfg.privacy.delta}", rank=0)
    except ImportError as err:
        raise JobFailure(str(err)) from None
    return privacy


def _configured_parts(cfg: Config, run_dir: Path | None) -> dict:
    """The server's parts and flags that follow from the config (and the run directory's record of faults struck)
    alone: secure aggregation, the straggler rule, the fault plan, the clock's and the per-client state's rules."""
    kept = cfg.client_state()
    return dict(secagg=SecureAggregation(cfg.secagg, cfg.seed) if cfg.secagg.enabled else None,
                stragglers=straggler_rule(cfg), lends_state=cfg.lends_client_state,
                faults=FaultPlan(cfg, faults_struck(run_dir)) if cfg.faults else None,
                spend_fault=lambda strike: note_fault_struck(
                    run_dir, strike.index, strike.round, strike.fault.kind, strike.client, strike.rank),
                virtual_clock=cfg.clock.mode != "off",
                keeps_below_quorum=cfg.clock.mode != "off" or cfg.clients.below_quorum == "keep",
                client_state=kept is not None,
                unrestorable_state=_unrestorable_state(cfg),
                restored_state=kept.restorable if kept is not None and cfg.undoes_dropped_state else "",
                kept_state=kept.lasting if kept is not None else "",
                personal=cfg.train.ditto_lambda > 0)


def _check_secagg_range(cfg: Config, strategy: Strategy, sizes: list[int] | None) -> None:
    """Secure aggregation's range for the largest client, known only now (``mpifl run`` reads no data before MPI
    starts; ``mpifl validate`` checks the same): a fraction_bits that cannot hold secagg.min_range is a ConfigError."""
    problem = config_range_problem(cfg, strategy, sizes)
    if problem:
        raise ConfigError(problem)


def _wrap_up(cfg: Config, run_dir: Path | None, checkpointer: Checkpointer, stop: StopRequest,
             notes: RankNotes) -> Callable[[list[dict], bool], None]:
    """What the server does once no round is left to run: link ``model.h5`` to the last round's checkpoint (the
    configured last round, or the one after which the privacy budget is spent), say so, and note the outcome.
    Before it takes up what dropped ranks still send (Server.run): a rank silent there ends the job, and the run
    directory must still say that every round is on disk. A rank silent while the last checkpoint collected
    per-client state ends it here, for the same reason once the run directory says so (Checkpointer.withheld)."""
    def wrap_up(done: list[dict], budget_spent: bool) -> None:
        reached = done[-1]["round"] if done else 0
        if run_dir and cfg.output.save_model and done and (reached == cfg.rounds or budget_spent):
            checkpointer.link_final_model(run_dir, reached)
        for line in secagg_summary(done, cfg.secagg) if cfg.secagg.enabled else ():
            log(line, rank=0)
        log_final(done, cfg.rounds, str(run_dir) if run_dir else "(no run directory)",
                  cfg.privacy.epsilon_budget if budget_spent else None)
        if budget_spent:
            notes("finished", reached, stopped=BUDGET_SPENT)
        else:
            notes("interrupted" if stopped_on_request(done, cfg.rounds, stop, budget_spent) else "finished", reached)
        if checkpointer.withheld:
            raise JobFailure(checkpointer.withheld)

    return wrap_up


def _unrestorable_state(cfg: Config) -> str:
    """The per-client state, as the logs name it, that must read as if a client of a round not applied had not
    trained and that the run cannot put back: SCAFFOLD's, FedDyn's or declared vectors without the journal of
    clients.accept_failures (``Config.undoes_dropped_state``); "" where there is none."""
    state = cfg.client_state()
    if state is None or not (state.rule or state.vectors) or cfg.undoes_dropped_state:
        return ""
    return state.what


def _trackers(cfg: Config, run_dir: Path | None, start: int, kept: list[dict], resumed: bool) -> list[Trackers]:
    """``output.trackers``, opened on rank 0 before the first round (none without a run directory to write in);
    ``kept``: the records a resume keeps, for the rounds a tracker lost when the job before was killed."""
    if not cfg.output.trackers or run_dir is None:
        return []
    if resumed:  # the rewound metrics.jsonl's records: the checkpoint's copy of its own round predates its timing
        kept = read_metrics(run_dir / METRICS) or kept
    return [open_trackers(cfg.output.trackers, run_dir, cfg.name, cfg.to_dict(), start, resumed,
                          notes=lambda record: {
                              "memory_warning": [memory_warning_line(w) for w in record.get("memory_warning", ())],
                              "faults": [fault_line(f) for f in record.get("faults", ())]},
                          warn=lambda message: log(message, rank=0), kept=kept)]


def _score(cfg: Config, flat: FlatModel, dataset: Dataset) -> Callable[[], dict]:
    """The server's held-out evaluation of the global model in ``flat``: on the CPU, in the host buffer itself, or on
    the server rank's GPU (``eval.device``), in a copy refreshed before each evaluation."""
    evaluate = evaluator_for(cfg)
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


def straggler_rule(cfg: Config) -> StragglerRule | None:
    """clients.accept_failures: when a rank still training is dropped from its round. Under a strategy whose
    clients keep state matched by the server's (Capabilities.client_state: SCAFFOLD's c_i and c, FedDyn's g_i and
    h), a dropped rank has already folded its clients' deltas into their state when it learns of the drop from
    its next header; that state is put back then, by the rank or, under per_round placement, by each client's home
    rank (storage.residuals.UndoJournal).

    None under virtual time (``clock.mode`` other than off): there the virtual clock decides who is a straggler,
    and a rank dropped for being slow on this machine would make the result depend on the machine. A rank silent
    past a wall-clock deadline then ends the job, named, as a hang; clients whose training raised are still
    dropped under accept_failures."""
    if not cfg.clients.accept_failures or cfg.clock.mode != "off":
        return None
    return StragglerRule(cfg.timeouts.straggler)


def strategy_for(cfg: Config) -> Strategy:
    """The configured strategy, with the stage a run mode replaces: FedAsync mixes each update in
    (``Mixing``); secure aggregation sums masked fixed-point updates in the ring (``RingSum``)."""
    strategy = make_strategy(cfg.strategy)
    if cfg.server.state == "disk" and isinstance(strategy.combiner, DistanceRule):
        strategy.combiner.ram_bytes = 0  # out of core: the round's kept updates go to a temporary file, never RAM
    if cfg.clock.mode != "fedasync" and not cfg.secagg.enabled:
        strategy.statistics_absolute = cfg.statistics_as_values
        return strategy
    twin = strategy.substituted(RingSum(cfg.strategy) if cfg.secagg.enabled else None,
                                Mixing(cfg.strategy) if cfg.clock.mode == "fedasync" else None)
    twin.statistics_absolute = cfg.statistics_as_values
    return twin


def _warn_stacked_models(cfg: Config, strategy: Strategy, client_ranks: int) -> None:
    said = stacked_models_warning(cfg, client_ranks) if strategy.stacked else None
    if said:
        log(said, rank=0)


def stacked_models_warning(cfg: Config, client_ranks: int) -> str | None:
    """A stacking strategy's participants per round (per server step: the updates a buffered clock applies at once)
    outnumbering the client ranks, so that the server stacks whole models; None where they do not."""
    clock = cfg.clock
    if clock.mode in ("fedbuff", "fedcompass"):
        most = clock.buffer if clock.mode == "fedbuff" else clock.in_flight()
        what = (f"{most} updates per server step (clock.buffer)" if clock.mode == "fedbuff" else
                f"up to {most} updates per server step (an arrival group, at most clock.concurrency)")
    else:
        most, what = cfg.clients_per_round(), f"{cfg.clients_per_round()} participants per round"
    if most <= client_ranks:
        return None
    return (f"strategy {cfg.strategy.name}: {what} on {client_ranks} client ranks: a rank's participants arrive one "
            "after another, so the server stacks every participant's whole model (participants x model x 4 bytes); "
            "one client rank per participant keeps it at participants x chunk")


def warn_statistics(cfg: Config, spec: ModelSpec) -> None:
    """DP noises every exchanged element, a BatchNorm's running variance too, which noise can take below zero (NaN
    evaluations): say so once, with the ways out."""
    names = [e.name for e in spec.entries if e.statistic]
    if names and cfg.privacy.mode != "off":
        log(f"privacy.mode {cfg.privacy.mode!r}: the model's statistics ({names[0]}"
            f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}) are clipped and noised with the rest, and "
            "a noised running variance can go below zero; a model with GroupNorm or LayerNorm, or model.local for "
            "its BatchNorm layers (FedBN), keeps them out of the noise", rank=0)


def open_checkpoint(path: Path, spec: ModelSpec) -> Checkpoint:
    """The checkpoint at ``path``, opened and checked to hold a model of ``spec`` (a ``CheckpointError`` if not)."""
    ckpt = Checkpoint(path)
    ckpt.check_spec(spec)
    return ckpt
