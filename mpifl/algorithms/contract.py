"""The client half of an algorithm: what mpifl asks of the part of a strategy that runs where its clients train.

A strategy's server half is a ``Strategy`` (combiner, server update, the ``bind``/``begin_round``/``finish`` hooks).
Its client half is a ``ClientAlgorithm``: a named per-client vector kept for each logical client on the rank that
hosts it (``Capabilities.client_rule`` names the algorithm, mpifl.config.client_state lays the vector out), and
what acts on local training:

- ``leader(work, store, cfg)`` builds the ``ClientHalf`` of a rank that trains clients: around each client's
  training (``training``, where per-step hooks such as ``mpifl.learning.steps.corrected_steps`` go) and after it
  (``update``: the new state, and what the update carries);
- ``member(work, cfg)`` builds the ``GroupHalf`` of a client group's other ranks (``clients.ranks_per_client``),
  which train with what the leader broadcasts (``ClientHalf.shared``);
- ``shard(rows, store, cfg)``, when given, builds the ``ShardHalf`` of every rank of a sharded client
  (``clients.sharding: fsdp``), each over the rows of the model it holds (``ShardRows``), its store holding the
  clients' vectors over those rows only: no rank holds a whole vector;
- ``streams``, when given, appends to the model a submodule of fp32 buffers that travel with it: broadcast with the
  weights, summed chunk by chunk with the updates, checkpointed and kept out of core (SCAFFOLD's server control
  variate c and the clients' control deltas). Its buffers start at zero, on every rank.

mpifl does the rest for every algorithm alike: the store in RAM or on disk within its budget, checkpoints and
resumes, lending under per-round placement, the put-back of a dropped client's vector, the plan's memory figures,
and the refusals its capabilities imply (no DP, secure aggregation or compression to rewrite the update).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from mpifl.config import Config
from mpifl.storage.residuals import ResidualStore
from mpifl.wire.flat import FlatModel


class ClientHalf(Protocol):
    """An algorithm's client half on a rank that trains logical clients (a group's leader)."""

    @property
    def shared(self) -> torch.Tensor:
        """What a client group's members train with, broadcast by the leader once ``training`` has begun."""

    def training(self, client: int, global_bytes: torch.Tensor) -> AbstractContextManager[None]:
        """Train ``client`` inside (``global_bytes``: the round's global model as the flat buffer's bytes, on the
        device of the model that trains): set up from the client's stored vector, and hook every step."""

    def update(self, client: int, global_bytes: torch.Tensor, steps: int, weight: float) -> None:
        """After ``client`` trained ``steps`` optimizer steps (its update's weight in the server's fold is
        ``weight``): keep its new vector in the store, and set in the model what its update must carry. A client
        whose training diverged keeps its old vector (its update is refused, never folded)."""


@runtime_checkable
class LaneCorrections(Protocol):
    """A client half whose whole effect on training is a correction of every optimizer step, y -= lr * k, k fixed
    for the client's training (SCAFFOLD's k = c - c_i): what lets clients train as lanes of one batched model
    (``train.batched_clients``, mpifl.learning.batched), each lane stepping with its own k."""

    def correction(self, client: int) -> torch.Tensor:
        """``client``'s k as one flat fp32 vector over the trained parameters, in their order (a new tensor, on
        the device of the model that trains), from the round's global state and the client's stored vector."""


class GroupHalf(Protocol):
    """An algorithm's client half on a client group's other ranks."""

    vector: torch.Tensor  # where the leader's ``ClientHalf.shared`` is received, before each client trains

    def training(self) -> AbstractContextManager[None]:
        """Train the received client inside, as the leader does: every rank of the group takes the same steps."""


@dataclass(frozen=True)
class ShardRows:
    """What one rank of a sharded client group holds of the model (``clients.sharding: fsdp``), for a client half
    that keeps its vectors over those rows: the trained parameters, this rank's rows of each, the round's global
    values of those rows, and its rows of each summed stream (SCAFFOLD's c), all in the model's order. Every rank of
    the group holds its own rows and takes the same steps, so a client half there acts on rows elementwise as an
    unsharded one acts on whole tensors."""

    params: Sequence[nn.Parameter]  # the trained parameters (``mpifl.learning.steps.trainable``), FSDP's DTensors
    rows: Sequence[torch.Tensor]  # this rank's rows of each (``mpifl.learning.steps.own_rows``: writes go through)
    anchors: Sequence[torch.Tensor]  # the round's global values of those rows, in the model's dtype, as taken
    streams: Sequence[torch.Tensor]  # this rank's rows of each summed-stream buffer (empty without streams)
    device: torch.device
    all_ranks: Callable[[bool], bool]  # True on every rank of the group when it is True on every one (a collective)

    @property
    def elements(self) -> int:
        """Elements of a client's vector over this rank's rows of the trained parameters."""
        return sum(r.numel() for r in self.rows)


class ShardHalf(Protocol):
    """An algorithm's client half on each rank of a sharded client group, over the rows that rank holds."""

    def training(self, client: int) -> AbstractContextManager[None]:
        """Train ``client`` inside, on this rank's rows: set up from its stored vector, and hook every step."""

    def update(self, client: int, steps: int, weight: float) -> None:
        """After ``client`` trained (as ``ClientHalf.update``): its new vector over this rank's rows in the store,
        and this rank's rows of what its update carries. A client whose training diverged on any rank of the
        group keeps its old vector on every one (``ShardRows.all_ranks``)."""


@dataclass(frozen=True)
class ClientAlgorithm:
    """How mpifl builds an algorithm's client half on each client rank (see the module's docstring)."""

    state: str  # the per-client vector, as logs name it when a dropped client's is put back ("c_i")
    leader: Callable[[FlatModel, ResidualStore, Config], ClientHalf]
    member: Callable[[FlatModel, Config], GroupHalf]
    streams: Callable[[nn.Module, Sequence[str]], nn.Module] | None = None  # (model, model.local) -> model
    shard: Callable[[ShardRows, ResidualStore, Config], ShardHalf] | None = None  # None: not on sharded clients
