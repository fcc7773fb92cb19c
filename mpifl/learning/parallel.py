"""One logical client trained by a group of ranks (``clients.ranks_per_client``): data parallelism in torch.

Every rank of the group holds the same model and the same client's data. Each batch the trainer draws is
split into ``size`` contiguous shares (``share_of``), one per rank; DistributedDataParallel averages the
gradients across the group in backward, so every rank takes the same optimizer step. Each rank's loss is
scaled by its share of the batch (``share_weight``) so that the average is the gradient of the whole batch's
mean loss, whatever the shares' sizes: the step is the one a single rank would take on the whole batch, up
to floating-point rounding (tested), and bitwise the same for a fixed group size on any number of groups.

The process group is built once per run and kept (``torch.distributed.init_process_group`` on each rank of
the group, through a rendezvous the caller provides), and each module is wrapped in DDP once: nothing is
spawned or set up per round. This module never touches MPI; ``mpifl.roles.group`` does the rendezvous
and the orders between the group's ranks.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

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


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


class DataParallel:
    """A rank's place in its client group, the process group (once per run) and the DDP wrapper of each
    module it trains (once per module)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self._wrapped: dict[int, nn.Module] = {}
        self.setup_seconds = 0.0  # spent building the process group and DDP wrappers, so far

    @property
    def ready(self) -> bool:
        """Whether the process group exists."""
        return dist.is_available() and dist.is_initialized()

    def start(self, store: dist.Store, device: torch.device, timeout_s: float) -> None:
        """Join the group's process group (every rank of the group calls this once, together)."""
        began = time.perf_counter()
        import datetime

        dist.init_process_group(backend_for(device), store=store, rank=self.rank, world_size=self.size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.setup_seconds += time.perf_counter() - began

    def wrap(self, module: nn.Module) -> nn.Module:
        """``module`` in DDP, built on first use (it broadcasts the group leader's weights once) and kept."""
        wrapped = self._wrapped.get(id(module))
        if wrapped is None:
            began = time.perf_counter()
            from torch.nn.parallel import DistributedDataParallel

            device = next((p.device for p in module.parameters()), torch.device("cpu"))
            wrapped = DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)
            self._wrapped[id(module)] = wrapped
            self.setup_seconds += time.perf_counter() - began
        return wrapped

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """The group leader's ``tensors`` on every rank of the group, in place."""
        for tensor in tensors:
            if tensor.numel():
                dist.broadcast(tensor, src=0)

    def total(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the group (one small all-reduce)."""
        summed = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(summed)
        return summed.tolist()

    def close(self) -> None:
        """Leave the process group at the end of the run."""
        if self.ready:
            dist.destroy_process_group()
