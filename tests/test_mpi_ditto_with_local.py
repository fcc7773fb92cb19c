"""Ditto beside FedBN or FedPer (``model.local``): the global model a client trains is w with its own local
tensors l_i, so its personal model v_i (Li, Hu, Beirami and Smith 2021) starts from and is pulled towards (w, l_i),
and is a whole model of its own, its local tensors too. Each client keeps both in one vector on the rank that hosts
it: l_i and its mark, then v_i (the tensors that travel, chunk by chunk, then its own local tensors) and v_i's mark.
Given (w, l_i) the personal training is independent of the global one, so w and every l_i are bitwise those of the
same run without Ditto; all of it equals the rule computed on whole models, bitwise, on any number of ranks, with
reduction groups, on disk, with clients placed per round, on the device replica, and across a resume on another
number of ranks."""
from __future__ import annotations

import numpy as np
import pytest
import yaml
from conftest import ran, stopped_and_resumed, write_config
from reference import ditto_reference, personal_reference
from results import assert_bitwise, run_result
from test_mpi_ditto import CONFIG as DITTO

from mpifl.cli.plan import estimate
from mpifl.config import load_config
from mpifl.planning.memory import client_state_elements

# Ditto's setup (tests/test_mpi_ditto.py: an MLP 64-9-10 on the digits, lambda 0.5) with the head kept per client
SETTINGS = {**yaml.safe_load(DITTO), "seed": 7}
SETTINGS["model"] = {**SETTINGS["model"], "local": ["3.*"]}
CONFIG = yaml.safe_dump(SETTINGS)
# BatchNorm in the middle; batches of 25 leave no client (121 to 253 samples with seed 7) a batch of one sample
FEDBN = ("model.name=fl_helpers:tiny_mlp", "model.kwargs={}", "model.local=['2.*']", "train.batch_size=25")
SHARED, HEAD = 64 * 9 + 9, 9 * 10 + 10  # FedPer: the first layer travels, the head stays


def reference(*overrides: str) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    return ditto_reference(load_config(None, list(overrides), data=yaml.safe_load(CONFIG)))


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),  # FedPer + Ditto on 2 client ranks
    (5, ("transport.chunk_mb=0.00001", "clients.groups=4")),  # 4 client ranks, 10-byte chunks, reduction groups
    # the vectors in one HDF5 file per rank, each lent, whole, to the rank that trains the client
    (4, ("model.local_ram_mb=0", "train.personal_ram_mb=0", "clients.placement=per_round")),
    (3, FEDBN),  # FedBN + Ditto: BatchNorm's weights and running statistics kept per client, in both models
    # the same on the GPU path's copies, run on the CPU: l_i and v_i loaded into and trained on the replica
    (3, (*FEDBN, "train.device_copy=true")),
], ids=["fedper", "groups-tiny-chunks", "on-disk-per-round", "fedbn", "fedbn-device-replica"])
def test_the_global_model_each_clients_local_tensors_and_personal_model_equal_the_rule_on_whole_models(
        tmp_path, ranks, overrides):
    (final, vectors), (want_final, want_vectors) = run_result(ran(tmp_path, CONFIG, ranks, *overrides)), reference(
        *overrides)
    assert_bitwise(final, want_final)
    assert_bitwise(vectors, want_vectors)
    assert len(vectors) == 8 and all(v[-1] == 1 for v in vectors.values())  # each kept a whole personal model
    if FEDBN[0] in overrides:
        return
    one, other = vectors[min(vectors)], vectors[max(vectors)]
    personal_head = slice(HEAD + 1 + SHARED, HEAD + 1 + SHARED + HEAD)
    assert not np.array_equal(one[personal_head], other[personal_head])  # personal heads of their own
    assert not np.array_equal(one[:HEAD], one[personal_head])  # and not the head the client trains w with


def test_ditto_leaves_the_global_model_and_each_clients_local_tensors_as_they_are_without_it():
    """The personal model reads (w, l_i) and never writes them: the run without Ditto is FedPer's own."""
    final, vectors = reference()
    shared, local = personal_reference(load_config(None, ["train.ditto_lambda=0"], data=yaml.safe_load(CONFIG)))
    assert_bitwise(final, shared)
    for client, own in local.items():
        assert np.array_equal(vectors[client][:HEAD], own) and vectors[client][HEAD] == 1


def test_a_resume_on_another_number_of_ranks_finds_each_clients_local_tensors_and_personal_model(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    rest = stopped_and_resumed(tmp_path, cfg)
    assert "resume: local tensors (model.local) and Ditto personal models of" in rest.stderr
    (final, vectors), (want_final, want_vectors) = run_result(tmp_path / "split"), reference()
    assert_bitwise(final, want_final)
    assert_bitwise(vectors, want_vectors)


def test_the_plan_counts_one_vector_per_client_holding_both():
    cfg = load_config(None, data=yaml.safe_load(CONFIG))
    size, plan = estimate(cfg, nranks=3, ranks_per_node=3, server_alone=False)
    # l_i and its mark, then v_i: the exchanged buffer (aligned to 64 bytes: up to 15 elements more), its own
    # local tensors and its mark
    assert client_state_elements(cfg, size) == size.exchanged // 4 + 2 * HEAD + 2
    assert 0 <= size.exchanged // 4 - SHARED < 16 and size.local // 4 == HEAD
    assert cfg.client_state().what == "local tensors (model.local) and Ditto personal models"
    _, plain = estimate(load_config(None, ["train.ditto_lambda=0"], data=yaml.safe_load(CONFIG)), nranks=3,
                        ranks_per_node=3, server_alone=False)
    assert plan.client_bytes > plain.client_bytes  # each hosted client's personal model beside its head


def test_scaffold_fedper_and_ditto_together_keep_three_kinds_in_one_vector_bitwise_on_any_number_of_ranks(tmp_path):
    """Three kinds of per-client state at once: SCAFFOLD's c_i, the head kept per client (FedPer) and its mark, and a
    Ditto personal model with its mark. Ditto reads w, never how w was trained, so w, c and each client's c_i and
    head are bitwise those of SCAFFOLD + FedPer alone (checked against SCAFFOLD's reference in
    tests/test_mpi_control_with_local.py); and all of it is the same bits on 2 and 4 client ranks, in 10-byte chunks,
    on disk and placed per round."""
    scaffold = ("strategy.name=scaffold",)
    for name in ("two", "four-tiny-chunks", "on-disk-per-round", "without-ditto"):
        (tmp_path / name).mkdir()
    runs = {name: run_result(ran(tmp_path / name, CONFIG, ranks, *scaffold, *extra)) for name, ranks, extra in (
        ("two", 3, ()), ("four-tiny-chunks", 5, ("transport.chunk_mb=0.00001",)),
        ("on-disk-per-round", 4, ("strategy.control_ram_mb=0", "model.local_ram_mb=0", "train.personal_ram_mb=0",
                                  "clients.placement=per_round")),
        ("without-ditto", 3, ("train.ditto_lambda=0",)))}
    final, vectors = runs["two"]
    for name in ("four-tiny-chunks", "on-disk-per-round"):
        assert_bitwise(runs[name][0], final)
        assert_bitwise(runs[name][1], vectors)
    alone_final, alone_vectors = runs["without-ditto"]
    assert_bitwise(alone_final, final)  # w and SCAFFOLD's c
    rule_and_head = next(iter(alone_vectors.values())).size  # c_i, the head and its mark
    assert_bitwise({c: v[:rule_and_head] for c, v in vectors.items()}, alone_vectors)
    assert len(vectors) == 8 and all(v[-1] == 1 and v[rule_and_head - 1] == 1 for v in vectors.values())
    # v_i: what travels (the first layer and SCAFFOLD's control section for it), its own head, its mark
    assert next(iter(vectors.values())).size == rule_and_head + 2 * SHARED + HEAD + 1
