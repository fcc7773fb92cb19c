"""A model's layout on the wire and on disk, without torch: which tensors a model exchanges, where each lives in
one contiguous byte buffer, and how that buffer is cut into chunks.

Layout: tensors are grouped by dtype into *segments* (one per dtype, in order of first
appearance), each segment 64-byte aligned inside one ``uint8`` buffer. A ``ModelSpec``
records names, shapes, dtypes and offsets; its hash is compared at start-up so a client with a
different model is refused.

Why torch-free: the planner, the checkpoint reader, ``mpifl status`` and ``mpifl inspect`` need
the layout but not the tensors (``mpifl.wire.flat`` builds the buffers from a torch module).
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

ALIGN = 64
# The submodule where a client half's summed streams travel with the model (SCAFFOLD's server control variate c,
# mpifl.algorithms.scaffold): the strategy finds its section in the spec by this name, kept for checkpoints' sake
CONTROL = "scaffold_control"

# The floating dtypes a model may exchange, by the names specs use, and their bytes per element
# (``mpifl.wire.flat.DTYPES`` maps the same names to torch's dtypes).
ITEMSIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as in ``ITEMSIZES``."""
    return ITEMSIZES[dtype]


def aligned(n: int) -> int:
    """``n`` rounded up to the next multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorEntry:
    """Where one exchanged tensor lives in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # bytes from the start of the buffer
    nbytes: int
    statistic: bool = False  # a floating buffer, not a parameter (BatchNorm's running mean and variance): state
    # that training updates without a gradient, so server optimizers leave it to the plain mean


@dataclass(frozen=True)
class Segment:
    """A contiguous run of tensors that share one dtype."""

    dtype: str
    offset: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        """Bytes per element of the segment's dtype."""
        return itemsize(self.dtype)


@dataclass(frozen=True)
class Chunk:
    """One message on the wire: a slice of one segment, whole elements only."""

    index: int
    dtype: str
    offset: int
    nbytes: int
    itemsize: int

    @property
    def numel(self) -> int:
        """Elements in the chunk (it holds whole elements only)."""
        return self.nbytes // self.itemsize


@dataclass(frozen=True)
class ModelSpec:
    """Ordered description of the exchanged tensors; equal specs mean compatible models."""

    entries: tuple[TensorEntry, ...]
    segments: tuple[Segment, ...]
    total_bytes: int

    @property
    def hash(self) -> str:
        """A short digest of names, shapes, dtypes and offsets: ranks compare it to refuse a different model."""
        payload = [(e.name, e.shape, e.dtype, e.offset) for e in self.entries]
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

    def first_difference(self, other: ModelSpec) -> str | None:
        """Describe the first tensor that differs from ``other``, or None when equal."""
        for mine, theirs in zip(self.entries, other.entries):
            if (mine.name, mine.shape, mine.dtype) != (theirs.name, theirs.shape, theirs.dtype):
                return (f"tensor {mine.name!r}: {list(mine.shape)} {mine.dtype} here, "
                        f"{theirs.name!r}: {list(theirs.shape)} {theirs.dtype} there")
        if len(self.entries) != len(other.entries):
            longer, n = ((self, len(other.entries)) if len(self.entries) > len(other.entries)
                         else (other, len(self.entries)))
            side = "here" if longer is self else "there"
            return f"tensor {longer.entries[n].name!r} exists only {side}"
        return None

    def chunks(self, chunk_bytes: int) -> list[Chunk]:
        """Split every segment into chunks of at most ``chunk_bytes`` (at least one element)."""
        return list(_iter_chunks(self.segments, chunk_bytes))


def _iter_chunks(segments: tuple[Segment, ...], chunk_bytes: int) -> Iterator[Chunk]:
    index = 0
    for seg in segments:
        step = max(1, chunk_bytes // seg.itemsize) * seg.itemsize
        for start in range(0, seg.nbytes, step):
            yield Chunk(index, seg.dtype, seg.offset + start, min(step, seg.nbytes - start), seg.itemsize)
            index += 1


NARROWABLE = ("float32", "float64")


def wire_chunks(chunks: list[Chunk], wire_dtype: str | None) -> list[Chunk]:
    """The same chunks as a client sends them: float32/float64 ones cast to ``wire_dtype``.

    Offsets are into the client's separate wire buffer (each chunk 64-byte aligned). With no
    narrowing this is ``chunks`` itself: updates go straight from the flat buffer.
    """
    if wire_dtype is None or all(c.dtype == wire_dtype or c.dtype not in NARROWABLE for c in chunks):
        return chunks
    wire_itemsize = itemsize(wire_dtype)
    out, offset = [], 0
    for c in chunks:
        dtype, size = (wire_dtype, wire_itemsize) if c.dtype in NARROWABLE else (c.dtype, c.itemsize)
        out.append(Chunk(c.index, dtype, offset, c.numel * size, size))
        offset = aligned(offset + c.numel * size)
    return out


def fp32_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """The same chunks as fp32 partial sums travel (``clients.groups``): each element 4 bytes, 64-byte aligned."""
    out, offset = [], 0
    for c in chunks:
        out.append(Chunk(c.index, "float32", offset, c.numel * 4, 4))
        offset = aligned(offset + c.numel * 4)
    return out


def element_offsets(chunks: list[Chunk]) -> list[int]:
    """Each chunk's first element in the model's element numbering (server-state vectors)."""
    out, total = [], 0
    for c in chunks:
        out.append(total)
        total += c.numel
    return out + [total]


def is_control(name: str) -> bool:
    """Whether a tensor is in the ``CONTROL`` section (SCAFFOLD's server c, a plug-in's summed streams): server
    state that travels and is checkpointed with the model in ``/model`` but is no weight of the model."""
    return name.startswith(CONTROL + ".")


def control_bytes(spec: ModelSpec) -> int:
    """Bytes of the model's SCAFFOLD control section (0 without one)."""
    return sum(e.nbytes for e in spec.entries if is_control(e.name))


def is_local(name: str, local: Sequence[str]) -> bool:
    """Whether a tensor's name matches one of the ``model.local`` glob patterns (it never travels). SCAFFOLD's
    control variates never are: they are the server's c, and their names repeat their parameters' (a pattern
    such as ``*bn*`` would otherwise catch the control of a parameter it does not name)."""
    return not is_control(name) and any(fnmatch.fnmatchcase(name, pattern) for pattern in local)


def layout(described: list[tuple[str, tuple[int, ...], str]], statistics: Collection[str] = ()) -> ModelSpec:
    """The spec of (name, shape, dtype) tensors in this order: grouped by dtype, segments 64-byte aligned;
    ``statistics``: the names of the buffers among them (``TensorEntry.statistic``)."""
    by_dtype: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape, dtype in described:
        by_dtype.setdefault(dtype, []).append((name, tuple(shape)))
    entries, segments, offset = [], [], 0
    for dtype, group in by_dtype.items():
        offset = aligned(offset)
        start = offset
        for name, shape in group:
            nbytes = math.prod(shape) * itemsize(dtype)
            entries.append(TensorEntry(name, shape, dtype, offset, nbytes, name in statistics))
            offset += nbytes
        segments.append(Segment(dtype, start, offset - start))
    return ModelSpec(tuple(entries), tuple(segments), aligned(offset))


def padding_ranges(spec: ModelSpec) -> list[tuple[int, int]]:
    """The byte ranges [start, end) of the buffer that no tensor covers: the alignment between dtype segments and
    at the end."""
    gaps, covered = [], 0
    for entry in sorted(spec.entries, key=lambda e: e.offset):
        if entry.offset > covered:
            gaps.append((covered, entry.offset))
        covered = max(covered, entry.offset + entry.nbytes)
    if spec.total_bytes > covered:
        gaps.append((covered, spec.total_bytes))
    return gaps
