"""Who is online at a virtual time: always, diurnal (a seeded phase per client), a trace of intervals, or batch
jobs (``queue``: mpifl.clock.queue)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from mpifl.clock.queue import Finish, QueueAvailability
from mpifl.config import ClockConfig
from mpifl.planning.seeds import CLOCK, derive_seed


class Availability:
    """``online(t)``: a boolean mask over logical clients; ``next_change(t)``: when it may next change."""

    def __init__(self, cfg: ClockConfig, num_clients: int, seed: int) -> None:
        self.kind, self.num_clients = cfg.availability, num_clients
        self.period, self.window = cfg.period, cfg.online_fraction * cfg.period
        if self.kind == "diurnal":
            self.phase = np.random.default_rng(derive_seed(seed, CLOCK, 1)).uniform(0.0, cfg.period, num_clients)
        self.intervals: dict[int, list[tuple[float, float]]] = {}
        self.source = f"clock.availability_trace {cfg.availability_trace!r}"  # what may run out (named in errors)
        if self.kind == "trace":
            self.intervals = read_intervals(cfg.availability_trace, num_clients)

    def online(self, t: float) -> np.ndarray:
        """Which clients are online at virtual time ``t``."""
        if self.kind == "diurnal":
            return np.mod(t + self.phase, self.period) < self.window
        mask = np.ones(self.num_clients, dtype=bool)
        for client, spans in self.intervals.items():
            mask[client] = any(a <= t < b for a, b in spans)
        return mask

    def finish(self, client: int, t: float, seconds: float) -> Finish:
        """A task of ``seconds`` started at ``t``: it arrives when it is done (only a batch job's end cuts one
        short: ``QueueAvailability``)."""
        return Finish(t + seconds)

    def next_change(self, t: float) -> float | None:
        """The earliest time after ``t`` when someone may come online (None: never again)."""
        if self.kind == "diurnal":
            wait = np.mod(-(t + self.phase), self.period)  # until each client's next online window opens
            return t + float(np.min(np.where(wait > 0, wait, self.period)))
        starts = [a for spans in self.intervals.values() for a, _ in spans if a > t]
        return min(starts) if starts else None


def read_intervals(path: str | None, num_clients: int) -> dict[int, list[tuple[float, float]]]:
    """An availability trace: JSON {client id: [[start, end], ...]} online intervals in virtual seconds, each
    start before its end. Raises ValueError naming the file and the client for anything else."""
    if not path:
        raise ValueError("clock.availability: 'trace' needs clock.availability_trace")
    where = f"clock.availability_trace {path!r}"
    try:
        table = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not JSON: {err}") from None
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected an object {{client id: [[start, end], ...]}}, "
                         f"not a JSON {type(table).__name__}")
    out = {}
    for key, spans in table.items():
        try:
            client = int(key)
        except ValueError:
            raise ValueError(f"{where}: key {key!r} is not a client id") from None
        if not 0 <= client < num_clients:
            raise ValueError(f"{where}: client {key} is not one of the {num_clients} clients")
        out[client] = [_interval(span, f"{where}: client {key}") for span in _listed(spans, f"{where}: client {key}")]
    return out


def _listed(spans: object, where: str) -> list:
    """A client's entry, which must be a list of intervals."""
    if not isinstance(spans, list):
        raise ValueError(f"{where}: expected a list of [start, end] intervals, not {spans!r}")
    return spans


def _interval(span: object, where: str) -> tuple[float, float]:
    """One [start, end] online interval: two finite numbers of virtual seconds, start before end."""
    if not (isinstance(span, list) and len(span) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in span)):
        raise ValueError(f"{where}: interval {span!r} is not [start, end] in virtual seconds")
    start, end = float(span[0]), float(span[1])
    if not (math.isfinite(start) and math.isfinite(end) and start < end):
        raise ValueError(f"{where}: interval {span!r} must have finite start < end")
    return start, end


def availability_trace_problem(path: str | None, num_clients: int) -> str | None:
    """Why ``clock.availability_trace`` cannot be used (unreadable, not the documented JSON, a client outside the
    run, an interval that ends before it starts), naming the key, the file and the client; None when it can or
    is unset. Read wherever a config is checked before a job starts, like ``queue_trace_problem``: the server
    reads the trace only as the first round is planned."""
    if path is None:
        return None
    try:
        read_intervals(path, num_clients)
    except OSError as err:
        return f"clock.availability_trace: {path!r} cannot be read: {err.strerror or err}"
    except ValueError as err:
        return str(err)
    return None


Online = Availability | QueueAvailability  # what the planners ask who is online, and when a task ends


def availability_for(cfg: ClockConfig, num_clients: int, seed: int) -> Online:
    """``clock.availability``'s model of who is online when."""
    if cfg.availability == "queue":
        return QueueAvailability(num_clients, seed, wait_median=cfg.queue_wait, wait_sigma=cfg.queue_wait_sigma,
                                 walltime=cfg.walltime, preemption_rate=cfg.preemption_rate,
                                 checkpoint=cfg.preemption_checkpoint, trace=cfg.queue_trace)
    return Availability(cfg, num_clients, seed)
