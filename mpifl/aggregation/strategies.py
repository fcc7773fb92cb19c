"""Aggregation math: small pure functions over chunks, and the strategy built from them.

A strategy decides, it never communicates. For every chunk of the model the server

1. *combines* the participants' chunks (weights or deltas, as the clients send them):
   a weighted mean folded into an fp32 accumulator in ascending client order
   (``acc = w0*x0``, then ``acc += w*x`` with torch's fused multiply-add, one rounding,
   bitwise reproducible), or a coordinate-wise median / trimmed mean over a stack of
   every participant's chunk (participants x chunk, never participants x model);
2. *updates* the global chunk: plain replacement (FedAvg), or a server optimizer step on
   the pseudo-gradient ``delta = combined - global`` (FedAvgM, FedAdam, FedYogi,
   FedAdagrad; Reddi et al. 2021), whose moments live in chunk-addressable fp32
   server-state vectors (RAM or HDF5, saved in checkpoints).

Everything is computed in fp32 and rounded once into the model's dtype.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from mpifl.config import StrategyConfig
from mpifl.wire.protocol import UpdateMeta

ACCUMULATOR_DTYPE = torch.float32
ADAPTIVE = ("fedadam", "fedyogi", "fedadagrad")
ROBUST = ("median", "trimmed_mean")


# -- combining participants' chunks -------------------------------------------------------------

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


def sort_columns(rows: torch.Tensor) -> None:
    """Sort every column of a (participants, n) fp32 stack in place (numpy: no index tensor)."""
    rows.numpy().sort(axis=0)


def median_of_sorted(rows: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of sorted rows; the mean of the middle two for an even count."""
    p = rows.shape[0]
    if p % 2:
        return rows[p // 2]
    out = rows[0]
    torch.add(rows[p // 2 - 1], rows[p // 2], out=out)
    return out.mul_(0.5)


def trimmed_count(participants: int, trim_fraction: float) -> int:
    """How many values a trimmed mean drops from each end: floor(beta * participants)."""
    return min(math.floor(trim_fraction * participants + 1e-9), (participants - 1) // 2)


def trimmed_mean_of_sorted(rows: torch.Tensor, trim_fraction: float) -> torch.Tensor:
    """Mean of sorted rows k..p-k-1, summed in ascending order, k = trimmed_count(p, beta)."""
    p = rows.shape[0]
    k = trimmed_count(p, trim_fraction)
    out = rows[k]
    for i in range(k + 1, p - k):
        out.add_(rows[i])
    return out.div_(p - 2 * k)


# -- server optimizer steps: delta (fp32) becomes the step added to the global chunk ------------

def momentum_step(delta: torch.Tensor, state: dict[str, torch.Tensor], lr: float, beta: float) -> None:
    """FedAvgM (Hsu et al. 2019): v = beta*v + delta; step = lr*v."""
    v = state["velocity"]
    v.mul_(beta).add_(delta)
    torch.mul(v, lr, out=delta)


def first_moment(delta: torch.Tensor, m: torch.Tensor, beta1: float) -> None:
    """m = beta1*m + (1-beta1)*delta."""
    m.mul_(beta1).add_(delta, alpha=1 - beta1)


def adam_second_moment(d2: torch.Tensor, v: torch.Tensor, beta2: float) -> None:
    """FedAdam: v = beta2*v + (1-beta2)*delta^2."""
    v.mul_(beta2).add_(d2, alpha=1 - beta2)


def yogi_second_moment(d2: torch.Tensor, v: torch.Tensor, beta2: float) -> None:
    """FedYogi: v = v - (1-beta2)*delta^2*sign(v - delta^2)."""
    v.sub_(d2 * torch.sign(v - d2), alpha=1 - beta2)


def adagrad_second_moment(d2: torch.Tensor, v: torch.Tensor, beta2: float) -> None:
    """FedAdagrad: v = v + delta^2."""
    v.add_(d2)


SECOND_MOMENT: dict[str, Callable] = {
    "fedadam": adam_second_moment, "fedyogi": yogi_second_moment, "fedadagrad": adagrad_second_moment}


def adaptive_step(delta: torch.Tensor, state: dict[str, torch.Tensor], kind: str, lr: float, beta1: float,
                  beta2: float, tau: float) -> None:
    """Reddi et al. 2021, Algorithm 2: step = lr * m / (sqrt(v) + tau)."""
    m, v = state["m"], state["v"]
    first_moment(delta, m, beta1)
    delta.mul_(delta)  # delta is no longer needed: reuse it for delta^2, then for the step
    SECOND_MOMENT[kind](delta, v, beta2)
    torch.sqrt(v, out=delta)
    delta.add_(tau)
    torch.div(m, delta, out=delta)
    delta.mul_(lr)


# -- the strategy -----------------------------------------------------------------------------

class Strategy:
    """What the streamed reduction calls for each chunk: weight, fold, finish."""

    def __init__(self, cfg: StrategyConfig):
        self.cfg = cfg
        self.name = cfg.name
        self.stacked = cfg.name in ROBUST
        self.delta = cfg.update == "delta"
        self.by_samples = cfg.weighting == "samples" and not self.stacked
        self.lr = cfg.server_lr if cfg.server_lr is not None else (1.0 if cfg.name == "fedavgm" else 0.01)
        if cfg.name == "fedavgm":
            self.state_init = {"velocity": 0.0}
        elif cfg.name in ADAPTIVE:
            self.state_init = {"m": 0.0, "v": cfg.tau ** 2}
        else:
            self.state_init = {}

    @property
    def needs_previous_global(self) -> bool:
        """Whether finishing a chunk reads the old global chunk (deltas and server optimizers do)."""
        return self.delta or bool(self.state_init)

    def weight(self, meta: UpdateMeta) -> float:
        return float(meta.num_samples) if self.by_samples else 1.0

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, index: int) -> None:
        """Take in the ``index``-th included participant's chunk (acc is a stack row per participant when robust)."""
        if self.stacked:
            acc[index].copy_(x)
        else:
            fold(acc, x, weight, index == 0)

    def finish(self, acc: torch.Tensor, count: int, total_weight: float, target: torch.Tensor,
               state: dict[str, torch.Tensor]) -> None:
        """Write the new global chunk into ``target`` (which holds the old one where needed)."""
        if not self.stacked and not self.needs_previous_global:
            weighted_mean_into(target, acc, total_weight)  # FedAvg: one fp32 division, one rounding
            return
        if self.stacked:
            rows = acc[:count]
            sort_columns(rows)
            combined = (median_of_sorted(rows) if self.name == "median"
                        else trimmed_mean_of_sorted(rows, self.cfg.trim_fraction))
        else:
            combined = acc.div_(total_weight)
        if not self.needs_previous_global:
            target.copy_(combined)
            return
        if not self.delta:
            combined.sub_(target)  # pseudo-gradient: combined weights - old global
        if self.name == "fedavgm":
            momentum_step(combined, state, self.lr, self.cfg.momentum)
        elif self.name in ADAPTIVE:
            adaptive_step(combined, state, self.name, self.lr, self.cfg.beta1, self.cfg.beta2, self.cfg.tau)
        combined.add_(target)
        target.copy_(combined)


def make_strategy(cfg: StrategyConfig) -> Strategy:
    """The strategy named in the config."""
    return Strategy(cfg)
