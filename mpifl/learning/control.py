"""SCAFFOLD's control variates, the model's side, and FedDyn's dynamic regulariser.

SCAFFOLD is Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning" (ICML), Algorithm 1 with option II.

The server control variate ``c`` travels *inside the model*: one fp32 buffer per trainable parameter, in a
submodule named ``CONTROL`` appended to the model. So ``c`` is broadcast with the weights, reduced
chunk by chunk as the clients' control deltas arrive, checkpointed, resumed and kept out of core exactly
like them, and a model spec says whether a run has it. Each logical client's own ``c_i`` stays on the rank
that hosts it (mpifl.roles.control), as one fp32 vector in the order of ``controlled_pairs``.

A client corrects every local step by ``-lr * (c - c_i)`` (``corrected_steps``), and after its K
local steps at learning rate lr forms (``control_delta``)::

    delta_c_i = (x - y) / (K * lr) - c          so that  c_i+ = c_i + delta_c_i

with x the global and y its trained weights. The server adds ``(1/N) * sum_i delta_c_i`` to ``c``
(N = clients.num_clients), and averages the weights as FedAvg does (mpifl.aggregation.strategies).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from mpifl.wire.spec import CONTROL, is_local  # CONTROL: the submodule holding the server control variate c

__all__ = ["CONTROL", "ControlVariates", "attach_control_variates", "control_delta", "controlled_pairs",
           "corrected_steps", "dynamic_regularizer"]

T = TypeVar("T")



class ControlVariates(nn.Module):
    """One fp32 buffer per controlled parameter of the model it is attached to, zero at the start (c = 0)."""

    def __init__(self, params: Sequence[tuple[str, torch.Tensor]]):
        super().__init__()
        self.names: list[str] = []  # the buffers, in order
        self.controlled: list[str] = []  # the parameter each corrects, by its name in the model
        for i, (name, param) in enumerate(params):
            buffer = f"c{i:04d}_{name.replace('.', '_')}"
            self.register_buffer(buffer, torch.zeros(param.shape, dtype=torch.float32, device=param.device))
            self.names.append(buffer)
            self.controlled.append(name)

    def forward(self, x: T) -> T:
        """The identity: the buffers only travel with the model, and in an ``nn.Sequential`` model, which calls
        every submodule in turn, this one is the last and passes the output through unchanged."""
        return x


def trainable(model: nn.Module, local: Sequence[str] = ()) -> list[tuple[str, nn.Parameter]]:
    """The parameters SCAFFOLD corrects and FedDyn regularises: every one that trains, in the model's own order,
    but those named by the ``model.local`` patterns ``local`` (FedBN, FedPer): each client keeps its own, never
    averaged, so there is no global value to correct them towards or anchor them at."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and not is_local(n, local)]


def attach_control_variates(model: nn.Module, local: Sequence[str] = ()) -> nn.Module:
    """Append the ``CONTROL`` submodule (last, so its buffers come last in the model's tensors), one buffer per
    parameter ``trainable`` names."""
    if hasattr(model, CONTROL):
        raise ValueError(f"the model already has a submodule named {CONTROL!r}")
    model.add_module(CONTROL, ControlVariates(trainable(model, local)))
    return model


def controlled_pairs(model: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, its server control buffer) for every controlled parameter, in order."""
    control = getattr(model, CONTROL)
    assert isinstance(control, ControlVariates)  # attach_control_variates put it there
    params, buffers = dict(model.named_parameters()), dict(control.named_buffers())
    return [(params[name], buffers[buffer]) for name, buffer in zip(control.controlled, control.names, strict=True)]


def control_elements(model: nn.Module, local: Sequence[str] = ()) -> int:
    """Elements of one client's vector (SCAFFOLD's c_i, FedDyn's g_i): the ``trainable`` parameters' count."""
    return sum(p.numel() for _, p in trainable(model, local))


def split(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of a flat fp32 ``vector`` shaped like each of ``like``, in order."""
    out, start = [], 0
    for t in like:
        out.append(vector[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return out


@contextlib.contextmanager
def corrected_steps(params: Sequence[nn.Parameter], corrections: Sequence[torch.Tensor]) -> Iterator[None]:
    """While inside, every optimizer step is followed by y -= lr * (c - c_i) for each of ``params`` (lr its
    parameter group's): SCAFFOLD's corrected step y -= lr * (g(y) + c - c_i), with the correction kept outside
    the optimizer's momentum and weight decay. For plain SGD that is the paper's step; with momentum beta it
    is what NIID-Bench (Li et al., ICDE 2022) and Flower's baseline do. Inside the momentum the correction
    would act 1 / (1 - beta) times, on top of control variates (x - y) / (K lr) that already carry that
    factor, and the run diverges (with beta 0.9: chance accuracy on Fashion-MNIST by round 2)."""
    by_id = {id(p): k for p, k in zip(params, corrections, strict=True)}

    def after_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    k = by_id.get(id(p))
                    if k is not None:
                        p.add_(k.to(p.dtype), alpha=-group["lr"])

    handle = register_optimizer_step_post_hook(after_step)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def dynamic_regularizer(params: Sequence[nn.Parameter], anchors: Sequence[torch.Tensor],
                        states: Sequence[torch.Tensor], alpha: float, backwards_per_step: int = 1) -> Iterator[None]:
    """While inside, every gradient of ``params[k]`` gains alpha (y - anchors[k]) - states[k]: the gradient of
    FedDyn's -<g_i, y> + alpha/2 ||y - x||^2 (Acar et al. 2021), part of the objective, so it goes through the
    optimizer's momentum like the loss's own gradient.

    A hook fires on every backward pass. With ``train.grad_accum_steps`` = A passes per optimizer step, each
    adds 1/A of the term, as the trainer divides each micro-batch's loss by A: the step's gradient then holds
    the regulariser's once, not A times."""
    if backwards_per_step < 1:
        raise ValueError(f"backwards_per_step must be at least 1 (got {backwards_per_step})")

    def hook(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        p, x, g = params[k], anchors[k], states[k]
        if backwards_per_step == 1:
            return lambda grad: grad + ((p.detach() - x).mul_(alpha).sub_(g)).to(grad.dtype)
        return lambda grad: grad + ((p.detach() - x).mul_(alpha).sub_(g).div_(backwards_per_step)).to(grad.dtype)

    handles = [p.register_hook(hook(k)) for k, p in enumerate(params)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def control_delta(global_weights: torch.Tensor, trained: torch.Tensor, server_control: torch.Tensor,
                  steps: int, lr: float) -> torch.Tensor:
    """Option II of the paper: delta_c_i = (x - y) / (K * lr) - c, in fp32 (x, y, c as flat fp32 vectors)."""
    if steps <= 0 or lr <= 0:
        raise ValueError(f"SCAFFOLD needs local steps > 0 and a learning rate > 0 (got {steps} steps, lr {lr})")
    return (global_weights - trained).div_(steps * lr).sub_(server_control)
