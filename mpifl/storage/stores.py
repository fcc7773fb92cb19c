"""Where the server's global model lives: in RAM (a FlatModel) or on disk (out-of-core HDF5).

Both stores give the round loop the same things (``GlobalStore``): the model's chunks
to stream out (window by window), a place to finish each chunk of the new model (holding
the old chunk on entry), the strategy's server-state slices for that chunk, and a way to
publish the result as a checkpoint. They produce bitwise-identical models. When and where
to publish is the ``mpifl.storage.checkpointer.Checkpointer``'s decision.

Server state (FedAvgM's velocity, FedAdam's moments) is a set of fp32 vectors with one
element per model element, addressed by the chunks' element offsets: whole vectors in
RAM for the in-memory server, ``/server_state/<name>`` datasets read and written chunk
by chunk for the out-of-core one.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from mpifl.planning.out_of_core import LIVE_WINDOWS, STATE_ITEMSIZE, WRITE_SLOTS, streaming_windows, window_span
from mpifl.storage.hdf5 import Checkpoint, CheckpointWriter
from mpifl.storage.ranges import MappedRange
from mpifl.wire.flat import DTYPES, FlatModel
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import host_bytes, share_malloc_arenas
from mpifl.wire.spec import Chunk

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
        """The model's chunk buffers, window by window; each stays valid until the window after the next one
        is requested (its sends may overlap the next window's), the last two until ``begin_round``."""

    def begin_round(self, round_: int, recycle: Path | None = None) -> None:
        """A round's reduction is about to write finished chunks (``recycle``: a checkpoint file about to be
        pruned, which a store that writes every round may overwrite instead of writing a new file)."""

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


def open_store(plan: ExchangeLayout, flat: FlatModel | None, path_of: PathOf, window_bytes: int,
               state_init: dict[str, float], read_previous: bool, map_windows: bool = True) -> GlobalStore:
    """The in-memory store around ``flat``, or the out-of-core one when there is no model in memory."""
    if flat is not None:
        return InMemoryStore(flat, plan, path_of, state_init)
    return OnDiskStore(plan, path_of, window_bytes, state_init, read_previous, map_windows)


class InMemoryStore:
    """The global model is a FlatModel; finished chunks overwrite it in place."""

    durable = False

    def __init__(self, flat: FlatModel, plan: ExchangeLayout, path_of: PathOf, state_init: dict[str, float]):
        self.flat, self.plan, self.path_of = flat, plan, path_of
        self.elements = plan.first_elements
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
        assert self.flat.bytes is not None  # the server's model is built on the host (numpy-backed)
        yield self.plan.chunk_slices(self.flat.bytes)

    def begin_round(self, round_: int, recycle: Path | None = None) -> None:
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


@dataclass
class Staging:
    """One finished chunk on its way to disk: its bytes and its server-state slices."""

    model: np.ndarray
    state: dict[str, torch.Tensor]


class WriteBehind:
    """Finished chunks written by one background thread while the reduction goes on.

    ``WRITE_SLOTS`` staging buffers bound the memory: finishing a chunk when all are queued
    waits for the oldest write. A write's error is raised in the round loop's thread, at the
    next finish or at the end of the round.
    """

    def __init__(self, slots: list[Staging]):
        self.free: deque[Staging] = deque(slots)
        self.queued: deque[tuple[Future, Staging]] = deque()
        self.filling: dict[int, Staging] = {}  # chunk index -> its staging, until committed
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="mpifl-writer")

    def staging(self, chunk: Chunk) -> Staging:
        """The chunk's staging buffers (taken from the free ones on first use)."""
        if chunk.index not in self.filling:
            if not self.free:
                self._retire_oldest()
            self.filling[chunk.index] = self.free.popleft()
        return self.filling[chunk.index]

    def submit(self, chunk: Chunk, write: Callable[[Staging], None]) -> None:
        """Queue the chunk's write; its staging is free again once written."""
        staging = self.filling.pop(chunk.index)
        self.queued.append((self.thread.submit(write, staging), staging))

    def drain(self) -> None:
        """Wait for every queued write (raising the first error)."""
        while self.queued:
            self._retire_oldest()

    def discard(self) -> None:
        """Wait for every queued write, ignoring errors: the file they went to is being dropped."""
        while self.queued:
            future, staging = self.queued.popleft()
            future.exception()
            self.free.append(staging)
        self.free.extend(self.filling.values())
        self.filling.clear()

    def _retire_oldest(self) -> None:
        future, staging = self.queued.popleft()
        self.free.append(staging)
        future.result()


class OnDiskStore:
    """Out-of-core: the global model is the newest checkpoint; every round publishes the next one.

    Memory: ``LIVE_WINDOWS`` read windows (``server.window_mb`` in all: mapped file pages, or buffers for
    windows that are not one stretch of the file) for streaming the model out, and
    ``WRITE_SLOTS`` chunks of staging for writing finished chunks, whatever the model's size.
    I/O overlaps the exchange: a reader thread fills the next window while the last two are
    sent, and a writer thread writes finished chunks while the next ones are received and
    folded (both with pread/pwrite, which release the GIL: storage.ranges.RawRanges).
    """

    durable = True

    def __init__(self, plan: ExchangeLayout, path_of: PathOf, window_bytes: int, state_init: dict[str, float],
                 read_previous: bool, map_windows: bool = True):
        self.plan, self.spec, self.path_of = plan, plan.spec, path_of
        self.windows = streaming_windows(plan.chunks, window_bytes)
        self.widest = max((window_span(w) for w in self.windows), default=0)  # a read buffer's size
        self.buffers: list[np.ndarray | None] = [None] * LIVE_WINDOWS  # made on first use: mapped windows need none
        self.sent: deque[MappedRange | None] = deque()  # mappings of the windows the caller may still be sending
        share_malloc_arenas()  # before the reader and writer threads: address-space limits (PBS vmem)
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="mpifl-reader")
        self.read_previous = read_previous
        self.map_windows = map_windows  # send windows straight from the page cache where the file allows it
        self.elements = plan.first_elements
        self.state_init = dict(state_init)
        most = max(c.numel for c in plan.chunks)
        biggest = max(c.nbytes for c in plan.chunks)
        state_slice = STATE_ITEMSIZE * most  # one chunk's slice of an fp32 server-state vector
        self.writes = WriteBehind([Staging(host_bytes(biggest),
                                           {name: torch.from_numpy(host_bytes(state_slice)).view(torch.float32)
                                            for name in self.state_init}) for _ in range(WRITE_SLOTS)])
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

    def _buffer(self, i: int) -> np.ndarray:
        """Window buffer ``i`` (0 or 1), allocated and touched on first use."""
        buffer = self.buffers[i]
        if buffer is None:
            buffer = self.buffers[i] = host_bytes(self.widest)
        return buffer

    def _views(self, window: list[Chunk], buffer: np.ndarray) -> tuple[int, list[np.ndarray]]:
        """The window's base offset and each chunk's slice of the window buffer."""
        base = window[0].offset
        return base, [buffer[c.offset - base:c.offset - base + c.nbytes] for c in window]

    def load(self, ckpt: Checkpoint) -> None:
        """Adopt a published checkpoint as the current global model."""
        if self.current is not None:
            self.current.close()
        self.current = ckpt

    def _current(self) -> Checkpoint:
        """The checkpoint holding the global model: ``start`` adopts or publishes one before any round."""
        assert self.current is not None, "the on-disk store was not started"
        return self.current

    def outgoing(self) -> Iterator[list[np.ndarray]]:
        """The model window by window, the next one made ready while the caller sends the last two; each
        window is valid until the caller asks for the window after the next one, the last two until
        ``begin_round``. A window that is one stretch of the checkpoint file is mapped (MPI reads the page
        cache: no copy), any other is read into a window buffer."""
        def ready(i: int) -> MappedRange | None:  # its buffer was window i-3's, sent before window i-1 was asked for
            window = self.windows[i]
            current = self._current()
            mapped = current.map_range(self.spec, window[0].offset, window_span(window)) if self.map_windows else None
            if mapped is None:
                current.read_range(self.spec, window[0].offset, self._buffer(i % LIVE_WINDOWS)[:window_span(window)])
            else:  # the mapping holds this window: its slot's read buffer goes, or the slot would hold both
                self.buffers[i % LIVE_WINDOWS] = None
            return mapped

        self._unmap_sent()
        ahead = self.reader.submit(ready, 0)
        try:
            for i, window in enumerate(self.windows):
                mapped = ahead.result()
                if len(self.sent) == LIVE_WINDOWS - 1:  # window i-2: the caller asked for window i, so it is sent
                    old = self.sent.popleft()
                    if old is not None:
                        old.unmap()
                self.sent.append(mapped)
                if i + 1 < len(self.windows):
                    ahead = self.reader.submit(ready, i + 1)
                if mapped is None:
                    buffer = self._buffer(i % LIVE_WINDOWS)
                else:
                    assert mapped.view is not None  # unmapped only once window i + 2 is asked for
                    buffer = mapped.view
                yield self._views(window, buffer)[1]
        finally:  # a send that failed leaves no read behind it; its mappings stay (MPI may still read them)
            ahead.exception()

    def _unmap_sent(self) -> None:
        """The dispatch is over: drop the mappings of the windows it sent."""
        while self.sent:
            mapped = self.sent.popleft()
            if mapped is not None:
                mapped.unmap()

    def _state_sizes(self) -> dict[str, tuple[int, float]]:
        return {name: (self.elements[-1], value) for name, value in self.state_init.items()}

    def begin_round(self, round_: int, recycle: Path | None = None) -> None:
        """Open the next checkpoint's temporary file (``recycle`` overwritten in place when it has the same
        layout): finished chunks go into it as they are made."""
        self._unmap_sent()
        self.writer = CheckpointWriter(self.path_of(round_), self.spec, {}, self._state_sizes(), self.plan.chunk_bytes,
                                       recycle=recycle)

    def finish_target(self, chunk: Chunk) -> torch.Tensor:
        """A staging chunk, holding the old value when the strategy reads it."""
        staging = self.writes.staging(chunk).model[:chunk.nbytes]
        if self.read_previous:
            self._current().read_range(self.spec, chunk.offset, staging)
        return torch.from_numpy(staging).view(DTYPES[chunk.dtype])

    def server_state(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """The chunk's state slices, read into staging."""
        start, out = self.elements[chunk.index], {}
        for name, staging in self.writes.staging(chunk).state.items():
            out[name] = staging[:chunk.numel]
            self._current().read_state(name, start, out[name].numpy(), self.state_init[name])
        return out

    def commit(self, chunk: Chunk) -> None:
        """Queue the staged chunk and its state for writing into the next checkpoint."""
        writer, start = self.writer, self.elements[chunk.index]

        def write(staging: Staging) -> None:
            assert writer is not None  # begin_round opened it before any chunk is committed
            writer.write_range(chunk.offset, staging.model[:chunk.nbytes])
            for name, state in staging.state.items():
                writer.write_state(name, start, state[:chunk.numel].numpy())

        self.writes.submit(chunk, write)

    def abandon_round(self) -> None:
        """Drop the half-written next checkpoint; the current one stays the global model."""
        self.writes.discard()
        if self.writer is not None:
            self.writer.abandon()
            self.writer = None

    def end_round(self, round_: int, attrs: dict, history: list[dict], save: bool) -> Path:
        """Every round's result is published atomically, like a checkpoint."""
        try:
            self.writes.drain()
        except BaseException:
            self.abandon_round()
            raise
        writer, self.writer = self.writer, None
        assert writer is not None  # begin_round opened it
        with writer:
            writer.file.attrs.update({k: v for k, v in attrs.items() if v is not None})
            writer.write_metrics(history)
            path = writer.publish(sync=save)
        self.load(Checkpoint(path))
        return path

    def write_initial(self, attrs: dict, receive_window: ReceiveWindow) -> Path:
        """Publish round 0 from chunks streamed in by ``receive_window(buffers)``."""
        with CheckpointWriter(self.path_of(0), self.spec, attrs, self._state_sizes(), self.plan.chunk_bytes) as writer:
            for window in self.windows:
                base, views = self._views(window, self._buffer(0))
                receive_window(views)
                writer.write_range(base, self._buffer(0)[:window_span(window)])
            writer.write_metrics([])
            path = writer.publish()
        self.buffers[0] = None  # rounds send mapped windows where the file allows: a read buffer is made on demand
        self.load(Checkpoint(path))
        return path
