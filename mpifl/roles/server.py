"""Rank 0: sample, stream the global model out, reduce updates as they stream back."""
from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
from mpi4py import MPI
from tqdm import tqdm

from mpifl.aggregation.floor import FloorRate
from mpifl.aggregation.reduction import (
    Dropping,
    ReceivePool,
    ReductionRound,
    ReductionStats,
    RoundAborted,
    StreamedReduction,
)
from mpifl.aggregation.strategies import Strategy
from mpifl.aggregation.updates import Mixing
from mpifl.config import TransportConfig
from mpifl.errors import INTERRUPTED, JobFailure, noted
from mpifl.logs import log, world_rank
from mpifl.metrics import CostMeter, JsonLines, current_rss_bytes, peak_rss_bytes
from mpifl.planning.faults import CHANGES_PAST_THE_CHECK, FaultPlan, Strike
from mpifl.planning.federation import RoundAssignment, Sampler, state_home, state_loans
from mpifl.planning.pools import PoolLayout, PoolShape, holds_stacks, pool_layout
from mpifl.planning.routes import RoundRoutes
from mpifl.privacy.dp import ServerPrivacy
from mpifl.privacy.secagg import SecureAggregation
from mpifl.roles.launch import StopRequest
from mpifl.roles.records import (
    RoundTimes,
    client_metrics,
    cost_to_date,
    divergence_line,
    dropped_entries,
    fault_entries,
    federated_evaluation,
    group_split,
    note_memory_growth,
    note_secagg,
    personal_diverged,
    plus_late,
    plus_server,
    rank_costs,
    resume_advice,
    round_cost,
    round_strikes,
    secagg_record,
    stalled_by,
    strike_line,
    strike_lines,
    summary,
)
from mpifl.storage.checkpointer import Checkpointer, StateWithheld
from mpifl.storage.hdf5 import Checkpoint
from mpifl.storage.stores import GlobalStore
from mpifl.units import MIB, range_list
from mpifl.wire import protocol
from mpifl.wire.late import DroppedClients, LateStreams, OwedStream
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.transport import ProgressInbox, send_chunks, send_windows, wait_all
from mpifl.wire.watchdog import RankStalled, RunDeadlines, StragglerRule, Watchdog


@dataclass
class Evaluation:
    """Held-out evaluation of the global model every ``every`` rounds and after the last."""

    score: Callable[[], dict] | None
    every: int
    rounds: int

    def __call__(self, round_: int, last: bool = False) -> dict | None:
        """The scores when due this round, else None; ``last``: the round is the run's last though not round
        ``rounds`` (a spent privacy budget ends the run there), and is evaluated as any last round is."""
        if self.score is None or self.every == 0 or (round_ % self.every and round_ != self.rounds and not last):
            return None
        return self.score()


def stopped_on_request(history: list[dict], rounds: int, stop: StopRequest, budget_spent: bool) -> bool:
    """Whether a stop on request (SIGTERM) ended the run before its last round; one that a spent privacy budget
    ended is complete, not stopped."""
    return stop.requested and not budget_spent and (history[-1]["round"] if history else 0) < rounds


@dataclass
class ServerParts:
    """What the round loop works with, each part built from its own config section."""

    plan: ExchangeLayout
    sampler: Sampler
    strategy: Strategy
    store: GlobalStore
    checkpointer: Checkpointer
    evaluation: Evaluation
    sink: JsonLines
    deadlines: RunDeadlines  # shared with whatever else waits on ranks (the residual publisher)
    note: Callable[..., None] = lambda state, round_=None, **detail: None  # rank 0's notes in the run directory
    lends_state: bool = False  # per-client state under per_round placement: headers name each round's loans
    privacy: ServerPrivacy | None = None  # DP-FedAvg: clip bound, noise, epsilon and budget
    secagg: SecureAggregation | None = None  # secure aggregation: unmask each chunk's ring sum
    stragglers: StragglerRule | None = None  # clients.accept_failures: when a rank still training is dropped
    # the clients dropped past their deadline, named in each rank's next header (shared with the residual publisher)
    dropped: DroppedClients = field(default_factory=DroppedClients)
    floor: FloorRate | None = None  # transport.floor_probe_mb: the raw-MPI floor's rates, for each record's 'exchange'
    faults: FaultPlan | None = None  # the config's faults: each round's strikes, recorded with what came of them
    # records, before the job ends, a strike that ended it (the run directory's faults-struck): a resume goes past it
    spend_fault: Callable[[Strike], None] = lambda strike: None
    virtual_clock: bool = False  # clock.mode other than off
    # clock.mode other than off, or clients.below_quorum='keep': too few usable updates leave the model unchanged
    keeps_below_quorum: bool = False
    client_state: bool = False  # per-client state: refused or failed clients named in their ranks' next headers
    # the per-client state, as the logs name it, that usable clients moved on and the run cannot put back: a round
    # with usable updates, too few, aborts
    unrestorable_state: str = ""
    restored_state: str = ""  # the per-client state a put-back restores (clients.accept_failures' journal)
    kept_state: str = ""  # the per-client state a client keeps from a round that does not apply its update: its own
    personal: bool = False  # train.ditto_lambda: each record names the clients whose personal model diverged


class Server:
    """Runs the rounds: sample, dispatch, reduce, evaluate, record; the checkpointer saves."""

    def __init__(self, comm: MPI.Comm, parts: ServerParts, transport: TransportConfig, stop: StopRequest,
                 progress: bool = True, min_participants: int = 1):
        self.comm, self.parts, self.transport, self.stop = comm, parts, transport, stop
        self.progress, self.min_participants = progress, min_participants
        self.rounds = parts.evaluation.rounds
        rows = parts.sampler.per_round if parts.strategy.stacked else 1
        self.pool = ReceivePool(PoolShape.of(parts.plan, rows))
        self.history: list[dict] = []
        self.rounds_here = 0  # rounds this process has run (not counting the ones a resume read back)
        self.budget_spent = False  # privacy.epsilon_budget ended the run early
        self.inbox = ProgressInbox(comm)  # the training ranks' progress reports, for the watchdogs
        # what ranks dropped from a round still send, taken up while later rounds run
        self.late = LateStreams(comm, parts.plan.inflight, self.pool.chunk_bytes, lambda m: log(m, rank=0))
        self.meter = CostMeter()  # the server's CPU-seconds and bytes written, read as each round's record is made

    def run(self, start_round: int = 0, history: Sequence[dict] = (),
            wrap_up: Callable[[list[dict], bool], None] | None = None) -> list[dict]:
        """Rounds start_round+1.. until the last, a spent privacy budget or a SIGTERM, then tell the clients to
        stop. ``wrap_up`` is given the history, and whether the privacy budget is spent, once no round is left to
        run, before what dropped ranks still send is taken up: a rank silent there ends the job, and the run
        directory must by then say how far the run got (``model.h5``, the notes)."""
        self.history = list(history)
        for record in self.history:
            self.parts.deadlines.observe(record["client_train_seconds"])
        self._replay(start_round)
        private = self.parts.privacy
        if private and start_round < self.rounds and private.exhausted(start_round + 1):
            log(f"privacy.epsilon_budget: round {start_round + 1} would take epsilon to "
                f"{private.epsilon(start_round + 1):.3f}, past {private.cfg.epsilon_budget}: the budget is spent, "
                "nothing to run", rank=0)
            self.budget_spent = True
            if wrap_up is not None:
                wrap_up(self.history, True)
            self._send_stop()
            return self.history
        bar = tqdm(total=self.rounds, initial=start_round, desc="[rank 0] rounds", leave=False,
                   disable=not (self.progress and sys.stderr.isatty()), dynamic_ncols=True)
        try:
            for round_ in range(start_round + 1, self.rounds + 1):
                self.parts.note("round", round_)
                record, stopping = self.round(round_)
                self.parts.sink.write(record)
                bar.update(1)
                if "eval" in record or "federated_eval" in record:
                    bar.write(f"[rank 0] round {round_}/{self.rounds}: " + summary(record))
                if stopping and round_ < self.rounds:
                    if not self.budget_spent:
                        log(f"SIGTERM: stopped after round {round_} with a checkpoint; continue with --resume", rank=0)
                    break
        finally:
            bar.close()
        if wrap_up is not None:
            wrap_up(self.history, self.budget_spent)
        deadlines = self.parts.deadlines.current()
        self.late.finish(deadlines.first_update, heard=self.heard, stop_requested=lambda: self.stop.requested,
                         grace=deadlines.sigterm_grace)
        self._send_stop()
        self.inbox()  # the last progress reports: received, not left behind at MPI_Finalize
        return self.history

    def heard(self) -> list[int]:
        """The ranks heard from since the last call: progress reports, and chunks of dropped ranks' late streams."""
        reported = self.inbox()
        self.late.note(reported)
        return reported + self.late()

    def round(self, round_: int) -> tuple[dict, bool]:
        """One round, top to bottom; also says whether a SIGTERM made it the last (it then checkpointed)."""
        parts, start = self.parts, time.perf_counter()
        plan = self._without_busy(parts.sampler.plan(round_))
        strikes, spent = self._strikes(round_, plan)
        with noted(f"round {round_}: strategy.name {parts.strategy.name!r}, in begin_round"):
            parts.strategy.begin_round(round_, len(plan.participants))
        routes = RoundRoutes.of(plan, self.transport, parts.plan.grouped)
        self._send_headers(plan, routes)
        watchdog = Watchdog(parts.deadlines.current(), round_, {**plan.train, **plan.streams},
                            lambda: self.stop.requested, heard=self.heard)
        self._dispatch(plan, routes, watchdog, strikes)
        dispatched = time.perf_counter()
        with noted(f"round {round_}: strategy.name {parts.strategy.name!r}, in the server's reduction"):
            stats = self._reduce(plan, routes, watchdog, started=dict(watchdog.last), strikes=strikes)
        if stats.nonfinite:
            self._poisoned(round_, strikes, stats.nonfinite)
        self._put_back_refused(plan, stats)
        reduced = time.perf_counter()
        last_by_budget = self._last_by_budget(round_)
        evaluation = parts.evaluation(round_, last=last_by_budget)
        evaluated = time.perf_counter()
        work = self._work_by_rank(plan, stats.metas)
        trained = max((w["train_seconds"] for w in work.values()), default=0.0)
        times = RoundTimes(start, dispatched, stats.first_arrival or dispatched, reduced, evaluated, evaluated,
                           evaluated, stats.aggregate_seconds, trained, stats.last_drop)
        record = self._record(plan, routes, stats.metas, evaluation, times, work)
        record.update(self._left_out(plan, stats))
        record.update(self._personal(round_, stats.metas))
        record["cost"] = round_cost(self.meter.since_last(), work, record["bytes_sent"] + record["bytes_received"])
        late = rank_costs(self.late.take_discarded())
        if late:
            record["cost"] = plus_late(record["cost"], late)
        before = self.history[-1].get("cost_to_date") if self.history else None
        record["cost_to_date"] = cost_to_date(before, record["cost"])
        record.update(self._safeguards(round_, plan, stats, strikes, spent))
        self.history.append(record)
        self._learn_from(plan, record)
        stopping = self.stop.requested  # read once: a later SIGTERM is handled after the next round
        if last_by_budget:
            self._spend_budget(round_, record)
            stopping = True
        try:
            parts.checkpointer.round_ended(round_, self.history, stopping)
        except StateWithheld as silent:  # the config's stall on that rank, if one kept it silent, strikes again
            why, advice = stalled_by(strikes, silent.ranks[0])
            raise JobFailure(f"{silent}{why}; {advice}") from None
        times.checkpointed = times.end = time.perf_counter()
        # the checkpoint's copy stops before saving; the JSON line has it all: the time split, and what saving cost
        record["time"].update(times.split())
        saving = self.meter.since_last()
        record["cost"] = plus_server(record["cost"], saving)
        record["cost_to_date"] = cost_to_date(before, record["cost"])  # the round's keys, so the rounds sum to it
        return record, stopping

    def _strikes(self, round_: int, plan: RoundAssignment) -> tuple[list[Strike], list[Strike]]:
        """The faults (``faults:``) that strike this round, and those a resumed run's record says already struck
        and that are therefore spent; each logged as it is decided."""
        faults = self.parts.faults
        if faults is None:
            return [], []
        strikes = round_strikes(faults, plan, self.parts.sampler.rank_of)
        spent = round_strikes(faults, plan, self.parts.sampler.rank_of, spent=True) if faults.spent else []
        for strike in spent:
            log(strike_line(strike, spent=True, recorded=faults.spent.get((strike.index, round_)) is not None),
                rank=0)
        for line in strike_lines(strikes):
            log(line, rank=0)
        return strikes, spent

    def _safeguards(self, round_: int, plan: RoundAssignment, stats: ReductionStats, strikes: list[Strike],
                    spent: list[Strike]) -> dict:
        """The round's record of what struck it and what guarded it: the faults and the strategy's rejections,
        the privacy accountant's spending, secure aggregation's cohort."""
        parts = self.parts
        record: dict[str, object] = {}
        if strikes or spent:
            record["faults"] = fault_entries(strikes, plan, stats.metas, spent, stats.unapplied,
                                             parts.strategy.round_rejected() or ())
        if parts.privacy:
            record["privacy"] = parts.privacy.after_round(round_, stats.metas)
        if parts.secagg:
            record["secagg"] = secagg_record(stats.metas, len(plan.participants), parts.secagg.cfg.fraction_bits,
                                             parts.strategy.weight_of, plan.withheld)
        return record

    def _learn_from(self, plan: RoundAssignment, record: dict) -> None:
        """What the run learns from a recorded round: memory growth and secure aggregation's notices, the
        derived deadlines, and (after the first round here, whose clients pay one-time costs: torch's lazy
        imports, first touches) each rank's training speed for the placement."""
        parts = self.parts
        note_memory_growth(self.history)
        if parts.secagg:
            note_secagg(self.history, parts.secagg.cfg)
        parts.deadlines.observe(record["client_train_seconds"])
        self.rounds_here += 1
        if self.rounds_here > 1:
            seconds = {int(rank): work["train_seconds"] for rank, work in record["ranks"].items()}
            parts.sampler.placement.observe(plan.train, seconds)

    def _dispatch(self, plan: RoundAssignment, routes: RoundRoutes, watchdog: Watchdog,
                  strikes: Sequence[Strike] = ()) -> None:
        """Stream the global model to the ranks that train this round (or to the tree's first level); ranks still
        finishing a round they were dropped from get it last, so they hold nobody else up (``strikes``: the round's
        faults, named where one stalls a rank past its deadline)."""
        dests = routes.model_dests
        late = [r for r in dests if self.late.owes(r)] if routes.tree is None else []
        tag = protocol.round_tag(protocol.MODEL, plan.round)
        try:
            for batch in ([r for r in dests if r not in late], late):
                if batch:
                    send_windows(self.comm, batch, tag, self.parts.store.outgoing(), self.parts.plan.inflight,
                                 watchdog)
        except RankStalled as stalled:
            self._give_up(plan.round, stalled, model_intact=True, strikes=strikes)

    def _dropping(self, plan: RoundAssignment, routes: RoundRoutes, started: dict[int, float]) -> Dropping | None:
        """clients.accept_failures: how a rank past its deadline is dropped from this round (not from an
        asynchronous step, whose held updates are already trained, nor from a chain, where ranks wait on
        each other)."""
        rule = self.parts.stragglers
        if rule is None or plan.hold or routes.chain:
            return None

        def began(rank: int) -> float | None:
            # an eager send completes before the rank takes the model up: a rank finishing a dropped round starts
            # when its late stream is in
            if self.late.owes(rank):
                return None
            return max(started.get(rank, 0.0), self.late.finished.get(rank, 0.0)) or None

        def owe(owed: OwedStream) -> None:
            self.late.add(owed)
            self.parts.dropped.note(owed, self._state_home())

        return Dropping(rule, began, functools.partial(self.parts.sampler.stream_members, plan), owe)

    def _put_back_refused(self, plan: RoundAssignment, stats: ReductionStats) -> None:
        """Per-client state: note every participant whose update was refused or failed (its header's error) as
        dropped, so that the rank that trained it (and, under per_round placement, its home) puts its journaled state
        back before anything reads, lends or publishes it, as if it had not been sampled. A rule keeps its client's
        vector before the update's NaN/Inf check: SCAFFOLD's c_i or FedDyn's g_i had moved on where only what the
        rule does not read went non-finite (a BatchNorm's running variance, a fault's NaN there)."""
        if not self.parts.client_state:
            return
        self._put_back(plan, sorted(c for c, m in stats.metas.items() if m.error is not None))

    def _put_back(self, plan: RoundAssignment, clients: list[int]) -> None:
        """Name ``clients`` as dropped in the next header of the rank that trained each (and of its home)."""
        for client in clients:
            self.parts.dropped.add(self._rank_of(plan, client), (client,), self._state_home())

    def _left_out(self, plan: RoundAssignment, stats: ReductionStats) -> dict:
        """A round not applied (a virtual clock): why, for its record, and under per-client state what became of the
        usable clients' state. Those whose journaled vectors are put back (``state_put_back``) are noted as dropped,
        so that the rank that trained each (and, under per_round placement, its home) puts them back before
        anything reads, lends or publishes them, as if it had not been sampled (the failed ones are noted as every
        refused update is: ``_put_back_refused``). Their residuals, local tensors and personal models stay as
        their training left them (``state_kept``), as a client's dropped past its deadline do."""
        if stats.unapplied is None:
            return {}
        parts = self.parts
        record: dict = {"unapplied": stats.unapplied}
        usable = sorted(c for c, m in stats.metas.items() if m.error is None)
        if not usable or not (parts.restored_state or parts.kept_state):  # nothing of theirs to put back or keep
            return record
        said = []
        if parts.restored_state:
            self._put_back(plan, usable)
            record["state_put_back"] = usable
            said.append(f"put back as if not sampled: {parts.restored_state}")
        if parts.kept_state:
            record["state_kept"] = usable
            said.append(f"kept as this round's training left them, as a client's dropped past its deadline are: "
                        f"{parts.kept_state}")
        who = f"logical client {usable[0]}" if len(usable) == 1 else f"logical clients {range_list(usable)}"
        log(f"round {plan.round}: {who} sent usable updates to a round not applied; {'; '.join(said)}", rank=0)
        return record

    def _without_busy(self, plan: RoundAssignment) -> RoundAssignment:
        """clients.accept_failures: ``plan`` without the ranks still training a round they were dropped from, which
        nobody waits for (a rank silent too long is retired: wire.late.LateStreams.busy)."""
        busy = self.late.busy(plan.round, self.parts.deadlines.current().first_update)
        if not busy:
            return plan
        plan = self.parts.sampler.without_busy(plan, busy, self._state_home(),
                                               max(1, self.min_participants, self._min_cohort()))
        if not plan.busy_ranks:
            log(f"round {plan.round}: ranks {range_list([world_rank(r) for r in busy])} are still training rounds "
                "they were dropped from, and without them no rank or too few participants (clients.min_participants, "
                "secagg.min_cohort) would be left: this round waits for them", rank=0)
        for rank, since in sorted(plan.busy_ranks.items()):
            left = [c for c, r in sorted(plan.busy_clients.items()) if r == rank]
            what = f"logical clients {range_list(left)} left out of it as if not sampled" if left else "nothing to do"
            log(f"round {plan.round}: rank {world_rank(rank)} is still training round {since}, from which it was "
                f"dropped: {what}, not waited for", rank=0)
        return plan

    def _min_cohort(self) -> int:
        """secagg.min_cohort under secure aggregation (fewer usable updates abort the round), else 1."""
        return self.parts.secagg.cfg.min_cohort if self.parts.secagg else 1

    def _state_home(self) -> Callable[[int], int] | None:
        """Where each client's per-client state is kept, when it is lent to the rank that trains the client
        (``clients.placement: per_round``); else None."""
        client_ranks = self.comm.Get_size() - 1
        return (lambda c: state_home(c, client_ranks)) if self.parts.lends_state else None

    def _reduce(self, plan: RoundAssignment, routes: RoundRoutes, watchdog: Watchdog,
                started: dict[int, float], strikes: Sequence[Strike] = ()) -> ReductionStats:
        """Fold the round's updates into the global model as they stream in; the store writes finished chunks.
        ``started``: when each rank took up the model (its straggler clock starts there); ``strikes``: the faults
        that strike this round, named where they make a round abort again on a resume."""
        parts, round_ = self.parts, plan.round
        parts.store.begin_round(round_, parts.checkpointer.recyclable(round_))
        if plan.mixing is not None:
            update = parts.strategy.update
            if not isinstance(update, Mixing):  # fedasync runs substitute Mixing (roles.build_server.strategy_for)
                raise TypeError(f"round {round_} mixes its update in (fedasync), but the strategy's server "
                                f"update is {type(update).__name__}, not Mixing")
            update.alpha = plan.mixing
        private = parts.privacy
        noise = private.noise(round_) if private else None
        streams = routes.streams
        task = ReductionRound(
            round_, streams, self._pool_layout(streams, summed=noise is not None or parts.secagg is not None),
            order=plan.order, weights=plan.weights, divisor=private.divisor if private else plan.divisor, noise=noise,
            unmask=parts.secagg.unmask(round_, plan.participants) if parts.secagg else None, labels=routes.labels,
            min_participants=self.min_participants, min_cohort=self._min_cohort(),
            header_clients=routes.header_clients, keep_model=parts.keeps_below_quorum,
            unrestorable_state=bool(parts.unrestorable_state))
        reduction = StreamedReduction(self.comm, parts.store, parts.plan, parts.strategy, self.pool, task,
                                      watchdog=watchdog, dropping=self._dropping(plan, routes, started))
        try:
            if plan.streams:
                stats = reduction.run()
            else:  # nobody this round: unchanged, but DP noise still moves the model
                stats = reduction.run_without_updates() if noise else ReductionStats()
        except RoundAborted as aborted:  # a config's rule (min_participants, min_cohort), not a crash: no traceback
            self._log_drops(plan, reduction.stats.metas)
            saved = parts.checkpointer.round_aborted(round_, self.history)
            where = f"; the model after round {round_ - 1} is in {saved}" if saved else ""
            moved = f" (the usable clients' {parts.unrestorable_state} moved on, and without the journal of " \
                "clients.accept_failures nothing puts them back, so the round cannot be left out as under a virtual " \
                "clock or clients.below_quorum='keep' it otherwise is)" if parts.keeps_below_quorum and \
                parts.unrestorable_state else ""
            raise JobFailure(f"{aborted}{moved}{where}; {resume_advice(strikes, reduction.stats.metas)}") from None
        except RankStalled as stalled:
            self._give_up(round_, stalled, model_intact=not reduction.model_touched, strikes=strikes)
        self._log_drops(plan, stats.metas)
        if stats.unapplied is not None:
            goes_on = " and the run goes on" if round_ < self.rounds else ""
            why = "under a virtual clock, as when too few updates arrive in time" if self.parts.virtual_clock else \
                "clients.below_quorum='keep'"
            log(f"{stats.unapplied}: the model stays as it was ({why}){goes_on}", rank=0)
        return stats

    def _last_by_budget(self, round_: int) -> bool:
        """privacy.epsilon_budget: whether the next round would spend past the budget, making this one the last
        (known before the round ends: epsilon depends on the number of rounds alone)."""
        private = self.parts.privacy
        return private is not None and round_ < self.rounds and private.exhausted(round_ + 1)

    def _spend_budget(self, round_: int, record: dict) -> None:
        """The budget ends the run after ``round_``: say so, and mark the round's record (the checkpoint's copy too,
        as the checkpointer saves after this), from which ``mpifl status`` and a resume tell the run complete."""
        private = self.parts.privacy
        assert private is not None  # _last_by_budget
        log(f"privacy.epsilon_budget: round {round_ + 1} would take epsilon from {record['privacy']['epsilon']:.3f} "
            f"to {private.epsilon(round_ + 1):.3f}, past {private.cfg.epsilon_budget}: stopping after round {round_}",
            rank=0)
        record["privacy"]["budget_spent"] = True
        self.budget_spent = True

    def _replay(self, resumed: int) -> None:
        """Asynchronous FL after a resume: the clients in flight retrain from the versions they started on
        (read from their checkpoints), with their own seeds, and hold their updates again."""
        model = None  # one buffer for every version resent
        for plan in self.parts.sampler.replay(resumed):
            path, clients = self.parts.checkpointer.path(plan.round - 1), sorted(sum(plan.train.values(), []))
            if not path.exists():
                raise JobFailure(f"resume after round {resumed}: logical clients {clients} trained on version "
                                 f"{plan.round - 1}, whose checkpoint {path} is gone")
            if model is None:
                model = np.empty(self.parts.plan.spec.total_bytes, dtype=np.uint8)
            with Checkpoint(path) as version:
                version.read_range(self.parts.plan.spec, 0, model)
            routes = RoundRoutes.of(plan, self.transport, self.parts.plan.grouped)
            self._send_headers(plan, routes)
            watchdog = Watchdog(self.parts.deadlines.current(), plan.round, plan.train, lambda: self.stop.requested,
                                heard=self.heard)
            send_chunks(self.comm, routes.model_dests, protocol.round_tag(protocol.MODEL, plan.round),
                        self.parts.plan.chunk_slices(model), self.parts.plan.inflight, watchdog)
            log(f"resume: retrained logical clients {clients} from version "
                f"{plan.round - 1} (in flight when round {resumed} ended)", rank=0)

    def _give_up(self, round_: int, stalled: RankStalled, model_intact: bool, strikes: Sequence[Strike] = ()) -> None:
        """A silent rank: keep the last completed round on disk, then end the job naming the rank, and the config's
        stalls on it (``strikes``: the round's), which strike again on a resume unless for ever. After a stop on
        request (SIGTERM), the job ends as a stopped one (``INTERRUPTED``, noted so): the walltime came, not a
        failure, and the rounds on disk resume as after any stop."""
        saved = self.parts.checkpointer.round_aborted(round_, self.history, model_intact)
        where = f"; the model after round {round_ - 1} is in {saved}" if saved else ""
        if stalled.interrupted:
            self.parts.note("interrupted", round_ - 1)
            raise JobFailure(f"{stalled}{where}; continue with --resume", INTERRUPTED) from None
        why, advice = stalled_by(strikes, stalled.rank)
        raise JobFailure(f"{stalled}{why}{where}; {advice}") from None

    def _poisoned(self, round_: int, strikes: list[Strike], nonfinite: int) -> NoReturn:
        """The round's new global model holds NaN/Inf values although every update passed its client's check: it is
        not published, and the job ends keeping the last model on disk, naming the strikes that change an update
        past that check (``corrupt``). Those are recorded as spent, so a resume goes past them as past a kill."""
        saved = self.parts.checkpointer.round_aborted(round_, self.history, model_intact=False)
        suspects = [s for s in strikes if s.fault.kind in CHANGES_PAST_THE_CHECK]
        for strike in suspects:
            self.parts.spend_fault(strike)
        why = ("; ".join(f"faults[{s.index}] ({s.fault.kind!r}) struck logical client {s.client} (rank "
                         f"{world_rank(s.rank)})"
                         for s in suspects) + " this round, and a resume goes past it") if suspects else \
            "a value changed after the check (a corrupted link or memory), or the strategy's server step overflowed"
        kept = f"the newest model on disk is {saved}" if saved else "no checkpoint is on disk: a resume starts over"
        raise JobFailure(f"round {round_}: the new global model has {nonfinite:,} NaN/Inf value"
                         f"{'s' if nonfinite != 1 else ''}, though every update passed its client's NaN/Inf check: "
                         f"{why}. The round is not applied; {kept}; continue with --resume") from None

    def _rank_of(self, plan: RoundAssignment, client: int) -> int:
        """The rank whose update of ``client`` this round's plan reduces: the one that trained it this round, else
        (an asynchronous step's held update, trained earlier) its home rank."""
        rank = plan.rank_of(client)
        return rank if rank is not None else self.parts.sampler.rank_of(client)

    def _log_drops(self, plan: RoundAssignment, metas: dict) -> None:
        for client, meta in sorted(metas.items()):
            if meta.error is not None:
                log(f"round {plan.round}: dropped logical client {client} (rank "
                    f"{world_rank(self._rank_of(plan, client))}): "
                    f"{meta.error}", rank=0)

    def _pool_layout(self, by_rank: dict[int, list[int]], summed: bool) -> PoolLayout:
        """The round's receive pool, sized as planning.pools sizes it (the memory model uses the same)."""
        parts, per_rank = self.parts, max(map(len, by_rank.values()), default=0)
        budget = parts.store.pool_budget(int(self.transport.pool_mb * MIB))
        held = holds_stacks(parts.strategy.stacked, parts.plan.codec is not None, summed, per_rank)
        return pool_layout(self.pool.shape, budget, len(by_rank), stacked=parts.strategy.stacked, held=held,
                           sequential=per_rank > 1)

    def _send_headers(self, plan: RoundAssignment, routes: RoundRoutes) -> None:
        """Tell every client rank its part of the round."""
        borrow, lend = state_loans(plan.train, self.comm.Get_size() - 1) if self.parts.lends_state else ({}, {})
        last = self._last_by_budget(plan.round)

        def header(rank: int) -> protocol.RoundOrder:
            send = tuple(plan.streams.get(rank, ())) if plan.hold else ()
            clip = self.parts.privacy.clip if self.parts.privacy else None
            cohort = tuple(sorted(plan.participants)) if self.parts.secagg else ()
            clients = tuple(plan.train.get(rank, ()))
            steps = tuple(plan.local_steps[c] for c in clients) if plan.local_steps else ()
            groups = tuple(plan.groups[c] for c in clients) if plan.groups is not None else ()
            parent, children, hops, stream = routes.header_of(rank)
            kind: type[protocol.RoundOrder] = protocol.HoldOrder if plan.hold else protocol.RoundOrder
            held = {"send": send} if plan.hold else {}  # asynchronous FL: the held updates to send now
            return kind(plan.round, self.parts.dropped.take(rank), clients=clients,
                        participants=len(plan.participants), last=last, clip=clip, cohort=cohort, steps=steps,
                        groups=groups, parent=parent, children=children, chain=hops, reduce_stream=stream,
                        borrow=tuple(borrow.get(rank, ())), lend=tuple(lend.get(rank, ())), **held)

        # ranks still training a round they were dropped from read the header of the round they rejoin
        wait_all([self.comm.isend(header(r), dest=r, tag=protocol.HEADER) for r in range(1, self.comm.Get_size())
                  if r not in plan.busy_ranks])

    def _send_stop(self) -> None:
        """Tell every client rank to stop (with the clients dropped since its last header), and whether the run
        stopped on request before its last round, which each notes as rank 0 does."""
        early = stopped_on_request(self.history, self.rounds, self.stop, self.budget_spent)
        wait_all([self.comm.isend(protocol.Stop(self.rounds + 1, self.parts.dropped.take(r), interrupted=early),
                                  dest=r, tag=protocol.HEADER) for r in range(1, self.comm.Get_size())])

    def _record(self, plan: RoundAssignment, routes: RoundRoutes, metas: dict, evaluation: dict | None,
                times: RoundTimes, work: dict[str, dict]) -> dict:
        """The round's line of metrics.jsonl; ``work``: each rank's clients and training seconds (_work_by_rank)."""
        usable = sorted((m for m in metas.values() if m.error is None), key=lambda m: m.client)  # not arrival order
        losses = [(m.metrics["loss"], m.num_samples) for m in usable if "loss" in m.metrics]
        record = {
            "round": plan.round,
            "participants": sorted({*plan.participants, *plan.busy_clients}),
            "dropped": dropped_entries(plan, metas, self._rank_of),
            "train_loss": sum(loss * n for loss, n in losses) / max(1, sum(n for _, n in losses)) if losses else None,
            "num_samples": sum(m.num_samples for m in usable),
            "bytes_sent": self.parts.plan.model_bytes * len(routes.model_dests),
            "bytes_received": self.parts.plan.update_bytes * sum(len(s) for s in routes.streams.values()),
            "server_rss_bytes": current_rss_bytes(),
            "server_peak_rss_bytes": peak_rss_bytes(),
            "server_pool_bytes": self.pool.nbytes,
            "client_train_seconds": max((m.train_seconds for m in metas.values()), default=0.0),
            # each usable participant's [client, rank, samples, seconds]: what mpifl calibrate fits the cost model to
            "timing": [[m.client, world_rank(self._rank_of(plan, m.client)), m.num_samples, m.train_seconds]
                       for m in usable],
            "ranks": work,
            "client_peak_rss_bytes": max((m.metrics.get("rank_peak_rss_bytes", 0) for m in metas.values()), default=0),
            "time": times.split(),
            **plan.clock,
        }
        device_peaks = [m.metrics["rank_peak_device_bytes"] for m in metas.values()
                        if "rank_peak_device_bytes" in m.metrics]
        if device_peaks:  # client ranks that train on a GPU
            record["client_peak_device_bytes"] = max(device_peaks)
        if self.parts.floor is not None:
            record["exchange"] = self.parts.floor.exchange(record["time"], record["bytes_sent"],
                                                           record["bytes_received"])
        if evaluation is not None:
            record["eval"] = evaluation
        if self.parts.lends_state:  # per_round placement: the clients whose state their home lent for the round
            borrowed, _ = state_loans(plan.train, self.comm.Get_size() - 1)
            record["state_loans"] = sum(len(moves) for moves in borrowed.values())
        group = group_split(metas.values())
        if group is not None:
            record["client_group"] = group
        federated = federated_evaluation(usable)
        if federated is not None:
            record["federated_eval"] = federated
        reported = client_metrics(usable)
        if reported is not None:
            record["client_metrics"] = reported
        with noted(f"round {plan.round}: strategy.name {self.parts.strategy.name!r}, in round_metrics"):
            strategy = self.parts.strategy.round_metrics()
            rejected = self.parts.strategy.round_rejected()
        if strategy:
            record["strategy_metrics"] = dict(strategy)
        if rejected is not None:  # a robust rule's choice: usable updates it left out (Krum's)
            record["rejected"] = list(rejected)
        return record

    def _personal(self, round_: int, metas: dict) -> dict:
        """Ditto: the record's ``personal_diverged`` (the clients whose personal model went non-finite), with a
        warning that names them; nothing without Ditto."""
        if not self.parts.personal:
            return {}
        diverged = personal_diverged(metas.values())
        if diverged:
            log(divergence_line(round_, diverged), rank=0)
        return {"personal_diverged": diverged}

    def _work_by_rank(self, plan: RoundAssignment, metas: dict) -> dict[str, dict]:
        """Each client rank's logical clients this round, their training time (they train one after another) and
        what the rank spent (records.rank_costs)."""
        by_rank: dict[str, list] = {}
        for client, meta in sorted(metas.items()):
            by_rank.setdefault(str(world_rank(self._rank_of(plan, client))), []).append(meta)
        return {rank: {"clients": len(reported), "train_seconds": sum(m.train_seconds for m in reported),
                       **rank_costs(reported)} for rank, reported in by_rank.items()}
