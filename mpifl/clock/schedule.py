"""The virtual-time schedule, planned from the config and the seed alone (never from the machine).

Synchronous rounds (``clock.mode: sync``): round r starts when round r-1 ended, or, when nobody is online
then, once the first client comes online (that wait is recorded apart from the round). A round does not wait
for k clients: with k' = min(k, clients online at its start), ``ceil(k' x (1 + over_selection))`` are sampled;
each one's task takes its cost-model duration (with any stall or slowdown fault that strikes it added); the
first k' to finish (by duration, then id) within ``deadline`` are kept and the rest are stragglers, dropped. A
task that never arrives (a stall for ever) is a straggler whatever the deadline. The round ends when the k'-th
kept update arrives, or at the deadline when fewer made it. Stragglers are never trained: their work is wasted
by definition, and reported (virtual seconds they worked until the round closed).

Asynchronous steps (``fedasync``, ``fedbuff``): ``concurrency`` clients train at once. At time 0
that many idle, online clients are dispatched with model version 0. Updates arrive in virtual
time (ties by id); every ``buffer`` arrivals (1 for FedAsync) the server takes a step, making
the next version, and after each arrival a new client is dispatched with the version current
then. A client is idle again once its update is applied. Each update's staleness is the number
of versions made between its dispatch and its step.

Execution follows the schedule: in step s the server sends version s-1 once, to the clients
dispatched with it (they train now and hold their updates on their ranks), then reduces the
updates that arrive at step s, in arrival order. So real parallelism is whatever the schedule
allows, the server never holds more than today, and a rank holds at most its in-flight updates.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from mpifl.clock.availability import Online
from mpifl.clock.queue import Finish, QueueAvailability
from mpifl.planning.seeds import CLOCK, SAMPLING, derive_seed

Duration = Callable[[int, int], float]  # (round or step, logical client) -> its task, in virtual seconds


@dataclass(frozen=True)
class SyncRound:
    """One synchronous round in virtual time."""

    round: int
    start: float
    end: float
    online: int  # clients online at the start
    selected: tuple[int, ...]  # sampled, over-selection included (ascending)
    kept: tuple[int, ...]  # the participants (ascending): the first k to finish in time
    stragglers: tuple[int, ...]
    wasted_seconds: float  # virtual seconds the stragglers (and any withheld) worked before the round closed
    preempted: tuple[int, ...] | None = None  # queue: stragglers whose task a preemption lost (None: no jobs)
    continued: tuple[int, ...] = ()  # queue with checkpoints: selected clients whose task ran on in a later job
    job_ended: tuple[int, ...] = ()  # queue: stragglers whose task their job's walltime or run time lost
    waited: float = 0.0  # virtual seconds from the previous round's end until a client was online to start this one
    # secagg.min_cohort: the clients on time but too few for their sum to hide them: left out, their work wasted
    withheld: tuple[int, ...] = ()

    def record(self) -> dict:
        """The round's virtual-time fields for metrics.jsonl: ``virtual_wait_seconds`` + ``virtual_round_seconds``
        summed over the rounds make ``virtual_time``."""
        record = {"virtual_time": self.end, "virtual_wait_seconds": self.waited,
                  "virtual_round_seconds": self.end - self.start, "online": self.online,
                  "selected": len(self.selected), "stragglers": list(self.stragglers),
                  "wasted_seconds": self.wasted_seconds}
        if self.preempted is not None:
            record.update(preempted=list(self.preempted), job_ended=list(self.job_ended),
                          continued=list(self.continued))
        return record


def sample_online(seed: int, key: tuple[int, ...], online: np.ndarray, count: int) -> list[int]:
    """``count`` distinct clients drawn uniformly from the online ones (ascending); with everyone online,
    the same draw as the real-time sampler's."""
    ids = np.flatnonzero(online)
    rng = np.random.default_rng(derive_seed(seed, SAMPLING, *key))
    return sorted(int(c) for c in ids[rng.choice(len(ids), size=min(count, len(ids)), replace=False)])


class SyncClock:
    """Synchronous rounds in virtual time: round r is planned after rounds 1..r-1 (cached)."""

    def __init__(self, seed: int, per_round: int, availability: Online, duration: Duration,
                 deadline: float | None, over_selection: float, min_participants: int = 1, min_cohort: int = 1) -> None:
        """``min_participants``: clients.min_participants, ``min_cohort``: secagg.min_cohort (1 without it): a round
        keeping fewer runs without updates; the on-time clients too few for secagg.min_cohort are ``withheld``."""
        self.seed, self.per_round, self.availability, self.duration = seed, per_round, availability, duration
        self.deadline, self.over_selection, self.min_participants = deadline, over_selection, min_participants
        self.min_cohort = min_cohort
        self.rounds: list[SyncRound] = []

    def round(self, r: int) -> SyncRound:
        """Round ``r`` (1-based)."""
        while len(self.rounds) < r:
            self.rounds.append(self._plan(len(self.rounds) + 1, self.rounds[-1].end if self.rounds else 0.0))
        return self.rounds[r - 1]

    def _plan(self, r: int, start: float) -> SyncRound:
        ready, online = start, self.availability.online(start)
        while not online.any():  # nobody to sample: the round starts when someone comes online
            later = self.availability.next_change(start)
            if later is None:
                raise ValueError(f"{self.availability.source}: no client is online at or after virtual time "
                                 f"{start:.0f} s, when round {r - 1} ended: the trace runs out at round {r}")
            start, online = later, self.availability.online(later)
        k = min(self.per_round, int(online.sum()))
        selected = sample_online(self.seed, (r,), online, math.ceil(k * (1 + self.over_selection) - 1e-9))
        ends = {c: self._finish(c, start, self.duration(r, c)) for c in selected}
        # seconds after the start until each task arrives, or until its job's end loses it (queue)
        took = {c: e.ended - start for c, e in ends.items()}
        in_time = sorted((c for c in selected if ends[c].at is not None and math.isfinite(took[c]) and (
            self.deadline is None or took[c] <= self.deadline)), key=lambda c: (took[c], c))
        kept = in_time[:k]
        # the k-th arrival, else the deadline, else (tasks lost, no deadline) when the last task arrived or was lost
        closes = took[kept[-1]] if len(kept) == k else self.deadline or max(took.values())
        withheld = tuple(sorted(kept)) if len(kept) < self.min_cohort else ()
        if len(kept) < max(self.min_participants, self.min_cohort):
            kept = []
        stragglers = tuple(c for c in selected if c not in kept and c not in withheld)
        wasted = sum(min(took[c], closes) for c in (*stragglers, *withheld))
        queued = isinstance(self.availability, QueueAvailability)
        # a task its job loses after the round closed was a straggler already: the loss cost the round nothing
        preempted, job_ended = lost_by_cause([(c, ends[c].preempted) for c in selected
                                              if ends[c].at is None and took[c] <= closes])
        return SyncRound(r, start, start + closes, int(online.sum()), tuple(selected), tuple(sorted(kept)),
                         stragglers, float(wasted), preempted if queued else None,
                         tuple(c for c in selected if ends[c].continued), job_ended, start - ready, withheld)

    def _finish(self, client: int, start: float, seconds: float) -> Finish:
        """When ``client``'s task of ``seconds``, started at ``start``, arrives or is lost; a task that never arrives
        (math.inf: a stall for ever) outlasts any job, and is asked of no availability (a checkpointed batch job
        would carry it on from job to job for ever)."""
        return Finish(math.inf) if math.isinf(seconds) else self.availability.finish(client, start, seconds)


def lost_by_cause(lost: list[tuple[int, bool]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Lost tasks ``(client, by a preemption)`` split into those a preemption lost and those their job's walltime
    or run time lost: a record names the two apart, as the availability plot marks only the first."""
    return tuple(c for c, cut in lost if cut), tuple(c for c, cut in lost if not cut)


@dataclass(frozen=True)
class Arrival:
    """One update applied at a step: who, from which version, when, and how stale."""

    client: int
    version: int  # the model version it trained on
    dispatched: float
    arrived: float
    staleness: int  # versions made between its dispatch and its step
    local_steps: int = 0  # fedcompass: the local steps it was given (0: the configured local work)


@dataclass(frozen=True)
class AsyncStep:
    """Server step s: makes version s from the updates that arrived since step s-1."""

    step: int
    time: float
    arrivals: tuple[Arrival, ...]  # in arrival order: the fold order
    train: tuple[int, ...]  # dispatched with version s-1 and applied by the last step: they train in step s
    online: int = 0
    train_steps: tuple[int, ...] = ()  # fedcompass: each trainer's local steps (aligned with ``train``)
    preempted: tuple[int, ...] | None = None  # queue: clients whose task a preemption lost since the last step
    job_ended: tuple[int, ...] = ()  # queue: clients whose task their job's walltime or run time lost since then
    open_versions: tuple[int, ...] = ()  # the versions that tasks still in flight after this step trained on

    def record(self) -> dict:
        """The step's virtual-time fields for metrics.jsonl."""
        record = {"virtual_time": self.time, "staleness": [a.staleness for a in self.arrivals],
                  "arrival_order": [a.client for a in self.arrivals], "online": self.online}
        if self.preempted is not None:
            record.update(preempted=list(self.preempted), job_ended=list(self.job_ended))
        if any(a.local_steps for a in self.arrivals):
            record["local_steps"] = [a.local_steps for a in self.arrivals]
        return record


@dataclass
class _Dispatch:
    client: int
    version: int
    time: float
    arrival: float
    step: int | None = None  # the step that applies it
    local_steps: int = 0
    group: int = -1
    preempted: bool = False  # its task was lost to a preemption (not to its job's walltime or run time)
    lost: bool = False  # its task never arrives (its job ended first): no step ever applies it


@dataclass
class AsyncPlan:
    """Every step of an asynchronous run, and the largest number of updates any rank holds at once."""

    steps: list[AsyncStep] = field(default_factory=list)


def plan_async(seed: int, steps: int, buffer: int, concurrency: int, num_clients: int,
               availability: Online, duration: Duration) -> AsyncPlan:
    """The FedAsync (``buffer`` 1) or FedBuff schedule of ``steps`` server steps (see the module docstring)."""
    dispatches: list[_Dispatch] = []
    # (time, client; or -1: try again, -2: a job's end lost the task, dispatch index)
    events: list[tuple[float, int, int]] = []
    busy = np.zeros(num_clients, dtype=bool)  # dispatched and not yet applied
    version, pending, plan = 0, [], AsyncPlan()
    lost: list[tuple[int, bool]] = []  # (client, by a preemption) whose task a job's end lost since the last step
    queued = isinstance(availability, QueueAvailability)  # batch jobs: each step records what they lost

    def dispatch(t: float) -> None:
        idle = availability.online(t) & ~busy
        if not idle.any():
            later = availability.next_change(t)
            if later is not None:
                heapq.heappush(events, (later, -1, -1))
            return
        client = sample_online(seed, (CLOCK, len(dispatches)), idle, 1)[0]
        busy[client] = True
        end = availability.finish(client, t, duration(version + 1, client))  # it trains in step version + 1
        d = _Dispatch(client, version, t, end.at if end.at is not None else math.inf, preempted=end.preempted,
                      lost=end.at is None)
        dispatches.append(d)
        heapq.heappush(events, (end.ended, client if end.at is not None else -2, len(dispatches) - 1))

    for _ in range(min(concurrency, num_clients)):
        dispatch(0.0)
    while version < steps:
        if not events:
            raise ValueError(f"clock: no client can ever train again ({availability.source}); the run cannot "
                             f"reach step {version + 1} of rounds={steps}")
        t, client, index = heapq.heappop(events)
        if client == -2:  # the task is lost: its client is free (and offline), another is sent
            busy[dispatches[index].client] = False
            lost.append((dispatches[index].client, dispatches[index].preempted))
        if client < 0:
            dispatch(t)
            continue
        pending.append(index)
        if len(pending) == buffer:
            version += 1
            arrivals = []
            for i in pending:
                dispatches[i].step = version
                busy[dispatches[i].client] = False
                arrivals.append(Arrival(dispatches[i].client, dispatches[i].version, dispatches[i].time,
                                        dispatches[i].arrival, version - 1 - dispatches[i].version))
            preempted, job_ended = lost_by_cause(lost)
            plan.steps.append(AsyncStep(version, t, tuple(arrivals), (), int(availability.online(t).sum()),
                                        preempted=preempted if queued else None, job_ended=job_ended))
            pending, lost = [], []
        dispatch(t)
    return _with_trainers(plan, dispatches)


def _with_trainers(plan: AsyncPlan, dispatches: list[_Dispatch]) -> AsyncPlan:
    """The plan with each step's trainers: the clients dispatched with its previous version whose update a step
    applied (a lost task is never trained); and each step's open versions (``open_versions``)."""
    trains: dict[int, list[int]] = {}
    for d in dispatches:
        if d.step is not None:
            trains.setdefault(d.version + 1, []).append(d.client)
    opened = open_versions(dispatches, len(plan.steps))
    plan.steps = [replace(s, train=tuple(sorted(trains.get(s.step, ()))), open_versions=opened[s.step - 1])
                  for s in plan.steps]
    return plan


def open_versions(dispatches: list[_Dispatch], steps: int) -> list[tuple[int, ...]]:
    """For each step 1..``steps``: the model versions that the tasks in flight after it trained on (dispatched
    before it, applied after it or by no step of this plan, and not lost). A plan of more steps has the same first
    ``steps`` steps and applies some of those it left unapplied, so after a step these are every version a resume
    may retrain from, whatever ``rounds`` it raises to: the checkpoints a run keeps (and refuses to resume without)."""
    opened: list[set[int]] = [set() for _ in range(steps)]
    for d in dispatches:
        if d.lost:
            continue
        for step in range(d.version + 1, min(steps, d.step - 1 if d.step is not None else steps) + 1):
            opened[step - 1].add(d.version)
    return [tuple(sorted(versions)) for versions in opened]


def held_updates(plan: AsyncPlan, rank_of: Callable[[int], int]) -> dict[int, int]:
    """The most updates each rank holds at once (trained in one step, sent in a later one): its memory bound."""
    held: dict[int, int] = {}
    worst: dict[int, int] = {}
    for step in plan.steps:
        for c in step.train:
            held[rank_of(c)] = held.get(rank_of(c), 0) + 1
        for r, n in held.items():
            worst[r] = max(worst.get(r, 0), n)
        for a in step.arrivals:
            held[rank_of(a.client)] -= 1
    return worst
