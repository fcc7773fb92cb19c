"""Who takes part and where they live: sampling, placement and round assignments, pure functions of the config."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from mpifl.config import ClientsConfig
from mpifl.planning.seeds import POISSON, SAMPLING, derive_seed


def sample_clients(seed: int, round_: int, num_clients: int, per_round: int) -> list[int]:
    """The sorted logical client ids taking part in a round."""
    rng = np.random.default_rng(derive_seed(seed, SAMPLING, round_))
    return sorted(int(c) for c in rng.choice(num_clients, size=per_round, replace=False))


def poisson_sample(seed: int, round_: int, num_clients: int, rate: float) -> list[int]:
    """Each client takes part independently with probability ``rate`` (sorted ids; possibly none)."""
    rng = np.random.default_rng(derive_seed(seed, SAMPLING, POISSON, round_))
    return [int(c) for c in np.flatnonzero(rng.random(num_clients) < rate)]


def group_of(client: int, groups: int) -> int:
    """A logical client's reduction group (``clients.groups``); without groups, the client itself."""
    return client % groups if groups else client


def rank_of_client(client: int, client_ranks: int, groups: int = 0) -> int:
    """The rank hosting a logical client: its group (or itself), round-robin over ranks 1..client_ranks."""
    return 1 + group_of(client, groups) % client_ranks


def group_by_rank(clients: list[int], client_ranks: int, groups: int = 0) -> dict[int, list[int]]:
    """Map each hosting rank to the (ascending) participants it serves (round robin)."""
    return Placement(client_ranks, groups).by_rank(clients)


def clients_of_rank(rank: int, num_clients: int, client_ranks: int, groups: int = 0) -> list[int]:
    """Every logical client a rank hosts (round robin)."""
    return Placement(client_ranks, groups).clients_of(rank, num_clients)


def longest_first(costs: dict[int, float], client_ranks: int, ranks: Sequence[int] | None = None) -> dict[int, int]:
    """Each unit's rank (1..client_ranks, or one of ``ranks``): the costliest unit first, each to the least loaded
    rank (lowest rank on ties), Graham's LPT rule; a pure function of its arguments, so every call agrees."""
    load = {rank: 0.0 for rank in (ranks if ranks is not None else range(1, client_ranks + 1))}
    rank_of_unit = {}
    for unit in sorted(costs, key=lambda u: (-costs[u], u)):
        r = min(load, key=lambda rank: (load[rank], rank))
        load[r] += costs[unit]
        rank_of_unit[unit] = r
    return rank_of_unit


def cost_groups(participants: Sequence[int], work: Sequence[float], groups: int) -> dict[int, int]:
    """``clients.group_by: cost``: each participant's reduction group (0..groups-1) this round, by Graham's LPT
    rule on its work (samples x epochs): the heaviest first, each into the lightest group (lowest id on ties).
    A pure function of the participants and their work, never of the ranks: results stay rank-count independent."""
    rank_of_unit = longest_first({c: work[c] for c in participants}, groups)
    return {c: r - 1 for c, r in sorted(rank_of_unit.items())}


def balanced_ranks(work: list[float], client_ranks: int, groups: int = 0) -> list[int]:
    """Each client's rank, balancing work (samples x epochs) over ranks: the heaviest unit (a client, or a
    group with clients.groups) first, each to the least loaded rank (lowest rank on ties). Deterministic."""
    units: dict[int, float] = {}
    for client, w in enumerate(work):
        units[group_of(client, groups)] = units.get(group_of(client, groups), 0.0) + w
    rank_of_unit = longest_first(units, client_ranks)
    return [rank_of_unit[group_of(c, groups)] for c in range(len(work))]


def state_home(client: int, client_ranks: int) -> int:
    """The rank that keeps ``client``'s per-client state when ``clients.placement: per_round`` trains it anywhere:
    round robin, 1 + c mod N, so that every rank keeps the same number of clients' vectors."""
    return rank_of_client(client, client_ranks)


def state_loans(train: dict[int, list[int]], client_ranks: int) -> tuple[dict[int, list[tuple[int, int]]],
                                                                       dict[int, list[tuple[int, int]]]]:
    """A per_round round's moves of per-client state, from who trains whom (rank -> clients): what each rank
    borrows, [(client, home)], and what it lends, [(client, trainer)], each ascending by client. A client that
    trains at its home moves nothing."""
    borrow: dict[int, list[tuple[int, int]]] = {}
    lend: dict[int, list[tuple[int, int]]] = {}
    for rank, clients in train.items():
        for client in clients:
            home = state_home(client, client_ranks)
            if home != rank:
                borrow.setdefault(rank, []).append((client, home))
                lend.setdefault(home, []).append((client, rank))
    return ({r: sorted(moves) for r, moves in borrow.items()}, {r: sorted(moves) for r, moves in lend.items()})


def fitted_overhead(observations: list[tuple[int, float, float]]) -> float | None:
    """A logical client's fixed cost in units of work (samples x epochs), from each rank's round as (clients, work,
    seconds): the least-squares fit of seconds = a x clients + b x work, returned as a / b (at least 0). None while
    the fit is undetermined: fewer than two independent rows, or no cost per unit of work (b <= 0)."""
    snn = snw = sww = snt = swt = 0.0
    for n, w, t in observations:
        snn, snw, sww, snt, swt = snn + n * n, snw + n * w, sww + w * w, snt + n * t, swt + w * t
    det = snn * sww - snw * snw
    if det <= 1e-9 * max(snn * sww, 1e-300):
        return None
    a, b = (snt * sww - swt * snw) / det, (snn * swt - snw * snt) / det
    return max(a, 0.0) / b if b > 0 else None


def even_spread(participants: int, client_ranks: int) -> int:
    """The most participants a rank trains when a round's are dealt evenly over the client ranks (per_round)."""
    return math.ceil(participants / max(1, client_ranks))


def most_trained_per_rank(clients: ClientsConfig, client_ranks: int) -> int:
    """The most participants one client rank trains in a round, whoever the sample draws.

    ``clients.placement: per_round`` deals a round's participants evenly over the ranks. A fixed placement
    (round_robin, balanced) does not: the sample may draw several clients that one rank hosts, so a rank can train
    up to as many participants as it hosts, even in a round with no more participants than ranks. Some rank hosts
    ceil(clients / ranks) or more, the exact worst case under round_robin (balanced may host more on one rank),
    which is all a caller asks: whether a rank may train, and send, more than one.
    """
    ranks, per_round = max(1, client_ranks), clients.per_round_count()
    spread = even_spread(per_round, ranks)
    if clients.placement == "per_round":
        return spread
    return max(spread, min(per_round, math.ceil(clients.num_clients / ranks)))


class Placement:
    """Which rank hosts each logical client: round robin (the default), or a table (``clients.placement``)."""

    def __init__(self, client_ranks: int, groups: int = 0, table: list[int] | None = None):
        self.client_ranks, self.groups, self.table = client_ranks, groups, table

    def rank_of(self, client: int) -> int:
        """The rank hosting ``client``."""
        return self.table[client] if self.table is not None else rank_of_client(client, self.client_ranks, self.groups)

    def clients_of(self, rank: int, num_clients: int) -> list[int]:
        """Every logical client ``rank`` hosts."""
        return [c for c in range(num_clients) if self.rank_of(c) == rank]

    def by_rank(self, clients: list[int], ready: Sequence[int] | None = None,
                unit_of: dict[int, int] | None = None) -> dict[int, list[int]]:
        """Map each hosting rank to the (ascending) clients of ``clients`` it serves (``ready`` and ``unit_of``: the
        ranks that may take them and what stays together, which a fixed placement has no say in)."""
        out: dict[int, list[int]] = {}
        for c in sorted(clients):
            out.setdefault(self.rank_of(c), []).append(c)
        return out

    def round_groups(self, clients: list[int]) -> dict[int, int]:
        """Each of a round's participants' reduction group (``clients.groups``): c mod G, or c itself without."""
        return {c: group_of(c, self.groups) for c in clients}

    def observe(self, train: dict[int, list[int]], seconds: dict[int, float]) -> None:
        """What each rank's clients took to train in a round (rank -> clients, rank -> seconds); a fixed
        placement has no use for it."""

    def streams(self, clients: list[int]) -> dict[int, list[int]]:
        """What each rank sends the server, ascending: its participants, or their groups' partial sums."""
        by_rank = self.by_rank(clients)
        if not self.groups:
            return by_rank
        group = self.round_groups(clients)
        return {rank: sorted({group[c] for c in members}) for rank, members in by_rank.items()}


class RoundBalancedPlacement(Placement):
    """``clients.placement: per_round``: every client rank can train every client (each holds the whole training
    set), and each round's participants (or, with clients.groups, their groups) go to the ranks by Graham's LPT
    rule on their estimated cost, overhead + samples x epochs each. The overhead, a client's fixed cost in units of
    work (model reset, optimizer, the first and the last small batch), is fitted to the training seconds every
    rank reports (``observe``), so it is 0 until a round has been measured.

    Where a client trains never changes a result: updates are folded in participant order, or group sums in group
    order, whatever rank formed them; only how long the round takes depends on the measured times."""

    def __init__(self, client_ranks: int, groups: int, work: list[float], group_by: str = "id"):
        super().__init__(client_ranks, groups)
        self.work, self.overhead, self.group_by = work, 0.0, group_by
        self.observations: list[tuple[int, float, float]] = []

    def round_groups(self, clients: list[int]) -> dict[int, int]:
        """Each participant's reduction group: by id (c mod G), or (``clients.group_by: cost``) formed anew from
        the round's participants by their work."""
        if self.groups and self.group_by == "cost":
            return cost_groups(clients, self.work, self.groups)
        return super().round_groups(clients)

    def rank_of(self, client: int) -> int:
        """No fixed answer: a client's rank changes from round to round."""
        raise ValueError("clients.placement 'per_round' places a client anew every round: ask the round's "
                         "RoundAssignment (rank_of), not the placement")

    def clients_of(self, rank: int, num_clients: int) -> list[int]:
        """Every client: any rank may train any of them."""
        return list(range(num_clients))

    def by_rank(self, clients: list[int], ready: Sequence[int] | None = None,
                unit_of: dict[int, int] | None = None) -> dict[int, list[int]]:
        """A round's clients by rank: their units (clients, or groups; ``unit_of``: each client's, when the round
        has fixed them already) spread by estimated cost over the client ranks, or over the ``ready`` ones."""
        group = unit_of if unit_of is not None else self.round_groups(clients)
        units: dict[int, float] = {}
        for c in clients:
            units[group[c]] = units.get(group[c], 0.0) + self.overhead + self.work[c]
        rank_of_unit = longest_first(units, self.client_ranks, ready)
        out: dict[int, list[int]] = {}
        for c in sorted(clients):
            out.setdefault(rank_of_unit[group[c]], []).append(c)
        return dict(sorted(out.items()))

    def observe(self, train: dict[int, list[int]], seconds: dict[int, float]) -> None:
        """Add a round's measured training seconds per rank and refit the per-client overhead."""
        for rank, clients in train.items():
            if clients and rank in seconds:
                self.observations.append((len(clients), sum(self.work[c] for c in clients), seconds[rank]))
        fitted = fitted_overhead(self.observations)
        if fitted is not None:
            self.overhead = fitted


def placement_for(clients: ClientsConfig, client_ranks: int, work: list[float] | None) -> Placement:
    """The ``clients.placement`` of this run; ``work`` is each client's samples x epochs (None: unknown)."""
    if clients.placement in ("balanced", "per_round"):
        work = work if work is not None else [1.0] * clients.num_clients
        if clients.placement == "per_round":
            return RoundBalancedPlacement(client_ranks, clients.groups, work, clients.group_by)
        return Placement(client_ranks, clients.groups, balanced_ranks(work, client_ranks, clients.groups))
    return Placement(client_ranks, clients.groups)


@dataclass(frozen=True)
class RoundAssignment:
    """What one round (or asynchronous step) does: who trains, whose updates are reduced, and how."""

    round: int
    participants: tuple[int, ...]  # whose updates are reduced, in fold order
    train: dict[int, list[int]]  # rank -> clients that train from the model sent this round (ascending)
    streams: dict[int, list[int]]  # rank -> what it sends, in fold order: participants, or groups' partial sums
    order: tuple[int, ...] | None = None  # the fold order of the streams when not ascending
    hold: bool = False  # trained updates stay on their ranks until a round lists them in ``streams``
    weights: dict[int, float] | None = None  # per participant, replacing the strategy's weight
    # a fixed divisor of the weighted sum (FedBuff's K, DP-FedAvg's k), not the total weight
    divisor: float | None = None
    mixing: float | None = None  # fedasync: this step's alpha x s(staleness)
    local_steps: dict[int, int] | None = None  # fedcompass: each trainer's own local steps
    clock: dict = field(default_factory=dict)  # virtual-time fields for the round's record
    groups: dict[int, int] | None = None  # clients.group_by 'cost': each participant's reduction group this round
    # clients.accept_failures: ranks still training a round they were dropped from (rank -> that round), which get
    # nothing this round, and the sampled clients left out for them, as if not sampled (client -> that rank)
    busy_ranks: dict[int, int] = field(default_factory=dict)
    busy_clients: dict[int, int] = field(default_factory=dict)
    # secagg.min_cohort: the clients drawn (Poisson sampling) and left out, too few for their sum to hide them
    withheld: tuple[int, ...] = ()

    def group_of(self, client: int, groups: int) -> int:
        """``client``'s reduction group this round (``groups``: clients.groups)."""
        return self.groups[client] if self.groups is not None else group_of(client, groups)

    def rank_of(self, client: int) -> int | None:
        """The rank that trains ``client`` this round (None: it does not train in it)."""
        return self._trainer_of.get(client)

    @functools.cached_property
    def _trainer_of(self) -> dict[int, int]:
        """Each training client's rank, built once: the record asks it for every participant."""
        return {client: rank for rank, clients in self.train.items() for client in clients}


class Sampler:
    """Each round's participants and their ranks, from the root seed and the ``clients`` section."""

    def __init__(self, seed: int, clients: ClientsConfig, placement: Placement, poisson: bool = False,
                 min_cohort: int = 1):
        """``min_cohort``: secagg.min_cohort, the fewest participants a round runs with (1 without secure
        aggregation); fewer drawn (Poisson sampling) are left out, and the round runs without updates."""
        self.seed, self.clients, self.placement, self.poisson = seed, clients, placement, poisson
        self.per_round, self.min_cohort = clients.per_round_count(), min_cohort

    def participants(self, round_: int) -> list[int]:
        """The sorted logical client ids taking part in ``round_`` (with ``poisson``, each client independently
        with probability per_round / num_clients: the count varies)."""
        if self.poisson:
            return poisson_sample(self.seed, round_, self.clients.num_clients,
                                  self.per_round / self.clients.num_clients)
        return sample_clients(self.seed, round_, self.clients.num_clients, self.per_round)

    def plan(self, round_: int) -> RoundAssignment:
        """A synchronous round in real time: the sampled clients train and send, in ascending id; fewer than
        ``min_cohort`` are withheld: nobody trains, and the round's sum (of nothing) reveals none of them."""
        participants = self.participants(round_)
        withheld = tuple(participants) if len(participants) < self.min_cohort else ()
        if withheld:
            participants = []
        groups = self.placement.round_groups(participants) if self.clients.group_by == "cost" else None
        return RoundAssignment(round_, tuple(participants), self.by_rank(participants), self.streams(participants),
                               groups=groups, withheld=withheld)

    def without_busy(self, plan: RoundAssignment, busy: dict[int, int],
                     state_home: Callable[[int], int] | None = None, least: int = 1) -> RoundAssignment:
        """``plan`` with the ``busy`` ranks (rank -> the round they were dropped from and still train) left out, so
        that nobody waits for them: a client whose rank is busy (or, when per-client state is lent, whose state's
        home is) is left out of the round as if it had not been sampled; under ``clients.placement: per_round`` the
        rest is dealt to the ready ranks. Only for a plain synchronous round: asynchronous steps and fixed
        weights or divisors never drop a rank. ``plan`` unchanged, to wait for the busy ranks as before, when no
        rank is ready or fewer than ``least`` participants (clients.min_participants) would be left."""
        if not busy or plan.hold or plan.order is not None or plan.weights is not None or \
                plan.divisor is not None or plan.local_steps is not None:
            return plan
        per_round = isinstance(self.placement, RoundBalancedPlacement)
        ready = [r for r in range(1, self.placement.client_ranks + 1) if r not in busy]
        trained_on = {} if per_round else {c: rank for rank, clients in plan.train.items() for c in clients}
        left_out: dict[int, int] = {}
        for client in plan.participants:
            blocker = trained_on.get(client)
            if state_home is not None and state_home(client) in busy:
                blocker = state_home(client)
            if blocker in busy:
                left_out[client] = blocker
        kept = [c for c in plan.participants if c not in left_out]
        if not ready or len(kept) < least:
            return plan
        gs = self.clients.groups
        train = self.placement.by_rank(kept, ready, {c: plan.group_of(c, gs) for c in kept}) if per_round else {
            rank: [c for c in clients if c not in left_out] for rank, clients in plan.train.items()}
        train = {rank: clients for rank, clients in train.items() if clients}
        groups = {c: g for c, g in plan.groups.items() if c not in left_out} if plan.groups is not None else None
        streams = {rank: sorted({plan.group_of(c, gs) for c in clients}) if gs else list(clients)
                   for rank, clients in train.items()}
        return replace(plan, participants=tuple(kept), train=train, streams=streams, groups=groups,
                       busy_ranks=dict(busy), busy_clients=left_out)

    def stream_members(self, plan: RoundAssignment, rank: int, stream: int) -> tuple[int, ...]:
        """The logical clients whose updates ``rank``'s stream ``stream`` carries in ``plan``: the participant
        itself, or (clients.groups) the group's members the rank trains."""
        groups = self.clients.groups
        return tuple(c for c in plan.train.get(rank, ()) if plan.group_of(c, groups) == stream) if groups else (stream,)

    def open_versions(self, round_: int) -> set[int]:
        """Model versions a resume after ``round_`` may need besides its own (asynchronous FL only)."""
        return set()

    def replay(self, round_: int) -> list[RoundAssignment]:
        """What a resume after ``round_`` redoes before going on (asynchronous FL only: nothing here)."""
        return []

    def by_rank(self, participants: list[int]) -> dict[int, list[int]]:
        """Each hosting rank's participants, ascending."""
        return self.placement.by_rank(participants)

    def streams(self, participants: list[int]) -> dict[int, list[int]]:
        """Each hosting rank's update streams: participants, or reduction groups (``clients.groups``)."""
        return self.placement.streams(participants)

    def rank_of(self, client: int) -> int:
        """The rank hosting ``client``."""
        return self.placement.rank_of(client)
