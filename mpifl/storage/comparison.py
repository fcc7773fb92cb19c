"""Two results compared bit for bit (``mpifl diff``), and one result's digest (``mpifl inspect``, ``mpifl diff``,
``profiling/combinations.py``).

A result is what a run leaves: its model's tensors (``model.h5``, else its newest checkpoint), the server's state
beside them (``/server_state``: FedAvgM's velocity, FedAdam's moments, FedDyn's h, a plug-in's vectors), and every
client's kept vector (SCAFFOLD's c_i, Ditto's v_i, local tensors, residuals) from its newest checkpoint's per-rank
files.
The claim mpifl makes is that the same config gives the same bytes on any number of ranks, chunk size, placement or
resume (docs/explanation/determinism.md), so the check is on bytes: a tensor is equal when its bytes are, and a
difference is then sized (how many elements, the largest absolute difference, the relative L2) to tell rounding
from a different result. The checkpoint's own CRC32s cannot serve: they are taken per chunk of the checkpoint's
``chunk_bytes``, which may differ between the two.
"""
from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from mpifl.errors import CheckpointError
from mpifl.storage.checkpointer import CHECKPOINTS, list_checkpoints

MODEL_FILE = "model.h5"
DIGEST_CHARS = 16  # hex characters a digest is quoted by (64 bits)
STATE_SLICE = 1 << 22  # elements of a server state vector read at once (16 MiB of fp32)


@dataclass(frozen=True)
class Result:
    """Where a result's tensors and kept vectors are read from."""

    model: Path  # model.h5 or a checkpoint
    vectors: Path | None  # the checkpoint whose per-rank files hold the clients' vectors, where there is one

    @classmethod
    def at(cls, path: str | Path) -> Result:
        """A run directory (its ``model.h5``, else its newest checkpoint, and its newest checkpoint's clients'
        vectors) or an HDF5 file (a checkpoint brings its own vectors; ``model.h5`` has none)."""
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
        return cls(path, None if path.name == MODEL_FILE else _with_vectors(path))

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """The model's tensors in name order, as stored (bf16 as its uint16 bits), one read at a time."""
        with model_group(self.model) as group:
            for name in sorted(group):
                yield name, group[name][()]

    def state_names(self) -> list[str]:
        """The server state's vectors (``/server_state``), in name order; none where the strategy keeps none."""
        with h5py.File(self.model, "r") as f:
            return sorted(f["server_state"]) if "server_state" in f else []

    def state_slices(self, name: str) -> Iterator[np.ndarray]:
        """Server state vector ``name`` in slices of ``STATE_SLICE`` elements: one is as long as the model (FedAdam
        keeps two), so it is never read whole."""
        with h5py.File(self.model, "r") as f:
            ds = f["server_state"][name]
            for start in range(0, ds.shape[0], STATE_SLICE):
                yield ds[start:start + STATE_SLICE]

    def dtypes(self) -> dict[str, str]:
        """Each tensor's recorded dtype (bf16 is stored as uint16 and says so in an attribute)."""
        with model_group(self.model) as group:
            return {name: str(ds.attrs.get("dtype", ds.dtype)) for name, ds in group.items()}

    def client_vectors(self) -> dict[int, np.ndarray]:
        """Every client's kept vector, by client id; a sharded group's rows (one file per rank of it) joined in the
        order of the ranks' index in the group. Empty where the result keeps none."""
        if self.vectors is None:
            return {}
        folder = self.vectors.with_suffix(".residuals")
        pieces: dict[int, dict[int, np.ndarray]] = {}
        for path in sorted(folder.glob("rank*.h5")):
            with h5py.File(path, "r") as f:
                shard = int(f.attrs.get("shard", 0))
                for client in f["clients"]:
                    pieces.setdefault(int(client), {})[shard] = f["clients"][client][()]
        return {client: np.concatenate([rows for _, rows in sorted(by_shard.items())])
                for client, by_shard in pieces.items()}


def _with_vectors(checkpoint: Path) -> Path | None:
    """``checkpoint`` where per-rank files of the clients' vectors were published beside it, else None."""
    return checkpoint if checkpoint.with_suffix(".residuals").is_dir() else None


def digest(result: Result) -> str:
    """SHA-256 of every tensor (its name, then its bytes, in name order), then of every server state vector (its
    name under ``server_state/``, then its bytes, in name order), then of every kept vector (its client id, then its
    bytes, in id order): equal for two results exactly when both are bitwise equal, whatever the chunking. A result
    without server state digests as before the state was part of it. The first ``DIGEST_CHARS`` hex characters."""
    h = hashlib.sha256()
    for name, values in result.tensors():
        h.update(name.encode())
        h.update(np.ascontiguousarray(values).tobytes())
    for name in result.state_names():
        h.update(f"server_state/{name}".encode())
        for values in result.state_slices(name):
            h.update(np.ascontiguousarray(values).tobytes())
    vectors = result.client_vectors()
    for client in sorted(vectors):
        h.update(str(client).encode())
        h.update(vectors[client].tobytes())
    return h.hexdigest()[:DIGEST_CHARS]


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
    bits = np.dtype(f"u{a.dtype.itemsize}")
    if np.array_equal(np.ascontiguousarray(a).view(bits), np.ascontiguousarray(b).view(bits)):
        return None  # the common case, without the float64 copies that size a difference
    return tally(name, tuple(a.shape), [gap_sums(a, b, dtype)])


def sliced_difference(name: str, a: Iterator[np.ndarray], b: Iterator[np.ndarray], elements: int,
                      dtype: str = "") -> Difference | None:
    """``difference`` of two long vectors read slice by slice (a server state vector), alike slices paired."""
    sums = []
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(f"{name}: {x.dtype} against {y.dtype}, or slices of other lengths: not results of one "
                             "config")
        sums.append(gap_sums(x, y, dtype))
    return tally(name, (elements,), sums)


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
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return values.astype(np.float64)


@dataclass(frozen=True)
class Comparison:
    """Everything that differs between two results: tensors that differ, tensors only one of them has, and the
    same for the clients' kept vectors (compared where both keep some)."""

    tensors: int
    elements: int
    differences: list[Difference]
    only_in_a: list[str]
    only_in_b: list[str]
    clients: int | None  # clients whose vectors were compared (None: not both keep any)
    client_differences: list[Difference]
    clients_only_in_a: list[int]
    clients_only_in_b: list[int]
    states: int = 0  # server state vectors in both
    state_differences: list[Difference] = field(default_factory=list)
    states_only_in_a: list[str] = field(default_factory=list)
    states_only_in_b: list[str] = field(default_factory=list)

    @property
    def bitwise_equal(self) -> bool:
        """Whether every tensor, server state vector and kept vector compared holds the same bytes, and neither has
        one the other lacks."""
        return not (self.differences or self.only_in_a or self.only_in_b or self.client_differences
                    or self.clients_only_in_a or self.clients_only_in_b or self.state_differences
                    or self.states_only_in_a or self.states_only_in_b)


def compare(a: Result, b: Result) -> Comparison:
    """``a`` against ``b``, tensor by tensor (one in memory at a time, each side) and client by client."""
    dtypes_a, dtypes_b = a.dtypes(), b.dtypes()
    shared = sorted(set(dtypes_a) & set(dtypes_b))
    found, elements = [], 0
    with model_group(a.model) as group_a, model_group(b.model) as group_b:
        for name in shared:
            if dtypes_a[name] != dtypes_b[name]:
                raise ValueError(f"{name}: dtype {dtypes_a[name]} against {dtypes_b[name]}: not results of one "
                                 "config")
            values = group_a[name][()]
            change = difference(name, values, group_b[name][()], dtypes_a[name])
            if change is not None:
                found.append(change)
            elements += int(values.size)
    states_a, states_b = a.state_names(), b.state_names()
    states = sorted(set(states_a) & set(states_b))
    state_changes = [d for name in states if (d := state_difference(a, b, name)) is not None]
    vectors_a, vectors_b = a.client_vectors(), b.client_vectors()
    compared = bool(vectors_a) and bool(vectors_b)
    both = sorted(set(vectors_a) & set(vectors_b))
    client_changes = [d for c in both if (d := difference(f"client {c}", vectors_a[c], vectors_b[c])) is not None]
    return Comparison(len(shared), elements, found, sorted(set(dtypes_a) - set(dtypes_b)),
                      sorted(set(dtypes_b) - set(dtypes_a)), len(both) if compared else None, client_changes,
                      sorted(set(vectors_a) - set(vectors_b)) if compared else [],
                      sorted(set(vectors_b) - set(vectors_a)) if compared else [],
                      len(states), state_changes, sorted(set(states_a) - set(states_b)),
                      sorted(set(states_b) - set(states_a)))


def state_difference(a: Result, b: Result, name: str) -> Difference | None:
    """How server state vector ``name`` differs between ``a`` and ``b``, slice by slice; None where it does not."""
    with h5py.File(a.model, "r") as fa, h5py.File(b.model, "r") as fb:
        length, other = fa["server_state"][name].shape[0], fb["server_state"][name].shape[0]
    if length != other:
        raise ValueError(f"server_state/{name}: {length} elements against {other}: not results of one config")
    return sliced_difference(f"server_state/{name}", a.state_slices(name), b.state_slices(name), length)


@contextlib.contextmanager
def model_group(path: Path) -> Iterator[h5py.Group]:
    """A checkpoint's ``/model`` group; CheckpointError naming the file where it is not one."""
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read as HDF5: {err}") from None
    with f:
        if "model" not in f:
            raise CheckpointError(f"{path}: no /model group: not an mpifl checkpoint")
        yield f["model"]
