"""Who takes part, where they live, and the seeds they use: pure functions of the config."""
from __future__ import annotations

import numpy as np

from mpifl.wire.protocol import rank_of_client

SAMPLING = 1  # stream keys keep the seed derivations of different purposes apart
CLIENT = 2
PARTITION = 3


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed derived from the root seed and a tuple of integer keys."""
    state = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 ^ int(state[1])


def client_seed(seed: int, round_: int, client: int) -> int:
    """The seed of one logical client's work in one round (never depends on the rank)."""
    return derive_seed(seed, CLIENT, round_, client)


def sample_clients(seed: int, round_: int, num_clients: int, per_round: int) -> list[int]:
    """The sorted logical client ids taking part in a round."""
    rng = np.random.default_rng(derive_seed(seed, SAMPLING, round_))
    return sorted(int(c) for c in rng.choice(num_clients, size=per_round, replace=False))


def group_by_rank(clients: list[int], client_ranks: int) -> dict[int, list[int]]:
    """Map each hosting rank to the (ascending) participants it serves."""
    out: dict[int, list[int]] = {}
    for c in sorted(clients):
        out.setdefault(rank_of_client(c, client_ranks), []).append(c)
    return out


def clients_of_rank(rank: int, num_clients: int, client_ranks: int) -> list[int]:
    """Every logical client a rank hosts."""
    return [c for c in range(num_clients) if rank_of_client(c, client_ranks) == rank]
