"""Aggregation math: small pure functions over chunks, and the strategies built from them.

A strategy decides, it never communicates. The server folds client chunks into an fp32
accumulator in a fixed client order and then finishes each chunk into the new global
model: ``acc = w0*x0``, then ``acc += w*x`` with torch's fused multiply-add
(``acc.add_(x, alpha=w)``, one rounding, bitwise reproducible on a given machine and
torch build), then ``acc / sum(w)`` rounded once to the model's dtype.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .config import StrategyConfig
from .protocol import UpdateMeta

ACCUMULATOR_DTYPE = torch.float32


def fold(acc: torch.Tensor, x: torch.Tensor, weight: float, first: bool) -> None:
    """acc = weight * x for the first term, else acc += weight * x fused (x may be bf16; acc is fp32)."""
    if first and x.dtype == acc.dtype:
        torch.mul(x, weight, out=acc)
    elif first:  # torch.mul would compute a bf16 product: widen first (exact), then scale in fp32
        acc.copy_(x).mul_(weight)
    else:
        acc.add_(x, alpha=weight)


def weighted_mean_into(out: torch.Tensor, acc: torch.Tensor, total_weight: float) -> None:
    """out = acc / total_weight, computed in fp32 and rounded once to out's dtype."""
    torch.div(acc, total_weight, out=out)


class Strategy(Protocol):
    """The per-chunk interface the streamed reduction drives."""

    def weight(self, meta: UpdateMeta) -> float: ...

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, first: bool) -> None: ...

    def finish(self, acc: torch.Tensor, total_weight: float, global_chunk: torch.Tensor) -> None: ...


class FedAvg:
    """Federated averaging (McMahan et al. 2017): weighted mean of client models."""

    def __init__(self, cfg: StrategyConfig):
        self.by_samples = cfg.weighting == "samples"

    def weight(self, meta: UpdateMeta) -> float:
        return float(meta.num_samples) if self.by_samples else 1.0

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, first: bool) -> None:
        fold(acc, x, weight, first)

    def finish(self, acc: torch.Tensor, total_weight: float, global_chunk: torch.Tensor) -> None:
        weighted_mean_into(global_chunk, acc, total_weight)


def make_strategy(cfg: StrategyConfig) -> Strategy:
    """The strategy named in the config."""
    return {"fedavg": FedAvg}[cfg.name](cfg)
