"""SCAFFOLD on a client rank: each hosted logical client's control variate c_i, kept between the rounds it
is sampled in, and what it does to that client's training and update (the math is mpifl.learning.control).

The c_i live in a per-client store like error-feedback residuals (storage.residuals): in RAM while the
hosted clients' vectors fit in ``strategy.control_ram_mb``, else in one HDF5 file per rank, and published
with every checkpoint, so a resume on any number of ranks finds each client's c_i. A client never
sampled has c_i = 0.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mpifl.learning.control import control_delta, controlled_pairs, corrected_steps, split
from mpifl.storage.residuals import ResidualStore
from mpifl.wire.flat import FlatModel


class ClientControls:
    """The hosted clients' c_i, the correction c - c_i while one trains, and its control delta afterwards."""

    def __init__(self, flat: FlatModel, store: ResidualStore, lr: float):
        pairs = controlled_pairs(flat.module)
        self.params = [p for p, _ in pairs]
        self.server = [c for _, c in pairs]  # views of the model's control section: the global c on arrival
        self.store, self.lr = store, lr
        elements = sum(p.numel() for p in self.params)
        self.firsts = [0, elements]  # the store's one chunk: the whole vector
        self.corrections = torch.empty(elements)
        base = flat.buffer.data_ptr()
        # each parameter's byte range in the flat buffer, to read its global value from the rank's host copy
        self.ranges = [(p.data_ptr() - base, p.numel() * p.element_size()) for p in self.params]

    @contextlib.contextmanager
    def training(self, client: int) -> Iterator[None]:
        """Train ``client`` inside: each step corrected by -lr * (c - c_i) (c is the model's, c_i the store's)."""
        corrections = split(self.corrections, self.params)
        for k, c in zip(corrections, self.server):
            k.copy_(c)
        self.corrections.sub_(self.store.read(client, 0))
        with corrected_steps(self.params, corrections):
            yield

    def update(self, client: int, global_bytes: torch.Tensor, steps: int, weight: float) -> None:
        """After ``client`` trained ``steps`` steps from the global model (``global_bytes``, the host copy of the
        flat buffer): c_i += delta_c_i in the store, and the model's control section set to c + delta_c_i / weight,
        so that its delta (what is sent) is the control delta over the client's weight in the server's fold. A client
        whose training diverged (a NaN or Inf delta) keeps its c_i: its update is refused, never folded."""
        if weight <= 0:
            raise ValueError(f"logical client {client}: SCAFFOLD divides its control delta by its weight, "
                             f"which is {weight}")
        deltas = []
        for p, c, (offset, nbytes) in zip(self.params, self.server, self.ranges):
            x = global_bytes[offset:offset + nbytes].view(p.dtype).view(p.shape)
            deltas.append(control_delta(x.float(), p.detach().float(), c, steps, self.lr))
        if not all(bool(torch.isfinite(d).all()) for d in deltas):
            return  # a diverged client: its update is refused (NaN/Inf), and its c_i stays as it was
        own = self.store.read(client, 0)
        for c, mine, delta in zip(self.server, split(own, self.params), deltas):
            mine.add_(delta)
            c.add_(delta.div_(weight))
        self.store.write(client, 0, own)
