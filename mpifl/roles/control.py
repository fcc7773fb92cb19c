"""SCAFFOLD and FedDyn on a client rank: each hosted logical client's own vector (SCAFFOLD's control variate
c_i, FedDyn's gradient state), kept between the rounds it is sampled in, and what it does to that client's
training and update (the math is mpifl.learning.control).

The vectors live in a per-client store like error-feedback residuals (storage.residuals): in RAM while the
hosted clients' vectors fit in ``strategy.control_ram_mb``, else in one HDF5 file per rank, and published
with every checkpoint, so a resume on any number of ranks finds each client's c_i. A client never
sampled has c_i = 0.

The model these classes work on is the one that trains: the rank's host model, or its device replica
(``train.device: cuda``, mpifl.learning.device). The store stays in host memory either way; the training
client's vector is copied to the model's device once before it trains and its new value back once after,
so every step's correction runs where the step does.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mpifl.learning.control import (
    control_delta,
    controlled_pairs,
    corrected_steps,
    dynamic_regularizer,
    split,
    trainable,
)
from mpifl.storage.residuals import ResidualStore
from mpifl.wire.flat import FlatModel


class ClientControls:
    """The hosted clients' c_i, the correction c - c_i while one trains, and its control delta afterwards."""

    def __init__(self, flat: FlatModel, store: ResidualStore, lr: float):
        pairs = controlled_pairs(flat.module)
        self.params = [p for p, _ in pairs]
        self.server = [c for _, c in pairs]  # views of the model's control section: the global c on arrival
        self.flat, self.store, self.lr = flat, store, lr
        self.corrections = torch.empty(sum(p.numel() for p in self.params), device=flat.device)

    @property
    def shared(self) -> torch.Tensor:
        """What a group's members need while the client trains (``GroupCorrections``): its correction c - c_i."""
        return self.corrections

    @contextlib.contextmanager
    def training(self, client: int, global_bytes: torch.Tensor) -> Iterator[None]:
        """Train ``client`` inside: each step corrected by -lr * (c - c_i) (c is the model's, c_i the store's)."""
        corrections = split(self.corrections, self.params)
        for k, c in zip(corrections, self.server):
            k.copy_(c)
        self.corrections.sub_(self.store.read(client, 0).to(self.corrections.device))
        with corrected_steps(self.params, corrections):
            yield

    def update(self, client: int, global_bytes: torch.Tensor, steps: int, weight: float) -> None:
        """After ``client`` trained ``steps`` steps from the global model (``global_bytes``, a copy of the flat
        buffer on the model's device): c_i += delta_c_i in the store, and the model's control section set to
        c + delta_c_i / weight, so that its delta (what is sent) is the control delta over the client's weight in
        the server's fold. A client whose training diverged (a NaN or Inf delta) keeps its c_i: its update is
        refused, never folded."""
        if weight <= 0:
            raise ValueError(f"logical client {client}: SCAFFOLD divides its control delta by its weight, "
                             f"which is {weight}")
        deltas = [control_delta(x.float(), p.detach().float(), c, steps, self.lr)
                  for p, c, x in zip(self.params, self.server, self.flat.views_in(self.params, global_bytes))]
        if not all(bool(torch.isfinite(d).all()) for d in deltas):
            return  # a diverged client: its update is refused (NaN/Inf), and its c_i stays as it was
        own = self.store.read(client, 0)
        for c, mine, delta in zip(self.server, split(own, self.params), deltas):
            mine.add_(delta.to(mine.device))
            c.add_(delta.div_(weight))
        self.store.write(client, 0, own)


class GroupCorrections:
    """A group member's side of SCAFFOLD (``clients.ranks_per_client``): the correction c - c_i of the client its
    group trains. The leader keeps c_i, computes the correction (``ClientControls.training``) and broadcasts it
    with the global model; the member corrects each of its steps by it, as the leader does, so the group's ranks
    take the same steps."""

    def __init__(self, flat: FlatModel):
        self.params = [p for p, _ in controlled_pairs(flat.module)]
        self.vector = torch.empty(sum(p.numel() for p in self.params), device=flat.device)

    def training(self) -> contextlib.AbstractContextManager[None]:
        """Train inside: each step corrected by -lr * (the received correction)."""
        return corrected_steps(self.params, split(self.vector, self.params))


class GroupDynamics:
    """A group member's side of FedDyn (``clients.ranks_per_client``): the g_i of the client its group trains,
    broadcast by the leader, and the global model it trains from, kept as it arrived. Every rank adds the same
    alpha (y - x) - g_i to its gradients (y is the same on every rank of the group), so DDP's average carries it
    unchanged, as on one rank."""

    def __init__(self, flat: FlatModel, alpha: float, backwards_per_step: int = 1):
        self.params = [p for _, p in trainable(flat.module, flat.local)]
        self.flat, self.alpha, self.backwards_per_step = flat, alpha, backwards_per_step
        self.vector = torch.empty(sum(p.numel() for p in self.params), device=flat.device)
        self.global_copy = torch.empty_like(flat.buffer)

    def training(self) -> contextlib.AbstractContextManager[None]:
        """Train inside the received client's regulariser, anchored at the global model just received."""
        self.global_copy.copy_(self.flat.buffer)
        anchors = self.flat.views_in(self.params, self.global_copy)
        return dynamic_regularizer(self.params, anchors, split(self.vector, self.params), self.alpha,
                                   self.backwards_per_step)


class ClientDynamics:
    """FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization", ICLR, Algorithm 1) on a
    client rank: each hosted client's gradient state g_i (0 until it first trains). While client i trains from
    the global x, its objective is L_i(y) - <g_i, y> + alpha/2 ||y - x||^2, so every gradient gains
    alpha (y - x) - g_i; afterwards g_i -= alpha (y - x)."""

    def __init__(self, flat: FlatModel, store: ResidualStore, alpha: float, backwards_per_step: int = 1):
        """``backwards_per_step``: train.grad_accum_steps, the backward passes that make one optimizer step."""
        self.params = [p for _, p in trainable(flat.module, flat.local)]
        self.flat, self.store, self.alpha, self.backwards_per_step = flat, store, alpha, backwards_per_step
        # the training client's g_i, on the device of the model that trains
        self.states = torch.empty(sum(p.numel() for p in self.params), device=flat.device)

    @property
    def shared(self) -> torch.Tensor:
        """What a group's members need while the client trains (``GroupDynamics``): its g_i."""
        return self.states

    @contextlib.contextmanager
    def training(self, client: int, global_bytes: torch.Tensor) -> Iterator[None]:
        """Train ``client`` inside its dynamic regulariser."""
        self.states.copy_(self.store.read(client, 0))  # a disk store's read is a scratch
        states = split(self.states, self.params)
        with dynamic_regularizer(self.params, self.flat.views_in(self.params, global_bytes), states, self.alpha,
                                 self.backwards_per_step):
            yield

    def update(self, client: int, global_bytes: torch.Tensor, steps: int, weight: float) -> None:
        """g_i -= alpha (y - x) after ``client`` trained (y its model); a diverged client keeps its g_i."""
        moved = [p.detach().float() - x.float() for p, x in zip(self.params, self.flat.views_in(self.params,
                                                                                              global_bytes))]
        if not all(bool(torch.isfinite(m).all()) for m in moved):
            return
        own = self.store.read(client, 0)
        for mine, m in zip(split(own, self.params), moved):
            mine.sub_(m.to(mine.device), alpha=self.alpha)
        self.store.write(client, 0, own)
