"""MOON, model-contrastive federated learning (Li, He and Song, CVPR 2021), as one plug-in file on ``mpifl.api``.

Each client trains the received global model w on its cross-entropy plus ``mu`` times a contrastive term that pulls
its representation z of each sample towards the global model's z_glob and away from z_prev, that of the client's
own model from the last round it trained (the paper's Eq. 3, as its code computes it)::

    l_con = -log( exp(cos(z, z_glob) / tau) / (exp(cos(z, z_glob) / tau) + exp(cos(z, z_prev) / tau)) )

The server averages the trained models as FedAvg does. What is new to mpifl is the previous model: a vector per
logical client that the trainer declares (``client_state``), which mpifl keeps on the rank hosting the client,
checkpoints, resumes on any number of ranks, lends under ``clients.placement: per_round`` and puts back when the
client is dropped past its deadline. A client never trained before takes the received global model as its previous
one (``start='global'``): the paper's code starts every client's from the initial global model, which is what a
client sampled in round 1 receives.

``model.name: examples.moon.moon:MoonNet`` and ``train.trainer: examples.moon.moon:MoonTrainer``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call

from mpifl.api import (
    ClientData,
    StateVector,
    TrainConfig,
    TrainContext,
    TrainResult,
    make_loss,
    make_optimizer,
    minibatches,
)


class MoonNet(nn.Module):
    """The paper's three parts over flattened inputs, sized for the digits: a base encoder (one tanh layer), a
    projection head giving the representation z (one tanh layer here, a two-layer MLP in the paper), and an output
    layer on z."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int = 64, projection: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.Tanh())
        self.projection = nn.Sequential(nn.Linear(hidden, projection), nn.Tanh())
        self.output = nn.Linear(projection, num_classes)

    def forward(self, x: torch.Tensor, with_representation: bool = False):
        """The class scores, and with ``with_representation`` the representation z beside them."""
        z = self.projection(self.encoder(x))
        scores = self.output(z)
        return (scores, z) if with_representation else scores


def contrastive_loss(z: torch.Tensor, z_global: torch.Tensor, z_previous: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """MOON's l_con, averaged over the batch: a two-way cross-entropy whose positive is the global representation."""
    positive = nn.functional.cosine_similarity(z, z_global, dim=-1)
    negative = nn.functional.cosine_similarity(z, z_previous, dim=-1)
    logits = torch.stack([positive, negative], dim=1) / temperature
    return nn.functional.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


class MoonTrainer:
    """Local SGD on cross-entropy + ``mu`` * l_con (``train.kwargs.mu``, ``train.kwargs.temperature``)."""

    modifies_weights = True
    client_state = {"previous": StateVector(covers="trainable", start="global")}

    def __init__(self, cfg: TrainConfig, mu: float = 1.0, temperature: float = 0.5) -> None:
        if mu < 0 or temperature <= 0:
            raise ValueError(f"MOON needs mu >= 0 and temperature > 0 (got mu={mu}, temperature={temperature})")
        self.cfg, self.mu, self.temperature = cfg, mu, temperature
        self.loss_fn = make_loss(cfg.loss)

    def train(self, model: nn.Module, data: ClientData | None, seed: int, context: TrainContext) -> TrainResult:
        """``train.local_epochs`` passes (or ``train.local_steps`` steps); then the trained model becomes the
        client's previous one. Reports the mean cross-entropy (``loss``) and the mean l_con (``contrastive``)."""
        if data is None or len(data) == 0:
            raise ValueError(f"MOON needs local data; logical client {context.client} has none")
        steps = self.cfg.local_steps or self.cfg.local_epochs * math.ceil(len(data) / self.cfg.batch_size)
        names = {id(p): n for n, p in model.named_parameters()}
        covered = context.covers["previous"]  # the parameters that train, in order
        global_params = {names[id(p)]: p.detach().clone() for p in covered}
        previous = {names[id(p)]: v.to(p.dtype) for p, v in zip(covered, context.views("previous"))}
        optimizer = make_optimizer(list(covered), self.cfg)
        batches = minibatches(len(data), self.cfg.batch_size, seed)
        first = covered[0]
        model.train()
        total_ce = total_con = 0.0
        for _ in range(steps):
            batch = next(batches)
            x, y = data.x[batch].to(first.device, first.dtype), data.y[batch].to(first.device)
            with torch.no_grad():
                z_global = functional_call(model, global_params, (x,), {"with_representation": True})[1]
                z_previous = functional_call(model, previous, (x,), {"with_representation": True})[1]
            optimizer.zero_grad(set_to_none=True)
            scores, z = model(x, with_representation=True)
            ce = self.loss_fn(scores, y)
            con = contrastive_loss(z, z_global, z_previous, self.temperature)
            (ce + self.mu * con).backward()
            optimizer.step()
            total_ce += ce.item()
            total_con += con.item()
        for kept, p in zip(context.views("previous"), covered):  # this model is the client's previous one next time
            kept.copy_(p.detach())
        return TrainResult(len(data), {"loss": total_ce / steps, "contrastive": total_con / steps}, local_steps=steps)
