"""FedBN and FedPer on a client rank: each hosted logical client's own values of the ``model.local`` tensors.

Li et al. 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization" (ICLR) keeps
the BatchNorm layers local; Arivazhagan et al. 2019, "Federated Learning with Personalization Layers"
(FedPer) keeps the head local. Either way the tensors named by ``model.local`` never travel
(mpifl.wire.flat keeps them in the rank's second buffer): the server averages the rest, and every client
trains from the global tensors plus its own local ones. Those live in a per-client store like
error-feedback residuals (storage.residuals): in RAM up to ``model.local_ram_mb``, else in one HDF5 file per
rank, published with every checkpoint. A client never sampled starts from the values the model was built
with, the same on every rank.
"""
from __future__ import annotations

import torch

from mpifl.storage.residuals import ResidualStore
from mpifl.wire.flat import FlatModel


class PersonalTensors:
    """Loads a client's local tensors into the rank's model before it trains, and keeps them after."""

    def __init__(self, flat: FlatModel, store: ResidualStore):
        self.tensors = [t for _, t in flat.local_tensors()]
        for name, t in flat.local_tensors():
            if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"model.local: tensor {name!r} is {t.dtype}; local tensors are kept as fp32, "
                                 "which holds float32, bfloat16 and float16 values exactly")
        self.elements = sum(t.numel() for t in self.tensors)
        self.firsts = [0, self.elements]  # the store's one chunk: the whole vector
        self.store = store
        self.initial = self._gather(torch.empty(self.elements))  # as built: a client's start
        self.seen = set(store.clients())  # clients with their own values (a resume reloads them)

    def _gather(self, out: torch.Tensor) -> torch.Tensor:
        start = 0
        for t in self.tensors:
            out[start:start + t.numel()].copy_(t.detach().flatten())
            start += t.numel()
        return out

    def load(self, client: int) -> None:
        """Put ``client``'s local tensors into the model (the built values for a client never trained)."""
        values = self.store.read(client, 0) if client in self.seen else self.initial
        start = 0
        with torch.no_grad():
            for t in self.tensors:
                t.copy_(values[start:start + t.numel()].view(t.shape))
                start += t.numel()

    def keep(self, client: int) -> None:
        """Store the model's local tensors as ``client``'s own (after it trained); a client whose local tensors
        went NaN or Inf keeps its previous ones (its update is refused too)."""
        if not all(bool(torch.isfinite(t).all()) for t in self.tensors):
            return
        own = self.store.read(client, 0)
        self.store.write(client, 0, self._gather(own))
        self.seen.add(client)
