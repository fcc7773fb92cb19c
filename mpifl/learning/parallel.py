"""One logical client trained by a group of ranks (``clients.ranks_per_client``): data parallelism in torch.

Every rank of the group holds the same model and the same client's data. Each batch the trainer draws is
split into ``size`` contiguous shares (``share_of``), one per rank; DistributedDataParallel averages the
gradients across the group in backward, so every rank takes the same optimizer step. Each rank's loss is
scaled by its share of the batch (``share_weight``) so that the average is the gradient of the whole batch's
mean loss, whatever the shares' sizes: the step is the one a single rank would take on the whole batch, up
to floating-point rounding (tested, with BatchNorm too), and bitwise the same for a fixed group size on any
number of groups.

BatchNorm layers normalize with the statistics of the whole batch, not of a rank's share: ``wrap`` turns each
into a group BatchNorm (``GroupBatchNorm*``, only the module's class changes, as for ``NHWCMaxPool2d``) that sums
the shares' sums over the group, forward and backward, so the step stays the whole batch's. PyTorch's
``SyncBatchNorm`` does this on GPUs only; this form runs over gloo on CPUs too.

The process group is built once per run and kept (``torch.distributed.init_process_group`` on each rank of
the group, through a rendezvous the caller provides), and each module is wrapped in DDP once: nothing is
spawned or set up per round. This module never touches MPI; ``mpifl.roles.group`` does the rendezvous
and the orders between the group's ranks.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import distributed as dist
from torch import nn


def share_of(batch: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """A rank's contiguous share of a batch of sample indices (the first ranks take one more when uneven)."""
    return torch.tensor_split(batch, size)[rank]


def share_weight(share: int, batch: int, size: int) -> float:
    """The factor on a rank's mean loss so that DDP's average of the group's gradients is the gradient of the
    whole batch's mean loss: (share / batch) x size."""
    return share * size / batch


def device_identity(device: torch.device) -> str:
    """What tells two processes' devices apart: a GPU's UUID (``CUDA_VISIBLE_DEVICES`` renumbers the GPUs in every
    process, so two ranks' ``cuda:0`` may or may not be the same GPU); ``"cpu"`` for the CPU."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def backend_for(identities: Sequence[str]) -> str:
    """The group's ``torch.distributed`` backend, from every rank's ``device_identity``: NCCL when each rank has a
    GPU of its own; gloo otherwise, between CPUs and between ranks that share a GPU, which NCCL refuses
    ("Duplicate GPU detected"): a node with fewer GPUs than client ranks still trains each client as a group."""
    on_gpus = all(identity != "cpu" for identity in identities)
    return "nccl" if on_gpus and len(set(identities)) == len(identities) else "gloo"


class _GroupSum(torch.autograd.Function):
    """A tensor summed over the process group, differentiable: the gradient of a sum that every rank sees is the
    sum of every rank's gradient of it."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: torch.Tensor) -> torch.Tensor:
        summed = tensor.clone()
        dist.all_reduce(summed)
        return summed

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        summed = grad.clone()
        dist.all_reduce(summed)
        return summed


def group_batch_norm(bn: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """Training-mode batch normalization of the group's whole batch, of which ``x`` is this rank's share: the
    mean and the biased variance from every share (two passes, summed over the group), the running statistics
    updated from them as one rank's BatchNorm would (unbiased variance, momentum or a cumulative mean)."""
    reduced = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    local_count = torch.tensor([x.numel() // max(x.size(1), 1)], dtype=x.dtype, device=x.device)
    sums = _GroupSum.apply(torch.cat([x.sum(reduced), local_count]))
    count = sums[-1].detach()  # the group's samples per channel: a constant of the step
    mean = sums[:-1] / count
    if float(count) <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {int(count)} over the client "
                         f"group (input size {list(x.size())} on this rank)")
    centred = x - mean.view(shape)
    var = _GroupSum.apply(centred.pow(2).sum(reduced)) / count
    if bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
        with torch.no_grad():
            assert bn.num_batches_tracked is not None
            bn.num_batches_tracked.add_(1)
            factor = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            bn.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
            bn.running_var.mul_(1 - factor).add_(var.detach() * count / (count - 1), alpha=factor)
    out = centred * torch.rsqrt(var + bn.eps).view(shape)
    if bn.affine:
        out = out * bn.weight.view(shape) + bn.bias.view(shape)
    return out


class _GroupStatistics:
    """Mixed into a BatchNorm class: in training, inside a process group of several ranks, normalize over the
    group's whole batch (``group_batch_norm``); otherwise exactly the BatchNorm it was."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn: nn.modules.batchnorm._BatchNorm = self  # type: ignore[assignment]
        if not (bn.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)  # type: ignore[misc]
        bn._check_input_dim(x)
        return group_batch_norm(bn, x)


class GroupBatchNorm1d(_GroupStatistics, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` over a client group's whole batch (``group_batch_norm``)."""


class GroupBatchNorm2d(_GroupStatistics, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` over a client group's whole batch (``group_batch_norm``)."""


class GroupBatchNorm3d(_GroupStatistics, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` over a client group's whole batch (``group_batch_norm``)."""


GROUP_BATCH_NORM: dict[type, type] = {nn.BatchNorm1d: GroupBatchNorm1d, nn.BatchNorm2d: GroupBatchNorm2d,
                                      nn.BatchNorm3d: GroupBatchNorm3d}


def use_group_batch_norm(module: nn.Module) -> int:
    """Every ``nn.BatchNorm{1,2,3}d`` of ``module`` normalizes over the client group's whole batch (its class only
    changes: the parameters and running statistics stay where they are, views of the flat buffer); how many."""
    swapped = 0
    for sub in module.modules():
        group_class = GROUP_BATCH_NORM.get(type(sub))
        if group_class is not None:
            sub.__class__ = group_class
            swapped += 1
    return swapped


class GroupParallel(Protocol):
    """What a built-in trainer asks of its client group (``DataParallel``, or ``mpifl.learning.sharding``'s
    ``ShardedParallel``): its place in the group, the model to run, and sums over the group."""

    rank: int
    size: int

    def wrap(self, module: nn.Module) -> nn.Module:
        """The module to run forward and backward in the group."""

    def total(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the group."""


class DataParallel:
    """A rank's place in its client group, the process group (once per run) and the DDP wrapper of each
    module it trains (once per module)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self._wrapped: dict[int, nn.Module] = {}
        self.setup_seconds = 0.0  # spent building the process group and DDP wrappers, so far
        self.backend: str | None = None  # the process group's, once started (``backend_for``)
        self.device = torch.device("cpu")  # where the group's own small sums live (NCCL's must be on its GPU)

    @property
    def ready(self) -> bool:
        """Whether the process group exists."""
        return dist.is_available() and dist.is_initialized()

    def start(self, store: dist.Store, device: torch.device, timeout_s: float) -> None:
        """Join the group's process group (every rank of the group calls this once, together)."""
        began = time.perf_counter()
        import datetime

        store.set(f"device/{self.rank}", device_identity(device))
        identities = [store.get(f"device/{rank}").decode() for rank in range(self.size)]
        self.backend = backend_for(identities)
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.setup_seconds += time.perf_counter() - began

    def wrap(self, module: nn.Module) -> nn.Module:
        """``module`` in DDP, built on first use (it broadcasts the group leader's weights once) and kept; its
        BatchNorm layers normalize over the group's whole batch."""
        wrapped = self._wrapped.get(id(module))
        if wrapped is None:
            began = time.perf_counter()
            from torch.nn.parallel import DistributedDataParallel

            device = next((p.device for p in module.parameters()), torch.device("cpu"))
            use_group_batch_norm(module)  # the whole batch's statistics, not this rank's share's
            wrapped = DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)
            self._wrapped[id(module)] = wrapped
            self.setup_seconds += time.perf_counter() - began
        return wrapped

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """The group leader's ``tensors`` on every rank of the group, in place (parameters too: outside autograd)."""
        with torch.no_grad():
            for tensor in tensors:
                if tensor.numel():
                    dist.broadcast(tensor, src=0)

    def total(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the group (one small all-reduce)."""
        summed = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        return summed.tolist()

    def close(self) -> None:
        """Leave the process group at the end of the run: first free the DDP wrappers, whose reducers hold the
        process group, so that ``destroy_process_group`` really ends it, its gloo threads included, while the
        interpreter is whole. Left to the interpreter's exit, a gloo worker thread still alive then can abort the
        process after the run has finished ("terminate called without an active exception"; pytorch/pytorch#190489
        and the discussion of pytorch/pytorch#179291): a job whose every output was written would end non-zero."""
        self._wrapped.clear()
        gc.collect()  # DDP's reducer and the modules' hooks form cycles
        if self.ready:
            dist.destroy_process_group()
