"""Aggregation math: small pure functions over chunks, and the strategies built from them.

A strategy decides, it never communicates. The server folds client chunks into an fp32
accumulator in a fixed client order and then finishes each chunk into the new global
model. The fold is torch's fused multiply-add (``acc.add_(x, alpha=w)``, one rounding),
which is bitwise reproducible on a given machine and torch build.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .config import StrategyConfig
from .protocol import UpdateMeta

ACCUMULATOR_DTYPE = torch.float32


def fold(acc: torch.Tensor, x: torch.Tensor, weight: float) -> None:
    """acc += weight * x, fused, in place (x may be bf16/fp16; acc is fp32)."""
    acc.add_(x, alpha=weight)


def weighted_mean_into(out: torch.Tensor, acc: torch.Tensor, total_weight: float) -> None:
    """out = acc / total_weight, rounded to out's dtype (acc is consumed)."""
    out.copy_(acc.div_(total_weight))


class Strategy(Protocol):
    """The per-chunk interface the streamed reduction drives."""

    def weight(self, meta: UpdateMeta) -> float: ...

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float) -> None: ...

    def finish(self, acc: torch.Tensor, total_weight: float, global_chunk: torch.Tensor) -> None: ...


class FedAvg:
    """Federated averaging (McMahan et al. 2017): weighted mean of client models."""

    def __init__(self, cfg: StrategyConfig):
        self.by_samples = cfg.weighting == "samples"

    def weight(self, meta: UpdateMeta) -> float:
        return float(meta.num_samples) if self.by_samples else 1.0

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float) -> None:
        fold(acc, x, weight)

    def finish(self, acc: torch.Tensor, total_weight: float, global_chunk: torch.Tensor) -> None:
        weighted_mean_into(global_chunk, acc, total_weight)


def make_strategy(cfg: StrategyConfig) -> Strategy:
    """The strategy named in the config."""
    return {"fedavg": FedAvg}[cfg.name](cfg)
