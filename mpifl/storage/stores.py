"""Where the server's global model lives: in RAM (a FlatModel) or on disk (out-of-core HDF5).

Both stores give the round loop the same things (:class:`GlobalStore`): the model's chunks
to stream out (window by window), a place to finish each chunk of the new model (holding
the old chunk on entry), the strategy's server-state slices for that chunk, and a way to
publish the result as a checkpoint. They produce bitwise-identical models. When and where
to publish is the :class:`~mpifl.storage.checkpointer.Checkpointer`'s decision.

Server state (FedAvgM's velocity, FedAdam's moments) is a set of fp32 vectors with one
element per model element, addressed by the chunks' element offsets: whole vectors in
RAM for the in-memory server, ``/server_state/<name>`` datasets read and written chunk
by chunk for the out-of-core one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np
import torch

from mpifl.storage.hdf5 import Checkpoint, CheckpointWriter
from mpifl.wire.flat import DTYPES, Chunk, FlatModel, element_offsets
from mpifl.wire.plan import ExchangePlan
from mpifl.wire.transport import touched_empty

PathOf = Callable[[int], Path]  # the checkpoint file of a round
ReceiveWindow = Callable[[list[np.ndarray]], None]  # fills a window's chunk buffers (the initial model)


class GlobalStore(Protocol):
    """Everything the server and the checkpointer ask of the global model's home."""

    durable: bool  # True when every round's model is published as it is made (nothing to re-save)

    def start(self, resume: Checkpoint | None, init_from: str | None, attrs: dict,
              receive_initial: ReceiveWindow) -> None:
        """Adopt the resumed checkpoint, or set up round 0."""

    def pool_budget(self, configured_bytes: int) -> int:
        """The receive pool's memory budget, from ``transport.pool_mb``."""

    def outgoing(self) -> Iterator[list[np.ndarray]]:
        """The model's chunk buffers, window by window (each valid until the next is requested)."""

    def begin_round(self, round_: int) -> None:
        """A round's reduction is about to write finished chunks."""

    def finish_target(self, chunk: Chunk) -> torch.Tensor:
        """Where chunk's new value goes; holds the old value on entry."""

    def server_state(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """The strategy's state slices for ``chunk``."""

    def commit(self, chunk: Chunk) -> None:
        """Chunk's new value (and state) is final."""

    def abandon_round(self) -> None:
        """The round is not applied: drop anything half-written."""

    def end_round(self, round_: int, attrs: dict, history: list[dict], save: bool) -> Path | None:
        """Publish the round's model as a checkpoint when asked to (durable stores always do)."""


def open_store(plan: ExchangePlan, flat: FlatModel | None, path_of: PathOf, window_bytes: int,
               state_init: dict[str, float], read_previous: bool) -> GlobalStore:
    """The in-memory store around ``flat``, or the out-of-core one when there is no model in memory."""
    if flat is not None:
        return InMemoryStore(flat, plan, path_of, state_init)
    return OnDiskStore(plan, path_of, window_bytes, state_init, read_previous)


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


class InMemoryStore:
    """The global model is a FlatModel; finished chunks overwrite it in place."""

    durable = False

    def __init__(self, flat: FlatModel, plan: ExchangePlan, path_of: PathOf, state_init: dict[str, float]):
        self.flat, self.plan, self.path_of = flat, plan, path_of
        self.elements = element_offsets(plan.chunks)
        self.state_init = dict(state_init)
        self.vectors = {name: torch.full((self.elements[-1],), value, dtype=torch.float32)
                        for name, value in self.state_init.items()}

    def start(self, resume: Checkpoint | None, init_from: str | None, attrs: dict,
              receive_initial: ReceiveWindow) -> None:
        """Resume from a checkpoint; otherwise the built model (seeded or ``init_from``) is round 0."""
        if resume is not None:
            self.load(resume)

    def pool_budget(self, configured_bytes: int) -> int:
        """At most a quarter of the model: the in-memory server's bound is ~1.25 x model."""
        return min(configured_bytes, self.plan.spec.total_bytes // 4)

    def outgoing(self) -> Iterator[list[np.ndarray]]:
        """The whole model is already in memory: one window."""
        yield self.plan.chunk_slices(self.flat.bytes)

    def begin_round(self, round_: int) -> None:
        """Nothing to prepare: chunks are finished in place."""

    def finish_target(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's view in the flat buffer."""
        return self.flat.chunk_view(chunk)

    def server_state(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """Slices of the in-memory state vectors."""
        start = self.elements[chunk.index]
        return {name: v[start:start + chunk.numel] for name, v in self.vectors.items()}

    def commit(self, chunk: Chunk) -> None:
        """Already in place."""

    def abandon_round(self) -> None:
        """Nothing was written outside memory."""

    def end_round(self, round_: int, attrs: dict, history: list[dict], save: bool) -> Path | None:
        """Publish a checkpoint when asked to."""
        if not save:
            return None
        sizes = {name: (self.elements[-1], value) for name, value in self.state_init.items()}
        with CheckpointWriter(self.path_of(round_), self.plan.spec, attrs, sizes, self.plan.chunk_bytes) as writer:
            writer.write_tensors(self.flat.tensors(), self.flat.bytes)
            for name, vector in self.vectors.items():
                writer.write_state(name, 0, vector.numpy())
            writer.write_metrics(history)
            return writer.publish()

    def load(self, ckpt: Checkpoint) -> None:
        """Read a checkpoint straight into the flat buffer (and the server state), then close it."""
        with ckpt:
            ckpt.read_into(self.flat.tensors())
            for name, vector in self.vectors.items():
                ckpt.read_state(name, 0, vector.numpy(), self.state_init[name])


class OnDiskStore:
    """Out-of-core: the global model is the newest checkpoint; every round publishes the next one.

    Memory: one read window for streaming the model out and one chunk of staging for
    writing finished chunks, whatever the model's size.
    """

    durable = True

    def __init__(self, plan: ExchangePlan, path_of: PathOf, window_bytes: int, state_init: dict[str, float],
                 read_previous: bool):
        self.plan, self.spec, self.path_of = plan, plan.spec, path_of
        self.windows = chunk_windows(plan.chunks, window_bytes)
        self.window = touched_empty(max(_span(w) for w in self.windows))
        self.staging = touched_empty(max(c.nbytes for c in plan.chunks))
        self.read_previous = read_previous
        self.elements = element_offsets(plan.chunks)
        self.state_init = dict(state_init)
        most = max(c.numel for c in plan.chunks)
        self.state_staging = {name: torch.from_numpy(touched_empty(4 * most)).view(torch.float32)
                              for name in self.state_init}
        self.current: Checkpoint | None = None
        self.writer: CheckpointWriter | None = None

    def start(self, resume: Checkpoint | None, init_from: str | None, attrs: dict,
              receive_initial: ReceiveWindow) -> None:
        """Adopt the resumed or ``init_from`` checkpoint, else publish round 0 as it streams in."""
        if resume is not None:
            self.load(resume)
        elif init_from:
            initial = Checkpoint(init_from)
            initial.check_spec(self.spec)
            self.load(initial)
        else:
            self.write_initial(attrs, receive_initial)

    def pool_budget(self, configured_bytes: int) -> int:
        """The configured budget: the model is not in memory."""
        return configured_bytes

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
        """Open the next checkpoint's temporary file: finished chunks go straight into it."""
        self.writer = CheckpointWriter(self.path_of(round_), self.spec, {}, self._state_sizes(), self.plan.chunk_bytes)

    def finish_target(self, chunk: Chunk) -> torch.Tensor:
        """A staging chunk, holding the old value when the strategy reads it."""
        if self.read_previous:
            self.current.read_range(self.spec, chunk.offset, self.staging[:chunk.nbytes])
        return torch.from_numpy(self.staging[:chunk.nbytes]).view(DTYPES[chunk.dtype])

    def server_state(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """The chunk's state slices, read into staging."""
        start, out = self.elements[chunk.index], {}
        for name, staging in self.state_staging.items():
            out[name] = staging[:chunk.numel]
            self.current.read_state(name, start, out[name].numpy(), self.state_init[name])
        return out

    def commit(self, chunk: Chunk) -> None:
        """Write the staged chunk and its state into the next checkpoint."""
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
        return path

    def write_initial(self, attrs: dict, receive_window: ReceiveWindow) -> Path:
        """Publish round 0 from chunks streamed in by ``receive_window(buffers)``."""
        with CheckpointWriter(self.path_of(0), self.spec, attrs, self._state_sizes(), self.plan.chunk_bytes) as writer:
            for window in self.windows:
                base, views = self._views(window)
                receive_window(views)
                writer.write_range(base, self.window[:_span(window)])
            writer.write_metrics([])
            path = writer.publish()
        self.load(Checkpoint(path))
        return path
