"""Flat buffers: every exchanged tensor is a view into one byte buffer, described by a spec."""
import pytest
import torch
from torch import nn

from mpifl.wire.flat import FlatModel


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)).to(dtype)


def test_parameters_and_float_buffers_are_views_into_the_flat_buffer():
    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    flat = FlatModel(m)
    base = flat.buffer.untyped_storage().data_ptr()
    for name, t in m.state_dict().items():
        assert torch.equal(t, before[name]), name
        if t.is_floating_point():
            assert t.untyped_storage().data_ptr() == base, f"{name} is not a view of the flat buffer"
    for p in m.parameters():
        assert p.untyped_storage().data_ptr() == base


def test_integer_buffers_stay_local_and_reset_to_their_initial_value():
    m = model()
    flat = FlatModel(m)
    assert "1.num_batches_tracked" not in [e.name for e in flat.spec.entries]
    m.train()
    m(torch.randn(4, 5))
    assert int(m[1].num_batches_tracked) == 1
    flat.reset_local_state()
    assert int(m[1].num_batches_tracked) == 0


def test_writing_the_buffer_changes_the_model():
    m = model()
    flat = FlatModel(m)
    flat.buffer.zero_()
    assert all(float(p.detach().abs().sum()) == 0 for p in m.parameters())


def test_training_steps_write_into_the_buffer():
    m = model()
    flat = FlatModel(m)
    snapshot = flat.buffer.clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(8, 5)).sum().backward()
    opt.step()
    assert not torch.equal(snapshot, flat.buffer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_each_dtype_is_a_64_byte_aligned_segment(dtype):
    m = model(dtype)
    flat = FlatModel(m)
    assert [s.dtype for s in flat.spec.segments] == [str(dtype).replace("torch.", "")]
    assert all(s.offset % 64 == 0 for s in flat.spec.segments)


def test_mixed_dtypes_get_one_segment_each():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).to(torch.bfloat16))
    flat = FlatModel(m)
    assert [s.dtype for s in flat.spec.segments] == ["float32", "bfloat16"]
    assert flat.spec.segments[1].offset % 64 == 0


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 40, 10**6])
def test_chunks_tile_each_segment_exactly_with_whole_elements(chunk_bytes):
    m = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 3).to(torch.bfloat16))
    spec = FlatModel(m).spec
    chunks = spec.chunks(chunk_bytes)
    for seg in spec.segments:
        mine = [c for c in chunks if c.dtype == seg.dtype]
        assert mine[0].offset == seg.offset
        assert sum(c.nbytes for c in mine) == seg.nbytes
        assert all(c.nbytes % c.itemsize == 0 and c.nbytes <= max(chunk_bytes, c.itemsize) for c in mine)
        assert all(a.offset + a.nbytes == b.offset for a, b in zip(mine, mine[1:]))
    assert [c.index for c in chunks] == list(range(len(chunks)))


def test_spec_hash_and_first_difference_name_the_tensor():
    a = FlatModel(nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))).spec
    b = FlatModel(nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 4))).spec
    assert a.hash == FlatModel(nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))).spec.hash
    assert a.hash != b.hash
    assert "'1.weight'" in a.first_difference(b)
    c = FlatModel(nn.Sequential(nn.Linear(5, 3))).spec
    assert "'1.weight' exists only here" in a.first_difference(c)


def test_tied_weights_travel_once_and_stay_tied():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    m = nn.ModuleDict({"emb": emb, "head": head})
    flat = FlatModel(m)
    assert [e.name for e in flat.spec.entries] == ["emb.weight"]
    flat.buffer.zero_()
    assert float(m["head"].weight.detach().abs().sum()) == 0


def test_a_meta_device_model_is_allocated_once_inside_the_flat_buffer():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    flat = FlatModel(m)
    base = flat.buffer.untyped_storage().data_ptr()
    assert all(not p.is_meta and p.untyped_storage().data_ptr() == base for p in m.parameters())
    assert int(m[1].num_batches_tracked) == 0 and not m[1].running_mean.is_meta
    reference = model()
    for (_, mine), (_, theirs) in zip(flat.tensors(), FlatModel(reference).tensors()):
        mine.copy_(theirs)
    x = torch.randn(4, 5)
    m.eval(), reference.eval()
    assert torch.equal(m(x), reference(x))


def test_the_bytes_no_tensor_covers_are_zero_whatever_the_memory_held_before(monkeypatch):
    """The buffer is allocated without zeroing (a 70B model's pages arrive as they are written), and the alignment
    between dtype segments is written by no tensor. It is zeroed, so a whole-buffer norm, copy or comparison never
    reads what the memory held before (once, a NaN left there made a drift norm NaN)."""
    import numpy as np

    from mpifl.wire import flat as flat_module
    from mpifl.wire.spec import padding_ranges

    monkeypatch.setattr(flat_module, "host_bytes", lambda n, touch=True: np.full(n, 0xFF, dtype=np.uint8))
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2).to(torch.bfloat16))
    flat = FlatModel(model)
    gaps = padding_ranges(flat.spec)
    assert gaps and sum(end - start for start, end in gaps) > 0
    for start, end in gaps:
        assert not flat.buffer[start:end].any(), (start, end)
    covered = torch.ones(flat.spec.total_bytes, dtype=torch.bool)
    for start, end in gaps:
        covered[start:end] = False
    assert sum(e.nbytes for e in flat.spec.entries) == int(covered.sum())  # the gaps are exactly what no tensor holds
