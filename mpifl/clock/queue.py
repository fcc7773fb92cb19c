"""Clients as batch jobs (``clock.availability: queue``): each logical client is online only while its job runs.

A cross-facility federation's client is an HPC job: it waits in a batch queue, runs for at most a walltime, may be
preempted, and is resubmitted. So each client's online time is a sequence of job runs, ``[start, end)``:

- from a model: a job is submitted when the previous one ends (the first at 0), waits a lognormal time in the queue
  (median ``clock.queue_wait``, sigma ``clock.queue_wait_sigma``), runs until its walltime (``clock.walltime``) or
  until it is preempted (``clock.preemption_rate`` per second, a Poisson process), each draw seeded by the client
  and the job's number;
- or from a trace in the Standard Workload Format of the Parallel Workloads Archive (``clock.queue_trace``;
  Feitelson et al., https://www.cs.huji.ac.il/labs/parallel/workload/swf.html): job i, in the order of submission,
  runs for client i mod N, from its submit time plus its wait to that plus its run time, as the trace has it. The
  trace's own start times are honoured: a client whose jobs overlap is online while any of them runs (the union),
  never with a job delayed until the one before it ends, which would stretch the trace's queue waits.

A task (a client's training and transfers) that the end of its client's online stretch cuts short is lost, its
work wasted, unless ``clock.preemption_checkpoint`` is set: then it carries on in the client's next job
(``finish``). ``Finish.preempted`` says why a task was lost: a preemption (drawn, or a trace's job stopped short),
or the job's normal end (its walltime, or a trace's run time), so that a record never calls the second a
preemption. Everything is a function of the config and the seed, so schedules, and results, are bitwise and
resumable like every clock mode.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpifl.planning.seeds import CLOCK, derive_seed

QUEUE = 2  # sub-key of CLOCK: client c's job draws (QUEUE, c)


@dataclass
class Jobs:
    """One client's online stretches, ``starts[i]`` to ``ends[i]``, ascending and disjoint, extended on demand: the
    model's job runs, or the union of a trace's overlapping jobs (``online_stretches``)."""

    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    preempted: list[bool] = field(default_factory=list)  # whether a preemption ended the stretch
    finished: bool = False  # a trace's: no job after the last


@dataclass(frozen=True)
class Finish:
    """How a task started at some time ends: ``at`` its arrival (None: lost when its job ended, at ``lost_at``;
    ``preempted``: by a preemption, else by the job's walltime or run time); ``continued``: it ran on in a later
    job (``clock.preemption_checkpoint``)."""

    at: float | None
    lost_at: float | None = None
    continued: bool = False
    preempted: bool = False

    @property
    def ended(self) -> float:
        """When the task arrived, or was lost."""
        end = self.at if self.at is not None else self.lost_at
        assert end is not None  # a task either arrives or is lost
        return end


class QueueAvailability:
    """``online(t)``, ``next_change(t)`` as ``Availability`` has them, and ``finish``: when a task ends."""

    def __init__(self, num_clients: int, seed: int, *, wait_median: float, wait_sigma: float, walltime: float,
                 preemption_rate: float, checkpoint: bool, trace: str | None = None) -> None:
        self.num_clients, self.seed, self.checkpoint = num_clients, seed, checkpoint
        self.wait_median, self.wait_sigma = wait_median, wait_sigma
        self.walltime, self.preemption_rate = walltime, preemption_rate
        self.jobs = [Jobs() for _ in range(num_clients)]
        self.source = f"clock.queue_trace {trace!r}" if trace is not None else "clock.availability 'queue'"
        self.rngs = [np.random.default_rng(derive_seed(seed, CLOCK, QUEUE, c)) for c in range(num_clients)]
        if trace is not None:
            for client, runs in read_swf(trace, num_clients).items():
                jobs = self.jobs[client]
                for start, end, cut in online_stretches(runs):
                    jobs.starts.append(start)
                    jobs.ends.append(end)
                    jobs.preempted.append(cut)
            for jobs in self.jobs:
                jobs.finished = True

    def _cover(self, client: int, t: float) -> Jobs:
        """Client ``client``'s jobs, drawn until one starts after ``t``."""
        jobs = self.jobs[client]
        while not jobs.finished and (not jobs.starts or jobs.starts[-1] <= t):
            submitted = jobs.ends[-1] if jobs.ends else 0.0
            rng = self.rngs[client]
            wait = float(rng.lognormal(math.log(self.wait_median), self.wait_sigma)) if self.wait_median > 0 else 0.0
            cut = float(rng.exponential(1.0 / self.preemption_rate)) if self.preemption_rate > 0 else math.inf
            jobs.starts.append(submitted + wait)
            jobs.ends.append(submitted + wait + min(self.walltime, cut))
            jobs.preempted.append(cut < self.walltime)
        return jobs

    def _job_at(self, client: int, t: float) -> int | None:
        """The index of the online stretch of ``client`` at ``t`` (None: between jobs)."""
        jobs = self._cover(client, t)
        i = bisect.bisect_right(jobs.starts, t) - 1
        return i if i >= 0 and t < jobs.ends[i] else None

    def is_online(self, client: int, t: float) -> bool:
        """Whether ``client``'s job runs at ``t``."""
        return self._job_at(client, t) is not None

    def online(self, t: float) -> np.ndarray:
        """Which clients' jobs run at virtual time ``t``."""
        return np.array([self.is_online(c, t) for c in range(self.num_clients)], dtype=bool)

    def next_change(self, t: float) -> float | None:
        """The earliest job start after ``t`` (None: a trace with no job left)."""
        starts = []
        for c in range(self.num_clients):
            jobs = self._cover(c, t)
            i = bisect.bisect_right(jobs.starts, t)
            if i < len(jobs.starts):
                starts.append(jobs.starts[i])
        return min(starts) if starts else None

    def finish(self, client: int, t: float, seconds: float) -> Finish:
        """A task of ``seconds`` started at ``t`` by ``client`` (whose job runs then): when it arrives, or when its
        job's end loses it; with checkpointing it carries on in the client's next jobs."""
        i = self._job_at(client, t)
        if i is None:
            raise ValueError(f"logical client {client} has no job running at virtual time {t}")
        left, now, continued = seconds, t, False
        while True:
            jobs = self._cover(client, now)
            if now + left <= jobs.ends[i]:
                return Finish(now + left, continued=continued)
            if not self.checkpoint:
                return Finish(None, lost_at=jobs.ends[i], preempted=jobs.preempted[i])
            left -= jobs.ends[i] - now
            self._cover(client, jobs.ends[i])
            if i + 1 >= len(jobs.starts):  # a trace's last job
                return Finish(None, lost_at=jobs.ends[i], preempted=jobs.preempted[i])
            i, now, continued = i + 1, jobs.starts[i + 1], True

    def next_start(self, client: int, t: float) -> float | None:
        """When ``client``'s next job after ``t`` starts (None: a trace with no job left for it)."""
        jobs = self._cover(client, t)
        i = bisect.bisect_right(jobs.starts, t)
        return jobs.starts[i] if i < len(jobs.starts) else None

    def runs(self, client: int, until: float) -> list[tuple[float, float, bool]]:
        """Client ``client``'s online stretches that start before ``until``: (start, end, ended by a preemption),
        for the plot."""
        jobs = self._cover(client, until)
        return [(a, b, p) for a, b, p in zip(jobs.starts, jobs.ends, jobs.preempted) if a < until]


def queue_trace_problem(path: str | None) -> str | None:
    """Why ``clock.queue_trace`` cannot be used (missing, a line that does not parse, no job in it), naming the key,
    the file and the line; None when it can or is unset. Read wherever a config is checked before a job starts
    (``mpifl validate``, ``run`` before MPI, ``plan``, ``pbs``, ``slurm``): the server reads it only as the first
    round is planned, after the queue wait and the ranks' start-up."""
    if path is None:
        return None
    if not Path(path).is_file():
        return f"clock.queue_trace: {path!r} {'is not a file' if Path(path).exists() else 'does not exist'}"
    try:
        read_swf(path, 1)
    except OSError as err:
        return f"clock.queue_trace: {path!r} cannot be read: {err.strerror or err}"
    except ValueError as err:
        return str(err)
    return None


UNKNOWN = -1  # SWF's value for a field it does not know
READ_FIELDS = (1, 2, 3, 8, 10)  # 0-based: submit, wait and run time, requested time, status (SWF's 2-4, 9 and 11)


def swf_fields(line: str, where: str) -> tuple[float, float, float, float, int]:
    """The fields ``read_swf`` uses of one job line: submit, wait, run time, requested time and status. A line is
    refused (``where`` names it) if it is too short for them, however many of SWF's 18 the fields after the last
    hold, or if one is not a finite number: a NaN wait or run time passes every comparison and would place a job
    nowhere, silently changing the schedule."""
    fields = line.split()
    if len(fields) <= READ_FIELDS[-1]:
        raise ValueError(f"{where}: a job line needs at least {READ_FIELDS[-1] + 1} fields (the Standard Workload "
                         f"Format has 18; mpifl reads 2-4, 9 and 11), this one has {len(fields)}")
    try:
        numbers = [float(fields[i]) for i in READ_FIELDS]
    except ValueError:
        numbers = [math.nan]
    if not all(math.isfinite(x) for x in numbers):
        raise ValueError(f"{where}: fields 2-4, 9 and 11 must be finite numbers (submit, wait and run time; "
                         f"requested time; status), got {line!r}")
    submit, wait, run, requested, status = numbers
    return submit, wait, run, requested, int(status)


def read_swf(path: str, num_clients: int) -> dict[int, list[tuple[float, float, bool]]]:
    """Job runs from a Standard Workload Format file, dealt to clients round-robin in submit order (jobs submitted
    in the same second in the file's order, which SWF keeps as its job numbers): client -> [(start, end, cut
    short)], each at the trace's own times (a client's jobs may overlap). A job is cut short when its run time fell
    short of its requested time (field 9) with a status other than completed (field 11: 1). Jobs with an unknown
    wait or run time (SWF's -1) and jobs that never ran (run time 0, e.g. cancelled in the queue) are skipped; any
    other negative wait or run time is refused, naming its line: it is no time at all, and skipping it silently
    would change which client gets every later job."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as err:  # a ValueError, which would otherwise not name the key
        raise ValueError(f"clock.queue_trace {path!r}: not a text file: {err}") from None
    jobs, skipped = [], 0
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(";"):
            continue
        where = f"clock.queue_trace {path!r} line {number}"
        submit, wait, run, requested, status = swf_fields(line, where)
        for name, value in (("wait", wait), ("run time", run)):
            if value < 0 and value != UNKNOWN:
                raise ValueError(f"{where}: {name} {value:g} is negative (SWF writes -1 for unknown)")
        if wait == UNKNOWN or run == UNKNOWN or run == 0:
            skipped += 1
            continue
        jobs.append((submit, number, submit + wait, submit + wait + run,
                     status != 1 and 0 < requested and run < requested))
    if not jobs:
        raise ValueError(f"clock.queue_trace {path!r} holds no job with a known wait and a run time above 0 "
                         f"({skipped} job(s) skipped: wait or run time -1, or run time 0)")
    out: dict[int, list[tuple[float, float, bool]]] = {}
    for i, (_, _, start, end, cut) in enumerate(sorted(jobs)):
        out.setdefault(i % num_clients, []).append((start, end, cut))
    return out


def online_stretches(runs: list[tuple[float, float, bool]]) -> list[tuple[float, float, bool]]:
    """The union of one client's job runs ``(start, end, cut short)``: disjoint stretches, ascending, each ended by a
    preemption only if every job that ends it was cut short. A job that another outlasts takes the client offline
    at no point, so its preemption cuts no task; jobs that meet end to end make one stretch."""
    stretches: list[tuple[float, float, bool]] = []
    for start, end, cut in sorted(runs):
        if stretches and start <= stretches[-1][1]:
            first, last, ended_by_cut = stretches[-1]
            if end == last:
                cut = cut and ended_by_cut
            elif end < last:
                end, cut = last, ended_by_cut
            stretches[-1] = (first, end, cut)
        else:
            stretches.append((start, end, cut))
    return stretches
