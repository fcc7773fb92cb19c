"""A plug-in dataset: ``fn(**data.kwargs) -> (x_train, y_train, x_test, y_test)``, arrays or tensors."""
from __future__ import annotations

import numpy as np


def spirals(num_samples: int = 1500, classes: int = 3, noise: float = 0.1, test_fraction: float = 0.2,
            seed: int = 0) -> tuple[np.ndarray, ...]:
    """Interleaved 2-D spiral arms, one per class: not linearly separable, so the hidden layers matter."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, size=num_samples)
    radius = rng.uniform(0.1, 1.0, size=num_samples)
    angle = np.pi * radius + 2 * np.pi * y / classes + rng.normal(0.0, noise, size=num_samples)
    x = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1).astype(np.float32)
    n_test = int(num_samples * test_fraction)
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]
