"""Sorting and selection networks for the robust combiners: which compare-exchanges, in which order.

Pure and torch-free: both the numpy network (kernels.py) and the generated C kernel
(native.py) run exactly these comparators, which is why their results are the same bits.
"""
from __future__ import annotations

import functools


@functools.cache
def sorting_network(p: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort on p wires: compare-exchanges (i, j), i < j, in order.

    Built for the next power of two, dropping comparators that reach wire p or beyond (as if
    those wires held +inf, where a compare-exchange changes nothing): 19 for p = 8 (optimal),
    63 for 16, 191 for 32.
    """
    n = 1 << max(p - 1, 0).bit_length()
    network = []
    size = 1
    while size < n:
        step = size
        while step:
            for j in range(step % size, n - step, 2 * step):
                for i in range(min(step, n - j - step)):
                    if (i + j) // (2 * size) == (i + j + step) // (2 * size) and i + j + step < p:
                        network.append((i + j, i + j + step))
            step //= 2
        size *= 2
    return tuple(network)


Comparator = tuple[int, int, bool, bool]  # wires i < j; whether the minimum (to i), the maximum (to j) is used


@functools.cache
def window_network(p: int, k: int) -> tuple[Comparator, ...]:
    """The comparators of ``sorting_network(p)`` that sorted positions k..p-k-1 depend on, each
    with which of its two outputs is read later (a selection network: 16 comparators and 26
    minimum/maximum for the median of 8, against 19 and 38 for a full sort).

    A window of two values is summed in either order, so a last comparator between them goes too.
    """
    needed, kept = set(range(k, p - k)), []
    unordered = p - 2 * k == 2
    for i, j in reversed(sorting_network(p)):
        low, high = i in needed, j in needed
        if not (low or high):
            continue
        if unordered and (i, j) == (k, k + 1):
            unordered = False
            continue
        unordered = False
        kept.append((i, j, low, high))
        needed.update((i, j))
    return tuple(reversed(kept))
