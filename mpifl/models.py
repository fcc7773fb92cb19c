"""Built-in models (MLP, small CNN, benchmark blob) and the model factory."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

from .config import ModelConfig
from .flat import DTYPES
from .plugins import resolve


def mlp(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (128, 64)) -> nn.Module:
    """A multilayer perceptron over flattened inputs."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def cnn(input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (16, 32)) -> nn.Module:
    """A small CNN (conv-BN-ReLU blocks, global average pooling) for image-shaped inputs."""
    if len(input_shape) != 3:
        raise ValueError(f"model 'cnn' needs (channels, height, width) inputs, the dataset gives {tuple(input_shape)}")
    layers: list[nn.Module] = []
    in_ch = input_shape[0]
    for ch in channels:
        layers += [nn.Conv2d(in_ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU()]
        in_ch = ch
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)]
    return nn.Sequential(*layers)


class Blob(nn.Module):
    """Parameters only, of a given total size: the model-only exchange benchmark's payload."""

    def __init__(self, size_mb: float = 100.0, tensor_mb: float = 64.0, dtype: torch.dtype = torch.float32):
        super().__init__()
        itemsize = torch.empty((), dtype=dtype).element_size()
        total = int(size_mb * 2**20) // itemsize
        per = max(1, int(tensor_mb * 2**20) // itemsize)
        sizes = [per] * (total // per) + ([total % per] if total % per else [])
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(n, dtype=dtype).uniform_(-1, 1)) for n in sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def build_model(cfg: ModelConfig, seed: int, input_shape: Sequence[int] | None = None,
                num_classes: int | None = None) -> nn.Module:
    """Build the configured model with seeded initialisation, in the configured dtype."""
    dtype = DTYPES[cfg.dtype]
    kwargs: dict[str, Any] = dict(cfg.kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.name == "blob":
            return Blob(dtype=dtype, **kwargs)
        if cfg.name in ("mlp", "cnn"):
            if input_shape is None or num_classes is None:
                raise ValueError(f"model {cfg.name!r} needs a dataset to size its input and output layers")
            model = (mlp if cfg.name == "mlp" else cnn)(input_shape, num_classes, **kwargs)
        else:
            model = resolve(cfg.name)(**kwargs)
            if not isinstance(model, nn.Module):
                raise TypeError(f"model.name {cfg.name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model.to(dtype)
