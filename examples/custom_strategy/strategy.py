"""FedAvg with a power-law client weighting: a participant weighs ``samples ** power``.

``power = 1`` is FedAvg, ``power = 0`` equal weights; in between, large clients count less than
their share. mpifl calls ``build(cfg, **strategy.kwargs)``; the combiner declares that it is a
weighted sum, so the strategy runs with reduction groups, the chain and secure aggregation (not
with differential privacy, which needs equal weights).
"""
from __future__ import annotations

from mpifl.api import Capabilities, Replace, Strategy, StrategyConfig, UpdateMeta, WeightedMean


class PowerMean(WeightedMean):
    """The weighted mean of WeightedMean (its fused fold), with weights ``samples ** power``."""

    # Inherited from WeightedMean all the same (only the weights change); declared here to say it outright.
    capabilities = Capabilities(summable=True, needs_every_row=False)

    def __init__(self, cfg: StrategyConfig, power: float) -> None:
        super().__init__(cfg)
        self.power = power

    def weight_of(self, meta: UpdateMeta) -> float:
        """``num_samples ** power``, from the participant's update header."""
        return float(meta.num_samples) ** self.power


def build(cfg: StrategyConfig, power: float = 0.5) -> Strategy:
    """The strategy ``strategy.name: examples.custom_strategy.strategy:build`` names; ``strategy.kwargs.power``."""
    if power < 0:
        raise ValueError(f"strategy.kwargs.power: must be >= 0, got {power}")
    return Strategy(cfg, PowerMean(cfg, power), Replace(cfg))
