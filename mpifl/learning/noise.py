"""Noise-based feature skew: every client sees its inputs through its own level of Gaussian noise.

NIID-Bench's "noise-based feature imbalance" (Li, Diao, Chen and He, "Federated Learning on Non-IID
Data Silos: An Experimental Study", ICDE 2022, arXiv:2102.02079, section III-B; code
github.com/Xtra-Computing/NIID-Bench, ``experiments.py`` and ``utils.AddGaussianNoise``): the samples
are split evenly (its ``homo`` partition), and party k of n adds noise of standard deviation
``scale * k / (n - 1)`` to every input it reads, drawn afresh each time (a torchvision transform), so
party 0 sees clean images and party n - 1 the full ``scale``. The global model is scored on n copies
of the test set, copy k at party k's level.

Here the same rule is ``data.feature_noise: scale``. Every draw comes from a stream derived from the
run's seed (mpifl.planning.seeds, key FEATURE_NOISE), never from the rank, so a run stays
deterministic and rank-count independent:

- training draws one noise tensor per minibatch, for the whole batch, from the stream of that
  client's training seed, and a rank of a multi-rank client adds the rows of it that its share of
  the batch takes (the ranks' rows together are the noise one rank would add to the whole batch);
- a client's validation split is noised once, by the client's own stream, so each federated
  evaluation scores the same inputs;
- the held-out set is scored at each client's level from a stream per level, the same noisy copies
  every round (NIID-Bench redraws them at each evaluation; fixing them keeps round-to-round changes
  those of the model).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from mpifl.planning.seeds import FEATURE_NOISE, HELD_OUT, VALIDATION, derive_seed


def client_noise_std(scale: float, client: int, num_clients: int) -> float:
    """NIID-Bench's level for party ``client`` of ``num_clients``: ``scale * client / (num_clients - 1)``
    (0 for the first client, ``scale`` for the last; one client alone gets ``scale``)."""
    if num_clients < 2:
        return scale
    return scale * client / (num_clients - 1)


def noise_generator(seed: int, *keys: int) -> torch.Generator:
    """A CPU generator for the feature-noise stream of ``seed`` (a run's root seed or a client's training seed)
    and ``keys``, apart from every other use of that seed."""
    return torch.Generator().manual_seed(derive_seed(seed, FEATURE_NOISE, *keys))


def gaussian(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """float32 Gaussian noise of standard deviation ``std`` drawn from ``generator``, in one new tensor."""
    return torch.randn(shape, generator=generator, dtype=torch.float32).mul_(std)


def noised(x: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """``x`` (as float32) plus Gaussian noise of standard deviation ``std`` drawn from ``generator``."""
    return gaussian(tuple(x.shape), std, generator).add_(x)  # one new tensor: a noisy copy is x's float32 size


def batch_noise(batch_len: int, sample_shape: tuple[int, ...], std: float, generator: torch.Generator,
                share: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The noise of one minibatch of ``batch_len`` samples, drawn whole, then cut to this rank's ``share`` of the
    batch (``share`` maps the batch's rows to the rank's; None: the whole batch). Drawing the whole batch on
    every rank of a client keeps each sample's noise the one it gets when a single rank trains the client."""
    noise = gaussian((batch_len, *sample_shape), std, generator)
    return noise if share is None else share(noise)


def validation_inputs(x: torch.Tensor, std: float, root_seed: int, client: int) -> torch.Tensor:
    """A client's validation inputs at its noise level, drawn once from the client's own stream."""
    return noised(x, std, noise_generator(root_seed, VALIDATION, client))


def held_out_copy(x: torch.Tensor, scale: float, level: int, num_clients: int, root_seed: int) -> torch.Tensor:
    """The held-out inputs at client ``level``'s noise level: the same copy every time it is asked for."""
    return noised(x, client_noise_std(scale, level, num_clients), noise_generator(root_seed, HELD_OUT, level))


def score_over_levels(score: Callable[[torch.Tensor], dict], x: torch.Tensor, scale: float, num_clients: int,
                      root_seed: int) -> dict:
    """``score`` of each noisy copy of the held-out set, one client level after another (one copy held at a time),
    averaged: the scores of the ``num_clients`` equal-sized copies taken together, as NIID-Bench concatenates
    them. Mean metrics (accuracy, mean loss) average exactly; each copy costs one plain evaluation."""
    scores = [score(held_out_copy(x, scale, k, num_clients, root_seed)) for k in range(num_clients)]
    return {key: sum(s[key] for s in scores) / len(scores) for key in scores[0]}
