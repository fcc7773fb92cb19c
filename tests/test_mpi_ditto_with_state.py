"""Ditto over SCAFFOLD, FedDyn or top-k with error feedback: a personal model's objective (Li, Hu, Beirami and Smith
2021) reads the global model w, never how w was trained, so w may be trained by a rule that keeps per-client state
of its own. Each client then keeps both in one vector on the rank that hosts it: its c_i, g_i or residual, then its
personal model and that model's mark. Given the round's global model the personal training is independent of the
global one, so the global model and the other rule's vectors are bitwise those of the same run without Ditto;
all of it equals the rules computed on whole models, bitwise, on any number of ranks, with reduction groups, on
disk, with clients placed per round, and across a resume on another number of ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from conftest import run_mpi, stopped_and_resumed, write_config
from reference import client_state_reference
from results import assert_bitwise, reference_controls_numbered, run_controls_numbered
from test_mpi_ditto import CONFIG as DITTO

from mpifl.cli.plan import estimate
from mpifl.config import load_config
from mpifl.planning.memory import client_state_elements
from mpifl.storage.residuals import MarkedChunks, RamResiduals

# Ditto's setup (tests/test_mpi_ditto.py: an MLP 64-9-10 on the digits, lambda 0.5) with SCAFFOLD for w
SETTINGS = {**yaml.safe_load(DITTO), "seed": 6, "strategy": {"name": "scaffold"}}
CONFIG = yaml.safe_dump(SETTINGS)
FEDDYN = ("strategy.name=feddyn", "strategy.alpha=0.05")
MODEL = 64 * 9 + 9 + 9 * 10 + 10  # the MLP's elements: SCAFFOLD's c_i (and control section) has as many


def reference(*overrides: str) -> dict[str, np.ndarray]:
    """The rule's final tensors (SCAFFOLD's c as control.<k>, in order) and each trained client's vector."""
    return reference_controls_numbered(client_state_reference(load_config(None, list(overrides),
                                                                          data=yaml.safe_load(CONFIG))))


def result(run_dir) -> dict[str, np.ndarray]:
    """The run's final tensors, named as :func:`reference` names them, and every client's kept vector."""
    return run_controls_numbered(run_dir, with_clients=True)


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),  # SCAFFOLD + Ditto on 2 client ranks
    (5, ("transport.chunk_mb=0.00001", "clients.groups=4")),  # 4 client ranks, 10-byte chunks, reduction groups
    (4, ("strategy.control_ram_mb=0", "train.personal_ram_mb=0")),  # the vectors in one HDF5 file per rank
    (4, ("clients.placement=per_round",)),  # each vector lent, whole, to the rank that trains the client
    (3, FEDDYN),  # FedDyn + Ditto
    (4, (*FEDDYN, "clients.groups=3", "strategy.control_ram_mb=0", "train.personal_ram_mb=0")),
], ids=["scaffold", "scaffold-groups-tiny-chunks", "scaffold-on-disk", "scaffold-per-round", "feddyn",
        "feddyn-groups-on-disk"])
def test_the_global_rule_and_each_clients_personal_model_equal_the_rules_on_whole_models(tmp_path, ranks, overrides):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    run = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides)
    assert run.returncode == 0, run.stderr[-3000:]
    got, want = result(tmp_path / "run"), reference(*overrides)
    assert_bitwise(got, want)
    vectors = [v for k, v in want.items() if k.startswith("client.")]
    assert len(vectors) == 8 and all(v[-1] == 1 for v in vectors)  # every client sampled; each personal model kept
    first_layer = slice(MODEL, MODEL + 64 * 9)  # the personal models' first layer: each client's own
    assert not np.array_equal(vectors[0][first_layer], vectors[1][first_layer])
    if "strategy.control_ram_mb=0" in overrides:
        assert sorted(p.name for p in (tmp_path / "run" / "controls").iterdir()) == ["rank00001.h5", "rank00002.h5",
                                                                                    "rank00003.h5"]


@pytest.mark.parametrize("overrides", [(), FEDDYN], ids=["scaffold", "feddyn"])
def test_ditto_leaves_the_global_model_and_the_rules_own_vectors_as_they_are_without_it(overrides):
    with_ditto, without = reference(*overrides), reference(*overrides, "train.ditto_lambda=0")
    assert {k for k in with_ditto if not k.startswith("client.")} == without.keys()
    for name, value in without.items():
        if name.startswith("client."):  # the rule's own part of the vector
            assert np.array_equal(with_ditto[name][:MODEL], value), name
        else:
            assert np.array_equal(with_ditto[name], value), name


def test_ditto_over_top_k_with_error_feedback_gives_the_same_bits_on_any_number_of_ranks(tmp_path):
    topk = ("strategy.name=fedavg", "compression.method=topk", "compression.fraction=0.2")
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    got = {}
    for name, ranks, extra in (("two", 3, ()), ("four", 5, ("compression.residual_ram_mb=0",
                                                              "train.personal_ram_mb=0")),
                               ("plain", 3, ("train.ditto_lambda=0",))):
        run = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / name), *topk, *extra)
        assert run.returncode == 0, run.stderr[-3000:]
        got[name] = result(tmp_path / name)
    assert_bitwise(got["two"], got["four"])
    plain = got.pop("plain")
    for name, value in plain.items():  # the global model and each residual: as without Ditto
        assert np.array_equal(got["two"][name][:MODEL] if name.startswith("client.") else got["two"][name], value)
    vectors = [v for k, v in got["two"].items() if k.startswith("client.")]
    assert all(v[-1] == 1 and v.size == 2 * MODEL + 1 for v in vectors)
    assert all(np.abs(v[:MODEL]).max() > 0 for v in vectors)  # top-k left something unsent in each residual


@pytest.mark.parametrize("overrides", [(), FEDDYN], ids=["scaffold", "feddyn"])
def test_a_resume_on_another_number_of_ranks_finds_each_clients_vector(tmp_path, overrides):
    cfg = write_config(tmp_path / "c.yaml", CONFIG if not overrides else yaml.safe_dump(
        {**SETTINGS, "strategy": {"name": "feddyn", "alpha": 0.05}}))
    rest = stopped_and_resumed(tmp_path, cfg)
    assert "and Ditto personal models of" in rest.stderr
    assert_bitwise(result(tmp_path / "split"), reference(*overrides))


def test_the_plan_counts_one_vector_per_client_holding_both():
    cfg = load_config(None, data=yaml.safe_load(CONFIG))
    size, _ = estimate(cfg, nranks=3, ranks_per_node=3, server_alone=False)
    # c_i, then the personal model as it travels (the model, then SCAFFOLD's control section), then its mark; the
    # plan counts the exchanged buffer's bytes, with its alignment to 64 bytes, so up to 15 elements more
    assert client_state_elements(cfg, size) == MODEL + size.exchanged // 4 + 1 and size.exchanged // 4 - 2 * MODEL < 16
    assert cfg.client_state().what == "SCAFFOLD control variates and Ditto personal models"
    topk = load_config(None, ["strategy.name=fedavg", "compression.method=topk"], data=yaml.safe_load(CONFIG))
    size, _ = estimate(topk, nranks=3, ranks_per_node=3, server_alone=False)
    assert client_state_elements(topk, size) == 2 * (size.exchanged // 4) + 1 and size.exchanged // 4 - MODEL < 16


def test_a_client_whose_c_i_was_written_but_whose_personal_model_never_was_has_none():
    store = RamResiduals([0, 4, 7, 10, 11])  # c_i (4), then a personal model of two chunks (3 + 3) and its mark
    personal = MarkedChunks(store, 1, 2)
    assert personal.firsts == [0, 3, 6]
    store.write(5, 0, torch.full((4,), 0.5))  # client 5's c_i, written by the global rule alone
    assert not personal.has(5)  # so Ditto starts its personal model from the global one
    personal.write(5, 0, torch.ones(3))
    assert not personal.has(5)  # half a model is not one
    personal.write(5, 1, torch.full((3,), 2.0))
    assert personal.has(5) and MarkedChunks(store, 1, 2).has(5)  # and so after a resume, from the same vector
    assert store.read(5, 0).tolist() == [0.5] * 4 and personal.read(5, 1).tolist() == [2.0] * 3


@pytest.mark.parametrize("overrides", [(), FEDDYN, ("strategy.name=fedavg", "compression.method=topk")],
                         ids=["scaffold", "feddyn", "topk-error-feedback"])
def test_ditto_beside_model_local_and_another_rules_state_keeps_all_three_in_one_vector(overrides):
    """Once refused as 'two kinds, not three': each client's vector now holds the rule's state, its local tensors
    and their mark, then its personal model with its own local tensors and their mark, and the plan counts it all
    (tests/test_mpi_ditto_with_local.py runs SCAFFOLD + FedPer + Ditto)."""
    cfg = load_config(None, ["model.local=['3.*']", *overrides], data=yaml.safe_load(CONFIG))
    state = cfg.client_state()
    assert state is not None and state.local and state.personal and (state.rule or state.residuals)
    head = 9 * 10 + 10  # the MLP's head: its local tensors
    size, _ = estimate(cfg, nranks=3, ranks_per_node=3, server_alone=False)
    travels = size.exchanged // 4  # what travels, in the exchange's chunks (SCAFFOLD's control section too)
    rule = MODEL - head if state.rule else travels  # c_i or g_i over the trainable parameters; a residual over all
    assert client_state_elements(cfg, size) == rule + (head + 1) + travels + head + 1
