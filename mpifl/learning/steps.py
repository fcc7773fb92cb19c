"""What a client half of an algorithm does to local training, step by step, whatever trains: the hooks SCAFFOLD,
FedDyn and Ditto use (mpifl.algorithms), public for plug-ins through ``mpifl.api``.

Both hooks work on the model as it trains, with no change to the trainer: ``corrected_steps`` acts after every
optimizer step (outside its momentum and weight decay), ``regularized_gradients`` on every gradient (inside them,
as part of the objective). So the built-in trainer, DDP across a client group and a plug-in trainer that uses a
``torch.optim`` optimizer all take them alike.

A client's per-client vector is one flat fp32 tensor in the order of the tensors it covers; ``split``,
``gather`` and ``scatter`` move between the two forms.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from mpifl.wire.spec import is_local

__all__ = ["corrected_steps", "gather", "own_rows", "regularized_gradients", "regularized_shard_gradients", "scatter",
           "split", "trainable", "trainable_elements"]


MASTER_OF = "mpifl_master_of"  # the attribute by which an optimizer's fp32 master copy names its model parameter


def trainable(model: nn.Module, local: Sequence[str] = ()) -> list[tuple[str, nn.Parameter]]:
    """The parameters a client rule corrects or regularises: every one that trains, in the model's own order, but
    those named by the ``model.local`` patterns ``local`` (FedBN, FedPer): each client keeps its own, never
    averaged, so there is no global value to correct them towards or anchor them at."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and not is_local(n, local)]


def trainable_elements(model: nn.Module, local: Sequence[str] = ()) -> int:
    """Elements of one client's vector over the ``trainable`` parameters (SCAFFOLD's c_i, FedDyn's g_i)."""
    return sum(p.numel() for _, p in trainable(model, local))


def own_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The rows of ``tensor`` this rank holds: a sharded parameter's (an FSDP DTensor's local shard, a view that
    writes through), or the whole of a plain tensor. A client half on a sharded client (``clients.sharding: fsdp``)
    keeps its vectors over these rows only."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def split(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of a flat fp32 ``vector`` shaped like each of ``like``, in order."""
    out, start = [], 0
    for t in like:
        out.append(vector[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return out


def gather(tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``tensors`` flattened one after another into ``out`` (fp32, on the host: a store's vector section)."""
    start = 0
    for t in tensors:
        out[start:start + t.numel()].copy_(t.detach().flatten())
        start += t.numel()
    return out


def scatter(values: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """The inverse of ``gather``: ``values``' consecutive runs copied into ``tensors``, in their dtypes."""
    start = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(values[start:start + t.numel()].view(t.shape))
            start += t.numel()


@contextlib.contextmanager
def corrected_steps(params: Sequence[nn.Parameter], corrections: Sequence[torch.Tensor]) -> Iterator[None]:
    """While inside, every optimizer step is followed by y -= lr * k for each of ``params`` (k its correction, lr its
    parameter group's): SCAFFOLD's corrected step y -= lr * (g(y) + c - c_i) with k = c - c_i, the correction kept
    outside the optimizer's momentum and weight decay. For plain SGD that is the paper's step; with momentum beta it
    is what NIID-Bench (Li et al., ICDE 2022) and Flower's baseline do. Inside the momentum the correction would act
    1 / (1 - beta) times, on top of control variates (x - y) / (K lr) that already carry that factor, and the run
    diverges (with beta 0.9: chance accuracy on Fashion-MNIST by round 2).

    A sharded parameter (``clients.sharding: fsdp``) is corrected on the rows this rank holds (``own_rows``): its
    correction is shaped like them. Where the optimizer steps an fp32 master copy of a narrow parameter (the
    causal_lm trainer under bf16), the copy names its parameter (``MASTER_OF``) and is corrected instead, before it
    is copied back."""
    by_id = {id(p): k for p, k in zip(params, corrections, strict=True)}

    def after_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    k = by_id.get(id(getattr(p, MASTER_OF, p)))  # a master copy's step corrects its parameter
                    if k is not None:
                        own_rows(p).add_(k.to(p.dtype), alpha=-group["lr"])

    with removed_on_exit([register_optimizer_step_post_hook(after_step)]):
        yield


@contextlib.contextmanager
def regularized_gradients(params: Sequence[nn.Parameter], anchors: Sequence[torch.Tensor],
                          states: Sequence[torch.Tensor], alpha: float, backwards_per_step: int = 1) -> Iterator[None]:
    """While inside, every gradient of ``params[k]`` gains alpha (y - anchors[k]) - states[k]: the gradient of
    -<g, y> + alpha/2 ||y - x||^2 (FedDyn's regulariser, Acar et al. 2021; with g = 0 Ditto's and FedProx's proximal
    term), part of the objective, so it goes through the optimizer's momentum like the loss's own gradient.

    A hook fires on every backward pass. With ``train.grad_accum_steps`` = A passes per optimizer step, each adds
    1/A of the term, as the trainer divides each micro-batch's loss by A: the step's gradient then holds the
    regulariser's once, not A times."""
    check_backwards_per_step(backwards_per_step)

    def hook(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        p, x, g = params[k], anchors[k], states[k]
        return lambda grad: grad + regularizer_term(p.detach(), x, g, alpha, backwards_per_step).to(grad.dtype)

    with removed_on_exit([p.register_hook(hook(k)) for k, p in enumerate(params)]):
        yield


def regularizer_term(y: torch.Tensor, x: torch.Tensor, g: torch.Tensor, alpha: float,
                     backwards_per_step: int) -> torch.Tensor:
    """(alpha (y - x) - g) / A: one backward pass's share of the gradient ``regularized_gradients`` adds (a new
    tensor)."""
    term = (y - x).mul_(alpha).sub_(g)
    return term if backwards_per_step == 1 else term.div_(backwards_per_step)


@contextlib.contextmanager
def regularized_shard_gradients(params: Sequence[nn.Parameter], anchors: Sequence[torch.Tensor],
                                states: Sequence[torch.Tensor], alpha: float,
                                backwards_per_step: int = 1) -> Iterator[None]:
    """``regularized_gradients`` for sharded parameters (``clients.sharding: fsdp``): ``anchors`` and ``states``
    shaped like the rows this rank holds (``own_rows``). FSDP runs the backward on gathered copies, so a hook on the
    sharded parameter's own gradient never fires; the term goes instead into the rows of its gradient each time FSDP
    has reduce-scattered a backward pass into it (a post-accumulate-grad hook, which FSDP calls then). The term
    then joins the averaged gradient rather than each rank's share before the average: the same sum, rounded in
    another order."""
    check_backwards_per_step(backwards_per_step)

    def hook(k: int) -> Callable[[torch.Tensor], None]:
        x, g = anchors[k], states[k]

        def add(p: torch.Tensor) -> None:
            assert p.grad is not None  # FSDP calls it once it has set the gradient
            with torch.no_grad():
                rows = own_rows(p.grad)
                rows.add_(regularizer_term(own_rows(p).detach(), x, g, alpha, backwards_per_step).to(rows.dtype))
        return add

    with removed_on_exit([p.register_post_accumulate_grad_hook(hook(k)) for k, p in enumerate(params)]):
        yield


def check_backwards_per_step(backwards_per_step: int) -> None:
    """A regulariser's passes per optimizer step (train.grad_accum_steps): at least one."""
    if backwards_per_step < 1:
        raise ValueError(f"backwards_per_step must be at least 1 (got {backwards_per_step})")


@contextlib.contextmanager
def removed_on_exit(handles: Sequence[RemovableHandle]) -> Iterator[None]:
    """Inside, the hooks ``handles`` registered stay; on the way out, however it is left, each is removed."""
    try:
        yield
    finally:
        for h in handles:
            h.remove()
