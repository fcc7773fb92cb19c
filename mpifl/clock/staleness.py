"""Staleness functions s(t - tau) of FedAsync (Xie et al. 2019, section 5.2): the weight of an update
trained on a model ``staleness`` versions old."""
from __future__ import annotations

from mpifl.config import ClockConfig


def staleness_weight(cfg: ClockConfig, staleness: int) -> float:
    """constant: 1; polynomial: (1 + staleness)^-a; hinge: 1 up to b, then 1 / (a (staleness - b) + 1)."""
    if cfg.staleness == "constant":
        return 1.0
    if cfg.staleness == "polynomial":
        return float((1.0 + staleness) ** -cfg.staleness_a)
    if staleness <= cfg.staleness_b:
        return 1.0
    return 1.0 / (cfg.staleness_a * (staleness - cfg.staleness_b) + 1.0)
