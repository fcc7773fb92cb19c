"""Per-client state that follows its client: ``clients.placement: per_round`` trains a client on any rank, while its
state (SCAFFOLD's cᵢ, FedDyn's gᵢ, error-feedback residuals, ``model.local`` tensors, Ditto's personal model) stays
on its home rank, 1 + c mod N (``planning.federation.state_home``).

Each round the header names the loans (``RoundHeader.borrow`` and ``lend``, from ``state_loans``). Right after the
header, every rank lends the vectors of its home clients that train elsewhere and receives those of the clients it
trains whose home is elsewhere, all posted at once, then waited for. Once the rank has sent its round, the borrowed
vectors go back and the lent ones come home, again all at once. Only bits are copied, so where a client trains
still changes no result; and by the end of every round each vector is at home, so a checkpoint publishes exactly
what a balanced placement would (its files keyed by client id).

Why two exchanges at the round's edges rather than a lazy fetch before each client: a rank that is training makes
no MPI progress, so a vector fetched from a busy rank would wait for that rank's next client; at the edges every
rank is in MPI at the same time.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from mpi4py import MPI

from mpifl.storage.residuals import Borrowing, RamResiduals
from mpifl.wire import protocol
from mpifl.wire.transport import wait_all, wake

PIECE_ELEMENTS = 1 << 26  # fp32 elements per message at most (256 MiB): far from MPI's int count limit


def pieces(firsts: list[int], most: int = PIECE_ELEMENTS) -> Iterator[tuple[int, int]]:
    """The element ranges one vector travels in: each state chunk, cut into pieces of at most ``most``; both sides
    derive the same ones from the store's layout, so messages carry no header."""
    for a, b in zip(firsts, firsts[1:]):
        for start in range(a, b, most):
            yield start, min(start + most, b)


class StateLending:
    """A client rank's side of the loans: its store (:class:`Borrowing`) and the two exchanges of each round."""

    def __init__(self, comm: MPI.Comm, store: Borrowing):
        self.comm, self.store = comm, store
        self.elements = store.firsts[-1]

    def borrow(self, header: protocol.RoundHeader) -> None:
        """Lend the header's ``lend`` vectors and receive its ``borrow`` ones; return once both are done. Each
        vector travels after a one-element flag: whether the client has a vector of its own (``has``), which
        Ditto and the local tensors read to start a client from the global model or the built values."""
        if not header.borrow and not header.lend:
            return
        tag = protocol.round_tag(protocol.STATE, header.round)
        requests: list[MPI.Request] = []
        flags = {client: np.zeros(1, np.float32) for client, _ in header.borrow}
        for client, home in header.borrow:
            vector = self.store.borrowed[client] = torch.empty(self.elements)
            requests += self._post(self.comm.Irecv, flags[client], vector, home, tag)
        sent = [(np.array([self.store.store.has(client)], np.float32), self._home_vector(client))
                for client, _ in header.lend]  # alive until the sends complete
        for (flag, vector), (_, trainer) in zip(sent, header.lend):
            requests += self._post(self.comm.Isend, flag, vector, trainer, tag)
        wait_all(requests)  # a peer that never posts is silent to the server too, whose watchdog ends the job
        self.store.owned.update({client: bool(flag[0]) for client, flag in flags.items()})

    def give_back(self, header: protocol.RoundHeader) -> None:
        """Send the borrowed vectors home and take the lent ones back into the store (a client that still has no
        vector of its own stays without one); return once both are done."""
        if not header.borrow and not header.lend:
            return
        tag = protocol.round_tag(protocol.STATE_BACK, header.round)
        requests: list[MPI.Request] = []
        returning = {client: (np.zeros(1, np.float32), self._return_target(client)) for client, _ in header.lend}
        for client, trainer in header.lend:
            requests += self._post(self.comm.Irecv, *returning[client], trainer, tag)
        flags = [np.array([self.store.has(client)], np.float32) for client, _ in header.borrow]
        for flag, (client, home) in zip(flags, header.borrow):
            requests += self._post(self.comm.Isend, flag, self.store.borrowed[client], home, tag)
        wait_all(requests)
        inner = self.store.store
        for client, (flag, vector) in returning.items():
            if not flag[0]:
                continue
            if isinstance(inner, RamResiduals):
                inner.vectors[client] = vector  # received in place, or a fresh buffer the store now keeps
                continue
            for index, (a, b) in enumerate(zip(self.store.firsts, self.store.firsts[1:])):
                inner.write(client, index, vector[a:b])
        self.store.lend_out()

    def _post(self, call: Callable[..., MPI.Request], flag: np.ndarray, vector: torch.Tensor, peer: int,
              tag: int) -> list[MPI.Request]:
        """Isend or Irecv ``flag``, then ``vector`` piece by piece, with ``peer`` (MPI keeps each (source, tag)
        stream in order, so the pieces need no header)."""
        data = vector.numpy()
        requests = [call([flag, MPI.FLOAT], peer, tag)]
        requests += [call([data[a:b], MPI.FLOAT], peer, tag) for a, b in pieces(self.store.firsts)]
        wake(self.comm, peer)
        return requests

    def _home_vector(self, client: int) -> torch.Tensor:
        """A home client's whole vector to lend: the RAM store's own, zeros for a client without one, or a copy
        read chunk by chunk from the rank's HDF5 file."""
        inner = self.store.store
        if isinstance(inner, RamResiduals):
            return inner.vectors[client] if inner.has(client) else torch.zeros(self.elements)
        out = torch.empty(self.elements)
        for index, (a, b) in enumerate(zip(self.store.firsts, self.store.firsts[1:])):
            out[a:b] = inner.read(client, index)
        return out

    def _return_target(self, client: int) -> torch.Tensor:
        """Where a lent vector comes back to: in place in the RAM store when the client has one there (its loan was
        sent before training began), else a buffer kept or written to the HDF5 file once received."""
        inner = self.store.store
        if isinstance(inner, RamResiduals) and inner.has(client):
            return inner.vectors[client]
        return torch.empty(self.elements)
