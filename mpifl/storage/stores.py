"""Where the server's global model lives: in RAM (a FlatModel) or on disk (out-of-core HDF5).

Both give the round loop the same things: the model's chunks to stream out (window by
window), a place to finish each chunk of the new model (holding the old chunk on entry),
the strategy's server-state slices for that chunk, and a way to publish a checkpoint.
They produce bitwise-identical models.

Server state (FedAvgM's velocity, FedAdam's moments) is a set of fp32 vectors with one
element per model element, addressed by the chunks' element offsets: whole vectors in
RAM for the in-memory server, ``/server_state/<name>`` datasets read and written chunk
by chunk for the out-of-core one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from mpifl.wire.flat import DTYPES, Chunk, FlatModel, ModelSpec, element_offsets
from mpifl.storage.hdf5 import Checkpoint, CheckpointWriter, checkpoint_name, prune_checkpoints
from mpifl.wire.transport import touched_empty


def chunk_windows(chunks: list[Chunk], window_bytes: int) -> list[list[Chunk]]:
    """Group consecutive chunks into windows of at most ``window_bytes`` (at least one chunk)."""
    windows: list[list[Chunk]] = [[]]
    for c in chunks:
        if windows[-1] and c.offset + c.nbytes - windows[-1][0].offset > window_bytes:
            windows.append([])
        windows[-1].append(c)
    return windows if windows[0] else []


def _span(window: list[Chunk]) -> int:
    """Bytes from the first chunk's start to the last chunk's end."""
    return window[-1].offset + window[-1].nbytes - window[0].offset


class InMemoryState:
    """The global model is a FlatModel; finished chunks overwrite it in place."""

    def __init__(self, flat: FlatModel, chunks: list[Chunk], directory: Path | None, keep: int,
                 state_init: dict[str, float] | None = None):
        self.flat, self.chunks, self.directory, self.keep = flat, chunks, directory, keep
        self.spec = flat.spec
        self.elements = element_offsets(chunks)
        self.state_init = dict(state_init or {})
        self.vectors = {name: torch.full((self.elements[-1],), value, dtype=torch.float32)
                        for name, value in self.state_init.items()}

    def outgoing(self) -> Iterator[list[np.ndarray]]:
        """The whole model is already in memory: one window."""
        yield [self.flat.chunk_bytes(c) for c in self.chunks]

    def begin_round(self, round_: int) -> None:
        pass

    def finish_target(self, chunk: Chunk) -> torch.Tensor:
        return self.flat.chunk_view(chunk)

    def server_state(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        start = self.elements[chunk.index]
        return {name: v[start:start + chunk.numel] for name, v in self.vectors.items()}

    def commit(self, chunk: Chunk) -> None:
        pass

    def abandon_round(self) -> None:
        pass

    def end_round(self, round_: int, attrs: dict, history: list[dict], save: bool) -> Path | None:
        """Publish a checkpoint when asked to."""
        if not save or self.directory is None:
            return None
        sizes = {name: (self.elements[-1], value) for name, value in self.state_init.items()}
        with CheckpointWriter(self.directory / checkpoint_name(round_), self.spec, attrs, sizes) as writer:
            writer.write_tensors(self.flat.tensors())
            for name, vector in self.vectors.items():
                writer.write_state(name, 0, vector.numpy())
            writer.write_metrics(history)
            path = writer.publish()
        prune_checkpoints(self.directory, self.keep)
        return path

    def load(self, ckpt: Checkpoint) -> None:
        """Read a checkpoint straight into the flat buffer (and the server state), then close it."""
        with ckpt:
            ckpt.read_into(self.flat.tensors())
            for name, vector in self.vectors.items():
                ckpt.read_state(name, 0, vector.numpy(), self.state_init[name])


class OnDiskState:
    """Out-of-core: the global model is the newest checkpoint; every round publishes the next one.

    Memory: one read window for streaming the model out and one chunk of staging for
    writing finished chunks, whatever the model's size.
    """

    def __init__(self, spec: ModelSpec, chunks: list[Chunk], directory: Path, keep: int, window_bytes: int,
                 state_init: dict[str, float] | None = None, read_previous: bool = False):
        self.spec, self.chunks, self.directory, self.keep = spec, chunks, directory, keep
        self.windows = chunk_windows(chunks, window_bytes)
        self.window = touched_empty(max(_span(w) for w in self.windows))
        self.staging = touched_empty(max(c.nbytes for c in chunks))
        self.read_previous = read_previous
        self.elements = element_offsets(chunks)
        self.state_init = dict(state_init or {})
        most = max(c.numel for c in chunks)
        self.state_staging = {name: torch.from_numpy(touched_empty(4 * most)).view(torch.float32)
                              for name in self.state_init}
        self.current: Checkpoint | None = None
        self.writer: CheckpointWriter | None = None

    def _views(self, window: list[Chunk]) -> tuple[int, list[np.ndarray]]:
        """The window's base offset and each chunk's slice of the window buffer."""
        base = window[0].offset
        return base, [self.window[c.offset - base:c.offset - base + c.nbytes] for c in window]

    def load(self, ckpt: Checkpoint) -> None:
        """Adopt a published checkpoint as the current global model."""
        if self.current is not None:
            self.current.close()
        self.current = ckpt

    def outgoing(self) -> Iterator[list[np.ndarray]]:
        """Read the model window by window; each window is valid until the next is requested."""
        for window in self.windows:
            base, views = self._views(window)
            self.current.read_range(self.spec, base, self.window[:_span(window)])
            yield views

    def _state_sizes(self) -> dict[str, tuple[int, float]]:
        return {name: (self.elements[-1], value) for name, value in self.state_init.items()}

    def begin_round(self, round_: int) -> None:
        self.writer = CheckpointWriter(self.directory / checkpoint_name(round_), self.spec, {}, self._state_sizes())

    def finish_target(self, chunk: Chunk) -> torch.Tensor:
        if self.read_previous:
            self.current.read_range(self.spec, chunk.offset, self.staging[:chunk.nbytes])
        return torch.from_numpy(self.staging[:chunk.nbytes]).view(DTYPES[chunk.dtype])

    def server_state(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        start, out = self.elements[chunk.index], {}
        for name, staging in self.state_staging.items():
            out[name] = staging[:chunk.numel]
            self.current.read_state(name, start, out[name].numpy(), self.state_init[name])
        return out

    def commit(self, chunk: Chunk) -> None:
        self.writer.write_range(chunk.offset, self.staging[:chunk.nbytes])
        start = self.elements[chunk.index]
        for name, staging in self.state_staging.items():
            self.writer.write_state(name, start, staging[:chunk.numel].numpy())

    def abandon_round(self) -> None:
        """Drop the half-written next checkpoint; the current one stays the global model."""
        if self.writer is not None:
            self.writer.abandon()
            self.writer = None

    def end_round(self, round_: int, attrs: dict, history: list[dict], save: bool) -> Path:
        """Every round's result is published atomically, like a checkpoint."""
        writer, self.writer = self.writer, None
        with writer:
            writer.file.attrs.update({k: v for k, v in attrs.items() if v is not None})
            writer.write_metrics(history)
            path = writer.publish()
        self.load(Checkpoint(path))
        prune_checkpoints(self.directory, self.keep)
        return path

    def write_initial(self, attrs: dict, receive_window) -> Path:
        """Publish round 0 from chunks streamed in by ``receive_window(window_chunks, buffers)``."""
        with CheckpointWriter(self.directory / checkpoint_name(0), self.spec, attrs, self._state_sizes()) as writer:
            for window in self.windows:
                base, views = self._views(window)
                receive_window(views)
                writer.write_range(base, self.window[:_span(window)])
            writer.write_metrics([])
            path = writer.publish()
        self.load(Checkpoint(path))
        return path
