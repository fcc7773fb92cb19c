"""``mpifl export CKPT OUT --client ID``: the model a logical client uses, as safetensors: under FedPer (model.local)
the global tensors with the client's own local ones, under Ditto its personal model v_i (with its own local tensors
beside model.local), each tensor bitwise the client's vector decoded here by hand from the per-rank files; and a
client with no model of its own, a run that keeps none, an unknown id and sharded files under a config that keeps
whole vectors refused, saying why (a sharded run's export: tests/test_mpi_sharded.py)."""
from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
from conftest import mpifl_here, ran
from results import client_vectors

from mpifl.storage.comparison import vector_clients
from mpifl.storage.hdf5 import load_tensors
from mpifl.storage.integrity import GROUP, metadata_crc32
from mpifl.units import range_list

safetensors = pytest.importorskip("safetensors.numpy")

# an MLP on digits: 1.weight [9, 64], 1.bias [9] travel; the head 3.weight [10, 9], 3.bias [10] is model.local
CONFIG = """
seed: 3
rounds: 2
clients: {num_clients: 8, per_round: 3}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [9]}, local: ["3.*"]}
train: {lr: 0.05, momentum: 0.5, batch_size: 16, local_epochs: 1, device: cpu}
strategy: {update: delta}
checkpoint: {every: 1}
eval: {every: 0}
output: {progress: false}
"""
SHARED = {"1.weight": (9, 64), "1.bias": (9,)}
HEAD = {"3.weight": (10, 9), "3.bias": (10,)}
# Ditto beside FedPer, with 10-byte exchange chunks: v_i is kept chunk by chunk
DITTO = CONFIG.replace("device: cpu}", "device: cpu, ditto_lambda: 0.5}") + "transport: {chunk_mb: 0.00001}\n"


def decoded(vector: np.ndarray, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """``vector``'s consecutive runs as the tensors of ``shapes``, in order (docs/reference/checkpoints.md)."""
    out, start = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        out[name] = vector[start:start + size].reshape(shape)
        start += size
    return out


def exported(checkpoint, out, client: int) -> dict[str, np.ndarray]:
    done = mpifl_here("export", str(checkpoint), str(out), "--client", str(client))
    assert done.returncode == 0, done.stderr
    return safetensors.load_file(str(out))


def refusal(checkpoint, out, *args: str) -> str:
    """The one-line refusal (exit 2) of an export, which wrote nothing."""
    done = mpifl_here("export", str(checkpoint), str(out), *args)
    assert done.returncode == 2 and not out.exists(), (done.returncode, done.stdout, done.stderr)
    return done.stderr


@pytest.fixture(scope="module")
def fedper(tmp_path_factory):
    return ran(tmp_path_factory.mktemp("fedper"), CONFIG, 3)


@pytest.fixture(scope="module")
def ditto(tmp_path_factory):
    return ran(tmp_path_factory.mktemp("ditto"), DITTO, 3)


def rewrite_config(checkpoint, old: str, new: str) -> None:
    """The checkpoint as if another run had written it: its config edited, its metadata checksum taken again."""
    with h5py.File(checkpoint, "r+") as f:
        assert old in f.attrs["config"]
        f.attrs["config"] = f.attrs["config"].replace(old, new)
        f[GROUP].attrs["metadata_crc32"] = metadata_crc32(f)


def last(run_dir):
    return run_dir / "checkpoints" / "ckpt-r000002.h5"


def test_a_fedper_clients_model_is_the_global_body_with_its_own_head_bitwise(fedper, tmp_path):
    vectors, body = client_vectors(fedper), load_tensors(last(fedper))
    assert sorted(body) == ["1.bias", "1.weight"]  # the global export has no head at all
    for client in sorted(vectors)[:2]:
        got = exported(last(fedper), tmp_path / f"c{client}.safetensors", client)
        want = {**{n: body[n].numpy() for n in SHARED}, **decoded(vectors[client], HEAD)}
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == np.float32 and np.array_equal(got[name], want[name]), name
    first, second = sorted(vectors)[:2]
    assert not np.array_equal(exported(last(fedper), tmp_path / "a.safetensors", first)["3.weight"],
                              exported(last(fedper), tmp_path / "b.safetensors", second)["3.weight"])


def test_a_ditto_clients_model_is_its_personal_model_with_its_own_head_bitwise(ditto, tmp_path):
    vectors = client_vectors(ditto)
    client = min(vectors)
    vector = vectors[client]  # its head and the head's mark, then v_i: body, own head, mark
    head = sum(int(np.prod(s)) for s in HEAD.values())
    assert vector[head] == 1 and vector[-1] == 1
    want = decoded(vector[head + 1:-1], {**SHARED, **HEAD})
    got = exported(last(ditto), tmp_path / "v.safetensors", client)
    assert got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    body = load_tensors(last(ditto))
    assert not np.array_equal(got["1.weight"], body["1.weight"].numpy())  # v_i, not the global w


def test_a_client_with_no_model_of_its_own_is_refused_the_global_model_is_what_it_uses(fedper, ditto, tmp_path):
    never = min(set(range(8)) - set(client_vectors(fedper)))  # never sampled: no vector in any rank file
    said = refusal(last(fedper), tmp_path / "n.safetensors", "--client", str(never))
    assert f"client {never}'s vector is in none of the 2 rank file(s)" in said
    assert "the global model is what it would use" in said
    # a vector whose personal part was never written (its mark 0), as where only another part was kept
    copy = tmp_path / "copy" / "checkpoints"
    shutil.copytree(last(ditto).parent, copy)
    client = min(client_vectors(ditto))
    for path in (copy / "ckpt-r000002.residuals").glob("rank*.h5"):
        with h5py.File(path, "r+") as f:
            if str(client) in f["clients"]:
                f["clients"][str(client)][-1] = 0
    said = refusal(copy / "ckpt-r000002.h5", tmp_path / "m.safetensors", "--client", str(client))
    assert f"client {client} has no Ditto personal model of its own at round 2" in said
    assert "the global model is what it would use" in said


def test_an_unknown_client_a_run_without_own_models_and_a_sharded_runs_files_are_refused(fedper, tmp_path):
    out = tmp_path / "x.safetensors"
    assert "no client 8: its run had clients 0 to 7" in refusal(last(fedper), out, "--client", "8")
    # a checkpoint whose run kept no model of a client's own (rewritten here as a plain FedAvg run's config)
    copy = tmp_path / "plain" / "checkpoints"
    shutil.copytree(last(fedper).parent, copy)
    rewrite_config(copy / "ckpt-r000002.h5", "local:\n  - 3.*", "local: []")
    said = refusal(copy / "ckpt-r000002.h5", out, "--client", "1")
    assert "kept nothing per client, no model of a client's own" in said
    assert "model.local (FedBN, FedPer) or train.ditto_lambda (Ditto)" in said
    # a plug-in trainer's declared vectors (APFL's personal model, say) are the trainer's to turn into a model
    rewrite_config(copy / "ckpt-r000002.h5", "trainer: torch", "trainer: plugin_helpers:VectorBreaker")
    said = refusal(copy / "ckpt-r000002.h5", out, "--client", "1")
    assert "its trainer's declared vectors, 'count', are the trainer's own to turn into the model a client " in said
    # each rank file holding rows of every client (clients.sharding: fsdp)
    for path in (copy / "ckpt-r000002.residuals").glob("rank*.h5"):
        with h5py.File(path, "r+") as f:
            f.attrs["shards"] = 2
    rewrite_config(copy / "ckpt-r000002.h5", "local: []", "local:\n  - 3.*")
    assert "holds one shard of each client's rows" in refusal(copy / "ckpt-r000002.h5", out, "--client", "1")


def test_a_torn_file_of_clients_vectors_is_named_in_one_line_and_nothing_is_written(fedper, tmp_path):
    """It used to end the export with h5py's OSError and a traceback."""
    copy = tmp_path / "torn" / "checkpoints"
    shutil.copytree(last(fedper).parent, copy)
    for path in (copy / "ckpt-r000002.residuals").glob("rank*.h5"):
        path.write_bytes(path.read_bytes()[:500])
    said = refusal(copy / "ckpt-r000002.h5", tmp_path / "x.safetensors", "--client", "1")
    assert "cannot read this file of clients' vectors" in said and "nothing written" in said
    assert "Traceback" not in said


def test_inspect_says_how_to_export_a_clients_own_model_where_the_run_kept_one(fedper, ditto):
    """The global model alone is not what a FedPer or Ditto client uses: inspect names the export that is."""
    said = mpifl_here("inspect", str(last(fedper)))
    assert said.returncode == 0, said.stderr
    trained = vector_clients(last(fedper))  # the clients with a model of their own: those sampled so far
    assert 0 < len(trained) < 8
    assert (f"each client's own model (the global tensors with its model.local ones): mpifl export {last(fedper)} "
            f"OUT --client ID (ID one of {range_list(trained)}, the {len(trained)} of 8 clients that have trained)") \
        in said.stdout
    said = mpifl_here("inspect", str(last(ditto)))
    assert f"each client's own personal model (Ditto): mpifl export {last(ditto)} OUT --client ID" in said.stdout
