"""Read-only tensors held once per node: MPI shared-memory windows that every rank of a node maps.

The training set every client rank reads is the same bytes on each of them. Broadcast as objects, a node with R
client ranks holds R copies; in one ``MPI_Win_allocate_shared`` window per tensor it holds one, and each rank's
resident memory counts only the pages it touches (its own clients' samples). The windows live until the process
ends (MPI frees them at ``MPI_Finalize``): the tensors that view them are the rank's data for the whole run.
"""
from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from mpi4py import MPI

_WINDOWS: list[MPI.Win] = []  # kept alive for as long as the tensors that view them
BCAST_SLICE_BYTES = 2**30  # below 2**31, the largest count an MPI call takes


def node_communicator(comm: MPI.Intracomm) -> MPI.Intracomm:
    """The ranks of ``comm`` that share this rank's node (its shared memory), ordered as in ``comm``."""
    return cast(MPI.Intracomm, comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank()))


def share_on_node(node: MPI.Intracomm, tensor: torch.Tensor | None,
                  across: MPI.Intracomm | None = None) -> torch.Tensor:
    """``tensor`` as a view of one shared window: every rank of ``node`` gets a tensor of the same shape, dtype and
    bytes, backed by the same memory. ``tensor`` is given on the node's first rank (None elsewhere); with ``across``
    (the nodes' first ranks, one per node) only on its first rank, and its bytes travel over ``across`` straight
    into each node's window, never through a pickle. Read-only by contract: a rank that wrote to it would change
    every rank's data. Collective over ``node`` (and ``across``)."""
    lead = node.Get_rank() == 0
    assert tensor is not None or not lead or across is not None  # a first rank shares what it holds, or receives it
    if tensor is not None:
        tensor = tensor.detach().contiguous()
    described = (tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size()) if tensor is not None \
        else None
    if across is not None:
        described = across.bcast(described, root=0)
    shape, dtype, nbytes = node.bcast(described if lead else None, root=0)
    window = MPI.Win.Allocate_shared(nbytes if lead else 0, 1, comm=node)
    _WINDOWS.append(window)
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    memory, _ = window.Shared_query(0)
    if lead:
        filled = np.frombuffer(cast(Any, memory), dtype=np.uint8, count=nbytes)
        if tensor is not None:
            filled[:] = tensor.view(-1).view(torch.uint8).numpy()
        if across is not None:
            bcast_bytes(across, filled)
    node.Barrier()  # every rank sees the bytes only once the first has written them
    return torch.frombuffer(memory, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)


def bcast_bytes(comm: MPI.Intracomm, buffer: np.ndarray) -> None:
    """Broadcast a uint8 buffer from ``comm``'s first rank in place, in slices that an MPI count (a C int) holds."""
    for start in range(0, len(buffer), BCAST_SLICE_BYTES):
        comm.Bcast(buffer[start:start + BCAST_SLICE_BYTES], root=0)
