"""Samplers that plan rounds in virtual time: what the server runs each round, from the schedule."""
from __future__ import annotations

from mpifl.clock.availability import availability_for
from mpifl.clock.compass import plan_compass
from mpifl.clock.devices import devices_for
from mpifl.clock.schedule import Arrival, AsyncStep, SyncClock, held_updates, plan_async
from mpifl.clock.staleness import staleness_weight
from mpifl.config import ClientsConfig, ClockConfig, Config
from mpifl.logs import log
from mpifl.planning.faults import FaultPlan
from mpifl.planning.federation import Placement, RoundAssignment, Sampler
from mpifl.units import MIB


class SyncSampler(Sampler):
    """Synchronous rounds in virtual time: the kept clients take part; the record carries the clock."""

    def __init__(self, seed: int, clients: ClientsConfig, placement: Placement, clock: SyncClock):
        super().__init__(seed, clients, placement)
        self.clock = clock

    def plan(self, round_: int) -> RoundAssignment:
        """A synchronous round in virtual time: the clients the clock kept train and send."""
        planned = self.clock.round(round_)
        kept = list(planned.kept)
        return RoundAssignment(round_, tuple(kept), self.by_rank(kept), self.streams(kept), clock=planned.record(),
                               withheld=planned.withheld)


class AsyncSampler(Sampler):
    """FedAsync / FedBuff steps: who trains from the model sent now, whose held updates are applied."""

    def __init__(self, seed: int, clients: ClientsConfig, clock: ClockConfig, placement: Placement,
                 steps: list[AsyncStep]):
        super().__init__(seed, clients, placement)
        self.clock_cfg, self.steps = clock, steps
        self.per_round = {"fedasync": 1, "fedbuff": clock.buffer}.get(clock.mode, clock.in_flight())

    def plan(self, round_: int) -> RoundAssignment:
        """One asynchronous step: the step's arrivals are applied (staleness-weighted), its trainers start."""
        step = self.steps[round_ - 1]
        order = tuple(a.client for a in step.arrivals)
        streams: dict[int, list[int]] = {}
        for client in order:
            streams.setdefault(self.rank_of(client), []).append(client)
        weights = {a.client: staleness_weight(self.clock_cfg, a.staleness) for a in step.arrivals}
        if self.clock_cfg.mode == "fedasync":  # x + a (x_client - x): the combined chunk is x_client itself
            (arrival,) = step.arrivals
            return RoundAssignment(round_, order, self.by_rank(list(step.train)), streams, order, hold=True,
                             weights={arrival.client: 1.0}, mixing=self.clock_cfg.alpha * weights[arrival.client],
                             clock=step.record())
        steps = dict(zip(step.train, step.train_steps)) if step.train_steps else None
        return RoundAssignment(round_, order, self.by_rank(list(step.train)), streams, order, hold=True,
                               weights=weights, divisor=float(len(order)), local_steps=steps, clock=step.record())


    def in_flight(self, step: int) -> dict[int, list[Arrival]]:
        """After ``step``: the updates trained (by training step, ascending; clients ascending) and applied later."""
        out: dict[int, list[Arrival]] = {}
        for later in self.steps[step:]:
            for a in later.arrivals:
                if a.version + 1 <= step:
                    out.setdefault(a.version + 1, []).append(a)
        return {t: sorted(out[t], key=lambda a: a.client) for t in sorted(out)}

    def open_versions(self, step: int) -> set[int]:
        """Model versions that clients in flight after ``step`` trained on, those whose updates this run applies
        (``in_flight``) and those only a longer run would (``rounds`` raised on a resume): a resume retrains them
        from these checkpoints, so pruning keeps them (``schedule.open_versions``)."""
        return set(self.steps[step - 1].open_versions) if step > 0 else set()

    def replay(self, step: int) -> list[RoundAssignment]:
        """Resuming after ``step``: retrain the clients then in flight (each from its version, with its seed) and
        hold their updates, as the interrupted run did."""
        plans = []
        for t, arrivals in self.in_flight(step).items():
            steps = {a.client: a.local_steps for a in arrivals} if any(a.local_steps for a in arrivals) else None
            plans.append(RoundAssignment(t, (), self.by_rank([a.client for a in arrivals]), {}, hold=True,
                                   local_steps=steps))
        return plans


def clock_sampler(cfg: Config, placement: Placement, samples: list[float], model_bytes: int,
                  update_bytes: int, quiet: bool = False) -> Sampler:
    """The round planner for ``clock.mode``, its whole schedule planned now (ValueError: it cannot be, naming the
    key); ``samples`` is each client's training work per task, in samples; ``quiet``: say nothing (validate)."""
    # secure aggregation's threshold: a round drawing fewer runs without updates rather than reveal their sum
    min_cohort = cfg.secagg.min_cohort if cfg.secagg.enabled else 1
    if cfg.clock.mode == "off":
        return Sampler(cfg.seed, cfg.clients, placement, poisson=cfg.privacy.sampling == "poisson"
                       and cfg.privacy.mode != "off", min_cohort=min_cohort)
    num_clients = cfg.clients.num_clients
    devices = devices_for(cfg.clock, num_clients, cfg.seed)
    availability = availability_for(cfg.clock, num_clients, cfg.seed)
    faults = FaultPlan(cfg)

    def delay(round_: int, client: int, compute_seconds: float) -> float:
        """What the stalls and slowdowns striking ``client`` in ``round_`` add to its task (faults: on its home
        rank, as ``clients.placement: per_round`` is refused under a clock)."""
        return faults.virtual_delay(round_, client, placement.rank_of(client), compute_seconds)

    def duration(round_: int, client: int) -> float:  # + 0.0 without a fault: the clean run's bits
        return (devices.task_seconds(client, samples[client], model_bytes, update_bytes)
                + delay(round_, client, devices.compute_seconds(client, samples[client])))

    if cfg.clock.mode == "sync":  # planned whole now, as the asynchronous modes are: a trace too short fails here
        clock = SyncClock(cfg.seed, cfg.clients_per_round(), availability, duration, cfg.clock.deadline,
                          cfg.clock.over_selection, cfg.clients.min_participants, min_cohort)
        last = clock.round(cfg.rounds)
        if not quiet:
            log(f"sync: {cfg.rounds} rounds planned over {last.end:.1f} virtual s", rank=0)
        return SyncSampler(cfg.seed, cfg.clients, placement, clock)
    if cfg.clock.mode == "fedcompass":
        def with_steps(client: int, local_steps: int) -> float:
            return devices.task_seconds(client, local_steps * cfg.train.batch_size, model_bytes, update_bytes)

        def late(step: int, client: int, local_steps: int) -> float:
            return delay(step, client, devices.compute_seconds(client, local_steps * cfg.train.batch_size))

        plan = plan_compass(cfg.seed, cfg.rounds, cfg.clock.in_flight(), num_clients, availability, with_steps,
                            cfg.clock.min_steps, cfg.clock.max_steps, cfg.clock.latest_factor, late)
        if len(plan.steps) < cfg.rounds:
            raise ValueError(f"clock: no client can ever train again ({availability.source}); the run cannot "
                             f"reach step {len(plan.steps) + 1} of rounds={cfg.rounds}")
    else:
        buffer = 1 if cfg.clock.mode == "fedasync" else cfg.clock.buffer
        plan = plan_async(cfg.seed, cfg.rounds, buffer, cfg.clock.in_flight(), num_clients, availability, duration)
    held = held_updates(plan, placement.rank_of)
    if not quiet:
        for warning in unstruck_targets(cfg, plan.steps):
            log(f"warning: {warning}", rank=0)
        log(f"{cfg.clock.mode}: {len(plan.steps)} steps planned over {plan.steps[-1].time:.1f} virtual s; a client "
            f"rank holds at most {max(held.values(), default=0)} updates in flight ({update_bytes / MIB:.1f} MiB each; "
            "by rank: " + ", ".join(f"{r}: {n}" for r, n in sorted(held.items())) + ")", rank=0)
    return AsyncSampler(cfg.seed, cfg.clients, cfg.clock, placement, plan.steps)


def unstruck_targets(cfg: Config, steps: list[AsyncStep]) -> list[str]:
    """Under an asynchronous clock a fault strikes a client in the server step it is dispatched in (the step whose
    model it trains from: ``AsyncStep.train``), and its update is applied some steps later. A fault that names
    ``clients`` and ``rounds`` (steps) none of which dispatches one of them would never strike it, silently: each
    such client, named with the steps the schedule does dispatch it in (first few)."""
    found = []
    for index, fault in enumerate(cfg.faults):
        for client in fault.clients:
            dispatched = [s.step for s in steps if client in s.train]
            if not any(fault.strikes_in(step, cfg.rounds) for step in dispatched):
                shown = ", ".join(map(str, dispatched[:6])) + (", ..." if len(dispatched) > 6 else "")
                when = f"step{'s' if len(dispatched) > 1 else ''} {shown}" if dispatched else "no step"
                found.append(f"faults[{index}]: logical client {client} is dispatched in none of the steps it "
                             f"strikes in ({cfg.clock.mode}: a fault strikes a client in the step it is dispatched in, "
                             f"whose model it trains from), so it never strikes it; the schedule dispatches it in "
                             f"{when}")
    return found


def task_samples(train_sizes: list[int] | None, num_clients: int, local_epochs: int, local_steps: int | None,
                 batch_size: int) -> list[float]:
    """Each client's training work per task in samples: steps x batch, else its training samples x epochs
    (0 without data: the task is then only the transfers)."""
    if local_steps:
        return [float(local_steps * batch_size)] * num_clients
    if train_sizes is None:
        return [0.0] * num_clients
    return [float(n * local_epochs) for n in train_sizes]
