"""Checkpoints: plain-h5py-readable, atomically published, and loud about bad files."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import mpifl_here
from torch import nn

from mpifl.config import resume_conflict
from mpifl.errors import CheckpointError
from mpifl.storage.checkpointer import (
    checkpoint_name,
    kept_per_client,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    retired_by_next,
)
from mpifl.storage.hdf5 import Checkpoint, CheckpointWriter, load_tensors
from mpifl.wire.flat import FlatModel


class Odd(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = nn.Parameter(torch.randn(5, 7, 3, dtype=dtype))
        self.b = nn.Parameter(torch.randn(11, dtype=dtype))
        self.register_buffer("scale", torch.tensor(2.5, dtype=dtype))  # 0-d tensor


def save(path, flat, round_=1, history=()):
    with CheckpointWriter(path, flat.spec, {"round": round_, "config": "rounds: 3\n"}) as writer:
        writer.write_tensors(flat.tensors())
        writer.write_metrics(list(history))
        return writer.publish()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensors_round_trip_by_name_with_their_dtype(tmp_path, dtype):
    torch.manual_seed(0)
    flat = FlatModel(Odd(dtype))
    path = save(tmp_path / "c.h5", flat, history=[{"round": 1, "loss": 0.5}])
    back = load_tensors(path)
    for name, t in flat.tensors():
        assert back[name].dtype == dtype and torch.equal(back[name].view(-1), t.reshape(-1)), name
    with h5py.File(path) as f:  # plain h5py sees one dataset per tensor with its dtype recorded
        assert f["model/a"].shape == (5, 7, 3) and f["model/a"].attrs["dtype"] == str(dtype)[6:]
        assert f.attrs["format"] == "mpifl-checkpoint" and f.attrs["round"] == 1
    with Checkpoint(path) as ckpt:
        assert ckpt.metrics() == [{"round": 1, "loss": 0.5}]


@pytest.mark.parametrize("step", [1, 6, 13, 64, 10**6])
def test_flat_byte_ranges_write_and_read_back_exactly(tmp_path, step):
    torch.manual_seed(1)
    flat = FlatModel(Odd(torch.bfloat16))
    with CheckpointWriter(tmp_path / "c.h5", flat.spec, {"round": 1}) as writer:
        for off in range(0, flat.spec.total_bytes, step * 2):  # even steps keep bf16 elements whole
            writer.write_range(off, flat.bytes[off:off + step * 2])
        writer.write_metrics([])
        path = writer.publish()
    out = np.zeros_like(flat.bytes)
    with Checkpoint(path) as ckpt:
        for off in range(0, flat.spec.total_bytes, step * 2):
            ckpt.read_range(flat.spec, off, out[off:off + step * 2])
    for e in flat.spec.entries:
        assert np.array_equal(out[e.offset:e.offset + e.nbytes], flat.bytes[e.offset:e.offset + e.nbytes]), e.name


def test_publish_is_atomic_and_old_checkpoints_are_pruned(tmp_path):
    flat = FlatModel(Odd())
    for r in range(1, 6):
        save(tmp_path / checkpoint_name(r), flat, r)
        prune_checkpoints(tmp_path, keep=3)
    (tmp_path / (checkpoint_name(6) + ".tmp")).write_bytes(b"half a file")
    assert [p.name for p in list_checkpoints(tmp_path)] == [checkpoint_name(r) for r in (3, 4, 5)]
    assert latest_checkpoint(tmp_path).round == 5


def test_the_out_of_core_server_overwrites_only_checkpoints_that_checkpoint_keep_lets_go():
    """The durable (out-of-core) store recycles the file the next publish retires. Before, with fewer files than
    keep - 1 the slice counted from the end and retired the oldest: keep=4 kept 2 checkpoints, keep=10 kept 5."""
    published = [Path(checkpoint_name(r)) for r in range(1, 9)]
    for keep, first_kept in ((4, 6), (10, 1), (2, 8), (1, 8)):  # with the next publish: keep (at least 2) in all
        for n in range(1, 9):
            retired = retired_by_next(published[:n], keep, spared=set())
            assert retired == published[:max(0, n - max(keep - 1, 1))], (keep, n)
        assert published[len(retired):] == published[first_kept - 1:]
    assert retired_by_next(published, 4, spared={checkpoint_name(2)}) == [published[0], *published[2:5]]


def test_truncated_corrupt_and_foreign_files_are_named_and_explained(tmp_path):
    flat = FlatModel(Odd())
    good = save(tmp_path / "good.h5", flat)
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(good.read_bytes()[:700])
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"\x00not hdf5" * 100)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["weights"] = np.zeros(3)
    for path, reason in [(truncated, "truncated or corrupt"), (garbage, "truncated or corrupt"),
                         (foreign, "not an mpifl checkpoint"), (tmp_path / "missing.h5", "no such checkpoint")]:
        with pytest.raises(CheckpointError, match=reason) as err:
            Checkpoint(path)
        assert str(path) in str(err.value)


def test_latest_checkpoint_skips_a_damaged_newest_file(tmp_path):
    flat = FlatModel(Odd())
    save(tmp_path / checkpoint_name(1), flat, 1)
    (tmp_path / checkpoint_name(2)).write_bytes(b"damaged")
    assert latest_checkpoint(tmp_path).round == 1


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path):
    path = save(tmp_path / "c.h5", FlatModel(Odd()))
    other = FlatModel(nn.Linear(3, 3)).spec
    with Checkpoint(path) as ckpt, pytest.raises(CheckpointError, match="tensor 'weight' is missing"):
        ckpt.check_spec(other)
    m = Odd()
    m.b = nn.Parameter(torch.randn(12))
    with Checkpoint(path) as ckpt, pytest.raises(CheckpointError, match=r"tensor 'b' is \[11\] float32 there"):
        ckpt.check_spec(FlatModel(m).spec)


def test_an_unwritable_directory_fails_clearly(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(OSError, match="cannot write checkpoint"):
        CheckpointWriter(not_a_dir / "c.h5", FlatModel(Odd()).spec, {"round": 1})


FULL_DISK = """
import resource, signal, sys, torch
from torch import nn
from mpifl.wire.flat import FlatModel
from mpifl.storage.hdf5 import CheckpointWriter
sys.path.insert(0, sys.argv[2])
from test_checkpoint import save
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG, like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
flat = FlatModel(nn.Linear(1000, 1000))
try:
    save(sys.argv[1], flat, 2)
except OSError as err:
    print("FAILED:", err)
"""


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    small = save(tmp_path / "ckpt.h5", FlatModel(Odd()), 1)
    before = small.read_bytes()
    here = str(__import__("pathlib").Path(__file__).parent)
    result = subprocess.run([sys.executable, "-c", FULL_DISK, str(small), here],
                            capture_output=True, text=True, timeout=120)
    assert "FAILED:" in result.stdout and "ckpt.h5" in result.stdout, result.stdout + result.stderr
    assert small.read_bytes() == before
    assert not (tmp_path / "ckpt.h5.tmp").exists()
    assert Checkpoint(small).round == 1


def test_resume_may_change_rounds_but_not_the_model():
    saved = {"rounds": 5, "model": {"name": "mlp", "dtype": "float32"}, "checkpoint": {"every": 1}}
    assert resume_conflict(saved, {**saved, "rounds": 9, "checkpoint": {"every": 3}}) is None
    changed = {**saved, "model": {"name": "mlp", "dtype": "bfloat16"}}
    assert resume_conflict(saved, changed) == "model.dtype: 'float32' in the checkpoint, 'bfloat16' now"
    dropped = {"train": {"trainer": "mine:T", "kwargs": {"sleep": 0.4}}}  # a plug-in setting left out on resume
    assert resume_conflict(dropped, {"train": {"trainer": "mine:T", "kwargs": {}}}) == (
        "train.kwargs.sleep: 0.4 in the checkpoint, not set now (so the plug-in's own default)")


FEDBUFF_RUN = {"rounds": 5, "clients": {"num_clients": 12}, "strategy": {"update": "delta"},
               "clock": {"mode": "fedbuff", "buffer": 3, "concurrency": 6}}


def finished_fedbuff_run(tmp_path, kept: list[int], in_flight: list[int]) -> Path:
    """A FedBuff run that finished after step 5, keeping the checkpoints of rounds ``kept``; its last records that
    the clients in flight then trained on versions ``in_flight`` (a run raised past step 5 retrains them)."""
    import json

    from mpifl.config import dump_config, load_config
    from mpifl.storage.checkpointer import IN_FLIGHT

    cfg = load_config(None, data=FEDBUFF_RUN)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in range(1, 6)))
    flat = FlatModel(Odd())
    for round_ in kept:
        attrs = {"round": round_, "config": dump_config(cfg), IN_FLIGHT: json.dumps(in_flight if round_ == 5 else [])}
        with CheckpointWriter(run / "checkpoints" / checkpoint_name(round_), flat.spec, attrs) as writer:
            writer.write_tensors(flat.tensors())
            writer.write_metrics([{"round": r} for r in range(1, round_ + 1)])
            writer.publish()
    return run


def test_raising_rounds_past_versions_whose_checkpoints_are_gone_is_refused_before_mpi_naming_them(tmp_path):
    from mpifl.config import ConfigError, load_config
    from mpifl.storage.rundir import find_resume

    run = finished_fedbuff_run(tmp_path, kept=[3, 4, 5], in_flight=[1, 2, 4])
    raised = load_config(None, data={**FEDBUFF_RUN, "rounds": 8})
    with pytest.raises(ConfigError) as refused:
        find_resume(raised, str(run), "latest")
    assert str(refused.value) == (
        f"cannot resume: {run / 'checkpoints' / checkpoint_name(5)}: clients in flight after step 5 trained on "
        f"versions 1, 2, and a resume retrains them from there, but {checkpoint_name(1)}, {checkpoint_name(2)} are not "
        f"in {run / 'checkpoints'}; restore the missing checkpoint files, resume from an older checkpoint that has "
        "its versions (--resume PATH), or go on from this model in a new run (model.init_from=PATH, another --run-dir)")
    for round_ in (1, 2):  # restored: the resume goes ahead
        save(run / "checkpoints" / checkpoint_name(round_), FlatModel(Odd()), round_)
    assert find_resume(raised, str(run), "latest") == run / "checkpoints" / checkpoint_name(5)


def test_status_does_not_advise_a_resume_that_would_be_refused(tmp_path):
    from mpifl.storage.rundir import post_mortem

    run = finished_fedbuff_run(tmp_path, kept=[4, 5], in_flight=[2, 4])
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("rounds: 5", "rounds: 8"))
    complete, lines = post_mortem(run)  # raised to 8, and the job that tried failed as it began
    assert not complete and "continue with --resume" not in lines[-1]
    assert lines[-1].endswith(f"a --resume would be refused: {run / 'checkpoints' / checkpoint_name(5)}: clients in "
                              "flight after step 5 trained on version 2, and a resume retrains them from there, but "
                              f"{checkpoint_name(2)} is not in {run / 'checkpoints'}; restore the missing checkpoint "
                              "files, resume from an older checkpoint that has its versions (--resume PATH), or go on "
                              "from this model in a new run (model.init_from=PATH, another --run-dir)")


def test_status_names_a_newest_checkpoint_a_resume_would_skip(tmp_path):
    from mpifl.storage.rundir import post_mortem

    run = finished_fedbuff_run(tmp_path, kept=[4, 5], in_flight=[4])
    with h5py.File(run / "checkpoints" / checkpoint_name(5), "r+") as f:
        f.attrs["round"] = 6  # edited: its metadata no longer match their checksum
    first = post_mortem(run)[1][0]
    assert first.startswith(f"{run}: 5 of 5 rounds recorded; newest checkpoint {checkpoint_name(5)} (unusable, so "
                            "a resume starts from the one before: ")
    assert first.endswith("fails its checksum: the file was edited after it was written)")


def test_resume_may_change_what_only_sets_speed_or_memory_not_the_numbers():
    saved = {"clients": {"num_clients": 8, "placement": "round_robin"},
             "model": {"name": "cnn", "nhwc_pooling": True, "local_ram_mb": 1024.0},
             "train": {"lr": 0.1, "reuse_freed_memory": True, "step_in_backward": False, "personal_ram_mb": 1024.0},
             "strategy": {"name": "scaffold", "control_ram_mb": 0.0}, "compression": {"residual_ram_mb": 0.0}}
    faster = {"clients": {"num_clients": 8, "placement": "per_round"},
              "model": {"name": "cnn", "nhwc_pooling": False, "local_ram_mb": 0.0},
              "train": {"lr": 0.1, "reuse_freed_memory": False, "step_in_backward": True, "personal_ram_mb": 0.0},
              "strategy": {"name": "scaffold", "control_ram_mb": 1024.0}, "compression": {"residual_ram_mb": 64.0}}
    assert resume_conflict(saved, faster) is None  # client state from disk into RAM, or back: one snapshot format


def test_a_checkpoint_older_than_a_key_resumes_at_the_keys_default_and_not_at_another_value():
    defaults = {"train": {"lr": 0.05, "prox_mu": 0.0}}
    older = {"train": {"lr": 0.1}}  # written before train.prox_mu existed: it ran as prox_mu 0
    assert resume_conflict(older, {"train": {"lr": 0.1, "prox_mu": 0.0}}, defaults) is None
    assert resume_conflict(older, {"train": {"lr": 0.1, "prox_mu": 0.01}}, defaults) == (
        "train.prox_mu: absent from the checkpoint (written before the key existed, so the run went as its default "
        "0.0), 0.01 now")


def test_inspect_and_export_a_checkpoint(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    flat = FlatModel(Odd(torch.bfloat16))
    path = save(tmp_path / "c.h5", flat, 4)
    shown = mpifl_here("inspect", str(path))
    assert shown.returncode == 0 and "round 4" in shown.stdout and "bfloat16" in shown.stdout
    out = tmp_path / "m.safetensors"
    done = mpifl_here("export", str(path), str(out))
    assert done.returncode == 0, done.stderr
    loaded = load_file(out)
    for name, t in flat.tensors():
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], t), name
    bad = mpifl_here("inspect", str(tmp_path / "nope.h5"))
    assert bad.returncode == 2 and "no such checkpoint file" in bad.stderr


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_an_exported_file_has_the_permissions_the_umask_gives_a_new_file(tmp_path, umask, mode):
    """safetensors creates its file 0600, so collaborators on a project file system could not read an export."""
    path = save(tmp_path / "c.h5", FlatModel(Odd(torch.float32)), 1)
    before = os.umask(umask)
    try:
        assert mpifl_here("export", str(path), str(tmp_path / "m.safetensors")).returncode == 0
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "m.safetensors").stat().st_mode) == mode


def test_export_writes_the_models_tensors_only_never_the_server_state_the_checkpoint_holds(tmp_path):
    from safetensors.torch import load_file

    from mpifl.algorithms.scaffold import attach_control_variates

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))
    own = {name: t.detach().clone() for name, t in model.state_dict().items()}
    flat = FlatModel(attach_control_variates(model))  # SCAFFOLD's server c, checkpointed in /model
    assert len(flat.spec.entries) == 2 * len(own)
    elements = sum(t.numel() for _, t in flat.tensors())
    state = {"h": (elements, 0.0)}  # and a server-state vector (FedDyn's h) under /server_state
    with CheckpointWriter(tmp_path / "c.h5", flat.spec, {"round": 1, "config": "rounds: 1\n"}, state) as writer:
        writer.write_tensors(flat.tensors())
        writer.write_state("h", 0, np.ones(elements, np.float32))
        path = writer.publish()
    out = tmp_path / "m.safetensors"
    done = mpifl_here("export", str(path), str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {len(own)} tensors to {out}\n"
    loaded = load_file(out)
    assert sorted(loaded) == sorted(own)
    for name, t in own.items():
        assert torch.equal(loaded[name], t), name


def test_inspect_counts_the_models_tensors_and_states_scaffolds_server_control_apart(tmp_path):
    from mpifl.algorithms.scaffold import attach_control_variates

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))  # 4 tensors, 38 fp32 elements: 152 B
    flat = FlatModel(attach_control_variates(model))  # and SCAFFOLD's c, as many, in /model
    with CheckpointWriter(tmp_path / "c.h5", flat.spec, {"round": 1, "config": "rounds: 1\n"}) as writer:
        writer.write_tensors(flat.tensors())
        path = writer.publish()
    shown = mpifl_here("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "tensors: 4, 0.00 MiB (+4 server control, 0.00 MiB: SCAFFOLD's c, not the model's)" in lines
    listed = lines[lines.index(next(x for x in lines if x.startswith("tensors:"))) + 1:][:9]
    assert sorted(x.split()[0] for x in listed[:4]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert listed[4].startswith("server control (scaffold_control.*")
    assert all(x.split()[0].startswith("scaffold_control.") for x in listed[5:9])


def test_random_bytes_on_disk_inside_a_tensor_fail_verification_naming_it(tmp_path):
    torch.manual_seed(2)
    flat = FlatModel(nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 5)))
    path = save(tmp_path / "c.h5", flat)
    with Checkpoint(path) as ckpt:
        assert ckpt.verify() == 1  # one 16 MiB chunk holds this small model
    with h5py.File(path) as f:
        where = f["model/1.weight"].id.get_offset()
    raw = bytearray(path.read_bytes())
    raw[where + 8:where + 24] = np.random.default_rng(0).bytes(16)  # no HDF5 metadata touched: the file opens
    path.write_bytes(bytes(raw))
    with Checkpoint(path) as ckpt, pytest.raises(CheckpointError, match=r"tensor '1\.weight' is corrupt"):
        ckpt.verify()


def test_export_refuses_a_checkpoint_that_fails_its_checksums_naming_the_tensor_and_writes_nothing(tmp_path):
    torch.manual_seed(2)
    path = save(tmp_path / "c.h5", FlatModel(nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 5))))
    with h5py.File(path) as f:
        where = f["model/1.weight"].id.get_offset()
    raw = bytearray(path.read_bytes())
    raw[where + 8] ^= 0x01  # one flipped bit, as a disk might: h5py reads the file as before
    path.write_bytes(bytes(raw))
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"an earlier export")
    refused = mpifl_here("export", str(path), str(out))
    assert refused.returncode == 2
    assert refused.stderr == (f"mpifl: export: {path}: tensor '1.weight' is corrupt: its bytes at flat offset "
                              f"4920..5520 fail their checksum; nothing written\n")
    assert out.read_bytes() == b"an earlier export" and sorted(p.name for p in tmp_path.iterdir()) == [
        "c.h5", "m.safetensors"]


def test_the_metadata_checksum_is_the_one_the_format_page_describes(tmp_path):
    import json
    import zlib

    path = save(tmp_path / "c.h5", FlatModel(Odd()), 2, history=[{"round": 1, "loss": 0.5}, {"round": 2}])
    with h5py.File(path) as f:  # docs/reference/checkpoints.md, "Integrity"
        attrs = {name: str(value) for name, value in f.attrs.items()}
        described = json.dumps([attrs, str(f["model"].attrs["order"]), list(f["metrics"].asstr()[...])],
                               sort_keys=True)
        assert int(f["integrity"].attrs["metadata_crc32"]) == zlib.crc32(described.encode())


# -- raw byte ranges: the out-of-core server's pread/pwrite path ---------------------------------

class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Parameter(torch.randn(300, 1000))  # 1.2 MB: aligned to 1 MiB in the file
        self.narrow = nn.Parameter(torch.randn(70, 30).to(torch.bfloat16))
        self.register_buffer("scale", torch.tensor(2.5))  # 0-d: read and written through h5py


def test_raw_ranges_read_and_write_any_flat_range_like_h5py(tmp_path):
    torch.manual_seed(0)
    flat = FlatModel(Wide())
    path = tmp_path / "c.h5"
    rng = np.random.default_rng(0)
    with CheckpointWriter(path, flat.spec, {"round": 1}) as writer:
        cuts = sorted(set(rng.integers(0, flat.spec.total_bytes, 12).tolist()) | {0, flat.spec.total_bytes})
        for lo, hi in zip(cuts, cuts[1:]):  # written in pieces that start and end mid-tensor, mid-row
            writer.write_range(lo, flat.bytes[lo:hi])
        writer.write_metrics([])
        writer.publish()
    with Checkpoint(path) as ckpt:
        offset = ckpt.file["model/big"].id.get_offset()
        assert offset % (1 << 20) == 0
        for name, tensor in flat.tensors():  # h5py reads what the raw writes put there
            stored = ckpt.file[f"model/{name}"][()]
            raw = np.atleast_1d(stored).view(np.uint8).ravel()
            assert np.array_equal(raw, tensor.reshape(-1).view(torch.uint8).numpy())
        stored = np.zeros(flat.spec.total_bytes, dtype=bool)  # the padding between dtype segments is not stored
        for e in flat.spec.entries:
            stored[e.offset:e.offset + e.nbytes] = True
        for _ in range(20):  # and the raw reads agree with the flat buffer for any range
            lo = int(rng.integers(0, flat.spec.total_bytes))
            hi = int(rng.integers(lo, flat.spec.total_bytes + 1))
            out = np.zeros(hi - lo, dtype=np.uint8)
            ckpt.read_range(flat.spec, lo, out)
            assert np.array_equal(out[stored[lo:hi]], flat.bytes[lo:hi][stored[lo:hi]])
        assert ckpt.verify() > 0


def test_raw_ranges_fall_back_to_h5py_for_chunked_or_compressed_datasets(tmp_path):
    torch.manual_seed(1)
    flat = FlatModel(Wide())
    path = tmp_path / "other-tool.h5"
    save(path, flat)
    with h5py.File(path, "r+") as f:  # rewrite one tensor as another tool might: chunked and compressed
        data = f["model/big"][()]
        attrs = dict(f["model/big"].attrs)
        del f["model/big"]
        ds = f["model"].create_dataset("big", data=data, chunks=(10, 100), compression="gzip")
        ds.attrs.update(attrs)
    with Checkpoint(path) as ckpt:
        out = np.zeros(flat.spec.total_bytes, dtype=np.uint8)
        ckpt.read_range(flat.spec, 0, out)
        for e in flat.spec.entries:  # the tensors' bytes (the padding between dtype segments is not stored)
            assert np.array_equal(out[e.offset:e.offset + e.nbytes], flat.bytes[e.offset:e.offset + e.nbytes]), e.name


def write_flat(path, flat, round_, recycle=None):
    with CheckpointWriter(path, flat.spec, {"round": round_}, recycle=recycle) as writer:
        writer.write_range(0, flat.bytes)
        writer.write_metrics([{"round": r} for r in range(1, round_ + 1)])
        return writer.publish(), writer.recycled


def test_a_recycled_checkpoint_file_is_overwritten_in_place_and_reads_like_a_new_one(tmp_path):
    torch.manual_seed(2)
    first, second = FlatModel(Wide()), FlatModel(Wide())
    old, recycled = write_flat(tmp_path / checkpoint_name(1), first, 1)
    inode = old.stat().st_ino
    new, recycled = write_flat(tmp_path / checkpoint_name(3), second, 3, recycle=old)
    assert recycled and not old.exists() and new.stat().st_ino == inode  # the same file, renamed
    with Checkpoint(new) as ckpt:
        assert ckpt.round == 3 and len(ckpt.metrics()) == 3 and ckpt.verify() > 0
        for name, tensor in ckpt.tensors().items():
            assert torch.equal(tensor, dict(second.tensors())[name])


def test_a_checkpoint_of_another_model_is_not_recycled(tmp_path):
    old, _ = write_flat(tmp_path / checkpoint_name(1), FlatModel(Odd()), 1)
    new, recycled = write_flat(tmp_path / checkpoint_name(2), FlatModel(Wide()), 2, recycle=old)
    assert not recycled and not old.exists()  # it was to be pruned anyway; a new file is written
    assert load_tensors(new)["big"].shape == (300, 1000)


class Adjacent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(1 << 18))  # 1 MiB each: a and b lie back to back in the file
        self.b = nn.Parameter(torch.randn(1 << 18))
        self.c = nn.Parameter(torch.randn(1000))
        self.d = nn.Parameter(torch.randn(1000))
        self.register_buffer("scale", torch.tensor(2.5))  # 0-d: not a plain byte range


def test_a_range_that_is_one_stretch_of_the_file_is_mapped_and_any_other_is_read(tmp_path):
    torch.manual_seed(2)
    flat = FlatModel(Adjacent())
    path = save(tmp_path / "c.h5", flat)
    with h5py.File(path, "r+") as f:  # d rewritten as another tool might: chunked, so no plain byte range
        data, attrs = f["model/d"][()], dict(f["model/d"].attrs)
        del f["model/d"]
        f["model"].create_dataset("d", data=data, chunks=(100,)).attrs.update(attrs)
    at = {e.name: e.offset for e in flat.spec.entries}
    with Checkpoint(path) as ckpt:
        for lo, hi in [(at["a"] + 12, at["b"] + 4096 + 7), (at["b"] + 5, at["b"] + 6), (at["c"], at["c"] + 4000)]:
            mapped = ckpt.map_range(flat.spec, lo, hi - lo)
            assert mapped is not None and np.array_equal(mapped.view, flat.bytes[lo:hi])
            mapped.unmap()
            mapped.unmap()  # idempotent
            assert mapped.view is None
        assert ckpt.map_range(flat.spec, at["c"], at["d"] + 8 - at["c"]) is None
        assert ckpt.map_range(flat.spec, at["d"], 8) is None


def test_a_range_over_the_padding_between_dtype_segments_is_never_mapped(tmp_path):
    torch.manual_seed(3)
    flat = FlatModel(Wide())
    path = save(tmp_path / "c.h5", flat)
    narrow = next(e for e in flat.spec.entries if e.name == "narrow")
    with Checkpoint(path) as ckpt:  # the flat padding before 'narrow' is in no dataset, whatever the file holds
        assert ckpt.map_range(flat.spec, narrow.offset - 60, 100) is None
        inside = ckpt.map_range(flat.spec, narrow.offset, narrow.nbytes)
        assert np.array_equal(inside.view, flat.bytes[narrow.offset:narrow.offset + narrow.nbytes])
        inside.unmap()


def test_a_checkpoint_says_what_its_clients_kept_even_where_its_model_plug_in_cannot_be_imported():
    """inspect and the resume's refusals name the per-client state from the checkpoint's config; a plug-in model,
    dataset or trainer missing on this machine does not decide it, so it does not hide it. A plug-in strategy
    might keep state of its own: missing, the state is named generically."""
    import types

    import yaml

    def kept(**sections) -> str:
        return kept_per_client(types.SimpleNamespace(config=yaml.safe_dump(sections)))  # type: ignore[arg-type]

    plugin_model = {"name": "not_installed_here.models:net", "kwargs": {"width": 3}, "local": ["head.*"]}
    scaffold = {"name": "scaffold", "update": "delta"}
    assert kept(model=plugin_model, strategy=scaffold) == "SCAFFOLD control variates and local tensors (model.local)"
    assert kept(model=plugin_model, train={"trainer": "not_installed_here.t:T"},
                data={"dataset": "not_installed_here.d:load"}) == "local tensors (model.local)"
    assert kept(model=plugin_model, strategy={"name": "not_installed_here.s:Mine"}) == (
        "per-client state (of plug-ins not importable here: put them on PYTHONPATH to have the kinds named)")
    apfl = {"trainer": "examples.apfl.apfl:APFLTrainer"}  # importable: its vectors are named, in their order
    assert kept(train=apfl) == "the trainer's per-client vectors (personal, alpha)"


def test_an_aborted_rounds_line_names_the_per_client_state_it_would_be_saved_with_as_a_noun(tmp_path, capsys):
    """Under per-client state the model before an aborted round is not saved again: the line names that state in
    parentheses (a name such as "the trainer's per-client vectors" read "the clients' the trainer's ...") and says
    it may have moved on, not that it did (every client may have been dropped)."""
    from types import SimpleNamespace

    from mpifl.config import CheckpointConfig
    from mpifl.storage.checkpointer import Checkpointer

    store = SimpleNamespace(abandon_round=lambda: None, durable=False)
    checkpointer = Checkpointer(store, tmp_path, CheckpointConfig(), 3, {}, persist=lambda *args: None,
                                persisted="the trainer's per-client vectors")
    assert checkpointer.round_aborted(2, []) is None
    assert ("round 2 aborted: the model before it is not saved again, since the per-client state it would be saved "
            "with (the trainer's per-client vectors) may have moved on in the round; a resume starts from the "
            "newest checkpoint on disk") in capsys.readouterr().err
