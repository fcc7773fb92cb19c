"""Server updates, the second stage of a strategy: how the combined chunk becomes the new global chunk.

Every update here is ``new = old + step(delta)`` on the fp32 pseudo-gradient ``delta`` (the
combined deltas, or combined weights - old global). ``step`` rewrites ``delta`` in place and
may keep per-element fp32 server state (``state_init``: vector name -> initial value; the
stores keep the vectors in RAM or HDF5 and in checkpoints). An update that forms the
pseudo-gradient declares ``reads_previous``; plain replacement does not. New updates go here
and are named in ``registry.BUILTIN``.
"""
from __future__ import annotations

import torch

from mpifl.aggregation import kernels
from mpifl.config import StrategyConfig


class ServerUpdate:
    """Base class: no server state and the identity step (the combined chunk replaces the global one)."""

    reads_previous = False  # whether the step needs the old global chunk (weights sent, not deltas)
    # Whether the step is part of how updates are combined, and so applies to the model's statistics (BatchNorm's
    # running mean and variance) too: FedAsync's mixing. A server optimizer's is not: statistics skip it.
    combines = False

    def __init__(self, cfg: StrategyConfig) -> None:
        self.cfg = cfg
        self.state_init: dict[str, float] = {}

    @property
    def state_bytes_per_element(self) -> int:
        """Bytes of server state per model element: one fp32 value per state vector."""
        return kernels.ACCUMULATOR_DTYPE.itemsize * len(self.state_init)

    def step(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Turn the pseudo-gradient into the step added to the old global chunk, in place (identity here)."""


class Replace(ServerUpdate):
    """FedAvg (McMahan et al. 2017): the new global chunk is the combined one."""


class GlobalStep(ServerUpdate):
    """x += eta_g * delta: a plain global step size on the combined delta (SCAFFOLD's eta_g,
    ``strategy.server_lr``, 1.0 by default: then exactly FedAvg's replacement)."""

    reads_previous = True

    def __init__(self, cfg: StrategyConfig) -> None:
        super().__init__(cfg)
        self.lr = cfg.server_lr if cfg.server_lr is not None else 1.0

    def step(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Scale the pseudo-gradient by eta_g (untouched at 1.0)."""
        if self.lr != 1.0:
            delta.mul_(self.lr)


class ServerOptimizer(ServerUpdate):
    """A server optimizer on the pseudo-gradient, with learning rate ``strategy.server_lr``."""

    reads_previous = True
    default_lr = 1.0

    def __init__(self, cfg: StrategyConfig) -> None:
        super().__init__(cfg)
        self.lr = cfg.server_lr if cfg.server_lr is not None else self.default_lr


class Momentum(ServerOptimizer):
    """FedAvgM (Hsu et al. 2019): v = beta*v + delta; step = lr*v."""

    def __init__(self, cfg: StrategyConfig) -> None:
        super().__init__(cfg)
        self.state_init = {"velocity": 0.0}

    def step(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Server momentum with beta = ``strategy.momentum``."""
        kernels.momentum_step(delta, state, self.lr, self.cfg.momentum)


class Adaptive(ServerOptimizer):
    """Reddi et al. 2021, Algorithm 2: step = lr * m / (sqrt(v) + tau), v from ``second_moment``."""

    default_lr = 0.01
    second_moment: kernels.SecondMoment

    def __init__(self, cfg: StrategyConfig) -> None:
        super().__init__(cfg)
        self.state_init = {"m": 0.0, "v": cfg.tau ** 2}

    def step(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """One adaptive step with ``strategy.beta1``, ``beta2`` and ``tau``."""
        cfg = self.cfg
        kernels.adaptive_step(delta, state, self.second_moment, self.lr, cfg.beta1, cfg.beta2, cfg.tau)


class FedAdam(Adaptive):
    """FedAdam: v = beta2*v + (1-beta2)*delta^2."""

    second_moment = staticmethod(kernels.adam_second_moment)


class FedYogi(Adaptive):
    """FedYogi: v = v - (1-beta2)*delta^2*sign(v - delta^2)."""

    second_moment = staticmethod(kernels.yogi_second_moment)


class FedAdagrad(Adaptive):
    """FedAdagrad: v = v + delta^2."""

    second_moment = staticmethod(kernels.adagrad_second_moment)


class Mixing(ServerUpdate):
    """FedAsync (Xie et al. 2019): x = (1 - a) x + a x_client, as x + a (x_client - x); the asynchronous
    schedule sets ``alpha`` (a = alpha x s(staleness)) before each step."""

    reads_previous = True
    combines = True  # x = (1 - a) x + a x_client is the aggregation itself: statistics are mixed as well

    def __init__(self, cfg: StrategyConfig) -> None:
        super().__init__(cfg)
        self.alpha = 1.0

    def step(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Step = a * (x_client - x)."""
        delta.mul_(self.alpha)
