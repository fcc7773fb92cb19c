"""A plug-in model: mpifl passes ``input_shape`` and ``num_classes`` because the signature names them."""
from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn


def net(input_shape: Sequence[int], num_classes: int, hidden: int) -> nn.Module:
    """Two tanh layers of width ``hidden`` (``model.kwargs.hidden``) over flattened inputs."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.Tanh(),
                         nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))
