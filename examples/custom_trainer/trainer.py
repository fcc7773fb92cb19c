"""A plug-in trainer: ``train.trainer: examples.custom_trainer.trainer:DecayTrainer``.

mpifl builds it once per client rank as ``DecayTrainer(cfg, **train.kwargs)`` (cfg the TrainConfig; each
keyword converted to its annotated type, so ``final_fraction: 1e-1`` is the float 0.1) and calls
``train(model, data, seed, context=...)`` for each logical client the rank hosts, with the global model loaded
into ``model``; the trained weights (or their delta) are what the client sends back. ``context`` says which
logical client trains in which round; whatever ``TrainResult.metrics`` holds besides ``loss`` is recorded per
round as ``client_metrics.<name>`` (mean over the clients by samples, min, max) in metrics.jsonl and the trackers.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from mpifl.api import ClientData, TrainConfig, TrainContext, TrainResult, make_loss, make_optimizer, minibatches


class DecayTrainer:
    """Local SGD whose learning rate falls linearly from ``train.lr`` to ``final_fraction * train.lr`` over the
    client's steps."""

    modifies_weights = True  # the model goes back trained, not as received

    def __init__(self, cfg: TrainConfig, final_fraction: float = 0.0) -> None:
        if not 0.0 <= final_fraction <= 1.0:
            raise ValueError(f"final_fraction must lie in [0, 1], got {final_fraction}")
        self.cfg, self.final_fraction = cfg, final_fraction
        self.loss_fn = make_loss(cfg.loss)

    def train(self, model: nn.Module, data: ClientData | None, seed: int,
              context: TrainContext | None = None) -> TrainResult:
        """``train.local_epochs`` passes (or ``train.local_steps`` steps); reports the mean loss, the steps and how
        far the client moved the model (``update_norm``, the L2 norm of trained - received)."""
        if data is None or len(data) == 0:
            who = f"logical client {context.client}" if context else "this client"
            raise ValueError(f"DecayTrainer needs local data; {who} has none")
        steps = self.cfg.local_steps or self.cfg.local_epochs * math.ceil(len(data) / self.cfg.batch_size)
        params = [p for p in model.parameters() if p.requires_grad]
        received = [p.detach().clone() for p in params]
        optimizer = make_optimizer(params, self.cfg)
        floor, last = self.final_fraction, max(steps - 1, 1)  # steps 0..steps-1: the last one runs at floor x lr
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - (1.0 - floor) * step / last)
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
        moved = math.sqrt(sum(float((p.detach() - r).pow(2).sum()) for p, r in zip(params, received)))
        return TrainResult(len(data), {"loss": total / steps, "update_norm": moved}, local_steps=steps)
