"""APFL, adaptive personalised federated learning (Deng, Kamani and Mahdavi 2020, arXiv:2003.13461), as one plug-in
file on ``mpifl.api``.

Each client keeps a personal model v and a mixing weight alpha of its own. Its personalised model is the mixture
v_bar = alpha v + (1 - alpha) w of v and the local copy w of the global model. Every local step, on the same
minibatch (the paper's Algorithm 1, both updates from the step's old values)::

    w     <- w     - lr       * grad f(w)
    v     <- v     - lr       * grad_v f(v_bar)        = alpha * grad f(v_bar)
    alpha <- alpha - alpha_lr * grad_alpha f(v_bar)    = <v - w, grad f(v_bar)>, then clipped to [0, 1]

and the server averages the w as FedAvg does. v and alpha are two per-client vectors of different kinds that the
trainer declares (``client_state``): v covers the trainable parameters and starts as the first global model the
client receives, alpha is one element of the trainer's own meaning. mpifl keeps both on the client's rank,
checkpoints, resumes and lends them, and puts them back when the client is dropped past its deadline.

``train.trainer: examples.apfl.apfl:APFLTrainer``; any classifier model (the built-in ``mlp`` here). w trains with
the config's optimizer (``train.optimizer``), v and alpha with plain SGD, as in the paper.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

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


class APFLTrainer:
    """APFL's local update (``train.kwargs``: ``alpha``, the mixing weight a client starts with; ``alpha_lr``, its
    step size, ``train.lr`` when unset; ``adapt_alpha: false`` keeps every client's alpha fixed)."""

    modifies_weights = True
    client_state = {"personal": StateVector(covers="trainable", start="global"),
                    "alpha": StateVector(covers="custom", size=1)}

    def __init__(self, cfg: TrainConfig, alpha: float = 0.25, alpha_lr: float | None = None,
                 adapt_alpha: bool = True) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"APFL's mixing weight alpha must lie in [0, 1], got {alpha}")
        self.cfg, self.alpha, self.adapt_alpha = cfg, alpha, adapt_alpha
        self.alpha_lr = cfg.lr if alpha_lr is None else alpha_lr
        self.loss_fn = make_loss(cfg.loss)

    def train(self, model: nn.Module, data: ClientData | None, seed: int, context: TrainContext) -> TrainResult:
        """``train.local_epochs`` passes (or ``train.local_steps`` steps) of the three updates. Reports w's mean loss
        (``loss``), the personalised model's (``personal_loss``) and the client's alpha after training."""
        if data is None or len(data) == 0:
            raise ValueError(f"APFL needs local data; logical client {context.client} has none")
        if context.fresh["alpha"]:
            context.state["alpha"].fill_(self.alpha)
        steps = self.cfg.local_steps or self.cfg.local_epochs * math.ceil(len(data) / self.cfg.batch_size)
        names = {id(p): n for n, p in model.named_parameters()}
        params = list(context.covers["personal"])  # w: the parameters that train, in order
        personal = context.views("personal")  # v, shaped like them (fp32)
        alpha = context.state["alpha"]
        optimizer = make_optimizer(params, self.cfg)
        batches = minibatches(len(data), self.cfg.batch_size, seed)
        first = params[0]
        model.train()
        total = total_personal = 0.0
        for _ in range(steps):
            batch = next(batches)
            x, y = data.x[batch].to(first.device, first.dtype), data.y[batch].to(first.device)
            v = [t.detach().requires_grad_() for t in personal]
            a = alpha.detach().clone().requires_grad_()
            mixed = {names[id(p)]: a * vi + (1 - a) * p.detach() for p, vi in zip(params, v)}
            personal_loss = self.loss_fn(functional_call(model, mixed, (x,)), y)
            grads = torch.autograd.grad(personal_loss, [*v, a])
            optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for vi, g in zip(personal, grads[:-1]):
                    vi.sub_(g, alpha=self.cfg.lr)
                if self.adapt_alpha:
                    alpha.sub_(grads[-1], alpha=self.alpha_lr).clamp_(0.0, 1.0)
            total += loss.item()
            total_personal += personal_loss.item()
        return TrainResult(len(data), {"loss": total / steps, "personal_loss": total_personal / steps,
                                       "alpha": float(alpha)}, local_steps=steps)

    @contextlib.contextmanager
    def personalized(self, model: nn.Module, context: TrainContext) -> Iterator[nn.Module]:
        """The client's personalised model v_bar = alpha v + (1 - alpha) w in ``model``, w as its training left it:
        what mpifl's federated evaluation scores on the client's validation split (``federated_eval.personal_*``).
        mpifl puts w back afterwards."""
        alpha = float(context.state["alpha"])
        with torch.no_grad():
            for w, v in zip(context.covers["personal"], context.views("personal")):
                w.mul_(1 - alpha).add_(v.to(w.dtype), alpha=alpha)
        yield model
