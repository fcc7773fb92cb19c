"""Run under mpiexec (4 ranks) by tests/test_mpi_data_loading.py: rank 1 shares a dataset with the client ranks as
if they sat on two nodes (client ranks split by parity, so the bytes also travel between the nodes' first ranks);
every client rank must get the same bytes, and no rank may hold more than the data once beside what it held before
(rank 1: its tensors as read, already held, and the shared copy it fills; the server: the labels and held-out set it
receives, bit for bit)."""
from __future__ import annotations

import torch
from mpi4py import MPI

import mpifl.roles.data as data
from mpifl.learning.datasets import Dataset
from mpifl.units import MIB

ROWS = 32_768  # 32,768 x 768 float32 inputs: 96 MiB, large beside what the allocator and MPI keep


def expected() -> Dataset:
    """The same dataset on every rank, bit for bit (a seeded generator)."""
    g = torch.Generator().manual_seed(11)
    return Dataset(torch.rand(ROWS, 768, generator=g), torch.randint(0, 10, (ROWS,), generator=g),
                   torch.rand(ROWS // 4, 768, generator=g).bfloat16(), torch.randint(0, 10, (ROWS // 4,), generator=g),
                   tokenizer="kept")


def nbytes(d: Dataset) -> int:
    return sum(t.numel() * t.element_size() for t in (d.x_train, d.y_train, d.x_test, d.y_test))


def peak_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))


def main() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    data.node_communicator = lambda c: c.Split(c.Get_rank() % 2, c.Get_rank())  # two "nodes" of client ranks
    read = expected() if rank == 1 else None
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak starts again from what the rank holds now
    before = peak_kib()
    got = data._read_on_a_client_rank(comm, lambda: read)
    grew = (peak_kib() - before) * 1024
    want = expected()
    if rank == 0:
        assert got.x_train.shape == (0, 768) and got.x_train.dtype == want.x_train.dtype, "server view"
        for name in ("y_train", "x_test", "y_test"):
            mine, theirs = getattr(got, name), getattr(want, name)
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), f"server: {name} differs"
        assert got.tokenizer == "kept"
        # labels and the held-out set, sent as raw bytes: the peak grew 15-19 MiB for 12 MiB received (a pickled
        # object held them about 3 times: 38 MiB); twice what arrived and 4 MiB of allocator slack tell them apart
        held = nbytes(got)
        assert grew <= 2 * held + 4 * MIB, f"server: peak grew by {grew / MIB:.0f} MiB receiving {held / MIB:.0f} MiB"
    else:
        for name in ("x_train", "y_train", "x_test", "y_test"):
            mine, theirs = getattr(got, name), getattr(want, name)
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), f"rank {rank}: {name} differs"
        assert got.tokenizer == "kept"
        limit = 1.5 * nbytes(want)  # the shared copy and what MPI moves around it; a pickled broadcast took 3x
        assert grew <= limit, f"rank {rank}: peak grew by {grew / MIB:.0f} MiB sharing {nbytes(want) / MIB:.0f} MiB"
    print(f"rank {rank}: ok, peak grew {grew / MIB:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
