"""Every random stream of a run, derived from the root seed: the one table of seed keys.

A stream's seed is ``derive_seed(seed, key, *sub_keys)``. Keys keep the purposes apart, so
adding a use of randomness never shifts another's draws; sub-keys name the round, the
client or the element block. None of them depends on the rank count, which is what makes
results rank-count independent (SHARD names a rank's place in its client group, which depends on
clients.ranks_per_client but not on how many groups run).

==================  =====  ===============================================================
key                 value  stream (sub-keys)
==================  =====  ===============================================================
SAMPLING            1      who takes part: (round); Poisson sampling (POISSON, round);
                           virtual-time draws among online clients (CLOCK, n)
CLIENT              2      one logical client's work in one round: (round, client)
PARTITION           3      the data split: (); a client's validation split: (client)
CLOCK               4      devices' speeds (0) and availability phases (1)
PRIVACY             5      element streams (privacy.noise), by purpose: CENTRAL, LOCAL,
                           COUNT, COMPRESSION, GROUP_COMPRESSION, then (round, ...)
POISSON             6      sub-key of SAMPLING
PERSONAL            7      a client's personal model's training (Ditto): (round, client)
FEATURE_NOISE       8      noise-based feature skew (data.feature_noise): a training run's
                           batches (the run's CLIENT or PERSONAL seed); a client's
                           validation split (VALIDATION, client); the held-out set at
                           client k's level (HELD_OUT, k)
FAULTS              9      injected faults (faults:): whether a fraction hits a client
                           (index, round, client); which bits a corruption flips (BITS,
                           index, round, client)
SHARD               10     in-model randomness (dropout) of one rank of a client group:
                           (rank in the group), under the run's CLIENT or PERSONAL seed
==================  =====  ===============================================================

Purposes of the element streams under PRIVACY: CENTRAL (0) the server's noise on the sum,
LOCAL (1) a client's own noise, COUNT (2) the noisy count of clipped updates, COMPRESSION (7)
stochastic rounding of a compressed update, GROUP_COMPRESSION (8) the same for a reduction
group's partial sum (keyed by group, not client).
"""
from __future__ import annotations

import numpy as np

SAMPLING = 1
CLIENT = 2
PARTITION = 3
CLOCK = 4
PRIVACY = 5
POISSON = 6
PERSONAL = 7
FEATURE_NOISE = 8
FAULTS = 9
SHARD = 10

CENTRAL = 0
LOCAL = 1
COUNT = 2
COMPRESSION = 7
GROUP_COMPRESSION = 8

VALIDATION = 0  # sub-keys of FEATURE_NOISE
HELD_OUT = 1
BITS = 0  # sub-keys of FAULTS
NOISE = 1


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed derived from the root seed and a tuple of integer keys."""
    state = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 ^ int(state[1])


def client_seed(seed: int, round_: int, client: int) -> int:
    """The seed of one logical client's work in one round (never depends on the rank)."""
    return derive_seed(seed, CLIENT, round_, client)


def personal_seed(seed: int, round_: int, client: int) -> int:
    """The seed of one logical client's personal-model training in one round (Ditto), apart from its other work."""
    return derive_seed(seed, PERSONAL, round_, client)
