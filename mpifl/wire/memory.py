"""Host memory for what MPI moves: numpy-allocated, so that large buffers get transparent huge pages.

numpy asks the kernel for huge pages (``madvise(MADV_HUGEPAGE)``) on large allocations; torch's
CPU allocator does not. With the kernel's default ``transparent_hugepage=madvise``, MPICH's
single-copy path between processes (``process_vm_readv``) then walks 512x fewer pages: measured
here, a 1000 MiB model reached 4 client ranks in 0.15 s from numpy memory against 0.33 s from a
torch allocation. Every long-lived buffer that MPI reads or writes, or that folds run over, comes
from here, pre-touched so the first round pays no page faults.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import torch

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
C_INT_MAX = 2**31 - 1  # mallopt takes a C int


def host_bytes(nbytes: int, touch: bool = True) -> np.ndarray:
    """A ``uint8`` buffer, huge-paged where the kernel allows; ``touch``: its pages already faulted in
    (zeroed). Untouched, pages arrive as they are first written, so filling it from memory that is
    freed as it goes never holds both at once."""
    buf = np.empty(nbytes, dtype=np.uint8)
    if touch:
        buf.fill(0)
    return buf


def host_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``numel`` elements in host_bytes memory."""
    return torch.from_numpy(host_bytes(numel * dtype.itemsize)).view(dtype)


def share_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas before starting helper threads.

    glibc gives each new thread its own arena, reserving 64 MiB of address space each; under
    an address-space limit (``ulimit -v``, PBS ``vmem``) a thread's first allocation can then
    fail. With the cap, helper threads share one arena. A no-op where the C library has no
    ``mallopt`` (not glibc).
    """
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(M_ARENA_MAX, arenas)


def _mallopt() -> Callable[[int, int], int] | None:
    """The C library's ``mallopt(param, value)`` (glibc's), or None where it has none (not glibc)."""
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None


def reuse_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation instead of handing it back to the kernel.

    Why: torch's CPU allocator keeps no cache, so every training step allocates its activations and gradients
    afresh. glibc serves a block above its mmap threshold (32 MiB at most) with a fresh ``mmap`` and unmaps it
    when it is freed, so each step page-faults in, and the kernel zeroes, new pages for every large gradient:
    on the cross-device task's 93 MB MLP, 16,385 page faults (64 MiB) per client, every client. With ``mmap``
    off for allocations (``M_MMAP_MAX`` 0; glibc still falls back to it where the heap cannot grow) and the
    heap never trimmed, the pages one step frees serve the next (``profiling/client_slowdown.py`` counts them).

    The cost: the process's resident memory stays at its high-water mark rather than shrinking after a peak.
    Call it once the long-lived buffers are allocated (they keep their own mappings, huge-paged by numpy).
    Returns whether it took effect: False where the C library has no ``mallopt`` (not glibc)."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, C_INT_MAX))


# Blocks from this size up are mapped afresh and unmapped when freed (``return_freed_memory``).
MAPPED_FROM_BYTES = 64 * 1024


def return_freed_memory(threshold: int = MAPPED_FROM_BYTES) -> bool:
    """Have glibc's malloc map every block of ``threshold`` bytes or more on its own and unmap it when it is freed,
    the opposite trade to ``reuse_freed_memory``: memory first, speed second.

    Why: a rank of a sharded client (``clients.sharding: fsdp``) allocates and frees a gathered FSDP unit, its
    gradients and the activations in every step, in sizes that differ from unit to unit. Left in the heap, the freed
    blocks fragment it and the process's peak grows past what it holds at any one time: 2.13-2.25 GiB per rank for
    a 168 M-parameter Llama-shaped client over 4 ranks on CPU, against 1.78-1.86 GiB with this (and against the
    plan's 1.83; ``profiling/sharded_client.py``, 2026-11-29). Each such block then costs its page faults
    afresh, about 15% of that client's step time there. Returns whether it took effect (False without glibc)."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, threshold))
