"""``mpifl diff A B``: whether two results hold the same bits, every tensor of the model, the server's state and
every client's kept vector, each side read once with its checksums checked as it passes, and where they do not,
which elements differ and by how much (exit 0 when bitwise equal, 1 when not, 2 for what cannot be read or is
corrupt); its digest is ``mpifl inspect``'s and ``profiling/combinations.py``'s."""
from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
from conftest import mpifl_here, run_mpi, write_config

from mpifl.storage.comparison import Entry, Result, difference, digest


def model_file(path: Path, tensors: dict[str, np.ndarray], bf16: tuple[str, ...] = (),
               state: dict[str, np.ndarray] | None = None) -> Path:
    """An HDF5 file laid out as a checkpoint's /model (bf16: uint16 bits with a dtype attribute) and, with
    ``state``, its /server_state."""
    with h5py.File(path, "w") as f:
        group = f.create_group("model")
        for name, values in tensors.items():
            group.create_dataset(name, data=values)
            if name in bf16:
                group[name].attrs["dtype"] = "bfloat16"
        if state is not None:
            for name, values in state.items():
                f.require_group("server_state").create_dataset(name, data=values)
    return path


WEIGHTS = {"0.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 7, "0.bias": np.zeros(3, np.float32)}


def test_identical_files_are_bitwise_equal_and_share_a_digest(tmp_path):
    a, b = model_file(tmp_path / "a.h5", WEIGHTS), model_file(tmp_path / "b.h5", dict(reversed(WEIGHTS.items())))
    said = mpifl_here("diff", str(a), str(b))
    assert said.returncode == 0, said.stdout + said.stderr
    assert "model: 2 tensors in both, 15 elements: bitwise equal" in said.stdout
    assert said.stdout.rstrip().endswith("bitwise equal")
    assert digest(Result.at(a)) == digest(Result.at(b))


def test_one_element_a_rounding_step_away_is_named_with_its_size(tmp_path):
    changed = dict(WEIGHTS, **{"0.weight": WEIGHTS["0.weight"].copy()})
    changed["0.weight"][1, 2] = np.nextafter(changed["0.weight"][1, 2], np.float32(9))
    a, b = model_file(tmp_path / "a.h5", WEIGHTS), model_file(tmp_path / "b.h5", changed)
    said = mpifl_here("diff", str(a), str(b))
    assert said.returncode == 1
    step = float(changed["0.weight"][1, 2]) - float(WEIGHTS["0.weight"][1, 2])
    assert f"  0.weight [3, 4]: 1 of 12 elements differ, max |a - b| {step:.3g}, relative L2 " in said.stdout
    assert "model: 2 tensors in both, 15 elements: 1 of them differ" in said.stdout
    assert said.stdout.rstrip().endswith("they differ")
    assert digest(Result.at(a)) != digest(Result.at(b))


def test_bytes_decide_signed_zeros_differ_the_same_nan_does_not():
    zero, nan = np.array([0.0, 1.0], np.float32), np.array([np.nan, 1.0], np.float32)
    assert difference("z", zero, -zero + np.array([0.0, 0.0], np.float32)) is not None  # -0.0 against 0.0
    assert difference("n", nan, nan.copy()) is None


def test_bf16_is_sized_as_the_values_its_bits_encode(tmp_path):
    bits = np.array([0x3F80, 0x4000], np.uint16)  # 1.0, 2.0 in bfloat16
    other = np.array([0x3F80, 0x4001], np.uint16)  # 2.0 + 2^-6
    change = difference("w", bits, other, "bfloat16")
    assert change is not None and change.differing == 1 and change.max_abs == 2.0 ** -6


def test_a_tensor_only_one_result_has_is_named_and_unreadable_input_exits_2(tmp_path):
    a = model_file(tmp_path / "a.h5", WEIGHTS)
    b = model_file(tmp_path / "b.h5", {"0.weight": WEIGHTS["0.weight"]})
    said = mpifl_here("diff", str(a), str(b))
    assert said.returncode == 1 and "  only in a: 0.bias" in said.stdout
    missing = mpifl_here("diff", str(a), str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and f"{tmp_path / 'nowhere'}: no such file or run directory" in missing.stderr
    (tmp_path / "junk.h5").write_text("not hdf5")
    junk = mpifl_here("diff", str(a), str(tmp_path / "junk.h5"))
    assert junk.returncode == 2 and "cannot be read as HDF5" in junk.stderr


def test_the_server_state_is_compared_and_digested_slice_by_slice(tmp_path, monkeypatch):
    """FedAdam's moments or FedDyn's h are part of the result a resume goes on from: a difference there alone is a
    difference, sized as a tensor's is, and read in slices (one is as long as the model)."""
    monkeypatch.setattr("mpifl.storage.comparison.SLICE", 3)
    h = np.linspace(-1, 1, 10, dtype=np.float32)
    moved = h.copy()
    moved[7] += 0.5
    a = model_file(tmp_path / "a.h5", WEIGHTS, state={"h": h})
    same = model_file(tmp_path / "same.h5", WEIGHTS, state={"h": h.copy()})
    b = model_file(tmp_path / "b.h5", WEIGHTS, state={"h": moved})
    equal = mpifl_here("diff", str(a), str(same))
    assert equal.returncode == 0 and "server state: 1 vectors in both: bitwise equal" in equal.stdout, equal.stdout
    said = mpifl_here("diff", str(a), str(b))
    assert said.returncode == 1, said.stdout + said.stderr
    assert "model: 2 tensors in both, 15 elements: bitwise equal" in said.stdout
    want = 0.5 / float(np.linalg.norm(moved.astype(np.float64)))
    line = next(ln for ln in said.stdout.splitlines() if ln.startswith("  server_state/h [10]"))
    assert line.startswith("  server_state/h [10]: 1 of 10 elements differ, max |a - b| 0.5, relative L2 "), line
    assert line.endswith(f"relative L2 {want:.3g}"), line
    assert digest(Result.at(a)) == digest(Result.at(same)) != digest(Result.at(b))
    # a result without server state digests as it did before the state was part of the digest
    assert digest(Result.at(model_file(tmp_path / "plain.h5", WEIGHTS))) != digest(Result.at(a))
    lacking = mpifl_here("diff", str(a), str(tmp_path / "plain.h5"))
    assert lacking.returncode == 1 and "server state: 0 vectors in both: bitwise equal\n  only in a: h" in \
        lacking.stdout, lacking.stdout


def test_a_tensor_is_read_in_slices_of_whole_rows_sized_and_digested_as_if_read_whole(tmp_path, monkeypatch):
    """A 70B model's embedding is 2 GiB of bf16: diff reads every tensor a few rows at a time, one slice of each side
    in memory, and neither its verdict nor its size nor the digest depends on how it was sliced."""
    rng = np.random.default_rng(0)
    big = rng.standard_normal((7, 5)).astype(np.float32)
    moved = big.copy()
    moved[0, 1] += 0.25
    moved[6, 4] -= 2.0
    a = model_file(tmp_path / "a.h5", {"emb": big, "b": np.float32(3.0)})
    b = model_file(tmp_path / "b.h5", {"emb": moved, "b": np.float32(3.0)})
    whole = mpifl_here("diff", str(a), str(b)).stdout
    codes = digest(Result.at(a)), digest(Result.at(b))
    read: list[tuple[int, ...]] = []
    original = Entry.slices

    def recording(entry):
        for piece in original(entry):
            read.append(piece.shape)
            yield piece

    monkeypatch.setattr("mpifl.storage.comparison.SLICE", 11)  # two rows of five at a time
    monkeypatch.setattr(Entry, "slices", recording)
    sliced = mpifl_here("diff", str(a), str(b)).stdout
    assert sliced == whole and "emb [7, 5]: 2 of 35 elements differ, max |a - b| 2, relative L2 " in sliced, sliced
    assert max(n for (n,) in read) == 10  # never more than two rows of the matrix at once
    assert (digest(Result.at(a)), digest(Result.at(b))) == codes
    assert f"digest {codes[0]}" in sliced and f"digest {codes[1]}" in sliced


def test_a_sharded_groups_rank_files_are_joined_into_each_clients_vector(tmp_path):
    run = tmp_path / "run"
    folder = run / "checkpoints" / "ckpt-r000001.residuals"
    folder.mkdir(parents=True)
    model_file(run / "checkpoints" / "ckpt-r000001.h5", WEIGHTS)
    for shard, rows in ((1, [3.0, 4.0]), (0, [1.0, 2.0])):
        with h5py.File(folder / f"rank{shard + 1:05d}.h5", "w") as f:
            f.attrs.update({"shard": shard, "shards": 2})
            f.create_group("clients").create_dataset("7", data=np.array(rows, np.float32))
    assert np.array_equal(Result.at(run).client_vectors()[7], [1.0, 2.0, 3.0, 4.0])


def test_a_vector_kept_by_a_group_of_two_diffs_equal_to_the_same_vector_kept_whole(tmp_path, monkeypatch):
    """One config on groups of two ranks and of one: a client's vector in two rank files against one, read in slices
    that cross the files' boundary, is bitwise equal, and a change past the boundary is found."""
    monkeypatch.setattr("mpifl.storage.comparison.SLICE", 3)
    vector = np.arange(7, dtype=np.float32) / 3

    def run_with(name: str, pieces: list[np.ndarray]) -> Path:
        run = tmp_path / name
        folder = run / "checkpoints" / "ckpt-r000001.residuals"
        folder.mkdir(parents=True)
        model_file(run / "checkpoints" / "ckpt-r000001.h5", WEIGHTS)
        for shard, rows in enumerate(pieces):
            with h5py.File(folder / f"rank{shard + 1:05d}.h5", "w") as f:
                f.attrs.update({"shard": shard, "shards": len(pieces)})
                f.create_group("clients").create_dataset("7", data=rows)
        return run

    whole, halves = run_with("whole", [vector]), run_with("halves", [vector[:4], vector[4:]])
    said = mpifl_here("diff", str(whole), str(halves))
    assert said.returncode == 0 and "clients' vectors: 1 clients in both: bitwise equal" in said.stdout, said.stdout
    assert digest(Result.at(whole)) == digest(Result.at(halves))
    moved = vector.copy()
    moved[5] += 1
    other = mpifl_here("diff", str(whole), str(run_with("moved", [moved[:2], moved[2:]])))
    assert other.returncode == 1 and "  client 7 [7]: 1 of 7 elements differ, max |a - b| 1," in other.stdout, \
        other.stdout


SCAFFOLD = """
seed: 2
rounds: 2
clients: {num_clients: 6, per_round: 4}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [16]}}
train: {lr: 0.05, batch_size: 16, local_epochs: 1}
strategy: {name: scaffold, update: delta}
checkpoint: {every: 1}
eval: {every: 0}
output: {progress: false}
"""


def test_one_config_on_two_rank_counts_diffs_bitwise_equal_with_every_clients_vector(tmp_path):
    """The determinism promise checked as a user would: SCAFFOLD on 2 and 3 client ranks, its model and every
    client's c_i; the same digest in diff and inspect; another seed differs."""
    cfg = write_config(tmp_path / "c.yaml", SCAFFOLD)
    for name, ranks, extra in (("two", 3, ()), ("three", 4, ()), ("seed", 3, ("seed=3",))):
        done = run_mpi(ranks, "run", str(cfg), *extra, "--run-dir", str(tmp_path / name))
        assert done.returncode == 0, done.stderr
    same = mpifl_here("diff", str(tmp_path / "two"), str(tmp_path / "three"))
    assert same.returncode == 0, same.stdout
    kept = len(Result.at(tmp_path / "two").client_vectors())
    assert kept >= 4 and f"clients' vectors: {kept} clients in both: bitwise equal" in same.stdout, same.stdout
    code = digest(Result.at(tmp_path / "two"))
    assert f"digest {code}" in same.stdout
    inspected = mpifl_here("inspect", str(tmp_path / "two" / "checkpoints" / "ckpt-r000002.h5"))
    assert f"digest: {code} " in inspected.stdout
    other = mpifl_here("diff", str(tmp_path / "two"), str(tmp_path / "seed"))
    assert other.returncode == 1 and "they differ" in other.stdout
    assert "configs differ in 1 key(s): seed 2 -> 3" in other.stdout  # what a difference is read against
    assert f"digest: {code} " in mpifl_here("inspect", str(tmp_path / "two")).stdout  # a run directory: its result
    assert "; checksums verified (" in same.stdout
    # a run's model.h5 is a hard link to its final checkpoint, whose clients' vectors it stands for: the same
    # digest in inspect, whichever name it is given by
    final = mpifl_here("inspect", str(tmp_path / "two" / "model.h5"))
    assert f"digest: {code} " in final.stdout
    # a model.h5 away from its run directory keeps none: equal as far as compared, and the last line says how far
    (tmp_path / "alone").mkdir()
    shutil.copy(tmp_path / "two" / "model.h5", tmp_path / "alone" / "model.h5")
    partial = mpifl_here("diff", str(tmp_path / "alone" / "model.h5"), str(tmp_path / "three"))
    assert partial.returncode == 0 and "clients' vectors: not compared (kept by b only)" in partial.stdout
    assert partial.stdout.rstrip().splitlines()[-1].startswith("bitwise equal as far as compared: the clients' "
                                                               "vectors were not, b alone keeping them")
    # a file of clients' vectors torn or gone: no result to compare or export, exit 2 naming it, no traceback
    shutil.copytree(tmp_path / "two", tmp_path / "torn")
    torn = sorted((tmp_path / "torn" / "checkpoints" / "ckpt-r000002.residuals").glob("rank*.h5"))[-1]
    torn.write_bytes(torn.read_bytes()[:500])
    for command in (("diff", str(tmp_path / "two"), str(tmp_path / "torn")),
                    ("inspect", "--verify", str(tmp_path / "torn" / "model.h5"))):
        refused = mpifl_here(*command)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert f"{torn}: cannot read this file of clients' vectors" in refused.stderr, refused.stderr
    shutil.rmtree(torn.parent)
    gone = mpifl_here("diff", str(tmp_path / "two"), str(tmp_path / "torn"))
    assert gone.returncode == 2 and "files of its clients' vectors that ckpt-r000002.h5 lists are missing" in \
        gone.stderr, gone.stderr
    # a side whose bytes no longer match its checksums is no result to compare: exit 2, naming what changed
    edited = tmp_path / "edited.h5"
    edited.write_bytes((tmp_path / "two" / "model.h5").read_bytes())
    with h5py.File(edited, "r+") as f:
        name = sorted(f["model"])[0]
        values = f["model"][name][()]
        values.flat[0] += 1
        f["model"][name][...] = values
    corrupt = mpifl_here("diff", str(tmp_path / "two" / "model.h5"), str(edited))
    assert corrupt.returncode == 2, corrupt.stdout + corrupt.stderr
    assert f"mpifl: diff: {edited}: tensor {name!r} is corrupt" in corrupt.stderr and "not compared" in corrupt.stderr


def checkpoint(path: Path, flat, chunk_bytes: int, h: np.ndarray) -> Path:
    """A checkpoint of ``flat`` with server-state vector ``h``, its checksums taken over chunks of ``chunk_bytes``."""
    from mpifl.storage.hdf5 import CheckpointWriter

    with CheckpointWriter(path, flat.spec, {"round": 1, "config": "rounds: 1\n"}, state={"h": (len(h), 0.0)},
                          chunk_bytes=chunk_bytes) as writer:
        writer.write_tensors(flat.tensors())
        writer.write_state("h", 0, h)
        writer.write_metrics([])
        return writer.publish()


def test_each_side_is_read_once_its_bytes_checked_against_its_own_checksums_as_they_pass(tmp_path, monkeypatch,
                                                                                          capsys):
    """A 70B checkpoint is 140 GB: diff reads each side once, comparing, digesting and checking its CRC32s in the
    same pass, whatever chunk size each side's checksums were taken over and wherever a slice cuts a checksummed
    piece. A corrupt side names the piece ``Checkpoint.verify`` names, before anything is printed."""
    import pytest
    import torch
    from torch import nn

    from mpifl.cli.checkpoints import diff
    from mpifl.errors import CheckpointError
    from mpifl.storage.hdf5 import Checkpoint
    from mpifl.wire.flat import FlatModel

    torch.manual_seed(0)
    flat = FlatModel(nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3)))
    elements = sum(t.numel() for _, t in flat.tensors())
    h = np.linspace(-1, 1, elements, dtype=np.float32)
    a, b = checkpoint(tmp_path / "a.h5", flat, 24, h), checkpoint(tmp_path / "b.h5", flat, 40, h)
    monkeypatch.setattr("mpifl.storage.comparison.SLICE", 5)  # slices of 5 elements, pieces of 6 and 10
    reads: list[str] = []
    sliced = Entry.slices
    monkeypatch.setattr(Entry, "slices", lambda entry: (reads.append(entry.label), sliced(entry))[1])
    monkeypatch.setattr(Checkpoint, "read_range", lambda *_: pytest.fail("read chunk by chunk to verify"))
    assert diff(str(a), str(b)) == 0
    said = capsys.readouterr().out
    with Checkpoint(a) as ckpt_a, Checkpoint(b) as ckpt_b:
        chunks = (len(ckpt_a.spec().chunks(24)), len(ckpt_b.spec().chunks(40)))
    assert f"; checksums verified ({chunks[0]} chunks)" in said and f"; checksums verified ({chunks[1]} chunks)" in said
    assert chunks[0] != chunks[1] and said.rstrip().endswith("bitwise equal"), said
    assert sorted(reads) == sorted(2 * ([name for name, _ in flat.tensors()] + ["server_state/h"]))  # once a side
    monkeypatch.undo()
    monkeypatch.setattr("mpifl.storage.comparison.SLICE", 5)

    for where in ("model/0.weight", "server_state/h"):
        edited = tmp_path / f"edited-{where.replace('/', '-')}.h5"
        edited.write_bytes(b.read_bytes())
        with h5py.File(edited, "r+") as f:
            values = f[where][()]
            values.flat[17] += 1  # in the piece after the first, inside a slice
            f[where][...] = values
        with Checkpoint(edited) as ckpt, pytest.raises(CheckpointError) as verified:
            ckpt.verify()
        with pytest.raises(CheckpointError) as compared:
            diff(str(a), str(edited))
        assert str(compared.value) == f"diff: {verified.value}; not compared"
        assert capsys.readouterr().out == ""
    stripped = tmp_path / "stripped.h5"  # its server state's checksums deleted: named, not a traceback
    stripped.write_bytes(b.read_bytes())
    with h5py.File(stripped, "r+") as f:
        del f["integrity/state/h"]
    with pytest.raises(CheckpointError, match=f"{stripped}: /integrity/state/h has 0 checksums, the layout "):
        diff(str(a), str(stripped))
    with Checkpoint(stripped) as ckpt, pytest.raises(CheckpointError, match="/integrity/state/h has 0 checksums"):
        ckpt.verify()  # mpifl inspect --verify says the same
