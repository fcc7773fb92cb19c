"""NIID-Bench's CNN for MNIST-sized inputs, as a plug-in model (``model.name:
profiling.niid_bench_model:simple_cnn_mnist``; the repository root must be on PYTHONPATH).

The same layers, in the same order and under the same names (so the state_dict keys match) as
``SimpleCNNMNIST(input_dim=16 * 4 * 4, hidden_dims=[120, 84], output_dim=10)`` in NIID-Bench's
``model.py`` (github.com/Xtra-Computing/NIID-Bench), which ``experiments.py`` builds for
``--model=simple-cnn`` on mnist, femnist and fmnist:

    conv1 Conv2d(1, 6, 5) -> ReLU -> MaxPool2d(2, 2)     28x28 -> 24x24 -> 12x12
    conv2 Conv2d(6, 16, 5) -> ReLU -> MaxPool2d(2, 2)    12x12 ->  8x8  ->  4x4
    flatten (16 * 4 * 4 = 256)
    fc1 Linear(256, 120) -> ReLU -> fc2 Linear(120, 84) -> ReLU -> fc3 Linear(84, 10)

44,426 parameters, no batch norm, no dropout, PyTorch's default initialisation.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class SimpleCNNMNIST(nn.Module):
    """NIID-Bench's ``SimpleCNNMNIST`` (model.py), layer for layer."""

    def __init__(self, input_dim: int, hidden_dims: Sequence[int], output_dim: int = 10, in_channels: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(input_dim, hidden_dims[0])
        self.fc2 = nn.Linear(hidden_dims[0], hidden_dims[1])
        self.fc3 = nn.Linear(hidden_dims[1], output_dim)
        self.input_dim = input_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, self.input_dim)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def simple_cnn_mnist(input_shape: Sequence[int], num_classes: int,
                     hidden_dims: Sequence[int] = (120, 84)) -> nn.Module:
    """The model NIID-Bench trains on FMNIST; mpifl passes ``input_shape`` (1, 28, 28) and ``num_classes`` (10)."""
    if len(input_shape) != 3:
        raise ValueError(f"simple_cnn_mnist needs (channels, height, width) inputs, got {tuple(input_shape)}")
    channels, height, width = input_shape
    side_h, side_w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2
    if side_h < 1 or side_w < 1:
        raise ValueError(f"simple_cnn_mnist: inputs of {height}x{width} are too small for two 5x5 conv + 2x2 pool")
    return SimpleCNNMNIST(16 * side_h * side_w, hidden_dims, num_classes, channels)
