"""What the out-of-core server (``server.state: disk``) holds besides its receive pool, whatever the model's size:
the windows it streams the model out through, and the staging of finished chunks on their way to disk.

The store (mpifl.storage.stores.OnDiskStore) allocates exactly these and ``mpifl plan`` counts them, both from the
definitions here, so the plan cannot drift from what the server does.
"""
from __future__ import annotations

from collections.abc import Sequence

from mpifl.wire.spec import Chunk

LIVE_WINDOWS = 3  # out-of-core windows at once: one being read ahead, two being sent
WRITE_SLOTS = 4  # finished chunks the out-of-core server may have queued for writing
STATE_ITEMSIZE = 4  # server-state vectors (momentum, moments) are fp32


def chunk_windows(chunks: Sequence[Chunk], window_bytes: int) -> list[list[Chunk]]:
    """Consecutive chunks grouped into windows spanning at most ``window_bytes`` (at least one chunk each)."""
    windows: list[list[Chunk]] = [[]]
    for c in chunks:
        if windows[-1] and c.offset + c.nbytes - windows[-1][0].offset > window_bytes:
            windows.append([])
        windows[-1].append(c)
    return windows if windows[0] else []


def window_span(window: Sequence[Chunk]) -> int:
    """Bytes from the window's first chunk to the end of its last."""
    return window[-1].offset + window[-1].nbytes - window[0].offset


def streaming_windows(chunks: Sequence[Chunk], window_bytes: int) -> list[list[Chunk]]:
    """The windows the server streams the model out through: ``server.window_mb`` shared by the live ones."""
    return chunk_windows(chunks, window_bytes // LIVE_WINDOWS)


def window_bytes_held(chunks: Sequence[Chunk], window_bytes: int) -> int:
    """The most the live windows hold at once, as mapped file pages or read buffers: each is the widest window's
    span (a chunk wider than a window's share makes a window of its own)."""
    windows = streaming_windows(chunks, window_bytes)
    return LIVE_WINDOWS * max((window_span(w) for w in windows), default=0)


def staging_bytes(chunks: Sequence[Chunk], state_vectors: int) -> int:
    """The write-behind staging: ``WRITE_SLOTS`` finished chunks, each with its slices of the fp32 server-state
    vectors."""
    if not chunks:
        return 0
    return WRITE_SLOTS * (max(c.nbytes for c in chunks) + STATE_ITEMSIZE * state_vectors * max(c.numel for c in chunks))


def out_of_core_bytes(chunks: Sequence[Chunk], window_bytes: int, state_vectors: int) -> int:
    """Everything the out-of-core store holds: its live windows and its staging."""
    return window_bytes_held(chunks, window_bytes) + staging_bytes(chunks, state_vectors)
