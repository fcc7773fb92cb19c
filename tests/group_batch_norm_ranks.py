"""Run under mpiexec by tests/test_mpi_ranks_per_client.py with a store file: two ranks hold uneven shares of one
batch (5 and 4 samples), and their group BatchNorm (mpifl.learning.parallel) must give each share the outputs,
and the group the input gradients, weight and bias gradients and running statistics, that one plain BatchNorm
gives the whole batch."""
from __future__ import annotations

import copy
import sys

import torch
from mpi4py import MPI
from torch import distributed as dist
from torch import nn

from mpifl.learning.parallel import share_of, use_group_batch_norm

CASES = [(nn.BatchNorm1d, (9, 4), dict(momentum=0.1)), (nn.BatchNorm1d, (9, 4), dict(momentum=None)),
         (nn.BatchNorm2d, (9, 3, 5, 5), dict(momentum=0.3)), (nn.BatchNorm2d, (9, 3, 5, 5), dict(affine=False)),
         (nn.BatchNorm3d, (9, 2, 3, 3, 3), dict())]


def main(store_path: str) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.manual_seed(0)  # the same batch and layer on both ranks
    for kind, shape, kwargs in CASES:
        plain = kind(shape[1], **kwargs).double()
        if plain.affine:
            nn.init.uniform_(plain.weight, 0.5, 1.5)
            nn.init.uniform_(plain.bias, -0.5, 0.5)
        grouped = copy.deepcopy(plain)
        assert use_group_batch_norm(grouped) == 1
        batch = torch.randn(*shape, dtype=torch.float64) * 3 + 1
        upstream = torch.randn(*shape, dtype=torch.float64)  # d(loss)/d(output) for the whole batch
        rows = share_of(torch.arange(shape[0]), rank, 2)
        for _ in range(2):  # two steps: the running statistics build on themselves
            whole = batch.clone().requires_grad_()
            (plain(whole) * upstream).sum().backward()
            mine = batch[rows].clone().requires_grad_()
            out = grouped(mine)
            (out * upstream[rows]).sum().backward()
            with torch.no_grad():
                expected = nn.functional.batch_norm(batch, None, None, plain.weight, plain.bias, True, 0.0, plain.eps)
            torch.testing.assert_close(out.detach(), expected[rows], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(mine.grad, whole.grad[rows], rtol=1e-10, atol=1e-10)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(grouped, name), getattr(plain, name), rtol=1e-10, atol=1e-12)
        if plain.affine:  # each rank holds its share's part of the gradient; summed, the whole batch's
            for name in ("weight", "bias"):
                summed = getattr(grouped, name).grad.clone()
                dist.all_reduce(summed)
                torch.testing.assert_close(summed, getattr(plain, name).grad, rtol=1e-10, atol=1e-10)
    grouped.eval()  # outside training, the plain BatchNorm with the running statistics
    torch.testing.assert_close(grouped(batch), plain.eval()(batch))
    dist.destroy_process_group()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
