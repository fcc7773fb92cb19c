"""A plug-in trainer: ``train.trainer: examples.custom_trainer.trainer:DecayTrainer``.

mpifl builds it once per client rank as ``DecayTrainer(cfg)`` (cfg the TrainConfig) and calls
``train(model, data, seed)`` for each logical client the rank hosts, with the global model loaded
into ``model``; the trained weights (or their delta) are what the client sends back.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from mpifl.api import ClientData, TrainConfig, TrainResult, make_loss, make_optimizer, minibatches


class DecayTrainer:
    """Local SGD whose learning rate falls linearly from ``train.lr`` to 0 over the client's steps."""

    modifies_weights = True  # the model goes back trained, not as received

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.loss_fn = make_loss(cfg.loss)

    def train(self, model: nn.Module, data: ClientData | None, seed: int) -> TrainResult:
        """``train.local_epochs`` passes (or ``train.local_steps`` steps); reports the mean loss and the steps."""
        if data is None or len(data) == 0:
            raise ValueError("DecayTrainer needs local data; this client has none")
        steps = self.cfg.local_steps or self.cfg.local_epochs * math.ceil(len(data) / self.cfg.batch_size)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(params, self.cfg)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / steps)
        batches = minibatches(len(data), self.cfg.batch_size, seed)  # seeded: every run trains the same
        first = next(model.parameters())  # the data stays on the host; batches go where the model is
        model.train()
        total = 0.0
        for _ in range(steps):
            batch = next(batches)
            optimizer.zero_grad(set_to_none=True)
            x, y = data.x[batch].to(first.device, first.dtype), data.y[batch].to(first.device)
            loss = self.loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item()
        return TrainResult(len(data), {"loss": total / steps}, local_steps=steps)
