"""Many logical clients trained at once as one batched model (``train.batched_clients: K``).

Why: a small model's local step is a few dozen kernel launches on a minibatch of 10-20 samples. On a GPU their
launch latency, not arithmetic, sets the pace (the LEAF CNN trained about 110 client updates/s on an H200, far below
what its FLOPs allow), and on a CPU every step pays the same Python and dispatch overhead. Training K clients as
one model with K *lanes* pays that overhead once per step for all of them.

How: ``torch.func``: the trained parameters are stacked K deep (lane k is client k's copy, all starting at the
global model), and ``vmap(grad(loss))`` over the lanes runs each layer once for every lane (a convolution becomes
a grouped convolution, a linear layer a batched matrix product). The optimizer's update is written out here for
stacked tensors, with the formulas of ``torch.optim``'s SGD, Adam and AdamW.

**Ragged clients.** Clients hold different numbers of samples, so they take different numbers of steps and their
last minibatch of a pass is short. Every minibatch is padded to ``batch_size`` rows whose loss weight is 0, and
the batch runs as many steps as its longest lane; a lane that has taken its own steps is frozen (its parameters are
put back after each later step, exactly, not moved by a zero step).

**What is exact.** A lane's arithmetic never reads another lane's values: the same client trains to the same bits
in any lane of any batch of the same width K (the batch is padded to K lanes, so every kernel sees the same
shapes), and so on any number of ranks. Against the one-client-at-a-time loop (``TorchTrainer``) it is the same
computation in another summation order (the padded mean, grouped kernels): the tests bound the difference, and
the docs' determinism page states it.

**What it takes.** Models whose training mode draws nothing and keeps no running state: no dropout, no
BatchNorm running statistics (``batched_problem`` names the module). Per-client rules: FedProx's proximal term
and SCAFFOLD's corrected steps (one correction vector per lane); the others are refused by the config checks.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from mpifl.config import TrainConfig
from mpifl.learning.datasets import ClientData
from mpifl.learning.noise import batch_noise, noise_generator
from mpifl.learning.trainers import LOSSES, TrainResult, make_loss, minibatches

__all__ = ["Lane", "LaneWeights", "batched_problem", "batched_refusal", "lane_steps", "train_lanes"]

OPTIMIZERS = ("sgd", "adam", "adamw")
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults, which make_optimizer keeps
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: max_norm / (total_norm + 1e-6)


@dataclass(frozen=True)
class Lane:
    """One logical client in a batch: its data, its training seed (``client_seed``) and, for SCAFFOLD, its
    correction c - c_i as one flat fp32 vector over the trained parameters (None without)."""

    data: ClientData
    seed: int
    correction: torch.Tensor | None = None


def lane_steps(samples: int, cfg: TrainConfig) -> int:
    """Optimizer steps a client of ``samples`` samples takes: the count ``TorchTrainer`` takes."""
    return cfg.local_steps or cfg.local_epochs * math.ceil(samples / (cfg.batch_size * cfg.grad_accum_steps))


def batched_problem(model: nn.Module, cfg: TrainConfig) -> str | None:
    """Why ``model`` cannot train its clients as lanes of one batch under ``cfg``, or None."""
    if cfg.optimizer not in OPTIMIZERS:
        return f"train.optimizer {cfg.optimizer!r} has no batched form (it has: {', '.join(OPTIMIZERS)})"
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            return (f"module {name!r} ({type(module).__name__}) keeps running statistics, which a lane cannot "
                    "update on its own; use GroupNorm or LayerNorm, or train clients one at a time")
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return (f"module {name!r} ({type(module).__name__}, p={module.p}) draws a mask each step, and lanes "
                    "would draw from one stream, so a client's training would depend on its batch mates")
    if not any(p.requires_grad for p in model.parameters()):
        return "the model has no trainable parameter"
    if cfg.loss not in LOSSES and not _takes_reduction(make_loss(cfg.loss)):
        return (f"train.loss {cfg.loss!r} takes no 'reduction' argument: a batch weighs out its padding rows "
                "from each sample's loss (reduction='none')")
    return None


def batched_refusal(model: nn.Module, cfg: TrainConfig) -> str | None:
    """``batched_problem`` as the config error says it, naming ``train.batched_clients``; None where the model's
    clients can train as lanes or the key is off. What ``mpifl validate`` and the run's ranks refuse alike."""
    problem = batched_problem(model, cfg) if cfg.batched_clients else None
    return f"train.batched_clients: {problem}" if problem else None


def _takes_reduction(loss: Callable) -> bool:
    """Whether a loss function can be asked for each sample's loss (a ``reduction`` parameter, or ``**kwargs``)."""
    try:
        params = inspect.signature(loss).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "reduction" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _per_sample(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed with ``reduction='none'`` as one value per sample (the mean over any other dimension, as
    ``mse_loss``'s mean reduction takes it)."""
    return loss if loss.dim() == 1 else loss.flatten(1).mean(1)


class _Plan:
    """Every micro-batch of every lane, drawn up front as ``TorchTrainer`` draws them for that client alone (its
    shuffled passes, its feature noise), so that a step gathers its rows on the device in one indexing and the
    host does no per-lane work between steps (on a GPU, that work would cost more than the step).

    The lanes' samples lie one after another in ``x``/``y`` (one copy to the device per batch); ``index[m]`` is
    micro-batch m's [K, B] rows into them and ``weight[m]`` 1 for a real row, 0 for padding and frozen lanes."""

    def __init__(self, lanes: Sequence[Lane], width: int, cfg: TrainConfig, steps: Sequence[int],
                 device: torch.device, dtype: torch.dtype):
        b, micro = cfg.batch_size, cfg.grad_accum_steps
        sizes = [len(lane.data) for lane in lanes]
        starts = [sum(sizes[:i]) for i in range(len(lanes))]
        self.micro_batches = max(steps) * micro
        index = torch.zeros((self.micro_batches, width, b), dtype=torch.int64)
        weight = torch.zeros((self.micro_batches, width, b), dtype=dtype)
        noise: dict[int, list[tuple[int, torch.Tensor]]] = {}  # micro-batch -> (lane, the noise of its rows)
        for i, lane in enumerate(lanes):
            order = minibatches(sizes[i], b, lane.seed)
            draws = noise_generator(lane.seed) if lane.data.noise_std else None
            for m in range(steps[i] * micro):
                batch = next(order)
                index[m, i, :len(batch)] = batch + starts[i]
                weight[m, i, :len(batch)] = 1
                if draws is not None:
                    rows = batch_noise(len(batch), tuple(lane.data.x.shape[1:]), lane.data.noise_std, draws)
                    noise.setdefault(m, []).append((i, rows.to(device=device, dtype=dtype)))
        self.x = torch.cat([lane.data.x for lane in lanes]).to(device=device, dtype=dtype)
        self.y = torch.cat([lane.data.y for lane in lanes]).to(device)
        self.index, self.weight, self.noise = index.to(device), weight.to(device), noise

    def batch(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Micro-batch ``m``: [K, B, ...] inputs (with each lane's noise), [K, B, ...] targets, [K, B] weights."""
        x = self.x[self.index[m]]
        for i, rows in self.noise.get(m, ()):
            x[i, :len(rows)] += rows
        return x, self.y[self.index[m]], self.weight[m]


class _Optimizer:
    """``torch.optim``'s SGD, Adam and AdamW for parameters stacked by lane, one step for every live lane, in place.

    A lane that has taken its own steps is frozen: its parameters are put back exactly after the step (not moved by a
    zero step, which momentum would not leave still). Its optimizer state may move: a frozen lane never steps again.
    While every lane lives, the step is ``torch.optim``'s for one client, on K lanes at once."""

    def __init__(self, cfg: TrainConfig, params: dict[str, torch.Tensor]):
        self.cfg, self.step_count = cfg, 0
        self.state: dict[str, list[torch.Tensor]] = {}
        if cfg.optimizer == "sgd" and cfg.momentum:
            self.state = {n: [torch.zeros_like(p)] for n, p in params.items()}
        elif cfg.optimizer in ("adam", "adamw"):
            self.state = {n: [torch.zeros_like(p), torch.zeros_like(p)] for n, p in params.items()}

    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], frozen: torch.Tensor | None,
             corrections: dict[str, torch.Tensor] | None) -> None:
        """Step ``params`` in place: each lane moved as ``torch.optim`` moves one client, then (SCAFFOLD) by
        -lr * its correction; the lanes listed in ``frozen`` (None: none) kept as they were."""
        self.step_count += 1
        for name, p in params.items():
            kept = p.index_select(0, frozen) if frozen is not None else None
            self._update(p, grads[name], self.state.get(name, []), None if corrections is None else corrections[name])
            if frozen is not None and kept is not None:
                p.index_copy_(0, frozen, kept)

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor],
                correction: torch.Tensor | None) -> None:
        c = self.cfg
        if c.optimizer == "sgd":
            d = g.add(p, alpha=c.weight_decay) if c.weight_decay else g
            if state:  # momentum, dampening 0: the first step's buffer is the gradient itself
                buf = state[0]
                if self.step_count == 1:
                    buf.copy_(d)
                else:
                    buf.mul_(c.momentum).add_(d)
                d = buf
            p.add_(d, alpha=-c.lr)
        else:
            (beta1, beta2), (m, v), t = ADAM_BETAS, state, self.step_count
            if c.optimizer == "adamw":
                p.mul_(1 - c.lr * c.weight_decay)
            elif c.weight_decay:
                g = g.add(p, alpha=c.weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(ADAM_EPS)
            p.addcdiv_(m, denom, value=-c.lr / (1 - beta1 ** t))
        if correction is not None:
            p.add_(correction.to(p.dtype), alpha=-c.lr)


def _clip(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """Each lane's gradients scaled to a global norm of at most ``max_norm`` (``clip_grad_norm_``'s rule)."""
    norms = torch.stack([g.flatten(1).norm(2, dim=1) for g in grads.values()]).norm(2, dim=0)
    scale = (max_norm / (norms + CLIP_EPS)).clamp(max=1.0)
    return {n: g * scale.view(-1, *([1] * (g.dim() - 1))).to(g.dtype) for n, g in grads.items()}


def _stacked_corrections(lanes: Sequence[Lane], trained: Mapping[str, torch.Tensor],
                         width: int) -> dict[str, torch.Tensor] | None:
    """Each lane's correction (SCAFFOLD's k) cut by parameter and stacked [K, ...] (zero for spare lanes), or None
    when no lane has one."""
    if all(lane.correction is None for lane in lanes):
        return None
    first = next(iter(trained.values()))
    stacked = torch.zeros(width, sum(p.numel() for p in trained.values()), device=first.device)
    for i, lane in enumerate(lanes):
        if lane.correction is not None:
            stacked[i] = lane.correction.to(first.device)
    cut = stacked.split([p.numel() for p in trained.values()], dim=1)
    return {n: t.reshape(width, *p.shape) for (n, p), t in zip(trained.items(), cut)}


def train_lanes(model: nn.Module, lanes: Sequence[Lane], cfg: TrainConfig, width: int,
                loss: Callable | None = None) -> list[tuple[LaneWeights, TrainResult]]:
    """Train each of ``lanes`` from ``model``'s current weights, all at once; ``model`` is left as it was.

    Returns, lane by lane, the trained parameters (by name; the model's frozen parameters and buffers are not
    trained) and the ``TrainResult`` ``TorchTrainer`` reports for that client. The batch has ``width`` lanes
    whatever ``len(lanes)`` is: the spare ones train nothing, so every batch runs the same kernels."""
    if not 0 < len(lanes) <= width:
        raise ValueError(f"a batch of width {width} takes 1 to {width} clients (got {len(lanes)})")
    if any(len(lane.data) == 0 for lane in lanes):
        raise ValueError("the batched trainer needs local data; a client has none")
    loss_fn = loss or make_loss(cfg.loss)
    named = dict(model.named_parameters())
    trained = {n: p for n, p in named.items() if p.requires_grad}
    fixed = {n: p.detach() for n, p in named.items() if not p.requires_grad} | dict(model.named_buffers())
    device, dtype = next(iter(trained.values())).device, next(iter(trained.values())).dtype
    params = {n: p.detach().unsqueeze(0).repeat(width, *([1] * p.dim())) for n, p in trained.items()}
    anchors = {n: p.detach() for n, p in trained.items()} if cfg.prox_mu else {}
    corrections = _stacked_corrections(lanes, trained, width)

    def lane_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = functional_call(model, (p, fixed), (x,))
        per_sample = _per_sample(loss_fn(out, y, reduction="none"))
        summed = (per_sample * weight).sum()
        return summed / weight.sum().clamp(min=1) / cfg.grad_accum_steps, summed.detach()

    lane_grad = vmap(grad(lane_loss, has_aux=True))
    steps = [lane_steps(len(lane.data), cfg) for lane in lanes]
    plan = _Plan(lanes, width, cfg, steps, device, dtype)
    optimizer = _Optimizer(cfg, params)
    loss_sums = torch.zeros(width, dtype=torch.float64, device=device)
    was_training = model.training
    model.train()
    try:
        for step in range(max(steps)):
            done = [i for i, s in enumerate(steps) if step >= s]  # spare lanes step freely: never read
            frozen = torch.tensor(done, device=device) if done else None
            grads: dict[str, torch.Tensor] = {}
            for k in range(cfg.grad_accum_steps):
                g, summed = lane_grad(params, *plan.batch(step * cfg.grad_accum_steps + k))
                grads = g if not grads else {n: grads[n].add_(g[n]) for n in grads}
                loss_sums += summed.double()
            if anchors:  # FedProx: the gradient of mu/2 ||w - w_global||^2
                for n, g in grads.items():
                    g.add_(params[n] - anchors[n], alpha=cfg.prox_mu)
            if cfg.max_grad_norm:
                grads = _clip(grads, cfg.max_grad_norm)
            optimizer.step(params, grads, frozen, corrections)
    finally:
        model.train(was_training)
    sums = loss_sums.tolist()
    return [(LaneWeights(params, i),
             TrainResult(len(lane.data), {"loss": sums[i] / max(_samples_seen(len(lane.data), cfg, steps[i]), 1)},
                         local_steps=steps[i]))
            for i, lane in enumerate(lanes)]


@dataclass(frozen=True)
class LaneWeights:
    """One lane's trained parameters, read from the batch's stacked tensors when they are loaded (a view per
    parameter made only then: a batch of thousands of lanes hands most of them out one at a time)."""

    stacked: Mapping[str, torch.Tensor]
    lane: int

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, this lane's trained tensor), in the model's order."""
        return ((name, tensor[self.lane]) for name, tensor in self.stacked.items())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.stacked[name][self.lane]

    def __iter__(self) -> Iterator[str]:
        return iter(self.stacked)


def _samples_seen(samples: int, cfg: TrainConfig, steps: int) -> int:
    """Samples a client reads in ``steps`` optimizer steps: passes over its ``samples``, the last batch of each
    pass short (the count its mean training loss divides by)."""
    per_pass = math.ceil(samples / cfg.batch_size)
    whole, rest = divmod(steps * cfg.grad_accum_steps, per_pass)
    return whole * samples + min(rest * cfg.batch_size, samples)
