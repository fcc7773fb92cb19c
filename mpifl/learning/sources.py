"""Datasets stored by client, so that a rank reads only the clients it hosts.

A *client source* knows where each client's samples lie without loading them. ``survey()``
(run once, on the server rank) reads what every rank needs, every client's labels and the
input shape (a ``ClientIndex``, small), and the held-out set. ``read_clients(index, ids)``
then reads the inputs of those clients only, on the rank that hosts them.

Samples are numbered client after client (clients in sorted order of their ids, rows in file
order), so a client's samples are one contiguous range of global indices: the numbering is the
same whether a rank reads every client (``read_whole``) or a few (``HeldRows``), and so
are the results. Built-in sources: LEAF JSON files (``mpifl.learning.leaf``) and tables with a
client-id column (``mpifl.learning.tables``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class ClientIndex:
    """What every rank knows about a client source: each client's labels, the inputs' shape and type."""

    labels: tuple[np.ndarray, ...]  # int64 labels, one array per client, clients in order
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    num_classes: int
    where: dict[str, Any] = field(default_factory=dict)  # the source's own notes: files per client, vocabulary
    ids: tuple = ()  # each client's id in the data (a LEAF user, a table's client id), clients in order
    id_kind: str = "client id"  # what the data calls an id, for messages: 'LEAF user', 'table client id'

    @property
    def starts(self) -> np.ndarray:
        """Global index of each client's first sample, then the total (length clients + 1)."""
        return np.concatenate([[0], np.cumsum([len(y) for y in self.labels])]).astype(np.int64)

    def named(self, client: int) -> str:
        """How the data names ``client``, for messages: "LEAF user 'f0042_17'" (empty without ids)."""
        return f"{self.id_kind} {self.ids[client]!r}" if client < len(self.ids) else ""

    def ranges(self) -> tuple[np.ndarray, ...]:
        """Each client's global sample indices (the natural partition)."""
        starts = self.starts
        return tuple(np.arange(starts[c], starts[c + 1]) for c in range(len(self.labels)))


class ClientSource(Protocol):
    """A dataset stored by client. Constructing one must not read data: every rank makes its own."""

    def survey(self) -> tuple[ClientIndex, tuple[torch.Tensor, torch.Tensor]]:
        """The index (every client's labels) and the held-out ``(x_test, y_test)``."""

    def read_clients(self, index: ClientIndex, clients: Sequence[int]) -> dict[int, torch.Tensor]:
        """The inputs of ``clients`` only, one tensor per client, rows in the index's order."""


class HeldRows:
    """``x_train`` as one rank holds it: only its clients' rows, addressed by global sample index."""

    def __init__(self, index: ClientIndex, held: dict[int, torch.Tensor]) -> None:
        self.starts, self.held = index.starts, held
        self.shape = torch.Size((int(self.starts[-1]), *index.input_shape))
        self.dtype = index.input_dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, indices: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The rows at these global indices, in their order; each must belong to a held client."""
        idx = np.asarray(indices, dtype=np.int64)
        owner = np.searchsorted(self.starts, idx, side="right") - 1
        out = torch.empty((len(idx), *self.shape[1:]), dtype=self.dtype)
        for client in np.unique(owner):
            if int(client) not in self.held:
                raise KeyError(f"sample rows of client {int(client)} are not held on this rank")
            mine = owner == client
            local = torch.from_numpy(idx[mine] - self.starts[client])
            out[torch.from_numpy(np.flatnonzero(mine))] = self.held[int(client)][local]
        return out


def read_whole(source: ClientSource) -> tuple:
    """Every client's data at once: ``(x_train, y_train, x_test, y_test, clients)``, numbered as above."""
    index, (x_test, y_test) = source.survey()
    inputs = source.read_clients(index, range(len(index.labels)))
    x_train = torch.cat([inputs[c] for c in range(len(index.labels))])
    y_train = torch.from_numpy(np.concatenate(index.labels))
    return x_train, y_train, x_test, y_test, index.ranges()


def classes_in(*labels: np.ndarray) -> int:
    """How many classes the labels name: the largest label + 1."""
    return int(max((int(y.max()) for y in labels if len(y)), default=0)) + 1
