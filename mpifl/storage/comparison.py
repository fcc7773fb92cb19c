"""Two results compared bit for bit (``mpifl diff``), and one result's digest (``mpifl inspect``, ``mpifl diff``,
``profiling/combinations.py``).

A result is what a run leaves: its model's tensors (``model.h5``, else its newest checkpoint), the server's state
beside them (``/server_state``: FedAvgM's velocity, FedAdam's moments, FedDyn's h, a plug-in's vectors), and every
client's kept vector (SCAFFOLD's c_i, Ditto's v_i, local tensors, residuals) from its newest checkpoint's per-rank
files.
The claim mpifl makes is that the same config gives the same bytes on any number of ranks, chunk size, placement or
resume (docs/explanation/determinism.md), so the check is on bytes: a tensor is equal when its bytes are, and a
difference is then sized (how many elements, the largest absolute difference, the relative L2) to tell rounding
from a different result. The checkpoint's own CRC32s cannot serve for that: they are taken per chunk of the
checkpoint's ``chunk_bytes``, which may differ between the two. They are checked in the same pass instead, each side
against its own (``RecordedChecksums``), so that a file is read once, not once to verify and once to compare.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from mpifl.errors import CheckpointError
from mpifl.storage.checkpointer import CHECKPOINTS, FINAL_MODEL, list_checkpoints, residuals_dir
from mpifl.storage.integrity import RecordedChecksums, StreamedCheck

MODEL_FILE = FINAL_MODEL
DIGEST_CHARS = 16  # hex characters a digest is quoted by (64 bits)
SLICE = 1 << 22  # elements of one tensor or vector read at once (16 MiB of fp32): a 70B model's embedding is ~1e9
SECTIONS = ("model", "server_state", "clients")  # a result's parts, in the order the digest covers them


@dataclass(frozen=True)
class Entry:
    """One tensor, server state vector or client's kept vector of a result, where its bytes lie: one dataset, or
    a sharded group's rows (one per rank file of the group, in the order of the ranks' index in it)."""

    label: str  # what the digest hashes before its bytes: the tensor's name, server_state/NAME, the client's id
    name: str  # what diff calls it: the label, or 'client ID'
    shape: tuple[int, ...]
    dtype: str  # as recorded (bf16 is stored as uint16 and says so in an attribute)
    parts: tuple[h5py.Dataset, ...]

    def slices(self) -> Iterator[np.ndarray]:
        """The entry's elements in order, flat, in slices of about ``SLICE`` elements (whole rows of a matrix), so
        that one is never held whole: a 70B model's embedding is 2 GiB of bf16, a state vector as long as the
        model. A vector kept in pieces (a sharded group's rank files) is cut at the same places as one kept whole,
        so that two results of one config pair slice for slice whatever their group sizes. A read that fails (a
        truncated file) is a CheckpointError naming the file and the entry."""
        try:
            if len(self.parts) > 1:
                yield from _joined_slices(self.parts)
                return
            ds = self.parts[0]
            if ds.ndim == 0:
                yield np.asarray(ds[()]).reshape(-1)
                return
            rows = max(1, SLICE // max(1, int(np.prod(ds.shape[1:]))))  # a 1-D vector: SLICE elements
            for start in range(0, ds.shape[0], rows):
                yield ds[start:start + rows].reshape(-1)
        except OSError as err:
            raise CheckpointError(f"{self.parts[0].file.filename}: {self.name} is unreadable (truncated or corrupt?): "
                                  f"{err}") from None

    @property
    def elements(self) -> int:
        """How many elements the entry holds."""
        return int(np.prod(self.shape))


def _joined_slices(parts: tuple[h5py.Dataset, ...]) -> Iterator[np.ndarray]:
    """The 1-D parts joined end to end, in slices of ``SLICE`` elements (the last shorter) whatever the parts'
    lengths."""
    ends = np.cumsum([int(ds.size) for ds in parts])
    starts = ends - [int(ds.size) for ds in parts]
    for at in range(0, int(ends[-1]), SLICE):
        stop = min(at + SLICE, int(ends[-1]))
        yield np.concatenate([ds[max(at - first, 0):min(stop, last) - first].reshape(-1)
                              for ds, first, last in zip(parts, starts, ends, strict=True)
                              if first < stop and last > at])


@dataclass(frozen=True)
class Result:
    """Where a result's tensors and kept vectors are read from."""

    model: Path  # model.h5 or a checkpoint
    vectors: Path | None  # the checkpoint whose per-rank files hold the clients' vectors, where there is one

    @classmethod
    def at(cls, path: str | Path) -> Result:
        """A run directory (its ``model.h5``, else its newest checkpoint, and its newest checkpoint's clients'
        vectors) or an HDF5 file: a checkpoint brings its own vectors, and a run's ``model.h5``, a hard link to its
        final checkpoint, that checkpoint's, where its run directory still has them (a copy alone has none)."""
        path = Path(path)
        if path.is_dir():
            newest = list_checkpoints(path / CHECKPOINTS)
            model = path / MODEL_FILE if (path / MODEL_FILE).is_file() else (newest[-1] if newest else None)
            if model is None:
                raise CheckpointError(f"{path}: neither {MODEL_FILE} nor a checkpoint in {path / CHECKPOINTS}: "
                                      "not a run directory that finished a round")
            return cls(model, _with_vectors(newest[-1]) if newest else None)
        if not path.is_file():
            raise CheckpointError(f"{path}: no such file or run directory")
        if path.name == MODEL_FILE:
            return cls(path, _with_vectors(residuals_dir(path).with_suffix(".h5")))
        return cls(path, _with_vectors(path))

    @contextlib.contextmanager
    def opened(self) -> Iterator[dict[str, dict[str | int, Entry]]]:
        """The result's entries by section (``SECTIONS``), by name (a client by its id), its files held open while
        they are read: one pass over a result opens each file once."""
        with contextlib.ExitStack() as stack:
            group = stack.enter_context(model_group(self.model))
            state = group.file.get("server_state")
            sections: dict[str, dict[str | int, Entry]] = {
                "model": {name: Entry(name, name, ds.shape, str(ds.attrs.get("dtype", ds.dtype)), (ds,))
                          for name, ds in group.items()},
                "server_state": {name: Entry(f"server_state/{name}", f"server_state/{name}", ds.shape,
                                             str(ds.dtype), (ds,))
                                 for name, ds in (state.items() if state is not None else [])},
                "clients": {}}
            pieces: dict[int, dict[int, h5py.Dataset]] = {}
            for path in vector_files(self.vectors) if self.vectors is not None else []:
                f = stack.enter_context(_opened_vectors(path))
                shard = int(f.attrs.get("shard", 0))
                for client, ds in f["clients"].items():
                    pieces.setdefault(int(client), {})[shard] = ds
            for client, by_shard in pieces.items():
                parts = tuple(ds for _, ds in sorted(by_shard.items()))
                length = sum(int(ds.size) for ds in parts)
                sections["clients"][client] = Entry(str(client), f"client {client}", (length,), str(parts[0].dtype),
                                                    parts)
            yield sections

    def client_vectors(self) -> dict[int, np.ndarray]:
        """Every client's kept vector, by client id, read whole; empty where the result keeps none."""
        with self.opened() as sections:
            return {int(c): np.concatenate([np.empty(0, e.parts[0].dtype), *e.slices()])
                    for c, e in sections["clients"].items()}


def vector_files(checkpoint: Path) -> list[Path]:
    """The per-rank files of ``checkpoint``'s clients' vectors, as its ``residual_files`` attribute lists them (every
    one there: a result missing some is no result to compare), else those found beside it."""
    folder = checkpoint.with_suffix(".residuals")
    try:
        with h5py.File(checkpoint, "r") as f:
            listed = f.attrs.get("residual_files")
    except OSError as err:
        raise CheckpointError(f"{checkpoint}: cannot read it: {err}") from None
    if listed is None:
        return sorted(folder.glob("rank*.h5"))
    files = [folder / name for name in json.loads(listed)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder}: {len(missing)} of the {len(files)} files of its clients' vectors that "
                              f"{checkpoint.name} lists are missing ({', '.join(missing)})")
    return files


def vector_clients(checkpoint: Path) -> list[int]:
    """The logical clients, ascending, that have a vector in ``checkpoint``'s files (their ids only: nothing read)."""
    clients: set[int] = set()
    for path in vector_files(checkpoint):
        with _opened_vectors(path) as f:
            clients.update(int(c) for c in f["clients"])
    return sorted(clients)


@contextlib.contextmanager
def _opened_hdf5(path: Path, unreadable: str) -> Iterator[h5py.File]:
    """``path`` open for reading; CheckpointError naming it, and saying ``unreadable``, where h5py cannot open it
    (truncated, not HDF5): a traceback names neither the file nor what it was to be."""
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise CheckpointError(f"{path}: {unreadable}: {err}") from None
    with f:
        yield f


def _opened_vectors(path: Path) -> contextlib.AbstractContextManager[h5py.File]:
    """A per-rank file of clients' vectors, open."""
    return _opened_hdf5(path, "cannot read this file of clients' vectors")


def _with_vectors(checkpoint: Path) -> Path | None:
    """``checkpoint`` where per-rank files of the clients' vectors were published beside it, or where it lists
    some and is a run's own (in its ``checkpoints/``: ``vector_files`` then names those missing), else None: a
    checkpoint copied away from its run keeps no vectors."""
    if checkpoint.with_suffix(".residuals").is_dir():
        return checkpoint
    if checkpoint.parent.name != CHECKPOINTS:
        return None
    try:
        with h5py.File(checkpoint, "r") as f:
            return checkpoint if "residual_files" in f.attrs else None
    except OSError:  # not there, or unreadable: the model's own reading says which
        return None


def digest(result: Result) -> str:
    """SHA-256 of every tensor (its name, then its bytes, in name order), then of every server state vector (its
    name under ``server_state/``, then its bytes, in name order), then of every kept vector (its client id, then its
    bytes, in id order): equal for two results exactly when both are bitwise equal, whatever the chunking. A result
    without server state digests as before the state was part of it. The first ``DIGEST_CHARS`` hex characters."""
    h = hashlib.sha256()
    with result.opened() as sections:
        for section in SECTIONS:
            for key in sorted(sections[section]):
                _hash(h, sections[section][key])
    return h.hexdigest()[:DIGEST_CHARS]


def _hash(h: hashlib._Hash, entry: Entry, check: StreamedCheck | None = None) -> None:
    """Add ``entry`` to digest ``h``: its label, then its bytes (each checked by ``check`` as it passes)."""
    h.update(entry.label.encode())
    for values in entry.slices():
        h.update(np.ascontiguousarray(values).data)
        if check is not None:
            check.feed(values)
    if check is not None:
        check.finish()


@dataclass(frozen=True)
class Difference:
    """How one tensor (or a client's vector) differs between two results."""

    name: str
    shape: tuple[int, ...]
    differing: int  # elements whose bytes differ
    elements: int
    max_abs: float  # the largest |a - b| over the elements, as float64 (inf where one is not finite)
    relative_l2: float  # ||a - b|| / ||b||

    def line(self) -> str:
        """The difference in one line, as ``mpifl diff`` prints it."""
        return (f"{self.name} {list(self.shape)}: {self.differing:,} of {self.elements:,} elements differ, "
                f"max |a - b| {self.max_abs:.3g}, relative L2 {self.relative_l2:.3g}")


def difference(name: str, a: np.ndarray, b: np.ndarray, dtype: str = "") -> Difference | None:
    """None where ``a`` and ``b`` hold the same bytes; else how they differ, element by element bitwise (a NaN
    against the same NaN is equal, 0.0 against -0.0 is not). ``dtype`` 'bfloat16': both are raw uint16 bits,
    sized as the values they encode."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{name}: {a.dtype} {list(a.shape)} against {b.dtype} {list(b.shape)}: not results of "
                         "one config")
    if same_bytes(a, b):
        return None  # the common case, without the float64 copies that size a difference
    return tally(name, tuple(a.shape), [gap_sums(a, b, dtype)])


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one shape and dtype hold the same bytes."""
    bits = np.dtype(f"u{a.dtype.itemsize}")
    return bool(np.array_equal(np.ascontiguousarray(a).view(bits), np.ascontiguousarray(b).view(bits)))


def entry_difference(a: Entry, b: Entry, digests: tuple[hashlib._Hash, hashlib._Hash],
                     checks: tuple[StreamedCheck | None, StreamedCheck | None] = (None, None)) -> Difference | None:
    """``difference`` of one entry of two results, read slice by slice (one slice of each side in memory at a
    time), each side's bytes added to ``digests`` and checked against its recorded checksums (``checks``) as they
    pass. An equal entry is read once and costs no float64 copy; one that differs is read again to size the
    difference."""
    if a.shape != b.shape or a.dtype != b.dtype or a.parts[0].dtype != b.parts[0].dtype:
        raise ValueError(f"{a.name}: {a.dtype} {list(a.shape)} against {b.dtype} {list(b.shape)}: not results of "
                         "one config")
    for h, entry in zip(digests, (a, b), strict=True):
        h.update(entry.label.encode())
    equal = True
    for x, y in zip(a.slices(), b.slices(), strict=True):
        digests[0].update(np.ascontiguousarray(x).data)
        digests[1].update(np.ascontiguousarray(y).data)
        for check, values in zip(checks, (x, y), strict=True):
            if check is not None:
                check.feed(values)
        equal = equal and same_bytes(x, y)
    for check in checks:
        if check is not None:
            check.finish()
    if equal:
        return None
    dtype = a.dtype if a.dtype == "bfloat16" else ""
    return tally(a.name, a.shape, [gap_sums(x, y, dtype) for x, y in zip(a.slices(), b.slices(), strict=True)])


GapSums = tuple[int, float, float, float]  # elements that differ, max |a - b| (NaN: none finite), ||a - b||², ||b||²


def gap_sums(a: np.ndarray, b: np.ndarray, dtype: str = "") -> GapSums:
    """What ``difference`` reports of one piece of two arrays of one shape, as sums that add over pieces."""
    bits = np.dtype(f"u{a.dtype.itemsize}")
    differs = np.ascontiguousarray(a).view(bits) != np.ascontiguousarray(b).view(bits)
    count = int(np.count_nonzero(differs))
    y = as_float64(b, dtype)
    if not count:  # an equal piece adds only its norm (a slice beside others that differ)
        return 0, float("nan"), 0.0, float(np.sum(np.square(y)))
    x = as_float64(a, dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        gaps = np.abs(x - y)[differs]
        max_abs = float(np.nan if np.isnan(gaps).all() else np.nanmax(gaps))
        return count, max_abs, float(np.sum(np.square(x - y))), float(np.sum(np.square(y)))


def tally(name: str, shape: tuple[int, ...], pieces: list[GapSums]) -> Difference | None:
    """The pieces' sums as one Difference, or None where no element differs."""
    count = sum(p[0] for p in pieces)
    if not count:
        return None
    maxima = [p[1] for p in pieces if not np.isnan(p[1])]
    norm = float(np.sqrt(sum(p[3] for p in pieces)))
    with np.errstate(invalid="ignore", over="ignore"):
        relative = float(np.sqrt(sum(p[2] for p in pieces))) / norm if norm else float("inf")
    return Difference(name, shape, count, int(np.prod(shape)), max(maxima) if maxima else float("nan"), relative)


def as_float64(values: np.ndarray, dtype: str = "") -> np.ndarray:
    """``values`` as float64; bf16's raw uint16 bits as the floats they encode."""
    with np.errstate(invalid="ignore"):  # a signalling NaN's bits are a value like any other here
        if dtype == "bfloat16":
            return (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return values.astype(np.float64)


@dataclass(frozen=True)
class Section:
    """One section of a comparison (the model, the server state or the clients' vectors)."""

    compared: int  # entries both results have
    elements: int  # their elements
    differences: list[Difference]
    only_in_a: list[str]
    only_in_b: list[str]

    @property
    def equal(self) -> bool:
        """Whether nothing differs in this section and neither side has an entry the other lacks."""
        return not (self.differences or self.only_in_a or self.only_in_b)


@dataclass(frozen=True)
class Comparison:
    """Everything that differs between two results, by section: tensors that differ, tensors only one of them has,
    the same for the server's state and for the clients' kept vectors (compared where both keep some), and each
    side's digest, taken in the same pass."""

    model: Section
    server_state: Section
    clients: Section | None  # None: not both keep clients' vectors
    digests: tuple[str, str]

    @property
    def bitwise_equal(self) -> bool:
        """Whether every tensor, server state vector and kept vector compared holds the same bytes, and neither has
        one the other lacks."""
        return self.model.equal and self.server_state.equal and (self.clients is None or self.clients.equal)


Recorded = tuple[RecordedChecksums | None, RecordedChecksums | None]  # each side's checksums, where it has some


def compare(a: Result, b: Result, recorded: Recorded = (None, None)) -> Comparison:
    """``a`` against ``b``, entry by entry in digest order, each read once in slices (one slice of each side in
    memory at a time; a differing one read again to size it), both digests taken as they pass, and each side's
    model and server state checked against its ``recorded`` checksums in the same pass (CheckpointError at the
    first piece that fails)."""
    hashes = (hashlib.sha256(), hashlib.sha256())
    with a.opened() as side_a, b.opened() as side_b:
        model = _compare_section(side_a["model"], side_b["model"], hashes, recorded, "model")
        state = _compare_section(side_a["server_state"], side_b["server_state"], hashes, recorded, "server_state")
        clients_a, clients_b = side_a["clients"], side_b["clients"]
        if clients_a and clients_b:
            clients: Section | None = _compare_section(clients_a, clients_b, hashes, (None, None), "clients",
                                                       "client ")
        else:  # compared only where both keep some; still part of each side's digest
            clients = None
            for h, entries in zip(hashes, (clients_a, clients_b), strict=True):
                for key in sorted(entries):
                    _hash(h, entries[key])
    return Comparison(model, state, clients,
                      (hashes[0].hexdigest()[:DIGEST_CHARS], hashes[1].hexdigest()[:DIGEST_CHARS]))


def _compare_section(a: dict, b: dict, hashes: tuple[hashlib._Hash, hashlib._Hash], recorded: Recorded,
                     section: str, prefix: str = "") -> Section:
    """One section of two results compared, every key of either side in sorted order (each side's digest order)
    added to its side's digest and checked against its recorded checksums."""
    found, elements = [], 0
    for key in sorted(set(a) | set(b)):
        checks = tuple(r.check(section, str(key)) if r is not None else None for r in recorded)
        if key in a and key in b:
            change = entry_difference(a[key], b[key], hashes, (checks[0], checks[1]))
            elements += a[key].elements
            if change is not None:
                found.append(change)
        else:
            side = 0 if key in a else 1
            _hash(hashes[side], (a if key in a else b)[key], checks[side])
    return Section(len(set(a) & set(b)), elements, found, [f"{prefix}{k}" for k in sorted(set(a) - set(b))],
                [f"{prefix}{k}" for k in sorted(set(b) - set(a))])


@contextlib.contextmanager
def model_group(path: Path) -> Iterator[h5py.Group]:
    """A checkpoint's ``/model`` group; CheckpointError naming the file where it is not one."""
    with _opened_hdf5(path, "cannot be read as HDF5") as f:
        if "model" not in f:
            raise CheckpointError(f"{path}: no /model group: not an mpifl checkpoint")
        yield f["model"]
