"""Ditto on a client rank: Li, Hu, Beirami and Smith 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization" (ICML), Algorithm 1. Each hosted logical client keeps a personal model v_i beside the global one,
updated with every gradient plus lambda (v - w) (``mpifl.learning.steps.regularized_gradients`` with no linear
term), with any strategy (``train.ditto_lambda``).

``PersonalModels`` is a rank that trains clients (a group's leader); ``GroupPersonalModels`` a client group's other
ranks (``clients.ranks_per_client``), which train v_i with the leader; ``ShardPersonalModels`` every rank of a
sharded client (``clients.sharding: fsdp``), each keeping v_i over the rows of the trained parameters it holds.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from mpifl.algorithms.contract import ShardRows
from mpifl.learning.datasets import ClientData
from mpifl.learning.steps import gather, regularized_gradients, regularized_shard_gradients, scatter, trainable
from mpifl.learning.trainers import Trainer
from mpifl.storage.residuals import ResidualStore
from mpifl.wire.flat import FlatModel
from mpifl.wire.spec import Chunk


class GroupPersonalModels:
    """A group member's side of Ditto (``clients.ranks_per_client``): train the personal model v_i the leader
    sends, with the group, regularised towards the global w sent beside it, then take w back. The leader keeps
    every v_i (``PersonalModels``); a member keeps none."""

    def __init__(self, flat: FlatModel, lam: float, backwards_per_step: int = 1):
        self.flat, self.lam, self.backwards_per_step = flat, lam, backwards_per_step
        self.params = [p for _, p in trainable(flat.module)]
        self.zeros = [torch.zeros(p.shape, dtype=torch.float32, device=p.device)  # Ditto has no linear term
                      for p in self.params]
        self.global_copy = torch.empty_like(flat.buffer)

    def train(self, trainer: Trainer, data: ClientData | None, seed: int) -> None:
        """v_i is in the model and w in ``global_copy`` (both just received): update v_i, then restore w."""
        anchors = self.flat.views_in(self.params, self.global_copy)
        try:
            with regularized_gradients(self.params, anchors, self.zeros, self.lam, self.backwards_per_step):
                trainer.train(self.flat.module, data, seed)
        finally:
            self.flat.buffer.copy_(self.global_copy)
            self.flat.reset_local_state()


class PersonalModels:
    """Ditto (Li, Hu, Beirami and Smith 2021, "Ditto: Fair and Robust Federated Learning Through
    Personalization", ICML, Algorithm 1) on a client rank: each hosted client's personal model v_i.

    Each round a client is sampled it first updates v_i (the received global w the first time) on its own
    data, with every gradient plus lambda (v - w), and keeps it; then it trains w as usual and sends that
    update. The two are independent given w, so v_i is trained first and the rank's model is given w back
    before the global training. v_i is kept as fp32 chunk by chunk (the model's chunks), in RAM or on disk,
    and published with every checkpoint. With federated evaluation due, v_i is evaluated on the client's
    validation split after its update (``personal_*`` in the header's ``evaluation``, summarised like the global
    model's scores). Under ``clients.accept_failures`` (``deferred``) the trained v_i is held until the client's
    round stands (``keep``) or fails (``discard``): a client dropped on its rank keeps v_i as before the round.

    With ``model.local`` (``with_local``), the global model a client trains is w with its own local tensors l_i
    (FedBN, FedPer: ``PersonalTensors`` has loaded them), and that is what v_i is pulled towards: v_i is a whole
    model of its own, its local tensors too, kept in the store's chunk after the model's chunks (the last one
    written, so that a written mark means a whole v_i). It starts as (w, l_i), and the model has l_i back after.
    """

    def __init__(self, flat: FlatModel, chunks: list[Chunk], store: ResidualStore, trainer: Trainer, lam: float,
                 with_local: bool = False, backwards_per_step: int = 1, deferred: bool = False):
        self.flat, self.chunks, self.store, self.trainer, self.lam = flat, chunks, store, trainer, lam
        # clients.accept_failures: v_i is held (``pending``) until the client's round is known to stand (``keep``)
        # or to have failed (``discard``), so that a dropped client leaves no trace, as its c_i or g_i leaves none
        self.deferred = deferred
        self.pending: tuple[int, list[torch.Tensor]] | None = None
        # the client whose personal training went non-finite last (its v_i not kept, nor scored), else None
        self.diverged: int | None = None
        self.backwards_per_step = backwards_per_step  # train.grad_accum_steps: Ditto's term once per step
        # called with (client, seed, w) once v_i is in the model, before it trains: a group's leader
        # (clients.ranks_per_client) sends its group both models there (GroupLeader.dispatch_personal)
        self.starting: Callable[[int, int, torch.Tensor], None] | None = None
        self.named = trainable(flat.module)
        self.params = [p for _, p in self.named]
        self.zeros = [torch.zeros(p.shape, dtype=torch.float32, device=p.device)  # Ditto has no linear term
                      for p in self.params]
        # with_local: the local tensors by name (parameters and statistics)
        self.local = dict(flat.local_tensors()) if with_local else {}

    def train(self, client: int, data: ClientData | None, global_bytes: torch.Tensor, seed: int,
              evaluate: Callable[[], dict] | None) -> dict:
        """Update ``client``'s v_i and keep it (unless it diverged); give the model the global w back (and the
        client's own local tensors). Returns ``evaluate()``'s metrics of v_i when given (the caller's federated
        evaluation of the model in place). A v_i gone non-finite is neither kept (the client's next personal
        training starts from its last kept v_i, or from w when it has none) nor scored: ``diverged`` names it."""
        self.pending = self.diverged = None
        metrics: dict = {}
        local = list(self.local.values())
        own_local = {n: t.detach().clone() for n, t in self.local.items()}  # l_i: v_i's anchor, the model's after
        if self.store.has(client):  # a personal model of its own (a resume reloads them), else a copy of (w, l_i)
            for i, c in enumerate(self.chunks):
                self.flat.chunk_view(c).copy_(self.store.read(client, i))
            if local:
                scatter(self.store.read(client, len(self.chunks)), local)
        self.flat.reset_local_state()
        anchors = self._anchors(global_bytes, own_local)
        try:
            if self.starting is not None:
                self.starting(client, seed, global_bytes)
            with regularized_gradients(self.params, anchors, self.zeros, self.lam, self.backwards_per_step):
                self.trainer.train(self.flat.module, data, seed)
            views = [self.flat.chunk_view(c) for c in self.chunks]
            if not all(bool(torch.isfinite(v).all()) for v in [*views, *local]):
                self.diverged = client
            else:
                metrics = evaluate() if evaluate is not None else {}
                self.pending = client, self._trained(views, local)
                if not self.deferred:
                    self.keep(client)
        finally:
            self.flat.buffer.copy_(global_bytes)
            with torch.no_grad():
                for n, t in self.local.items():
                    t.copy_(own_local[n])
            self.flat.reset_local_state()
        return metrics

    def _trained(self, views: list[torch.Tensor], local: list[torch.Tensor]) -> list[torch.Tensor]:
        """v_i's chunks as the store keeps them (fp32, on the host), then its own local tensors' when it has them:
        copies when held for later, since the model is given w back before the client's round is known to stand."""
        chunks = [v.to(device="cpu", dtype=torch.float32, copy=self.deferred) for v in views]
        if not local:
            return chunks
        n = len(self.chunks)
        return [*chunks, gather(local, torch.zeros(self.store.firsts[n + 1] - self.store.firsts[n]))]

    def keep(self, client: int) -> None:
        """``client``'s round stands: store the v_i it trained (nothing if its personal training diverged)."""
        if self.pending is None or self.pending[0] != client:
            return
        for i, values in enumerate(self.pending[1]):  # the local tensors' chunk last: its write marks v_i as whole
            self.store.write(client, i, values)
        self.pending = None

    def discard(self) -> None:
        """The client's round failed (dropped under clients.accept_failures): its v_i stays as before the round."""
        self.pending = None

    def _anchors(self, global_bytes: torch.Tensor, own_local: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """What each trainable parameter is pulled towards: its view in w's bytes, or for a local tensor the
        client's own l_i (the global model this client trains)."""
        shared = iter(self.flat.views_in([p for n, p in self.named if n not in own_local], global_bytes))
        return [own_local[n] if n in own_local else next(shared) for n, _ in self.named]


class ShardPersonalModels:
    """Ditto on one rank of a sharded client (``clients.sharding: fsdp``): each hosted client's v_i over this rank's
    rows of the trained parameters (a transformers model's buffers are constants, never trained), in one chunk of
    the store. As ``PersonalModels``: v_i (the global w the first time) is trained on the client's data with every
    gradient's rows plus lambda (v - w) (``regularized_shard_gradients``), held unless it diverged on any rank of
    the group, and the shard is then given w back (``restore``) before the client trains w. The held v_i is kept
    (``keep``) only once the client's update is checked usable on every rank, as ``PersonalModels`` defers it: a
    client whose update is refused (NaN/Inf) keeps v_i as before the round."""

    def __init__(self, rows: ShardRows, store: ResidualStore, trainer: Trainer, lam: float,
                 restore: Callable[[], None], backwards_per_step: int = 1):
        self.rows, self.store, self.trainer, self.lam, self.restore = rows, store, trainer, lam, restore
        self.backwards_per_step = backwards_per_step
        self.zeros = [torch.zeros(r.shape, dtype=torch.float32, device=r.device) for r in rows.rows]
        self.scratch = torch.empty(rows.elements, dtype=torch.float32)  # v_i's rows, held until the update stands
        self.pending: int | None = None  # the client whose v_i ``scratch`` holds
        self.diverged: int | None = None  # the client whose personal training went non-finite last (v_i not kept)

    def train(self, client: int, module: torch.nn.Module, data: ClientData | None, seed: int) -> None:
        """Update ``client``'s v_i on this rank's rows and hold it (``keep`` stores it); the shard holds w again
        afterwards; ``diverged`` names the client when its v_i went non-finite on any rank of the group."""
        self.pending = self.diverged = None
        try:
            if self.store.has(client):
                scatter(self.store.read(client, 0), list(self.rows.rows))
            with regularized_shard_gradients(self.rows.params, self.rows.anchors, self.zeros, self.lam,
                                             self.backwards_per_step):
                self.trainer.train(module, data, seed)
            if self.rows.all_ranks(all(bool(torch.isfinite(r).all()) for r in self.rows.rows)):
                gather(list(self.rows.rows), self.scratch)
                self.pending = client
            else:
                self.diverged = client
        finally:
            self.restore()

    def keep(self, client: int, usable: bool) -> None:
        """``client``'s update was checked on every rank of the group: store the v_i it trained if the update is
        ``usable`` (nothing if its personal training diverged), else leave v_i as before the round."""
        if usable and self.pending == client:
            self.store.write(client, 0, self.scratch)
        self.pending = None
