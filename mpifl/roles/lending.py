"""Per-client state that follows its client: ``clients.placement: per_round`` trains a client on any rank, while its
state (SCAFFOLD's cᵢ, FedDyn's gᵢ, error-feedback residuals, ``model.local`` tensors, Ditto's personal model) stays
on its home rank, 1 + c mod N (``planning.federation.state_home``).

Each round the header names the loans (``RoundOrder.borrow`` and ``lend``, from ``state_loans``). Right after the
header, every rank lends the vectors of its home clients that train elsewhere and receives those of the clients it
trains whose home is elsewhere, all posted at once, then waited for. Once the rank has sent its round, the borrowed
vectors go back and the lent ones come home, again all at once: posted then, completed at the next round's loans,
before a checkpoint's publication, or at the stop. Only bits are copied, so where a client trains still changes no
result; and every vector is at home before anything is published, so a checkpoint holds exactly what a balanced
placement's would (its files keyed by client id).

A rank dropped as a straggler (``clients.accept_failures``) still owes its hand-back: the next round's loans wait
for it to finish the round it was dropped from.

Why two exchanges at the round's edges rather than a lazy fetch before each client: a rank that is training makes
no MPI progress, so a vector fetched from a busy rank would wait for that rank's next client; at the edges every
rank is in MPI at the same time.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import torch
from mpi4py import MPI

from mpifl.storage.residuals import Borrowing, UndoJournal, keep_whole, landing_vector, whole_vector
from mpifl.wire import protocol
from mpifl.wire.transport import wake

PIECE_ELEMENTS = 1 << 26  # fp32 elements per message at most (256 MiB): far from MPI's int count limit


def poll_all(requests: list[MPI.Request]) -> None:
    """Complete ``requests`` by polling, yielding the core between polls but never sleeping: MPI copies a large
    message between two processes only while both poll, so a side asleep in a back-off stalls it. SCAFFOLD on
    the cross-device LEAF CNN (200 clients, 20 a round, about 10 vectors of 6.8 MB lent each way a round, 2 client
    ranks): 0.54 and 0.56 s a round polling, 0.68 and 0.76 with ``wire.transport``'s sleeping waits (2026-11-27)."""
    while not MPI.Request.Testall(requests):
        os.sched_yield()


def pieces(firsts: list[int], most: int = PIECE_ELEMENTS) -> Iterator[tuple[int, int]]:
    """The element ranges one vector travels in: each state chunk, cut into pieces of at most ``most``; both sides
    derive the same ones from the store's layout, so messages carry no header."""
    for a, b in zip(firsts, firsts[1:]):
        for start in range(a, b, most):
            yield start, min(start + most, b)


class StateLending:
    """A client rank's side of the loans: its store (``Borrowing``) and the two exchanges of each round.

    The hand-back is posted when the rank has sent its round, and completed at the next synchronised moment: the
    next round's loans, a checkpoint's publication, or the stop. A rank that finished its round first so never
    waits for one still training, and every exchange is completed while all client ranks are in MPI together,
    where it runs at memory speed by polling without sleeping (a sleeping side stalls MPI's copies of large
    messages between processes)."""

    def __init__(self, comm: MPI.Comm, store: Borrowing, journal: UndoJournal | None = None):
        """``journal``: SCAFFOLD's or FedDyn's put-back of dropped clients (clients.accept_failures), which keeps
        each lent vector as it left, before the hand-back overwrites it."""
        self.comm, self.store, self.journal = comm, store, journal
        self.elements = store.firsts[-1]
        self.returning: list[MPI.Request] = []  # the last round's hand-back, posted, not yet complete
        self.returned: dict[int, tuple[np.ndarray, torch.Tensor]] = {}  # lent client -> (flag, where it lands)
        self.outgoing: list[object] = []  # buffers of the hand-back's sends, alive until they complete

    def borrow(self, header: protocol.RoundOrder) -> None:
        """Lend the header's ``lend`` vectors and receive its ``borrow`` ones; return once both are done. Each
        vector travels after a one-element flag: whether the client has a vector of its own (``has``), which
        Ditto and the local tensors read to start a client from the global model or the built values."""
        self.settle()
        if not header.borrow and not header.lend:
            return
        tag = protocol.round_tag(protocol.STATE, header.round)
        requests: list[MPI.Request] = []
        flags = {client: np.zeros(1, np.float32) for client, _ in header.borrow}
        for client, home in header.borrow:
            vector = self.store.borrowed[client] = torch.empty(self.elements)
            requests += self._post(self.comm.Irecv, flags[client], vector, home, tag)
        sent = [(np.array([self.store.store.has(client)], np.float32), whole_vector(self.store.store, client))
                for client, _ in header.lend]  # alive until the sends complete
        for (flag, vector), (_, trainer) in zip(sent, header.lend):
            requests += self._post(self.comm.Isend, flag, vector, trainer, tag)
        poll_all(requests)
        self.store.owned.update({client: bool(flag[0]) for client, flag in flags.items()})

    def give_back(self, header: protocol.RoundOrder) -> None:
        """Post the hand-back: the borrowed vectors (and whether each client now has one of its own) go home, the
        lent ones come back (completed by ``settle``)."""
        if not header.borrow and not header.lend:
            return
        tag = protocol.round_tag(protocol.STATE_BACK, header.round)
        if self.journal is not None:
            for client, _ in header.lend:
                self.journal.remember(client)  # a RAM store's vector is where its hand-back lands
        self.returned = {client: (np.zeros(1, np.float32), landing_vector(self.store.store, client))
                         for client, _ in header.lend}
        for client, trainer in header.lend:
            self.returning += self._post(self.comm.Irecv, *self.returned[client], trainer, tag)
        for client, home in header.borrow:
            flag, vector = np.array([self.store.has(client)], np.float32), self.store.borrowed[client]
            self.outgoing.append((flag, vector))
            self.returning += self._post(self.comm.Isend, flag, vector, home, tag)
        self.store.end_loans()

    def settle(self) -> None:
        """Complete the last hand-back and keep what came home (a client that still has no vector of its own stays
        without one)."""
        if not self.returning:
            return
        poll_all(self.returning)
        for client, (flag, vector) in self.returned.items():
            if flag[0]:
                keep_whole(self.store.store, client, vector)
        self.returning, self.returned, self.outgoing = [], {}, []

    def _post(self, call: Callable[..., MPI.Request], flag: np.ndarray, vector: torch.Tensor, peer: int,
              tag: int) -> list[MPI.Request]:
        """Isend or Irecv ``flag``, then ``vector`` piece by piece, with ``peer`` (MPI keeps each (source, tag)
        stream in order, so the pieces need no header)."""
        data = vector.numpy()
        requests = [call([flag, MPI.FLOAT], peer, tag)]
        requests += [call([data[a:b], MPI.FLOAT], peer, tag) for a, b in pieces(self.store.firsts)]
        wake(self.comm, peer)
        return requests
