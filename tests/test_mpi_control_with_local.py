"""SCAFFOLD and FedDyn beside FedBN / FedPer (``model.local``): each client keeps its c_i (or g_i) and its own
local tensors in one vector on the rank that hosts it; the local tensors never travel, and the algorithm's rule
covers only the tensors that do. Equal to the rule computed on whole models, bitwise, on any number of ranks,
with reduction groups, on disk, and across a resume on another number of ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from conftest import run_mpi, stopped_and_resumed, write_config
from reference import client_state_reference
from results import assert_bitwise, reference_controls_numbered, run_controls_numbered
from test_mpi_personal import CONFIG as PERSONAL

from mpifl.cli.plan import estimate
from mpifl.config import ModelConfig, load_config
from mpifl.planning.memory import client_state_elements

# FedPer's setup (tests/test_mpi_personal.py: the MLP's head 3.* stays local) under SCAFFOLD
SETTINGS = {**yaml.safe_load(PERSONAL), "seed": 4, "clients": {"num_clients": 8, "per_round": 5},
            "strategy": {"name": "scaffold", "update": "delta"}}
CONFIG = yaml.safe_dump(SETTINGS)
FEDDYN = ("strategy.name=feddyn", "strategy.weighting=equal", "strategy.alpha=0.05")


def reference(*overrides: str) -> dict[str, np.ndarray]:
    """The rule's final tensors (SCAFFOLD's c as control.<k>, in order) and each trained client's vector."""
    return reference_controls_numbered(client_state_reference(load_config(None, list(overrides),
                                                                          data=yaml.safe_load(CONFIG))))


def result(run_dir) -> dict[str, np.ndarray]:
    """The run's final tensors, named as :func:`reference` names them, and every client's kept vector."""
    return run_controls_numbered(run_dir, with_clients=True)


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),  # SCAFFOLD + FedPer on 2 client ranks
    (5, ("transport.chunk_mb=0.00001", "clients.groups=4")),  # 4 client ranks, 10-byte chunks, reduction groups
    (4, ("strategy.control_ram_mb=0", "model.local_ram_mb=0")),  # the vectors in one HDF5 file per rank
    (3, FEDDYN),  # FedDyn + FedPer
    (5, (*FEDDYN, "clients.groups=4")),
    (4, ("strategy.control_ram_mb=0", "model.local_ram_mb=0", "train.device_copy=true")),  # the GPU path's copies
], ids=["scaffold", "scaffold-groups-tiny-chunks", "scaffold-on-disk", "feddyn", "feddyn-groups", "device-replica"])
def test_the_rule_covers_the_shared_tensors_and_each_client_keeps_its_own_head_bitwise(tmp_path, ranks, overrides):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    run = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides)
    assert run.returncode == 0, run.stderr[-3000:]
    got, want = result(tmp_path / "run"), reference(*overrides)
    assert not any(n.startswith("3.") for n in got)  # the head never reaches the server
    assert_bitwise(got, want)
    heads = [v[-(9 * 10 + 10) - 1:-1] for k, v in want.items() if k.startswith("client.")]
    assert not np.array_equal(heads[0], heads[-1]) and all(v[-1] == 1 for k, v in want.items() if "client." in k)
    if "strategy.control_ram_mb=0" in overrides:
        assert sorted(p.name for p in (tmp_path / "run" / "controls").iterdir()) == ["rank00001.h5", "rank00002.h5",
                                                                                    "rank00003.h5"]


@pytest.mark.parametrize("overrides", [(), FEDDYN], ids=["scaffold", "feddyn"])
def test_a_resume_on_another_number_of_ranks_finds_each_clients_vector(tmp_path, overrides):
    feddyn = {"name": "feddyn", "update": "delta", "weighting": "equal", "alpha": 0.05}
    cfg = write_config(tmp_path / "c.yaml", yaml.safe_dump({**SETTINGS, "strategy": feddyn}) if overrides else CONFIG)
    rest = stopped_and_resumed(tmp_path, cfg)
    assert "and local tensors (model.local) of" in rest.stderr
    assert_bitwise(result(tmp_path / "split"), reference(*overrides))


@pytest.mark.parametrize("first", ["balanced", "per_round"])
def test_a_resume_may_change_the_placement_and_every_clients_vector_ends_bitwise(tmp_path, first):
    """Placement decides only which rank trains which client, and a checkpoint keeps each client's vector by client
    id, so a run placed ``first`` for two rounds and resumed round robin on 3 ranks ends bitwise as the rule."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    stopped_and_resumed(tmp_path, cfg, resume_ranks=3, first_overrides=(f"clients.placement={first}",))
    assert yaml.safe_load((tmp_path / "split" / "config.yaml").read_text())["clients"]["placement"] == "round_robin"
    assert_bitwise(result(tmp_path / "split"), reference())


def test_plan_counts_one_vector_per_client_holding_both():
    cfg = load_config(None, data=yaml.safe_load(CONFIG))
    size, _ = estimate(cfg, nranks=3, ranks_per_node=3, server_alone=False)
    # SCAFFOLD's c_i covers the first layer only; the head (3.*) is each client's own, then its mark
    assert client_state_elements(cfg, size) == (64 * 9 + 9) + (9 * 10 + 10) + 1
    assert cfg.client_state().what == "SCAFFOLD control variates and local tensors (model.local)"


def test_a_client_whose_c_i_was_touched_but_whose_head_was_never_kept_starts_from_the_built_head():
    from mpifl.algorithms.local_layers import PersonalTensors
    from mpifl.learning.models import build_flat_model
    from mpifl.storage.residuals import RamResiduals, Section

    flat = build_flat_model(ModelConfig(name="mlp", kwargs={"hidden": [3]}, local=["3.*"]), 0, input_shape=(4,),
                            num_classes=2)
    store = RamResiduals([0, 4 * 3 + 3, 4 * 3 + 3 + 3 * 2 + 2 + 1])  # c_i of the first layer, then the head
    personal = PersonalTensors(flat, Section(store, 1), marked=True)
    head = [t for _, t in flat.local_tensors()]
    built = [t.clone() for t in head]
    store.read(7, 0).fill_(0.5)  # client 7's training began (its c_i read and written), then failed
    with torch.no_grad():
        head[0].add_(1.0)
    personal.load(7)
    assert all(torch.equal(t, b) for t, b in zip(head, built))
    with torch.no_grad():
        head[0].add_(1.0)
    personal.keep(7)
    assert store.read(7, 1)[-1] == 1 and bool((store.read(7, 0) == 0.5).all())  # the c_i section untouched
    again = PersonalTensors(flat, Section(store, 1), marked=True)  # as after a resume
    with torch.no_grad():
        head[0].zero_()
    again.load(7)
    assert torch.equal(head[0], built[0] + 1.0)


@pytest.mark.parametrize("overrides", [(), FEDDYN], ids=["scaffold", "feddyn"])
def test_a_client_trained_by_a_group_of_ranks_keeps_its_vector_on_the_leader(tmp_path, overrides):
    """clients.ranks_per_client=2: the leader keeps the vector and sends the members the head and c - c_i (or
    g_i); one group or two give the same bits, and the rule up to the rounding of DDP's split batches."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    got = {}
    for ranks in (3, 5):
        run = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / f"run{ranks}"),
                      "clients.ranks_per_client=2", *overrides)
        assert run.returncode == 0, run.stderr[-3000:]
        got[ranks] = result(tmp_path / f"run{ranks}")
    assert_bitwise(got[3], got[5])
    want = reference(*overrides)
    assert got[3].keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[3][name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
