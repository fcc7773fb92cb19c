"""FedBN and FedPer (``model.local``): the named tensors never travel and every logical client keeps its own,
on the rank that hosts it; the rest is averaged as usual. Equal to the rule computed on whole models, bitwise,
on any number of ranks, with reduction groups, with the local tensors in RAM or on disk, and across a resume on
another number of ranks."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from conftest import mpifl_here, ran, stopped_and_resumed, write_config
from fl_helpers import tiny_mlp
from reference import personal_reference
from results import assert_bitwise, run_result

from mpifl.cli.plan import estimate
from mpifl.config import ConfigError, ModelConfig, load_config
from mpifl.learning.models import build_flat_model
from mpifl.wire.flat import FlatModel

CONFIG = """
seed: 3
rounds: 3
clients: {num_clients: 8, per_round: 6}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [9]}, local: ["3.*"]}
train: {lr: 0.05, momentum: 0.5, batch_size: 16, local_epochs: 1, device: cpu}
strategy: {update: delta}
eval: {every: 0}
output: {progress: false}
"""


def reference(*overrides: str) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    return personal_reference(load_config(None, list(overrides), data=yaml.safe_load(CONFIG)))


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),  # 2 client ranks, 3 participants each: each loads its own head before it trains
    (5, ("transport.chunk_mb=0.00001",)),  # 4 client ranks, 10-byte chunks
    (4, ("clients.groups=3",)),  # the groups' partial sums of the shared tensors
    (4, ("model.local_ram_mb=0", "strategy.update=weights")),  # local tensors in one HDF5 file per rank
    (3, ("train.device_copy=true",)),  # the GPU path's copies on the CPU: each head loaded into the replica
], ids=["2-client-ranks", "4-client-ranks-tiny-chunks", "reduction-groups", "local-on-disk", "device-replica"])
def test_local_tensors_stay_with_their_client_and_the_rest_is_averaged_bitwise_on_any_number_of_ranks(
        tmp_path, ranks, overrides):
    (shared, local), (want_shared, want_local) = run_result(ran(tmp_path, CONFIG, ranks, *overrides)), reference(
        *overrides)
    assert sorted(shared) == ["1.bias", "1.weight"]  # the head never reaches the server
    assert_bitwise(shared, want_shared)
    assert_bitwise(local, want_local)
    assert not np.array_equal(local[min(local)], local[max(local)])  # heads of their own
    if "model.local_ram_mb=0" in overrides:
        assert len(list((tmp_path / "run" / "locals").glob("rank*.h5"))) == 3


def test_a_resumed_run_on_another_number_of_ranks_keeps_every_clients_local_tensors(tmp_path):
    """Stopped with its clients' local tensors on disk (model.local_ram_mb=0), resumed with them in RAM."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    rest = stopped_and_resumed(tmp_path, cfg, first_overrides=("model.local_ram_mb=0",))
    assert "resume: local tensors (model.local) of" in rest.stderr
    assert list((tmp_path / "split" / "locals").glob("rank*.h5"))  # the first part kept them on disk
    (shared, local), (want_shared, want_local) = run_result(tmp_path / "split"), reference()
    assert_bitwise(shared, want_shared)
    assert_bitwise(local, want_local)
    # what a resume needs beside the checkpoint, said by inspect, and named when it is gone
    last = tmp_path / "split" / "checkpoints" / "ckpt-r000003.h5"
    inspect = mpifl_here("inspect", str(last))
    assert "per client: local tensors (model.local), kept by the client ranks, in " in inspect.stdout
    assert (f"each client's own model (the global tensors with its model.local ones): mpifl export {last} OUT "
            "--client ID (ID one of ") in inspect.stdout
    shutil.rmtree(last.with_suffix(".residuals"))
    again = subprocess.run([sys.executable, "-m", "mpifl", "run", str(cfg), "rounds=4", "--run-dir",
                            str(tmp_path / "split"), "--resume", str(last)], capture_output=True, text=True)
    assert again.returncode == 2 and "its local tensors (model.local) files" in again.stderr
    assert "are missing" in again.stderr


def test_fedbn_patterns_keep_batchnorm_weights_and_running_statistics_off_the_wire():
    flat = FlatModel(tiny_mlp(), local=["2.*"])  # Flatten, Linear, BatchNorm1d, ReLU, Linear
    assert [e.name for e in flat.spec.entries] == ["1.weight", "1.bias", "4.weight", "4.bias"]
    assert [n for n, _ in flat.local_tensors()] == ["2.weight", "2.bias", "2.running_mean", "2.running_var"]


@pytest.mark.parametrize("patterns,message", [
    (["head.*"], "model.local: 'head.*' matches no floating tensor of the model"),
    (["*"], "names every tensor of the model: nothing would travel"),
])
def test_local_patterns_that_name_nothing_or_everything_are_refused(patterns, message):
    with pytest.raises(ConfigError, match=message):
        build_flat_model(ModelConfig(name="mlp", kwargs={"hidden": [3]}, local=patterns), 0, input_shape=(4,),
                         num_classes=2)


def test_local_patterns_that_name_every_trained_parameter_are_refused_though_statistics_would_travel():
    """The built-in cnn has BatchNorm layers: with every weight and bias local only their running statistics
    would travel, and the clients would learn nothing together."""
    with pytest.raises(ConfigError, match=r"names every trained parameter of the model, so only 1\.running_mean, "
                                          r"1\.running_var, 4\.running_mean, 4\.running_var would travel"):
        build_flat_model(ModelConfig(name="cnn", local=["*.weight", "*.bias"]), 0, input_shape=(1, 8, 8),
                         num_classes=10)


def test_a_pattern_that_names_nothing_lists_the_models_tensors_and_its_batchnorm_layers():
    """The built-in cnn is an nn.Sequential: its BatchNorm layers are '1' and '4', not '*.bn*' as in models whose
    layers are named; the error says what the patterns could match and what FedBN would keep."""
    with pytest.raises(ConfigError) as refused:
        build_flat_model(ModelConfig(name="cnn", local=["*.bn*"]), 0, input_shape=(1, 8, 8), num_classes=10)
    assert str(refused.value) == (
        "model.local: '*.bn*' matches no floating tensor of the model 'cnn'; its tensors: '0.weight', '0.bias' "
        "(Conv2d); '1.weight', '1.bias', '1.running_mean', '1.running_var' (BatchNorm2d); '3.weight', '3.bias' "
        "(Conv2d); '4.weight', '4.bias', '4.running_mean', '4.running_var' (BatchNorm2d); '8.weight', '8.bias' "
        "(Linear). For FedBN, its BatchNorm layers are model.local=['1.*', '4.*']")
    flat = build_flat_model(ModelConfig(name="cnn", local=["1.*", "4.*"]), 0, input_shape=(1, 8, 8), num_classes=10)
    assert [e.name for e in flat.spec.entries] == ["0.weight", "0.bias", "3.weight", "3.bias", "8.weight", "8.bias"]


def test_a_long_listing_stops_after_its_first_forty_tensors():
    from mpifl.learning.models import tensor_listing

    listing = tensor_listing(torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(30)]))
    assert listing.count("(Linear)") == 20 and listing.endswith("'19.bias' (Linear); and 20 more")


def test_the_plan_counts_each_hosted_clients_local_tensors():
    size, plan = estimate(load_config(None, [], data=yaml.safe_load(CONFIG)), nranks=3, ranks_per_node=3,
                          server_alone=False)
    head = (9 * 10 + 10) * 4
    assert size.local == head and size.exchanged < (64 * 9 + 9) * 4 + 128
    everything = load_config(None, ["model.local=[]"], data=yaml.safe_load(CONFIG))
    _, shared_only = estimate(everything, nranks=3, ranks_per_node=3, server_alone=False)
    # a client rank hosts 4 clients: their 4 heads, less the head no longer in its copy of the global model (the
    # head still trains: its gradient and momentum stay counted; both layouts round each buffer to 64 bytes)
    assert plan.client_bytes - shared_only.client_bytes >= 4 * head - head


@pytest.mark.parametrize("overrides,message", [
    (("clock.mode=fedbuff", "clock.concurrency=6"), "with clock.mode 'fedbuff' a client may train again"),
])
def test_local_tensors_are_refused_beside_what_they_cannot_share_a_rank_with(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*overrides], data=yaml.safe_load(CONFIG))


def test_a_client_never_trained_starts_from_the_built_values_and_a_diverged_one_keeps_its_own():
    from mpifl.algorithms.local_layers import PersonalTensors
    from mpifl.storage.residuals import RamResiduals

    flat = build_flat_model(ModelConfig(name="mlp", kwargs={"hidden": [3]}, local=["3.*"]), 0, input_shape=(4,),
                            num_classes=2)
    personal = PersonalTensors(flat, RamResiduals([0, 3 * 2 + 2]))
    head = [t for _, t in flat.local_tensors()]
    built = [t.clone() for t in head]
    with torch.no_grad():
        head[0].add_(1.0)
    personal.keep(5)
    mine = [t.clone() for t in head]
    personal.load(6)  # never trained: the built head
    assert all(torch.equal(t, b) for t, b in zip(head, built))
    with torch.no_grad():
        head[0][0, 0] = float("nan")
    personal.keep(5)  # diverged: client 5 keeps what it had
    personal.load(5)
    assert all(torch.equal(t, m) for t, m in zip(head, mine))
