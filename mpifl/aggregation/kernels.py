"""Aggregation kernels: small pure functions over one chunk, in fp32, rounded once into the model's dtype.

Combining (McMahan et al. 2017, FedAvg): a weighted mean folded into an fp32 accumulator in
ascending client order (``acc = w0*x0``, then ``acc += w*x`` with torch's fused multiply-add,
one rounding, bitwise reproducible). Robust combining (Yin et al. 2018): the coordinate-wise
median or trimmed mean of a sorted (participants, chunk) stack.

Server steps turn the pseudo-gradient ``delta`` (fp32) into the step added to the global chunk,
in place: FedAvgM (Hsu et al. 2019) and FedAdam / FedYogi / FedAdagrad (Reddi et al. 2021,
Algorithm 2), with their moments in fp32 server-state vectors.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

ACCUMULATOR_DTYPE = torch.float32  # accumulators, stacks and server-state vectors
SecondMoment = Callable[[torch.Tensor, torch.Tensor, float], None]


# -- combining participants' chunks -------------------------------------------------------------

def fold(acc: torch.Tensor, x: torch.Tensor, weight: float, first: bool, scratch: torch.Tensor | None = None) -> None:
    """acc = weight * x for the first term, else acc += weight * x fused (x may be bf16; acc is fp32).

    A narrower ``x`` is widened (exactly) into ``scratch`` first when one is given: torch's
    mixed-dtype ``add_`` runs about 3x slower than widening then adding in fp32 (same result).
    """
    if first and x.dtype == acc.dtype:
        torch.mul(x, weight, out=acc)
    elif first:  # torch.mul would compute a bf16 product: widen first (exact), then scale in fp32
        acc.copy_(x).mul_(weight)
    elif x.dtype != acc.dtype and scratch is not None:
        wide = scratch[:x.numel()]
        wide.copy_(x)
        acc.add_(wide, alpha=weight)
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


def adaptive_step(delta: torch.Tensor, state: dict[str, torch.Tensor], second_moment: SecondMoment, lr: float,
                  beta1: float, beta2: float, tau: float) -> None:
    """Reddi et al. 2021, Algorithm 2: step = lr * m / (sqrt(v) + tau), v by ``second_moment``."""
    m, v = state["m"], state["v"]
    first_moment(delta, m, beta1)
    delta.mul_(delta)  # delta is no longer needed: reuse it for delta^2, then for the step
    second_moment(delta, v, beta2)
    torch.sqrt(v, out=delta)
    delta.add_(tau)
    torch.div(m, delta, out=delta)
    delta.mul_(lr)
