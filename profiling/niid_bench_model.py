"""NIID-Bench's CNN for MNIST-sized inputs, as the plug-in model the NIID-Bench configs name (``model.name:
profiling.niid_bench_model:simple_cnn_mnist``; the repository root must be on PYTHONPATH).

It is mpifl's built-in ``lenet`` (mpifl.learning.models.LeNet), whose layers, names and build order are those of
``SimpleCNNMNIST(input_dim=16 * 4 * 4, hidden_dims=[120, 84], output_dim=10)`` in NIID-Bench's ``model.py``
(github.com/Xtra-Computing/NIID-Bench), which ``experiments.py`` builds for ``--model=simple-cnn`` on mnist,
femnist and fmnist:

    conv1 Conv2d(1, 6, 5) -> ReLU -> MaxPool2d(2, 2)     28x28 -> 24x24 -> 12x12
    conv2 Conv2d(6, 16, 5) -> ReLU -> MaxPool2d(2, 2)    12x12 ->  8x8  ->  4x4
    flatten (16 * 4 * 4 = 256)
    fc1 Linear(256, 120) -> ReLU -> fc2 Linear(120, 84) -> ReLU -> fc3 Linear(84, 10)

44,426 parameters, no batch norm, no dropout, PyTorch's default initialisation. The name stays so that the
NIID-Bench configs, and the checkpoints of runs made with them, keep resuming (a resume refuses a changed
``model.name``).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from mpifl.learning.models import lenet


def simple_cnn_mnist(input_shape: Sequence[int], num_classes: int,
                     hidden_dims: Sequence[int] = (120, 84)) -> nn.Module:
    """The model NIID-Bench trains on FMNIST; mpifl passes ``input_shape`` (1, 28, 28) and ``num_classes`` (10)."""
    return lenet(input_shape, num_classes, hidden=hidden_dims)
