"""Flat byte ranges of the model, read from and written to its per-tensor HDF5 datasets.

The flat layout (``ModelSpec``) puts tensors one after another; a range may start and end
inside tensors, even inside a row: whole rows go straight through, partial rows at the
ends are read, patched and written back. This is what lets the out-of-core server work
window by window.
"""
from __future__ import annotations

import math

import h5py
import numpy as np

from mpifl.wire.flat import ModelSpec, TensorEntry

STORED_AS = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "float64": np.float64}


def io_range(spec: ModelSpec, datasets, offset: int, buf: np.ndarray, write: bool) -> None:
    """Copy between flat bytes [offset, offset+len(buf)) and the per-tensor datasets."""
    end = offset + len(buf)
    for e in spec.entries:
        lo, hi = max(offset, e.offset), min(end, e.offset + e.nbytes)
        if lo >= hi:
            continue
        ds = datasets[e.name]
        piece = buf[lo - offset:hi - offset].view(STORED_AS[e.dtype])
        itemsize = piece.dtype.itemsize
        _io_elements(ds, e, (lo - e.offset) // itemsize, (hi - e.offset) // itemsize, piece, write)


def _io_elements(ds: h5py.Dataset, e: TensorEntry, a: int, b: int, piece: np.ndarray, write: bool) -> None:
    """Elements [a, b) of a tensor in row-major order, via whole rows of the dataset."""
    if not e.shape:  # 0-d tensor: one element
        if write:
            ds[()] = piece[0]
        else:
            piece[0] = ds[()]
        return
    if len(e.shape) == 1:
        if write:
            ds[a:b] = piece
        else:
            piece[...] = ds[a:b]
        return
    row = math.prod(e.shape[1:])
    r0, r1 = a // row, -(-b // row)
    if not write:
        piece[...] = ds[r0:r1].reshape(-1)[a - r0 * row:b - r0 * row]
    elif a == r0 * row and b == r1 * row:
        ds[r0:r1] = piece.reshape((r1 - r0,) + e.shape[1:])
    else:  # partial rows at a chunk boundary: read, patch, write back
        block = ds[r0:r1]
        block.reshape(-1)[a - r0 * row:b - r0 * row] = piece
        ds[r0:r1] = block
