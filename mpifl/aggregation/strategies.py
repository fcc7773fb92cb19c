"""A strategy: a combiner and a server update, composed into what the reduction and server call.

A strategy decides, it never communicates. For every chunk of the model the server

1. *combines* the participants' chunks (weights or deltas, as the clients send them) with the
   strategy's combiner (combiners.py): a weighted mean folded into an fp32 accumulator, or a
   coordinate-wise median / trimmed mean over a stack of every participant's chunk
   (participants x chunk, never participants x model);
2. *updates* the global chunk with its server update (updates.py): plain replacement
   (FedAvg), or a server optimizer step on the pseudo-gradient ``delta = combined - global``
   (FedAvgM, FedAdam, FedYogi, FedAdagrad; Reddi et al. 2021), whose moments live in
   chunk-addressable fp32 server-state vectors (RAM or HDF5, saved in checkpoints).

Everything is computed in fp32 and rounded once into the model's dtype. ``make_strategy``
builds a registered name (registry.py) or calls an import path ``package.module:attr`` as
``attr(cfg, **cfg.kwargs)``, cfg the StrategyConfig; attr returns a Strategy (or is a Strategy
subclass). A strategy's ``capabilities`` (what run modes it can take) come from its combiner's
declaration (or the safe assumption when it declares none) and its server update's state.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from mpifl.aggregation.combiners import Combiner, declared_capabilities
from mpifl.aggregation.kernels import ACCUMULATOR_DTYPE, Rows
from mpifl.aggregation.registry import BUILTIN, STRATEGIES, stages
from mpifl.aggregation.updates import ServerUpdate
from mpifl.config import ConfigError, StrategyConfig
from mpifl.config.capabilities import UNDECLARED, Capabilities
from mpifl.plugins import is_import_path, resolve
from mpifl.wire.protocol import UpdateMeta

__all__ = ["ACCUMULATOR_DTYPE", "Strategy", "make_strategy"]


class Strategy:
    """What the streamed reduction calls for each chunk (weight, fold, finish) and planning asks (bytes)."""

    def __init__(self, cfg: StrategyConfig, combiner: Combiner, update: ServerUpdate,
                 capabilities: Capabilities | None = None) -> None:
        self.cfg, self.combiner, self.update = cfg, combiner, update
        self.name = cfg.name
        self.delta = cfg.update == "delta"  # clients send trained - global, not their weights
        self.stacked = combiner.stacked
        self.state_init = dict(update.state_init)
        self.weigher = combiner  # whose weight_of weighs the participants (kept when a run mode swaps the combiner)
        declared = capabilities or declared_capabilities(combiner)
        self.declared = declared is not None  # False: the checks assume the safe side and say how to declare
        base = declared or UNDECLARED
        self.capabilities = dataclasses.replace(base, server_state=base.server_state or bool(self.state_init))

    @property
    def needs_previous_global(self) -> bool:
        """Whether finishing a chunk reads the old global chunk (deltas and server optimizers do)."""
        return self.delta or self.update.reads_previous

    def weight(self, num_samples: int) -> float:
        """A participant's weight in the combination, from its sample count."""
        return self.combiner.weight(num_samples)

    def weight_of(self, meta: UpdateMeta) -> float:
        """A participant's weight from its whole update header (the combiner's ``weight_of``)."""
        return self.weigher.weight_of(meta)

    def total_weight(self, metas: Sequence[UpdateMeta]) -> float:
        """What the round's weighted sum is divided by, from its usable participants' headers."""
        return self.weigher.total_weight(metas)

    def substituted(self, combiner: Combiner | None = None, update: ServerUpdate | None = None) -> Strategy:
        """A twin with the stage a run mode substitutes (secure aggregation's ring sum, FedAsync's mixing); the
        participants keep this strategy's weights and the twin keeps its capabilities."""
        twin = copy.copy(self)
        Strategy.__init__(twin, self.cfg, combiner or self.combiner, update or self.update, self.capabilities)
        twin.weigher = self.weigher
        return twin

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, index: int) -> None:
        """Take in the ``index``-th included participant's chunk (acc is a stack row per participant when stacked)."""
        self.combiner.fold(acc, x, weight, index)

    def finish(self, acc: Rows, count: int, total_weight: float, target: torch.Tensor,
               state: dict[str, torch.Tensor]) -> None:
        """Write the new global chunk into ``target`` (which holds the old one where needed).

        ``acc`` is one fp32 accumulator, or, for a stacking combiner whose stack is held in the receive
        slots, its rows: only stacking combiners ever get rows, and they take ``kernels.Rows``."""
        stack: torch.Tensor = acc  # type: ignore[assignment]  # rows reach stacking combiners only (see above)
        if not self.needs_previous_global:  # FedAvg: one fp32 division (or copy) into target, one rounding
            self.combiner.combine_into(target, stack, count, total_weight)
            return
        combined = self.combiner.combine(stack, count, total_weight)
        if not self.delta:
            combined.sub_(target)  # pseudo-gradient: combined weights - old global
        self.update.step(combined, state)
        combined.add_(target)
        target.copy_(combined)

    def start_finish(self, acc: Rows, count: int, total_weight: float, target: torch.Tensor,
                     state: dict[str, torch.Tensor]) -> list[Future] | None:
        """Begin ``finish`` on the combiner's worker threads, so the caller can go on receiving; the
        jobs' results say when ``target`` is written. None: this strategy finishes only in the caller."""
        if self.needs_previous_global:
            return None
        return self.combiner.start_combine_into(target, acc, count, total_weight)

    def state_bytes(self, elements: int) -> int:
        """Bytes of server state (fp32 vectors) for a model of ``elements`` exchanged elements."""
        return elements * self.update.state_bytes_per_element

    def accumulator_rows(self, participants: int) -> int:
        """fp32 accumulator rows per chunk for ``participants`` participants (1, or one per participant)."""
        return self.combiner.accumulator_rows(participants)


def make_strategy(cfg: StrategyConfig) -> Strategy:
    """The strategy named in the config: a registered name, or an import path called as ``fn(cfg, **cfg.kwargs)``."""
    if cfg.name in BUILTIN:
        combiner, update = stages(cfg.name)
        return Strategy(cfg, combiner(cfg), update(cfg))
    if not is_import_path(cfg.name):
        raise ConfigError(f"strategy.name: {cfg.name!r} is not allowed; choose one of "
                          f"{', '.join(map(repr, STRATEGIES))} or an import path 'package.module:function'")
    try:
        build = resolve(cfg.name)
    except ImportError as err:
        raise ConfigError(f"strategy.name: {err}") from None
    try:
        inspect.signature(build).bind(cfg, **cfg.kwargs)
    except TypeError as err:
        raise ConfigError(f"strategy.kwargs: {cfg.name!r} is called as fn(cfg, **strategy.kwargs): {err}") from None
    except ValueError:  # no signature to check against
        pass
    strategy = build(cfg, **cfg.kwargs)
    if not isinstance(strategy, Strategy):
        raise ConfigError(f"strategy.name: {cfg.name!r} returned {type(strategy).__name__}, not a "
                          "mpifl.aggregation.strategies.Strategy")
    return strategy
