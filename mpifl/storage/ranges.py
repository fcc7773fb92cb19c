"""Flat byte ranges of the model, read from and written to its per-tensor HDF5 datasets.

The flat layout (``ModelSpec``) puts tensors one after another; a range may start and end
inside tensors, even inside a row: whole rows go straight through, partial rows at the
ends are read, patched and written back. This is what lets the out-of-core server work
window by window.

``RawRanges`` is the fast path: a tensor stored contiguously (no chunking, no filters,
native byte order, space allocated) is a plain byte range of the file, so its bytes go
through ``os.preadv``/``os.pwrite`` at the dataset's file offset. That is one system call
per piece, with the GIL released, so a reader or writer thread overlaps with MPI and the
folds. Anything else (a checkpoint written by another tool) takes h5py's path.

``MappedRange`` goes one step further for sending: a range that is one stretch of the file
(adjacent tensors) is mapped read-only with its page tables filled at once
(``MAP_POPULATE``), and MPI reads the page cache through it: no copy on the server at all.
"""
from __future__ import annotations

import bisect
import ctypes
import math
import mmap
import os
from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from mpifl.wire.spec import ModelSpec, TensorEntry

STORED_AS = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "float64": np.float64}


def io_range(spec: ModelSpec, datasets: Mapping[str, h5py.Dataset], offset: int, buf: np.ndarray,
             write: bool) -> None:
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


def file_address(ds: h5py.Dataset, stored_as: type) -> int | None:
    """The file offset of a dataset's bytes when they are one plain, allocated range; else None."""
    plist = ds.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters() or ds.dtype != np.dtype(stored_as):
        return None
    return ds.id.get_offset()


class RawRanges:
    """Flat byte ranges moved with ``pread``/``pwrite`` where tensors allow it, h5py elsewhere."""

    def __init__(self, spec: ModelSpec, datasets: Mapping[str, h5py.Dataset], path: Path, write: bool) -> None:
        self.spec, self.datasets = spec, datasets
        self.starts = [e.offset for e in spec.entries]
        self.addresses = [file_address(datasets[e.name], STORED_AS[e.dtype]) if e.nbytes else None
                          for e in spec.entries]
        self.fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)

    def close(self) -> None:
        """Close the file descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def file_span(self, offset: int, nbytes: int) -> int | None:
        """The file offset of flat bytes [offset, offset+nbytes) when they are one stretch of the file (raw
        tensors, adjacent in the file and in the flat layout: no padding between them), else None."""
        end, start, covered, expected = offset + nbytes, None, offset, None
        first = max(0, bisect.bisect_right(self.starts, offset) - 1)
        for i in range(first, len(self.starts)):
            e = self.spec.entries[i]
            if e.offset >= end:
                break
            lo, hi = max(offset, e.offset), min(end, e.offset + e.nbytes)
            if lo >= hi:
                continue
            address = self.addresses[i]
            at = None if address is None else address + lo - e.offset
            if at is None or lo != covered or (expected is not None and at != expected):
                return None
            start, covered, expected = at if start is None else start, hi, at + hi - lo
        return start if covered == end else None

    def io(self, offset: int, buf: np.ndarray, write: bool) -> None:
        """Copy between flat bytes [offset, offset+len(buf)) and the file."""
        end = offset + len(buf)
        first = max(0, bisect.bisect_right(self.starts, offset) - 1)
        for i in range(first, len(self.starts)):
            e = self.spec.entries[i]
            if e.offset >= end:
                break
            lo, hi = max(offset, e.offset), min(end, e.offset + e.nbytes)
            if lo >= hi:
                continue
            piece = buf[lo - offset:hi - offset]
            address = self.addresses[i]
            # memoryview(piece): ndarray exports the buffer protocol, but numpy's stubs declare __buffer__
            # only for Python >= 3.12, so mypy (python_version 3.10) cannot see it
            if address is None:
                typed = piece.view(STORED_AS[e.dtype])
                itemsize = typed.dtype.itemsize
                _io_elements(self.datasets[e.name], e, (lo - e.offset) // itemsize, (hi - e.offset) // itemsize,
                             typed, write)
            elif write:
                _pwrite(self.fd, memoryview(piece), address + lo - e.offset)  # type: ignore[arg-type]
            else:
                _pread(self.fd, memoryview(piece), address + lo - e.offset)  # type: ignore[arg-type]


def _pread(fd: int, view: memoryview, at: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], at)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {at}")
        view, at = view[n:], at + n


def _pwrite(fd: int, view: memoryview, at: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


class MappedRange:
    """A read-only, populated mapping of ``nbytes`` of a file at ``at``; ``view`` is its bytes.

    The view is a plain array over the mapping's address: ``unmap`` (explicit, idempotent) ends
    it, and nothing may touch the view after that.
    """

    def __init__(self, fd: int, at: int, nbytes: int):
        page = mmap.ALLOCATIONGRANULARITY
        base = at - at % page
        self.length = nbytes + at - base
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        address = _libc().mmap(None, self.length, mmap.PROT_READ, flags, fd, base)
        if address in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {nbytes} bytes at {at} failed: {os.strerror(err)}")
        self.address = address
        mapped = (ctypes.c_uint8 * nbytes).from_address(address + at - base)
        self.view: np.ndarray | None = np.ctypeslib.as_array(mapped)  # None once unmapped

    def unmap(self) -> None:
        """Release the mapping and drop the view (idempotent)."""
        if self.address is not None:
            _libc().munmap(self.address, self.length)
            self.address, self.view = None, None


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int64]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC = libc
    return _LIBC
