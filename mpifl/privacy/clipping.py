"""Clipping an update to an L2 norm taken over the whole model (every chunk of the flat buffer)."""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def l2_norm(chunks: Iterable[torch.Tensor]) -> float:
    """The L2 norm of all these tensors together, accumulated in float64."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2 for c in chunks))


def clip_factor(norm: float, bound: float) -> float:
    """The scale that brings an update of this norm within ``bound``: min(1, bound / norm)."""
    return 1.0 if norm <= bound else bound / norm
