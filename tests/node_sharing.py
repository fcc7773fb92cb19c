"""Run under mpiexec by tests/test_mpi_data_loading.py: every rank maps the first rank's tensors through
wire.shared and checks them; then the first rank writes, and the others must see it (one copy, not several)."""
from __future__ import annotations

import torch
from mpi4py import MPI

from mpifl.wire.shared import node_communicator, share_on_node


def expected() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(5, 3, generator=g).t(),  # not contiguous
            torch.randint(0, 9, (11,), generator=g), torch.zeros(0, 4), torch.rand(2, 2, generator=g).bfloat16()]


def main() -> None:
    node = node_communicator(MPI.COMM_WORLD)
    lead = node.Get_rank() == 0
    shared = [share_on_node(node, t if lead else None) for t in expected()]
    for got, want in zip(shared, expected()):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (got, want)
    node.Barrier()
    if lead:
        shared[1][0] = 100  # only to show it is one copy: the contract is read-only
    node.Barrier()
    assert int(shared[1][0]) == 100, f"rank {node.Get_rank()} holds a copy of its own"
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: ok, node of {node.Get_size()}", flush=True)


if __name__ == "__main__":
    main()
