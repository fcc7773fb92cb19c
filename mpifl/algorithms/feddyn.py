"""FedDyn, both halves: Acar et al. 2021, "Federated Learning Based on Dynamic Regularization" (ICLR), Algorithm 1.

**The client half** (``ClientDynamics``). Each hosted logical client keeps a gradient state g_i, one fp32 value per
``trainable`` element (0 until it first trains). While client i trains from the global x, its objective is
L_i(y) - <g_i, y> + alpha/2 ||y - x||^2, so every gradient gains alpha (y - x) - g_i
(``mpifl.learning.steps.regularized_gradients``); afterwards g_i -= alpha (y - x).

**The server half** (``DynamicRegularized``): h <- h - alpha (P / N) d, then x <- x + d - h / alpha, with d the
participants' mean delta, P of them out of N clients. h is server state like FedAdam's moments (RAM or HDF5, in
every checkpoint). Participants are weighted equally (``strategy.weighting: equal``: the config checks).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from mpifl.aggregation.combiners import WeightedMean
from mpifl.aggregation.kernels import Rows
from mpifl.aggregation.strategies import Strategy, parameter_spans
from mpifl.aggregation.updates import ServerUpdate
from mpifl.algorithms.contract import ClientAlgorithm, ShardRows
from mpifl.config import StrategyConfig
from mpifl.config.capabilities import DYNAMIC_MEAN
from mpifl.config.client_state import RULE_VECTORS
from mpifl.learning.steps import regularized_gradients, regularized_shard_gradients, split, trainable
from mpifl.storage.residuals import ResidualStore
from mpifl.wire.flat import FlatModel
from mpifl.wire.spec import Chunk, ModelSpec

# --- the client half ----------------------------------------------------------------------------------------------


class ClientDynamics:
    """The hosted clients' g_i, the regulariser while one trains, and g_i's update afterwards."""

    def __init__(self, flat: FlatModel, store: ResidualStore, alpha: float, backwards_per_step: int = 1):
        """``backwards_per_step``: train.grad_accum_steps, the backward passes that make one optimizer step."""
        self.params = [p for _, p in trainable(flat.module, flat.local)]
        self.flat, self.store, self.alpha, self.backwards_per_step = flat, store, alpha, backwards_per_step
        # the training client's g_i, on the device of the model that trains
        self.states = torch.empty(sum(p.numel() for p in self.params), device=flat.device)

    @property
    def shared(self) -> torch.Tensor:
        """What a group's members need while the client trains (``GroupDynamics``): its g_i."""
        return self.states

    @contextlib.contextmanager
    def training(self, client: int, global_bytes: torch.Tensor) -> Iterator[None]:
        """Train ``client`` inside its dynamic regulariser."""
        self.states.copy_(self.store.read(client, 0))  # a disk store's read is a scratch
        states = split(self.states, self.params)
        with regularized_gradients(self.params, self.flat.views_in(self.params, global_bytes), states, self.alpha,
                                   self.backwards_per_step):
            yield

    def update(self, client: int, global_bytes: torch.Tensor, steps: int, weight: float) -> None:
        """g_i -= alpha (y - x) after ``client`` trained (y its model); a diverged client keeps its g_i."""
        moved = [p.detach().float() - x.float() for p, x in zip(self.params, self.flat.views_in(self.params,
                                                                                              global_bytes))]
        if not all(bool(torch.isfinite(m).all()) for m in moved):
            return
        keep_dynamics(self.store, client, moved, self.params, self.alpha)


def keep_dynamics(store: ResidualStore, client: int, moved: Sequence[torch.Tensor], like: Sequence[torch.Tensor],
                  alpha: float) -> None:
    """g_i -= alpha (y - x) in the store (``moved``: y - x, shaped like ``like``)."""
    own = store.read(client, 0)
    for mine, m in zip(split(own, like), moved):
        mine.sub_(m.to(mine.device), alpha=alpha)
    store.write(client, 0, own)


class ShardDynamics:
    """``ClientDynamics`` on one rank of a sharded client (``clients.sharding: fsdp``): g_i over this rank's rows of
    the trained parameters, their regulariser while a client trains (``regularized_shard_gradients``: into the
    rows of the gradients FSDP reduce-scatters) and g_i's update afterwards, elementwise as ``ClientDynamics``."""

    def __init__(self, rows: ShardRows, store: ResidualStore, alpha: float, backwards_per_step: int = 1):
        self.rows, self.store, self.alpha, self.backwards_per_step = rows, store, alpha, backwards_per_step
        self.states = torch.empty(rows.elements, device=rows.device)

    @contextlib.contextmanager
    def training(self, client: int) -> Iterator[None]:
        """Train ``client`` inside its dynamic regulariser, on this rank's rows."""
        self.states.copy_(self.store.read(client, 0))
        with regularized_shard_gradients(self.rows.params, self.rows.anchors, split(self.states, self.rows.rows),
                                         self.alpha, self.backwards_per_step):
            yield

    def update(self, client: int, steps: int, weight: float) -> None:
        """g_i -= alpha (y - x) on this rank's rows; a client diverged on any rank keeps its g_i on all."""
        moved = [y.detach().float() - x.float() for y, x in zip(self.rows.rows, self.rows.anchors)]
        if self.rows.all_ranks(all(bool(torch.isfinite(m).all()) for m in moved)):
            keep_dynamics(self.store, client, moved, self.rows.rows, self.alpha)


class GroupDynamics:
    """A group member's side of FedDyn (``clients.ranks_per_client``): the g_i of the client its group trains,
    broadcast by the leader, and the global model it trains from, kept as it arrived. Every rank adds the same
    alpha (y - x) - g_i to its gradients (y is the same on every rank of the group), so DDP's average carries it
    unchanged, as on one rank."""

    def __init__(self, flat: FlatModel, alpha: float, backwards_per_step: int = 1):
        self.params = [p for _, p in trainable(flat.module, flat.local)]
        self.flat, self.alpha, self.backwards_per_step = flat, alpha, backwards_per_step
        self.vector = torch.empty(sum(p.numel() for p in self.params), device=flat.device)
        self.global_copy = torch.empty_like(flat.buffer)

    def training(self) -> contextlib.AbstractContextManager[None]:
        """Train inside the received client's regulariser, anchored at the global model just received."""
        self.global_copy.copy_(self.flat.buffer)
        anchors = self.flat.views_in(self.params, self.global_copy)
        return regularized_gradients(self.params, anchors, split(self.vector, self.params), self.alpha,
                                     self.backwards_per_step)


CLIENT = ClientAlgorithm(
    state=RULE_VECTORS["dynamic_regularizer"],
    leader=lambda work, store, cfg: ClientDynamics(work, store, cfg.strategy.alpha, cfg.train.grad_accum_steps),
    member=lambda work, cfg: GroupDynamics(work, cfg.strategy.alpha, cfg.train.grad_accum_steps),
    shard=lambda rows, store, cfg: ShardDynamics(rows, store, cfg.strategy.alpha, cfg.train.grad_accum_steps))


# --- the server half ----------------------------------------------------------------------------------------------

class DynamicMean(WeightedMean):
    """FedDyn's combination: the participants' mean delta (equal weights: config checks); ``DynamicRegularized``
    turns it into the new model and its server state h."""

    capabilities = DYNAMIC_MEAN


class DynamicState(ServerUpdate):
    """FedDyn's server state h, one fp32 value per element (0 at the start); ``DynamicRegularized`` updates it with
    the round's participant count, which a step does not see."""

    reads_previous = True

    def __init__(self, cfg: StrategyConfig) -> None:
        super().__init__(cfg)
        self.state_init = {"h": 0.0}


class DynamicRegularized(Strategy):
    """FedDyn's server: h <- h - alpha (P / N) d, then x <- x + d - h / alpha."""

    def bind(self, spec: ModelSpec, num_clients: int) -> None:
        """Learn N, the federation's size, and where the statistics lie."""
        super().bind(spec, num_clients)
        self.num_clients = num_clients

    def finish(self, acc: Rows, count: int, total_weight: float, target: torch.Tensor,
               state: dict[str, torch.Tensor], chunk: Chunk | None = None) -> None:
        """H and the new global chunk from the mean delta, in fp32; statistics take the mean delta alone (their h
        stays 0: the regulariser is on the parameters)."""
        mean: torch.Tensor = self.combiner.combine(acc, count, total_weight)  # type: ignore[arg-type]
        alpha = self.cfg.alpha
        h = state["h"]
        for lo, hi in parameter_spans(self.statistic_spans(chunk), mean.numel()):
            # P is the total weight (equal weights, config checks): count is the streams folded, groups or clients
            h[lo:hi].sub_(mean[lo:hi], alpha=alpha * total_weight / self.num_clients)
            mean[lo:hi].sub_(h[lo:hi], alpha=1 / alpha)
        mean.add_(target)  # in fp32, rounded once into the model's dtype
        target.copy_(mean)
