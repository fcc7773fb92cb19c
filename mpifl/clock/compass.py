"""FedCompass (Li et al. 2024) in virtual time: a compute-aware scheduler with arrival groups.

``concurrency`` clients, sampled once among those online at time 0, stay in the federation (with batch jobs,
``clock.availability: queue``: sampled among all clients, each joining when its job starts and, when a job's end
loses its task, again when its next job starts). A
client (re)assigned at time t joins the open group whose expected arrival leaves it the most local
steps Q, with min_steps <= Q <= max_steps (Q = floor((expected - t - transfers) / seconds per
step)); if none does, it opens a new group with Q = max_steps, expected at t + its duration and
aggregated at the latest at t + latest_factor x that duration. A group is aggregated (one server
step, FedBuff's rule over its updates) when all its members have arrived, or at its latest time
with those who have; members arriving after that are applied on their own. Every client applied
is reassigned at once, with the new version. So fast clients do more local work instead of waiting.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from mpifl.clock.availability import Online
from mpifl.clock.queue import QueueAvailability
from mpifl.clock.schedule import (
    Arrival,
    AsyncPlan,
    AsyncStep,
    _Dispatch,
    lost_by_cause,
    open_versions,
    sample_online,
)
from mpifl.planning.seeds import CLOCK

StepsDuration = Callable[[int, int], float]  # (client, local steps) -> virtual seconds
StepsDelay = Callable[[int, int, int], float]  # (step, client, local steps) -> virtual seconds a fault adds


def no_delay(step: int, client: int, local_steps: int) -> float:
    """No fault delays any task."""
    return 0.0


@dataclass
class _Group:
    expected: float  # when its members are expected to arrive together
    latest: float  # when it is aggregated with whoever has arrived
    members: list[int] = field(default_factory=list)  # dispatch indices
    arrived: list[int] = field(default_factory=list)
    open: bool = True


class _Compass:
    """The scheduler's state while the schedule is planned."""

    def __init__(self, steps: int, availability: Online, duration: StepsDuration, min_steps: int,
                 max_steps: int, latest_factor: float, delay: StepsDelay = no_delay) -> None:
        self.steps, self.availability, self.duration, self.delay = steps, availability, duration, delay
        self.min_steps, self.max_steps, self.latest_factor = min_steps, max_steps, latest_factor
        self.dispatches: list[_Dispatch] = []
        self.groups: list[_Group] = []
        # (time, 0 arrival / 1 group deadline / 2 a job's end lost the task / 3 its client's next job starts, index)
        self.events: list[tuple[float, int, int]] = []
        self.version, self.plan = 0, AsyncPlan()
        self.jobs = availability if isinstance(availability, QueueAvailability) else None  # batch jobs, if any
        self.lost: list[tuple[int, bool]] = []  # (client, by a preemption) whose task a job's end lost since then

    def steps_in(self, group: _Group, client: int, t: float) -> int:
        """The local steps that bring ``client``, sent at ``t``, in with ``group`` (capped at max_steps)."""
        transfers, per_step = self.duration(client, 0), self.duration(client, 1) - self.duration(client, 0)
        if per_step <= 0:
            return self.max_steps
        return min(self.max_steps, math.floor((group.expected - t - transfers) / per_step))

    def assign(self, client: int, t: float) -> None:
        """Give ``client`` its local steps and arrival group; schedule its arrival (with batch jobs, a client whose
        job has ended by then waits for its next one)."""
        if self.jobs is not None and not self.jobs.is_online(client, t):
            self._wait_for_next_job(client, t)
            return
        fits = [(self.steps_in(g, client, t), -gid) for gid, g in enumerate(self.groups) if g.open and g.expected > t]
        q, gid = max([f for f in fits if f[0] >= self.min_steps], default=(self.max_steps, None))
        if gid is None:
            took = self.duration(client, self.max_steps)
            self.groups.append(_Group(t + took, t + self.latest_factor * took))
            gid = -(len(self.groups) - 1)
            heapq.heappush(self.events, (self.groups[-1].latest, 1, len(self.groups) - 1))
        # the groups expect the device's duration; a stall or slowdown fault (unforeseen) makes the task take longer
        end = self.availability.finish(client, t, self.duration(client, q) + self.delay(self.version + 1, client, q))
        d = _Dispatch(client, self.version, t, end.ended, local_steps=q, group=-gid, preempted=end.preempted,
                      lost=end.at is None)
        self.dispatches.append(d)
        if end.at is None:  # its job ends first: the task is lost, and the group does not wait for it
            heapq.heappush(self.events, (end.ended, 2, len(self.dispatches) - 1))
            return
        self.groups[-gid].members.append(len(self.dispatches) - 1)
        heapq.heappush(self.events, (d.arrival, 0, len(self.dispatches) - 1))

    def apply(self, indices: list[int], t: float) -> None:
        """One server step from these updates (in arrival order); their clients are reassigned."""
        self.version += 1
        order = sorted(indices, key=lambda i: (self.dispatches[i].arrival, self.dispatches[i].client))
        arrivals = []
        for i in order:
            d = self.dispatches[i]
            d.step = self.version
            arrivals.append(Arrival(d.client, d.version, d.time, d.arrival, self.version - 1 - d.version,
                                    d.local_steps))
        preempted, job_ended = lost_by_cause(self.lost)
        self.plan.steps.append(AsyncStep(self.version, t, tuple(arrivals), (), int(self.availability.online(t).sum()),
                                         preempted=preempted if self.jobs is not None else None, job_ended=job_ended))
        self.lost = []
        if self.version < self.steps:
            for i in order:
                self.assign(self.dispatches[i].client, t)

    def run(self) -> AsyncPlan:
        """Process arrivals and group deadlines until ``steps`` server steps are planned."""
        while self.version < self.steps and self.events:
            t, kind, index = heapq.heappop(self.events)
            if kind >= 2:
                self.rejoin(kind, index, t)
                continue
            group = self.groups[index] if kind == 1 else self.groups[self.dispatches[index].group]
            if kind == 1:  # the group's latest time: aggregate whoever has arrived
                if group.open:
                    group.open = False
                    if group.arrived:
                        self.apply(group.arrived, t)
            elif not group.open:  # it missed its group: applied on its own
                self.apply([index], t)
            else:
                group.arrived.append(index)
                if len(group.arrived) == len(group.members):
                    group.open = False
                    self.apply(group.arrived, t)
        return self.plan

    def rejoin(self, kind: int, index: int, t: float) -> None:
        """A lost task (``kind`` 2, dispatch ``index``): its client waits for its next job; that job's start
        (``kind`` 3, client ``index``): the client is assigned again, with the version current then."""
        if kind == 3:
            self.assign(index, t)
            return
        client = self.dispatches[index].client
        self.lost.append((client, self.dispatches[index].preempted))
        self._wait_for_next_job(client, t)

    def _wait_for_next_job(self, client: int, t: float) -> None:
        """Assign ``client`` again when its next batch job starts (never, past a trace's last)."""
        again = self.jobs.next_start(client, t) if self.jobs is not None else None
        if again is not None:
            heapq.heappush(self.events, (again, 3, client))

    def with_trainers(self) -> AsyncPlan:
        """The plan with each step's trainers: the clients dispatched with its previous version, and their steps;
        and each step's open versions (``schedule.open_versions``)."""
        trains: dict[int, list[tuple[int, int]]] = {}
        for d in self.dispatches:
            if d.step is not None:
                trains.setdefault(d.version + 1, []).append((d.client, d.local_steps))
        opened = open_versions(self.dispatches, len(self.plan.steps))
        self.plan.steps = [replace(s, train=tuple(c for c, _ in sorted(trains.get(s.step, ()))),
                                   train_steps=tuple(q for _, q in sorted(trains.get(s.step, ()))),
                                   open_versions=opened[s.step - 1])
                           for s in self.plan.steps]
        return self.plan


def plan_compass(seed: int, steps: int, concurrency: int, num_clients: int, availability: Online,  # noqa: PLR0913 - FedCompass's own parameters, each a config key
                 duration: StepsDuration, min_steps: int, max_steps: int, latest_factor: float,
                 delay: StepsDelay = no_delay) -> AsyncPlan:
    """The FedCompass schedule of ``steps`` server steps (see the module docstring); ``delay``: what faults add to
    a task, unforeseen by the scheduler."""
    compass = _Compass(steps, availability, duration, min_steps, max_steps, latest_factor, delay)
    # batch jobs: the members are drawn from all clients and join as each one's job starts
    pool = np.ones(num_clients, dtype=bool) if compass.jobs is not None else availability.online(0.0)
    for client in sample_online(seed, (CLOCK, 0), pool, min(concurrency, num_clients)):
        compass.assign(client, 0.0)
    compass.run()
    return compass.with_trainers()
