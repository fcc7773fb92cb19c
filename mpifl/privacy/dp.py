"""DP-FedAvg on the server and on the clients (McMahan et al. 2018; Andrew et al. 2021).

Clients send their delta clipped to L2 norm C (over the whole update). In central mode the server
adds Gaussian noise of std z_sum x C to the sum of the clipped deltas, chunk by chunk as it
finishes them, then divides by the expected number of participants (k, or q x N with Poisson
sampling: a fixed divisor, so the count itself reveals nothing). In local mode each client adds
that noise to its own clipped delta before sending, keyed by its id as well.

Adaptive clipping (central): each client also reports whether its norm was within C; the server
noises the sum of the bits less 1/2 each (std sigma_b: sensitivity 1/2), takes
b = sum / divisor + 1/2, clipped to [0, 1], and sets C = C x exp(-eta_C (b - gamma)),
gamma the target quantile. The budget is split as in Andrew et al. (Theorem 1): the sum's noise
multiplier is z_sum = (z^-2 - (2 sigma_b)^-2)^(-1/2), so the pair is accounted as one Gaussian
mechanism of multiplier z.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import torch

from mpifl.config import PrivacyConfig
from mpifl.planning.seeds import CENTRAL, COUNT, LOCAL, PRIVACY, derive_seed
from mpifl.privacy.accounting import epsilon
from mpifl.privacy.noise import ElementNoise
from mpifl.wire.protocol import UpdateMeta


def count_noise(cfg: PrivacyConfig, per_round: int) -> float:
    """sigma_b: the configured one, or clients per round / 20 (Andrew et al. 2021)."""
    return cfg.count_noise if cfg.count_noise is not None else per_round / 20


def sum_noise_multiplier(cfg: PrivacyConfig, per_round: int) -> float:
    """z_sum: the multiplier of the noise on the sum (all of z without adaptive clipping)."""
    if not cfg.adaptive_clip or cfg.mode != "central":
        return cfg.noise_multiplier
    if cfg.noise_multiplier == 0:
        return 0.0
    return (cfg.noise_multiplier ** -2 - (2 * count_noise(cfg, per_round)) ** -2) ** -0.5


def noisy_share_within(within: int, participants: int, noise: float, divisor: float) -> float:
    """b: the share of the ``participants`` within the bound (``within`` of them), from the sum of their bits each
    less 1/2 plus ``noise``, over ``divisor`` and back by 1/2, clipped to [0, 1] (which the noise can leave).

    Why the half: with b_i - 1/2 per client, adding or removing one client moves the sum by at most 1/2, which is
    the sensitivity the budget split (z_sum, with 2 sigma_b) assumes (Andrew et al. 2021; TF Privacy's
    QuantileEstimatorQuery). A count of the bits themselves moves by 1, and epsilon was too low under Poisson
    sampling."""
    return min(1.0, max(0.0, (within - participants / 2 + noise) / divisor + 0.5))


class ServerPrivacy:
    """The server's side: the round's clip bound, noise on each finished chunk, epsilon, the budget."""

    def __init__(self, cfg: PrivacyConfig, seed: int, num_clients: int, per_round: int, history: list[dict]):
        self.cfg, self.seed, self.num_clients, self.per_round = cfg, seed, num_clients, per_round
        previous = [r["privacy"] for r in history if "privacy" in r]
        self.clip = previous[-1]["next_clip"] if previous else cfg.clip  # adaptive C resumes where it was
        self._epsilons: dict[int, float] = {}
        self.divisor = float(per_round)  # k, or q x N = k with Poisson sampling: fixed, whoever takes part

    def noise(self, round_: int) -> Callable[[torch.Tensor, int], None] | None:
        """Central DP: what adds the round's noise to a chunk's sum (its first element given); else None."""
        if self.cfg.mode != "central":
            return None
        std = sum_noise_multiplier(self.cfg, self.per_round) * self.clip
        source = ElementNoise(self.seed, CENTRAL, round_)
        return lambda acc, first: source.add(acc, first, std)

    def epsilon(self, rounds: int) -> float:
        """Epsilon at the configured delta after ``rounds`` rounds (each count accounted once: the budget check
        asks for round r + 1 before round r + 1's record does, and an accountant call can take a second)."""
        if rounds not in self._epsilons:
            self._epsilons[rounds] = epsilon(self.cfg, rounds, self.num_clients, self.per_round)
        return self._epsilons[rounds]

    def after_round(self, round_: int, metas: Mapping[int, UpdateMeta]) -> dict:
        """The round's privacy record; with adaptive clipping, the next round's bound."""
        usable = [m for m in metas.values() if getattr(m, "error", None) is None]
        within = sum(1 for m in usable if m.metrics.get("clip_within"))
        record = {"epsilon": self.epsilon(round_), "delta": self.cfg.delta, "clip": self.clip,
                  "noise_multiplier": self.cfg.noise_multiplier, "clipped": len(usable) - within}
        if self.cfg.adaptive_clip and self.cfg.mode == "central":
            rng = np.random.default_rng(derive_seed(self.seed, PRIVACY, COUNT, round_))
            noise = rng.normal(0.0, count_noise(self.cfg, self.per_round))
            fraction = noisy_share_within(within, len(usable), noise, self.divisor)
            self.clip *= math.exp(-self.cfg.clip_lr * (fraction - self.cfg.target_quantile))
        record["next_clip"] = self.clip
        return record

    def exhausted(self, next_round: int) -> bool:
        """Whether round ``next_round`` would take epsilon past the budget."""
        budget = self.cfg.epsilon_budget
        return budget is not None and self.epsilon(next_round) > budget


class ClientPrivacy:
    """A client's side: clip its update to the round's bound; in local mode, noise it too."""

    def __init__(self, cfg: PrivacyConfig, seed: int):
        self.cfg, self.seed = cfg, seed

    def apply(self, chunks: list[torch.Tensor], firsts: list[int], bound: float, round_: int, client: int) -> dict:
        """Clip (and noise) the update in place; report its norm and whether it was within the bound."""
        from mpifl.privacy.clipping import clip_factor, l2_norm

        norm = l2_norm(chunks)
        factor = clip_factor(norm, bound)
        if factor < 1.0:
            for c in chunks:
                c.mul_(factor)
        if self.cfg.mode == "local":
            source, std = ElementNoise(self.seed, LOCAL, round_, client), self.cfg.noise_multiplier * bound
            for c, first in zip(chunks, firsts):
                source.add(c, first, std)
        return {"update_norm": norm, "clip_within": norm <= bound}
