"""The out-of-core store streams the model out window by window, keeping each window readable until the
caller asks for the window after the next one, so the sends of one window can overlap the next's."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from test_checkpoint import save
from torch import nn

from mpifl.planning.out_of_core import LIVE_WINDOWS, staging_bytes, window_bytes_held
from mpifl.storage.stores import OnDiskStore
from mpifl.wire.flat import FlatModel
from mpifl.wire.layout import ExchangeLayout

CHUNK = 256 << 10


class Mixed(nn.Module):
    """Two 1 MiB tensors back to back in the file (windows over them are mapped), a small one and a 0-d
    buffer (windows over them may be read)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(1 << 18))
        self.b = nn.Parameter(torch.randn(1 << 18))
        self.c = nn.Parameter(torch.randn(1000))
        self.register_buffer("scale", torch.tensor(2.5))


def open_disk_store(tmp_path, flat, mapped, window_chunks=2):
    plan = ExchangeLayout(flat.spec, flat.spec.chunks(CHUNK), flat.spec.chunks(CHUNK), 2, CHUNK)
    store = OnDiskStore(plan, lambda r: tmp_path / f"round-{r}.h5", LIVE_WINDOWS * window_chunks * CHUNK, {},
                        read_previous=False, map_windows=mapped)
    store.start(None, str(save(tmp_path / "initial.h5", flat, round_=0)), {}, lambda views: None)
    return store


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_each_window_stays_valid_until_the_window_after_next_is_requested(tmp_path, mapped):
    torch.manual_seed(5)
    flat = FlatModel(Mixed())
    store = open_disk_store(tmp_path, flat, mapped)
    def model_bytes(chunk):
        return flat.bytes[chunk.offset:chunk.offset + chunk.nbytes]

    live, sent = [], 0
    for views, chunks in zip(store.outgoing(), store.windows):
        live = (live + [(views, chunks)])[-2:]  # what a caller may still be sending
        for held_views, held_chunks in live:
            assert all(np.array_equal(v, model_bytes(c)) for v, c in zip(held_views, held_chunks))
        assert len(store.sent) <= LIVE_WINDOWS - 1
        sent += len(views)
    assert sent == len(store.plan.chunks) and len(store.windows) > LIVE_WINDOWS
    assert any(m is not None for m in store.sent) == mapped  # the last two, until the round begins
    store.begin_round(1)
    assert not store.sent
    store.abandon_round()
    store.current.close()


def test_out_of_core_memory_is_the_configured_window_in_all(tmp_path):
    flat = FlatModel(Mixed())
    store = open_disk_store(tmp_path, flat, mapped=False, window_chunks=2)
    list(store.outgoing())
    buffers = [b for b in store.buffers if b is not None]
    assert len(buffers) == LIVE_WINDOWS and sum(b.nbytes for b in buffers) <= LIVE_WINDOWS * 2 * CHUNK
    store.current.close()


def test_the_live_windows_never_hold_more_than_the_plan_counts_mapped_or_read(tmp_path, monkeypatch):
    """A window that maps drops its slot's read buffer, so mapped pages and read buffers together stay within what
    ``mpifl plan`` counts for the windows (planning.out_of_core.window_bytes_held)."""
    flat = FlatModel(Mixed())
    store = open_disk_store(tmp_path, flat, mapped=True)
    budget = window_bytes_held(store.plan.chunks, LIVE_WINDOWS * 2 * CHUNK)
    unmappable = {store.windows[1][0].offset}  # in the first round, as a window over two datasets' gap would be
    map_range = type(store.current).map_range

    def map_unless_unmappable(self, spec, offset, nbytes):
        return None if offset in unmappable else map_range(self, spec, offset, nbytes)
    monkeypatch.setattr(type(store.current), "map_range", map_unless_unmappable)
    for _ in range(2):  # the second round maps every window, in slots that read one in the first
        for i, _views in enumerate(store.outgoing()):
            assert (store.sent[-1] is None) == (store.windows[i][0].offset in unmappable)
            if store.sent[-1] is not None:  # window i is mapped: its slot holds no read buffer beside it
                assert store.buffers[i % LIVE_WINDOWS] is None
            buffers = sum(b.nbytes for b in store.buffers if b is not None)
            mapped = sum(m.length for m in store.sent if m is not None)
            assert buffers + mapped <= budget + LIVE_WINDOWS * mmap.ALLOCATIONGRANULARITY  # mappings start on a page
        store.begin_round(1)
        store.abandon_round()
        unmappable.clear()
    store.current.close()


def test_the_planned_write_staging_is_what_the_store_allocates(tmp_path):
    flat = FlatModel(Mixed())
    plan = ExchangeLayout(flat.spec, flat.spec.chunks(CHUNK), flat.spec.chunks(CHUNK), 2, CHUNK)
    store = OnDiskStore(plan, lambda r: tmp_path / f"round-{r}.h5", 6 * CHUNK, {"m": 0.0, "v": 0.0},
                        read_previous=False)
    allocated = sum(s.model.nbytes + sum(t.numel() * t.element_size() for t in s.state.values())
                    for s in store.writes.free)
    assert allocated == staging_bytes(plan.chunks, state_vectors=2) > 0


def test_publishing_the_initial_model_leaves_no_read_buffer_behind(tmp_path):
    flat = FlatModel(Mixed())
    plan = ExchangeLayout(flat.spec, flat.spec.chunks(CHUNK), flat.spec.chunks(CHUNK), 2, CHUNK)
    store = OnDiskStore(plan, lambda r: tmp_path / f"round-{r}.h5", 6 * CHUNK, {}, read_previous=False)

    def receive(views):
        for view in views:
            view[:] = 7
    store.start(None, None, {"round": 0, "config": "rounds: 1\n"}, receive)
    assert store.buffers == [None] * LIVE_WINDOWS
    store.current.close()
