"""One round's reduction as a task: who sends what and how it is weighed (``ReductionRound``), and the round's
totals once every header is in (``checked_totals``, ``round_totals``), with the quorum rules that abort a round
before anything is written (``RoundAborted``). Pure bookkeeping, apart from MPI: the receiver is reduction.py's."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mpifl.aggregation.strategies import Strategy
from mpifl.planning.pools import PoolLayout
from mpifl.wire import protocol


class RoundAborted(RuntimeError):
    """Too few usable updates: the round is not applied and the job stops."""


class BelowQuorum(RoundAborted):
    """Fewer usable updates than clients.min_participants or secagg.min_cohort: the round is not applied. Under a
    virtual clock (``ReductionRound.keep_model``) the model stays as it was and the run goes on, as when too few
    updates arrive in time (unless usable clients moved state the run cannot put back:
    ``ReductionRound.unrestorable_state``);
    otherwise the job stops. ``usable``: how many updates were usable."""

    def __init__(self, message: str, usable: int) -> None:
        super().__init__(message)
        self.usable = usable


@dataclass(frozen=True)
class ReductionRound:
    """What one round's reduction folds and how: who sends what, the pool layout, and the round's own
    weights, divisor, noise and unmasking (each None when the round has none)."""

    round: int
    by_rank: dict[int, list[int]]  # rank -> its streams (participants or groups), in fold order
    layout: PoolLayout
    order: Sequence[int] | None = None  # the streams' fold order when not ascending
    weights: Mapping[int, float] | None = None  # asynchronous FL's staleness weights
    divisor: float | None = None  # a fixed divisor of the weighted sum (FedBuff's K, DP-FedAvg's k)
    noise: Callable[[torch.Tensor, int], None] | None = None  # DP-FedAvg: adds noise to a chunk's sum
    unmask: Callable[[torch.Tensor, int, Mapping], None] | None = None  # secure aggregation: ring sum to floats
    labels: Mapping[int, str] | None = None  # what a stream is called in messages, where more than its id says
    min_participants: int = 1  # clients.min_participants: fewer usable updates abort the round
    min_cohort: int = 1  # secagg.min_cohort: fewer usable updates abort the round, their sum would reveal them
    header_clients: int = 1  # the most logical clients one header lists (a reduction group's members)
    keep_model: bool = False  # a virtual clock: too few usable updates leave the model unchanged, the run goes on
    # per-client state that must read as if the client had not trained and that the run cannot put back (SCAFFOLD's
    # c_i, FedDyn's g_i or declared vectors without clients.accept_failures' journal): usable updates moved it on,
    # so too few of them still abort the round; with none usable it is left out. With the journal they are put back
    # (the server names the usable clients as dropped); top-k's residuals, local tensors and Ditto's personal models
    # keep what the training made of them, as a dropped client's do
    unrestorable_state: bool = False

    @property
    def quorum(self) -> int:
        """The fewest usable updates the round is applied with."""
        return max(self.min_participants, self.min_cohort)

    @functools.cached_property
    def meta_tag(self) -> int:
        """The tag of the round's update headers."""
        return protocol.round_tag(protocol.META, self.round)

    @functools.cached_property
    def update_tag(self) -> int:
        """The tag of the round's update chunks."""
        return protocol.round_tag(protocol.UPDATE, self.round)


def checked_totals(strategy: Strategy, metas: Mapping[int, protocol.UpdateMeta], task: ReductionRound,
                   order: Sequence[int]) -> tuple[float, float | None]:
    """The round's divisor and statistics total (``round_totals``) once every header is in; a round with fewer
    usable updates than clients.min_participants or secagg.min_cohort, or with no weight, is aborted before anything
    is written."""
    usable = [m for m in metas.values() if m.error is None]
    only = f"round {task.round}: only {len(usable)} of {len(metas)} participants sent a usable update"
    if len(usable) < task.min_participants:
        raise BelowQuorum(f"{only}, fewer than clients.min_participants={task.min_participants}; the round is not "
                          "applied", len(usable))
    if len(usable) < task.min_cohort:
        raise BelowQuorum(f"{only}, fewer than secagg.min_cohort={task.min_cohort}: the securely aggregated sum of "
                          f"so few would reveal what they sent{' (one update, exactly)' if len(usable) == 1 else ''}; "
                          "the round is not applied, and it is not unmasked", len(usable))
    total, statistics = round_totals(strategy, usable, task.weights, task.divisor, len(metas) - len(usable))
    if total <= 0:
        raise RoundAborted(f"round {task.round}: zero total client weight (clients {order}); cannot average")
    return total, statistics


def round_totals(strategy: Strategy, usable: Sequence[protocol.UpdateMeta], weights: Mapping[int, float] | None,
                 divisor: float | None, dropped: int = 0) -> tuple[float, float | None]:
    """What the round's weighted sum is divided by, and its statistics where that differs (None: the same), from
    its usable participants' headers: a fixed divisor (DP-FedAvg's k; FedBuff's K less the ``dropped`` updates of
    its buffer, so that a dropped update does not shrink the step), asynchronous FL's staleness weights' sum, or
    the strategy's own total; the statistics take, asynchronously where they arrive as values, their weights' own
    sum (not FedBuff's K), otherwise the strategy's (FedNova's)."""
    if weights is not None:
        own = math.fsum(weights[m.client] for m in usable)
        total = divisor - dropped if divisor is not None else sum(weights[m.client] for m in usable)
        return total, own if strategy.statistics_absolute else None
    if divisor is not None:
        return divisor, None
    return strategy.total_weight(usable), strategy.statistics_total(usable)
