"""FedBN and FedPer on a client rank: each hosted logical client's own values of the ``model.local`` tensors.

Li et al. 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization" (ICLR) keeps
the BatchNorm layers local; Arivazhagan et al. 2019, "Federated Learning with Personalization Layers"
(FedPer) keeps the head local. Either way the tensors named by ``model.local`` never travel
(mpifl.wire.flat keeps them in the rank's second buffer): the server averages the rest, and every client
trains from the global tensors plus its own local ones. Those are the client's per-client vector: in RAM up to
``model.local_ram_mb``, else in one HDF5 file per rank, published with every checkpoint. A client never sampled
starts from the values the model was built with, the same on every rank.

The model is the one that trains: the rank's host model or its device replica (``train.device: cuda``). The
store stays in host memory; a client's tensors go to the device before it trains and back after, once each.
"""
from __future__ import annotations

import torch

from mpifl.learning.steps import gather, scatter
from mpifl.storage.residuals import ResidualStore
from mpifl.wire.flat import FlatModel


class PersonalTensors:
    """Loads a client's local tensors into the rank's model before it trains, and keeps them after.

    ``marked``: the store's vectors hold one element more, 1 once the client has kept its own tensors. A store
    shared with another kind of per-client state (``Section``) has a vector for every client that other kind
    touched, zeros where this one never wrote; the mark tells the two apart, in RAM, on disk and in a checkpoint's
    snapshot alike, so a client never trained starts from the built values after a resume as before it."""

    def __init__(self, flat: FlatModel, store: ResidualStore, marked: bool = False):
        self.tensors = [t for _, t in flat.local_tensors()]
        for name, t in flat.local_tensors():
            if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"model.local: tensor {name!r} is {t.dtype}; local tensors are kept as fp32, "
                                 "which holds float32, bfloat16 and float16 values exactly")
        self.elements = sum(t.numel() for t in self.tensors)
        self.store, self.marked = store, marked
        self.initial = gather(self.tensors, torch.empty(self.elements))  # as built, in host memory: a client's start

    def load(self, client: int) -> None:
        """Put ``client``'s local tensors into the model (the built values for a client never trained)."""
        if self.marked:
            stored = self.store.read(client, 0)
            values = stored if bool(stored[self.elements] == 1) else self.initial
        else:
            values = self.store.read(client, 0) if self.store.has(client) else self.initial
        scatter(values, self.tensors)

    def keep(self, client: int) -> None:
        """Store the model's local tensors as ``client``'s own (after it trained); a client whose local tensors
        went NaN or Inf keeps its previous ones (its update is refused too)."""
        if not all(bool(torch.isfinite(t).all()) for t in self.tensors):
            return
        own = self.store.read(client, 0)
        gather(self.tensors, own)
        if self.marked:
            own[self.elements] = 1
        self.store.write(client, 0, own)
