"""Who takes part, where they live, and the seeds they use: pure functions of the config."""
from __future__ import annotations

import numpy as np

from mpifl.config import ClientsConfig

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


def group_of(client: int, groups: int) -> int:
    """A logical client's reduction group (``clients.groups``); without groups, the client itself."""
    return client % groups if groups else client


def rank_of_client(client: int, client_ranks: int, groups: int = 0) -> int:
    """The rank hosting a logical client: its group (or itself), round-robin over ranks 1..client_ranks."""
    return 1 + group_of(client, groups) % client_ranks


def group_by_rank(clients: list[int], client_ranks: int, groups: int = 0) -> dict[int, list[int]]:
    """Map each hosting rank to the (ascending) participants it serves."""
    out: dict[int, list[int]] = {}
    for c in sorted(clients):
        out.setdefault(rank_of_client(c, client_ranks, groups), []).append(c)
    return out


def clients_of_rank(rank: int, num_clients: int, client_ranks: int, groups: int = 0) -> list[int]:
    """Every logical client a rank hosts."""
    return [c for c in range(num_clients) if rank_of_client(c, client_ranks, groups) == rank]


def streams_by_rank(clients: list[int], client_ranks: int, groups: int = 0) -> dict[int, list[int]]:
    """What each rank sends the server this round, ascending: its participants, or their groups' partial sums."""
    by_rank = group_by_rank(clients, client_ranks, groups)
    if not groups:
        return by_rank
    return {rank: sorted({group_of(c, groups) for c in members}) for rank, members in by_rank.items()}


class Sampler:
    """Each round's participants and their ranks, from the root seed and the ``clients`` section."""

    def __init__(self, seed: int, clients: ClientsConfig, client_ranks: int):
        self.seed, self.clients, self.client_ranks = seed, clients, client_ranks
        self.per_round = clients.per_round_count()

    def participants(self, round_: int) -> list[int]:
        """The sorted logical client ids taking part in ``round_``."""
        return sample_clients(self.seed, round_, self.clients.num_clients, self.per_round)

    def by_rank(self, participants: list[int]) -> dict[int, list[int]]:
        """Each hosting rank's participants, ascending."""
        return group_by_rank(participants, self.client_ranks, self.clients.groups)

    def streams(self, participants: list[int]) -> dict[int, list[int]]:
        """Each hosting rank's update streams: participants, or reduction groups (``clients.groups``)."""
        return streams_by_rank(participants, self.client_ranks, self.clients.groups)

    def rank_of(self, client: int) -> int:
        """The rank hosting ``client``."""
        return rank_of_client(client, self.client_ranks, self.clients.groups)
