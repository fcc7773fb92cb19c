"""HDF5 checkpoints: one dataset per tensor under /model/<name>, published atomically. No pickle.

Layout of a checkpoint file (named ``ckpt-r<round>.h5`` by the checkpointer)::

    /                  attrs: format, format_version, round, spec_hash, config (YAML), seed,
                              strategy, created, version_* (mpifl, torch, h5py, mpi)
    /model/<name>      one dataset per exchanged tensor, in its own dtype; bf16 is stored as
                       its raw uint16 bits; every dataset has attr ``dtype`` (torch dtype name)
    /server_state/<n>  strategy state: one float32 vector per name (FedAvgM ``velocity``,
                       FedAdam/Yogi/Adagrad ``m`` and ``v``), one element per model element
                       in chunk order; attr ``fill`` is its initial value (empty for FedAvg)
    /metrics           the metrics history so far, one JSON string per round

Publishing writes ``<name>.tmp`` in the same directory, flushes, fsyncs, then ``os.replace``:
a crash at any moment leaves the previous checkpoint intact. Tensor data is read and
written by flat byte ranges, so a server can work window by window (out-of-core).
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from mpifl.errors import CheckpointError
from mpifl.metrics import json_line
from mpifl.storage.integrity import ChunkChecksums, verify
from mpifl.storage.ranges import STORED_AS, MappedRange, RawRanges, file_address
from mpifl.units import MIB
from mpifl.wire.spec import ModelSpec, layout

if TYPE_CHECKING:  # torch only where tensors are read or written: `mpifl status` and `inspect` start without it
    from types import TracebackType

    import torch

FORMAT = "mpifl-checkpoint"
FORMAT_VERSION = 2  # 2: a CRC32 per chunk under /integrity (see storage.integrity); /model attr "order"
ALIGNMENT = 1 << 20  # tensors of 1 MiB or more start on a 1 MiB boundary (Lustre stripes, whole pages)


def _contiguous() -> h5py.h5p.PropDCID:
    """Dataset creation: one contiguous range, allocated at creation (its file offset is known), never
    filled (every byte is written by mpifl): what makes ``RawRanges``' pread/pwrite possible."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a tensor; bf16 as its raw uint16 bits."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


class CheckpointWriter:
    """Writes one checkpoint to a temporary file; ``publish()`` makes it visible atomically."""

    def __init__(self, path: Path, spec: ModelSpec, attrs: dict, state: dict[str, tuple[int, float]] | None = None,
                 chunk_bytes: int = 16 * MIB, recycle: Path | None = None):
        """``recycle``: a published checkpoint of the same model that is about to be pruned, overwritten in
        place instead of writing a new file (every model and state byte is rewritten; see ``_recycled``)."""
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.spec = spec
        self.checksums = ChunkChecksums(spec, chunk_bytes, list(state or {}))
        self.recycled = recycle is not None and self._recycled(recycle, state or {})
        if not self.recycled:
            self._create(state or {})
        self.file.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION, "spec_hash": spec.hash,
                                **{k: v for k, v in attrs.items() if v is not None}})
        self.raw = RawRanges(spec, self.datasets, self.tmp, write=True)

    def _create(self, state: dict[str, tuple[int, float]]) -> None:
        try:  # freed space is tracked in the file, so a recycled file's rewritten metrics reuse it
            self.file = h5py.File(self.tmp, "w", alignment_threshold=ALIGNMENT, alignment_interval=ALIGNMENT,
                                  fs_strategy="fsm", fs_persist=True)
        except OSError as err:
            raise OSError(f"cannot write checkpoint {str(self.tmp)!r}: {err}") from None
        model = self.file.create_group("model")
        model.attrs["order"] = json.dumps([e.name for e in self.spec.entries])  # the flat layout, rebuilt on verify
        self.datasets = {}
        with self._naming_errors():
            for e in self.spec.entries:
                ds = model.create_dataset(e.name, shape=e.shape, dtype=STORED_AS[e.dtype], dcpl=_contiguous())
                ds.attrs["dtype"] = e.dtype
                self.datasets[e.name] = ds
            server_state = self.file.create_group("server_state")
            for name, (size, fill) in state.items():  # unwritten parts read as the fill value
                ds = server_state.create_dataset(name, shape=(size,), dtype=np.float32, fillvalue=np.float32(fill))
                ds.attrs["fill"] = fill

    def _recycled(self, old: Path, state: dict[str, tuple[int, float]]) -> bool:
        """Take over ``old`` as this checkpoint's temporary file when it has the same layout: the same model,
        every tensor one plain byte range, the same state vectors. Its blocks and cached pages are reused:
        overwriting a 2 GiB file ran at 8 GB/s here, writing a new one at 0.7 GB/s. Its attributes,
        metrics and checksums are replaced; the caller rewrites every model and state byte. Renamed
        first, so it is never a published checkpoint while half overwritten."""
        try:
            os.replace(old, self.tmp)
            self.file = h5py.File(self.tmp, "r+")
        except OSError:
            self.tmp.unlink(missing_ok=True)
            return False
        f = self.file
        model, server_state = f.get("model"), f.get("server_state")
        same = (f.attrs.get("spec_hash") == self.spec.hash and model is not None and server_state is not None
                and all(e.name in model and (not e.nbytes or file_address(model[e.name], STORED_AS[e.dtype]))
                        for e in self.spec.entries)
                and sorted(server_state) == sorted(state)
                and all(server_state[n].shape == (size,) for n, (size, _) in state.items()))
        if not same:
            f.close()
            self.tmp.unlink(missing_ok=True)
            return False
        for key in list(f.attrs):
            del f.attrs[key]
        for name in ("metrics", "integrity"):
            if name in f:
                del f[name]
        self.datasets = {e.name: model[e.name] for e in self.spec.entries}
        return True

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """On error, drop the temporary file (the previous checkpoint is untouched)."""
        if exc_type is not None:
            self.abandon()

    def write_range(self, offset: int, data: np.ndarray) -> None:
        """Write flat bytes ``data`` at byte ``offset`` of the model's flat layout."""
        with self._naming_errors():
            self.raw.io(offset, data, write=True)
        self.checksums.model_bytes(offset, data)

    def write_state(self, name: str, start: int, data: np.ndarray) -> None:
        """Write float32 ``data`` into server-state vector ``name`` from element ``start``."""
        with self._naming_errors():
            self.file["server_state"][name][start:start + len(data)] = data
        self.checksums.state_elements(name, start, data)

    def write_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], flat_bytes: np.ndarray | None = None) -> None:
        """Write whole tensors by name; ``flat_bytes``, the flat buffer they are views of, spares reading back."""
        with self._naming_errors():
            for name, t in tensors:
                self.datasets[name][...] = to_numpy(t.detach())
        if flat_bytes is not None:
            self.checksums.model_bytes(0, flat_bytes)

    @contextlib.contextmanager
    def _naming_errors(self) -> Iterator[None]:
        try:
            yield
        except (OSError, RuntimeError) as err:  # disk full, quota, I/O error (h5py raises either): say which file
            raise OSError(f"could not write checkpoint {str(self.tmp)!r}: {_first_line(err)}") from None

    def write_metrics(self, history: list[dict]) -> None:
        """Store the run's round records, one JSON string each, so a checkpoint carries its history."""
        lines = [json_line(r) for r in history]
        with self._naming_errors():
            self.file.create_dataset("metrics", data=np.array(lines, dtype=h5py.string_dtype()),
                                     dtype=h5py.string_dtype())

    def publish(self, sync: bool = True) -> Path:
        """Write the checksums, flush, fsync (unless not ``sync``), and atomically rename into place.

        Without ``sync`` the file is complete and replaces nothing half-written, so it survives the
        process (a killed job) but not the node: the page cache may still hold it."""
        try:
            with self._naming_errors():
                self.file.flush()  # what h5py wrote is in the file before the raw reads of checksums.save
                self.checksums.save(self.file, lambda c, out: self.raw.io(c.offset, out, write=False))
                self.raw.close()
                self.file.flush()
                self.file.close()
            if sync:
                with open(self.tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(self.tmp, self.path)
            if sync:
                fsync_dir(self.path.parent)
        except OSError as err:
            self.abandon()
            if str(err).startswith("could not write checkpoint"):
                raise
            raise OSError(f"could not publish checkpoint {str(self.path)!r}: {err}") from None
        return self.path

    def abandon(self) -> None:
        """Drop the temporary file; the previous checkpoint stays as it was."""
        try:
            if hasattr(self, "raw"):
                self.raw.close()
            self.file.close()
        except Exception:  # noqa: BLE001 - closing a half-written file may fail again
            pass
        self.tmp.unlink(missing_ok=True)


class Checkpoint:
    """A validated, read-only checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such checkpoint file")
        try:
            self.file = h5py.File(self.path, "r")
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{self.path}: not a readable HDF5 file (truncated or corrupt?): {err}") from None
        attrs = self.file.attrs
        if attrs.get("format") != FORMAT or "model" not in self.file:
            self.file.close()
            raise CheckpointError(f"{self.path}: not an mpifl checkpoint (no format={FORMAT!r} attribute or "
                                  "/model group)")
        self.round = int(attrs["round"])
        self.spec_hash = str(attrs["spec_hash"])
        self.config = str(attrs.get("config", ""))
        self.raw: RawRanges | None = None  # opened by the first read_range

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the raw range reader (if opened) and the HDF5 file."""
        if self.raw is not None:
            self.raw.close()
        self.file.close()

    def __repr__(self) -> str:
        return f"<mpifl checkpoint {self.path.name}: round {self.round}, spec {self.spec_hash}>"

    def check_spec(self, spec: ModelSpec) -> None:
        """Refuse a checkpoint of another model, naming the first differing tensor (the stored hash is not trusted)."""
        model = self.file["model"]
        for e in spec.entries:
            ds = model.get(e.name)
            if ds is None:
                raise CheckpointError(f"{self.path}: checkpoint of another model: tensor {e.name!r} is missing")
            if tuple(ds.shape) != e.shape or ds.attrs.get("dtype") != e.dtype:
                raise CheckpointError(f"{self.path}: checkpoint of another model: tensor {e.name!r} is "
                                      f"{list(ds.shape)} {ds.attrs.get('dtype')} there, {list(e.shape)} {e.dtype} here")
        if spec.hash != self.spec_hash:
            raise CheckpointError(f"{self.path}: checkpoint of another model (spec {self.spec_hash} != {spec.hash})")

    def spec(self) -> ModelSpec:
        """The flat layout the checkpoint was written with (from ``/model``'s ``order`` and the datasets)."""
        model = self.file["model"]
        order = json.loads(model.attrs["order"]) if "order" in model.attrs else sorted(model)
        return layout([(n, tuple(model[n].shape), str(model[n].attrs.get("dtype", model[n].dtype))) for n in order])

    def verify(self) -> int:
        """Read everything back and check every chunk's checksum; the number of chunks checked (0: none stored)."""
        self.metrics_readable()
        return verify(self)

    def metrics_readable(self) -> None:
        """CheckpointError naming the file where its metrics history cannot be read."""
        with self._reading("metrics"):
            self.metrics()

    @contextlib.contextmanager
    def _reading(self, what: str) -> Iterator[None]:
        try:
            yield
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{self.path}: {what} is unreadable (truncated or corrupt?): {err}") from None

    def read_range(self, spec: ModelSpec, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (uint8) with the flat bytes at ``offset`` of the model."""
        with self._reading(f"model bytes {offset}..{offset + len(out)}"):
            self._raw(spec).io(offset, out, write=False)

    def map_range(self, spec: ModelSpec, offset: int, nbytes: int) -> MappedRange | None:
        """The flat bytes at ``offset`` mapped read-only (``MappedRange``) when they are one stretch of the
        file, else None (then ``read_range`` copies them)."""
        with self._reading(f"model bytes {offset}..{offset + nbytes}"):
            raw = self._raw(spec)
            at = raw.file_span(offset, nbytes)
            return None if at is None or nbytes == 0 else MappedRange(raw.fd, at, nbytes)

    def _raw(self, spec: ModelSpec) -> RawRanges:
        """The file's raw ranges for ``spec`` (opened on first use)."""
        if self.raw is None or self.raw.spec is not spec:
            if self.raw is not None:
                self.raw.close()
            self.raw = RawRanges(spec, self.file["model"], self.path, write=False)
        return self.raw

    def read_state(self, name: str, start: int, out: np.ndarray, fill: float) -> None:
        """Fill float32 ``out`` from server-state vector ``name`` at element ``start`` (``fill`` if absent)."""
        group = self.file.get("server_state")
        if group is None or name not in group:
            out.fill(fill)
            return
        ds = group[name]
        if start + len(out) > ds.shape[0]:
            raise CheckpointError(f"{self.path}: server_state/{name} has {ds.shape[0]} elements, "
                                  f"needs {start + len(out)}")
        with self._reading(f"server_state/{name}"):
            ds.read_direct(out, source_sel=np.s_[start:start + len(out)])

    def read_into(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Read every tensor straight into the given (flat-buffer) views: no second copy."""
        model = self.file["model"]
        for name, t in named:
            with self._reading(f"tensor {name!r}"):
                model[name].read_direct(to_numpy(t))

    def tensors(self) -> dict[str, torch.Tensor]:
        """All tensors as torch tensors of their recorded dtypes (loads the whole model)."""
        import torch

        out = {}
        for name, ds in _datasets(self.file["model"]):
            data = torch.from_numpy(np.array(ds))
            out[name] = data.view(torch.bfloat16) if ds.attrs.get("dtype") == "bfloat16" else data
        return out

    def entries(self) -> list[tuple[str, tuple, str, int]]:
        """(name, shape, dtype, nbytes) of every tensor."""
        return [(n, tuple(ds.shape), str(ds.attrs.get("dtype", ds.dtype)), ds.size * ds.dtype.itemsize)
                for n, ds in _datasets(self.file["model"])]

    def metrics(self) -> list[dict]:
        """The metrics history saved with the checkpoint."""
        if "metrics" not in self.file:
            return []
        return [json.loads(s) for s in self.file["metrics"].asstr()[...]]


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read every /model/<name> dataset of a checkpoint as a torch tensor."""
    with Checkpoint(path) as ckpt:
        return ckpt.tensors()


def _datasets(group: h5py.Group) -> list[tuple[str, h5py.Dataset]]:
    out: list[tuple[str, h5py.Dataset]] = []
    group.visititems(lambda n, o: out.append((n, o)) if isinstance(o, h5py.Dataset) else None)
    return out


def _first_line(err: BaseException) -> str:
    """HDF5's messages span lines (time, file, errno...): the operating system's reason when there is one."""
    text = str(err)
    if "error message = '" in text:
        return "write failed: " + text.split("error message = '", 1)[1].split("'", 1)[0]
    return text.splitlines()[0] if text else type(err).__name__


def fsync_dir(directory: Path) -> None:
    """Make a file's creation or rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

