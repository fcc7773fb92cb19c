"""Checkpoint integrity: a CRC32 of every chunk of the model and of each server-state vector.

The checksums are taken from the bytes in memory as each chunk is written (in any order,
as the out-of-core server finishes chunks), stored under ``/integrity`` with the chunk size
that laid them out, and checked by reading the checkpoint back chunk by chunk (bounded
memory). A changed byte anywhere in the tensors, however it got there (a disk error, a
stray write through h5py), fails the check and names the tensor.

Layout::

    /integrity             attrs: chunk_bytes (the layout of the checksums); metadata_crc32: the CRC32
                           of what the file says about itself (every root attribute: round, spec
                           hash, config, seed, strategy, residual files...; the flat layout's
                           order; the metrics history), so an edited round cannot skip a round
                           on resume
    /integrity/model       uint32, one CRC32 per piece: a chunk cut at tensor boundaries (flat order),
                           so a failed check names its tensor
    /integrity/state/<n>   uint32, one CRC32 per chunk's slice of server-state vector <n>

A checkpoint with no ``/integrity`` group is refused by ``verify``: mpifl has written one
into every checkpoint since checksums began, so a missing group means a file that was edited
or is not what it claims.
"""
from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from mpifl.errors import CheckpointError
from mpifl.wire.spec import Chunk, ModelSpec, element_offsets

try:  # ISA-L's CRC32: the same values as zlib's, ~10x faster (carry-less multiply), and it releases the GIL
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without isal's wheels: zlib's table-driven CRC32 (~4-6 GB/s)
    from zlib import crc32 as _crc32

if TYPE_CHECKING:  # the checkpoint's type alone: storage.hdf5 imports this module, so it is described, not imported
    from typing import Protocol

    class CheckpointFile(Protocol):
        """What the checks read of a checkpoint (``mpifl.storage.hdf5.Checkpoint``)."""

        path: Path
        file: h5py.File
        spec_hash: str

        def spec(self) -> ModelSpec:
            """The flat layout the checkpoint was written with."""

        def read_range(self, spec: ModelSpec, offset: int, out: np.ndarray) -> None:
            """Fill ``out`` (uint8) with the flat bytes at ``offset`` of the model."""

GROUP = "integrity"


def crc32(data: np.ndarray) -> int:
    """CRC32 (zlib's polynomial and values) of an array's bytes."""
    # ndarray exports the buffer protocol; numpy's stubs declare __buffer__ only for Python >= 3.12
    return _crc32(memoryview(np.ascontiguousarray(data)).cast("B"))  # type: ignore[arg-type]


class ChunkChecksums:
    """CRC32s of a checkpoint's chunks, taken from whatever is written (in any order), saved before publishing.

    A chunk written whole in one call is summed from memory; one written in pieces is read back
    from the file at the end (only the stores' chunk-by-chunk writes avoid that cost entirely).
    """

    def __init__(self, spec: ModelSpec, chunk_bytes: int, state_names: list[str]):
        self.chunks, self.chunk_bytes = spec.chunks(chunk_bytes), chunk_bytes
        self.pieces, self.first_piece = pieces(spec, self.chunks)
        self.starts = [c.offset for c in self.chunks]
        self.elements = element_offsets(self.chunks)
        self.model = np.zeros(len(self.pieces), dtype=np.uint32)
        self.sums = {name: np.zeros(len(self.chunks), dtype=np.uint32) for name in ["", *state_names]}
        self.seen = {name: np.zeros(len(self.chunks), dtype=bool) for name in self.sums}  # "": the model

    def model_bytes(self, offset: int, data: np.ndarray) -> None:
        """Record the chunks wholly inside flat bytes [offset, offset + len(data))."""
        for c in self._inside(self.starts, offset, offset + len(data), lambda c: c.offset + c.nbytes):
            self._record("", c, data[c.offset - offset:c.offset - offset + c.nbytes])

    def state_elements(self, name: str, start: int, data: np.ndarray) -> None:
        """Record the chunks' slices wholly inside elements [start, start + len(data)) of state vector ``name``."""
        for c in self._inside(self.elements[:-1], start, start + len(data), lambda c: self.elements[c.index + 1]):
            self._record(name, c, data[self.elements[c.index] - start:self.elements[c.index + 1] - start])

    def save(self, file: h5py.File, read_model: Callable[[Chunk, np.ndarray], None]) -> None:
        """Sum what was written in pieces by reading it back, then write every checksum under ``/integrity``."""
        for name, seen in self.seen.items():
            for c in (self.chunks[i] for i in np.flatnonzero(~seen)):
                if name:
                    lo, hi = self.elements[c.index], self.elements[c.index + 1]
                    self._record(name, c, file["server_state"][name][lo:hi])
                else:
                    data = np.empty(c.nbytes, dtype=np.uint8)
                    read_model(c, data)
                    self._record("", c, data)
        group = file.create_group(GROUP)
        group.attrs["chunk_bytes"] = self.chunk_bytes
        group.attrs["metadata_crc32"] = metadata_crc32(file)
        group.create_dataset("model", data=self.model)
        states = group.create_group("state")
        for name, values in self.sums.items():
            if name:
                states.create_dataset(name, data=values)

    def _inside(self, starts: list[int], lo: int, hi: int, end: Callable[[Chunk], int]) -> Iterator[Chunk]:
        """Chunks whose span (from ``starts``, sorted) lies within [lo, hi)."""
        for c in self.chunks[bisect.bisect_left(starts, lo):]:
            if end(c) > hi:
                return
            yield c

    def _record(self, name: str, chunk: Chunk, data: np.ndarray) -> None:
        if name:
            self.sums[name][chunk.index] = crc32(data)
        else:
            for i, (offset, nbytes, _) in self.pieces_of(chunk):
                self.model[i] = crc32(data[offset - chunk.offset:offset - chunk.offset + nbytes])
        self.seen[name][chunk.index] = True

    def pieces_of(self, chunk: Chunk) -> list[tuple[int, tuple[int, int, str]]]:
        """(index, piece) of every piece of ``chunk``."""
        first, last = self.first_piece[chunk.index], self.first_piece[chunk.index + 1]
        return [(i, self.pieces[i]) for i in range(first, last)]


def pieces(spec: ModelSpec, chunks: list[Chunk]) -> tuple[list[tuple[int, int, str]], list[int]]:
    """Each chunk cut at tensor boundaries, (flat offset, bytes, tensor name) in flat order (padding left out),
    and where each chunk's pieces start in that list (one entry more than chunks)."""
    out: list[tuple[int, int, str]] = []
    first: list[int] = []
    e = 0
    entries = spec.entries
    for c in chunks:  # chunks and entries both run in flat order: one merge
        first.append(len(out))
        while e < len(entries) and entries[e].offset + entries[e].nbytes <= c.offset:
            e += 1
        k = e
        while k < len(entries) and entries[k].offset < c.offset + c.nbytes:
            lo, hi = max(c.offset, entries[k].offset), min(c.offset + c.nbytes, entries[k].offset + entries[k].nbytes)
            if lo < hi:
                out.append((lo, hi - lo, entries[k].name))
            k += 1
    return out, first + [len(out)]


def metadata_crc32(file: h5py.File) -> int:
    """CRC32 of what a checkpoint says about itself: its root attributes, the flat layout's order and the
    metrics history, as canonical JSON (read back from the file, so writing and checking see the same types)."""
    attrs = {key: str(value) for key, value in sorted(file.attrs.items())}
    order = str(file["model"].attrs.get("order", "")) if "model" in file else ""
    metrics = [str(line) for line in file["metrics"].asstr()[...]] if "metrics" in file else []
    return _crc32(json.dumps([attrs, order, metrics], sort_keys=True).encode())


def metadata_problem(ckpt: CheckpointFile) -> str | None:
    """Why a checkpoint's description of itself cannot be trusted (no integrity record, or metadata that fails
    its checksum), or None. Cheap: no tensor is read, so resume runs it on every candidate before choosing."""
    if GROUP not in ckpt.file:
        return (f"{ckpt.path}: no integrity record (/{GROUP}): every mpifl checkpoint has one, so this file was "
                "edited or is not what it claims; refusing to trust it")
    stored = ckpt.file[GROUP].attrs.get("metadata_crc32")
    if stored is None or int(stored) != metadata_crc32(ckpt.file):
        return (f"{ckpt.path}: its metadata (round, spec, config, strategy or metrics) fails its checksum: the "
                "file was edited after it was written")
    return None


def verify(ckpt: CheckpointFile) -> int:
    """Check a checkpoint's metadata, tensors and server state against its stored CRC32s, chunk by chunk;
    return the number of chunks checked. Raise CheckpointError naming what changed (the metadata, or the
    first tensor or state vector whose bytes changed), or saying the integrity record is missing."""
    spec, chunks, cut, first, stored = _checked_layout(ckpt)
    buffer = np.empty(max(c.nbytes for c in chunks), dtype=np.uint8)
    for c in chunks:
        ckpt.read_range(spec, c.offset, buffer[:c.nbytes])
        for i in range(first[c.index], first[c.index + 1]):
            offset, nbytes, name = cut[i]
            if crc32(buffer[offset - c.offset:offset - c.offset + nbytes]) != stored[i]:
                raise CheckpointError(_corrupt_tensor(ckpt.path, name, offset, nbytes))
    elements = element_offsets(chunks)
    for name, ds in ckpt.file["server_state"].items() if "server_state" in ckpt.file else []:
        sums = _state_sums(ckpt, name, len(chunks))
        for c in chunks:
            if crc32(ds[elements[c.index]:elements[c.index + 1]]) != sums[c.index]:
                raise CheckpointError(_corrupt_state(ckpt.path, name, elements[c.index], elements[c.index + 1]))
    return len(chunks)


def _checked_layout(ckpt: CheckpointFile) -> tuple[ModelSpec, list[Chunk], list[tuple[int, int, str]], list[int],
                                                   np.ndarray]:
    """The layout a checkpoint's checksums were taken over (spec, chunks, pieces and where each chunk's start) and
    the model's stored CRC32s, once its metadata, spec hash and checksum count are checked; no tensor is read."""
    problem = metadata_problem(ckpt)
    if problem:
        raise CheckpointError(problem)
    group = ckpt.file[GROUP]
    spec = ckpt.spec()
    if spec.hash != ckpt.spec_hash:
        raise CheckpointError(f"{ckpt.path}: its tensors' names, shapes or dtypes no longer match its spec hash")
    chunks = spec.chunks(int(group.attrs["chunk_bytes"]))
    stored = group["model"][...]
    cut, first = pieces(spec, chunks)
    if len(cut) != len(stored):
        raise CheckpointError(f"{ckpt.path}: /{GROUP}/model has {len(stored)} checksums, the layout {len(cut)}")
    return spec, chunks, cut, first, stored


def _state_sums(ckpt: CheckpointFile, name: str, chunks: int) -> np.ndarray:
    """The stored CRC32s of server-state vector ``name``, one per chunk; CheckpointError where they are missing or
    miscounted."""
    states = ckpt.file[GROUP].get("state")
    sums = states[name][...] if states is not None and name in states else np.empty(0, np.uint32)
    if len(sums) != chunks:
        raise CheckpointError(f"{ckpt.path}: /{GROUP}/state/{name} has {len(sums)} checksums, the layout {chunks}")
    return sums


def _corrupt_tensor(path: Path, name: str, offset: int, nbytes: int) -> str:
    return (f"{path}: tensor {name!r} is corrupt: its bytes at flat offset {offset}..{offset + nbytes} fail their "
            "checksum")


def _corrupt_state(path: Path, name: str, lo: int, hi: int) -> str:
    return f"{path}: server_state/{name} is corrupt: elements {lo}..{hi} fail their checksum"


@dataclass(frozen=True)
class RecordedChecksums:
    """A checkpoint's stored CRC32s regrouped by what they cover, so that a pass reading the file entry by entry
    (``mpifl diff``, in its digest's name order) checks every byte as it reads it, instead of reading the file once
    more chunk by chunk (``verify``): for a 70B model that is 140 GB of reading saved on each side."""

    path: Path
    chunks: int  # the chunks the checksums were taken over
    tensors: dict[str, list[tuple[int, int, int]]]  # name -> (flat offset, bytes, CRC32) of its pieces, in order
    state: dict[str, list[tuple[int, int, int]]]  # vector -> (first element, elements, CRC32) per chunk's slice

    def check(self, section: str, name: str) -> StreamedCheck | None:
        """The check of one entry's bytes as they pass (``section``: 'model' or 'server_state'); None for what the
        record does not cover (clients' vectors)."""
        path = self.path
        if section == "model":
            cut = self.tensors.get(name, [])
            return StreamedCheck(f"{path}: tensor {name!r}", [(n, crc) for _, n, crc in cut],
                                 lambda i: _corrupt_tensor(path, name, cut[i][0], cut[i][1]))
        if section == "server_state" and name in self.state:
            slices = self.state[name]
            return StreamedCheck(f"{path}: server_state/{name}", [(n, crc) for _, n, crc in slices],
                                 lambda i: _corrupt_state(path, name, slices[i][0], slices[i][0] + slices[i][1]),
                                 per_element=True)
        return None


def recorded_checksums(ckpt: CheckpointFile) -> RecordedChecksums:
    """``ckpt``'s CRC32s by tensor and by server-state vector, once its metadata, spec hash and checksum count are
    checked (CheckpointError naming what is wrong, as ``verify`` does); reads the record alone, no tensor."""
    _, chunks, cut, _, stored = _checked_layout(ckpt)
    tensors: dict[str, list[tuple[int, int, int]]] = {}
    for (offset, nbytes, name), crc in zip(cut, stored, strict=True):
        tensors.setdefault(name, []).append((offset, nbytes, int(crc)))
    elements = element_offsets(chunks)
    state = {}
    for name in ckpt.file["server_state"] if "server_state" in ckpt.file else []:
        sums = _state_sums(ckpt, name, len(chunks))
        state[name] = [(elements[c.index], elements[c.index + 1] - elements[c.index], int(crc))
                       for c, crc in zip(chunks, sums, strict=True)]
    return RecordedChecksums(ckpt.path, len(chunks), tensors, state)


class StreamedCheck:
    """One entry's bytes checked against its recorded pieces as they stream past in order, in slices cut anywhere
    (the CRC32 carries over a slice's end). ``per_element``: piece sizes count elements (a state vector's chunk
    slices), turned into bytes by each slice's item size."""

    def __init__(self, what: str, pieces: list[tuple[int, int]], corrupt: Callable[[int], str],
                 per_element: bool = False):
        self.what, self.pieces, self.corrupt, self.per_element = what, pieces, corrupt, per_element
        self.index, self.done, self.crc = 0, 0, 0  # the piece being summed, its bytes summed so far, their CRC32

    def feed(self, values: np.ndarray) -> None:
        """Sum the next slice of the entry's bytes; CheckpointError (``corrupt``) at the first piece that fails."""
        data = memoryview(np.ascontiguousarray(values)).cast("B")  # type: ignore[arg-type]
        scale = values.dtype.itemsize if self.per_element else 1
        at = 0
        while at < len(data):
            if self.index >= len(self.pieces):
                raise CheckpointError(f"{self.what} holds more bytes than its checksums cover")
            size = self.pieces[self.index][0] * scale
            take = min(size - self.done, len(data) - at)
            self.crc = _crc32(data[at:at + take], self.crc)
            self.done, at = self.done + take, at + take
            if self.done == size:
                if self.crc != self.pieces[self.index][1]:
                    raise CheckpointError(self.corrupt(self.index))
                self.index, self.done, self.crc = self.index + 1, 0, 0

    def finish(self) -> None:
        """Every piece was summed: a shorter entry than its record (cannot be, from a checked spec) is an error."""
        if self.index < len(self.pieces):
            raise CheckpointError(f"{self.what} holds fewer bytes than its checksums cover")
