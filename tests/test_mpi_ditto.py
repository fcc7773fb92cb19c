"""Ditto (Li et al. 2021): a personal model per client, kept on the rank that hosts it, trained towards the
received global model before the client trains the global one; equal to the rule computed on whole models,
bitwise (global and personal models), on any number of ranks, with reduction groups, with the personal models
in RAM or on disk, and across a resume on another number of ranks."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import ran, run_mpi, stopped_and_resumed, write_config
from reference import ditto_reference
from results import assert_bitwise, run_result

from mpifl.cli.plan import estimate
from mpifl.config import ConfigError, load_config
from mpifl.units import range_list

CONFIG = """
seed: 4
rounds: 3
clients: {num_clients: 8, per_round: 6}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [9]}}
train: {lr: 0.05, momentum: 0.5, batch_size: 16, local_epochs: 1, device: cpu, ditto_lambda: 0.5}
strategy: {update: delta}
eval: {every: 0}
output: {progress: false}
"""


def reference(*overrides: str, dropped_in: dict[int, set[int]] | None = None,
              config: str = CONFIG) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    return ditto_reference(load_config(None, list(overrides), data=yaml.safe_load(config)), dropped_in)


# Rounds 1-3 sample clients [1, 2, 4, 5, 6, 7], [0, 1, 4, 5, 6, 7], [1, 2, 4, 5, 6, 7]: client 2 sends NaN the first
# time (it keeps no v_i), 0 and 4 raise in round 2 (0 never keeps one, 4 keeps round 1's), 6's update is lost in
# round 3, each after its personal model was trained.
FAILING = CONFIG.replace("clients: {num_clients: 8, per_round: 6}",
                         "clients: {num_clients: 8, per_round: 6, accept_failures: true}") + """
faults:
  - {kind: nan, clients: [2], rounds: [1]}
  - {kind: raise, clients: [0, 4], rounds: [2]}
  - {kind: lose, clients: [6], rounds: [3], stage: send}
"""
FAILED_IN = {1: {2}, 2: {0, 4}, 3: {6}}


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),  # 2 client ranks, 3 participants each
    (5, ("transport.chunk_mb=0.00001",)),  # 4 client ranks, 10-byte chunks: personal models stored by chunk
    (4, ("clients.groups=3",)),  # the groups' partial sums of the global updates
    (4, ("train.personal_ram_mb=0", "strategy.update=weights")),  # personal models in one HDF5 file per rank
    (3, ("train.device_copy=true",)),  # the GPU path's copies on the CPU: v_i trained on the replica
    (3, ("train.grad_accum_steps=2", "train.batch_size=8")),  # two backward passes a step, lambda (v - w) once
], ids=["2-client-ranks", "4-client-ranks-tiny-chunks", "reduction-groups", "personal-on-disk", "device-replica",
        "gradient-accumulation"])
def test_ditto_equals_the_papers_rule_on_whole_models_bitwise_on_any_number_of_ranks(tmp_path, ranks, overrides):
    (final, personal), (want_final, want_personal) = run_result(ran(tmp_path, CONFIG, ranks, *overrides)), reference(
        *overrides)
    assert_bitwise(final, want_final)
    assert_bitwise(personal, want_personal)
    if "train.personal_ram_mb=0" in overrides:
        assert len(list((tmp_path / "run" / "personal").glob("rank*.h5"))) == 3


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),
    (4, ("train.personal_ram_mb=0", "transport.chunk_mb=0.00001")),  # on disk, chunk by chunk
    (4, ("clients.placement=per_round",)),  # each v_i lent by its home rank to the rank that trains it
], ids=["2-client-ranks-in-ram", "3-client-ranks-on-disk", "lent-per-round"])
def test_a_client_whose_round_fails_keeps_its_personal_model_as_before_the_round_bitwise(tmp_path, ranks, overrides):
    run = ran(tmp_path, FAILING, ranks, *overrides)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["round"]: {d["client"] for d in r["dropped"]} for r in records} == FAILED_IN
    (final, personal), (want_final, want_personal) = run_result(run), reference(
        *overrides, dropped_in=FAILED_IN, config=FAILING)
    assert 0 not in personal
    assert_bitwise(final, want_final)
    assert_bitwise(personal, want_personal)


def test_a_raise_in_dittos_personal_training_is_the_clients_failure_not_swallowed():
    """Under accept_failures a raise in Ditto's personal training (a built-in trainer's: an out-of-memory error)
    is the client's error, as one in its global training is, so the client is dropped naming why and its v_i stays
    as before the round (ClientRank._serve_client); without accept_failures it ends the job naming the client. It
    was swallowed: the client's global update was sent and no line said what happened."""
    from types import SimpleNamespace

    import torch

    from mpifl.roles.local_training import ClientFailure, LocalTraining, TrainingParts

    class OutOfMemory:
        def train(self, *args, **kwargs):
            raise RuntimeError("out of memory")

    def training(accept_failures: bool) -> LocalTraining:
        parts = TrainingParts(trainer=SimpleNamespace(train=lambda model, data, seed: None), seed=4,
                              accept_failures=accept_failures)
        return LocalTraining(parts, SimpleNamespace(module=None), SimpleNamespace(models=OutOfMemory()), None,
                             SimpleNamespace(personal=lambda model, round_, val: None), None, rank=1)

    scores, error = training(True).personal(2, 5, None, None, torch.zeros(1))
    assert scores == {} and error == "training its personal model: RuntimeError: out of memory"
    with pytest.raises(ClientFailure, match=r"logical client 5 on rank 1 failed in round 2 while training its "
                                            r"personal model: RuntimeError: out of memory"):
        training(False).personal(2, 5, None, None, torch.zeros(1))


def test_a_resumed_ditto_run_on_another_number_of_ranks_keeps_every_personal_model(tmp_path):
    """Stopped with its clients' personal models on disk (train.personal_ram_mb=0), resumed with them in RAM."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    rest = stopped_and_resumed(tmp_path, cfg, first_overrides=("train.personal_ram_mb=0",))
    assert "resume: Ditto personal models of" in rest.stderr
    assert list((tmp_path / "split" / "personal").glob("rank*.h5"))  # the first part kept them on disk
    (final, personal), (want_final, want_personal) = run_result(tmp_path / "split"), reference()
    assert_bitwise(final, want_final)
    assert_bitwise(personal, want_personal)


def test_each_client_evaluates_its_personal_model_on_its_validation_split(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), "data.val_fraction=0.2",
                     "eval.federated_every=1", "rounds=2")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        federated = record["federated_eval"]
        assert {"accuracy", "personal_accuracy", "personal_loss"} <= federated.keys(), federated
        assert 0.0 <= federated["personal_accuracy"] <= 1.0
        # each client's personal accuracy, and its spread, beside the weighted mean
        per_client = federated["personal_accuracy_per_client"]
        assert sorted(map(int, per_client)) == record["participants"]
        assert federated["personal_accuracy_worst10"] == min(per_client.values())  # 6 clients: the worst one
        assert federated["personal_accuracy_unweighted"] == pytest.approx(np.mean(list(per_client.values())))


def test_the_plan_counts_each_hosted_clients_personal_model():
    size, plan = estimate(load_config(None, [], data=yaml.safe_load(CONFIG)), nranks=3, ranks_per_node=3,
                          server_alone=False)
    _, plain = estimate(load_config(None, ["train.ditto_lambda=0"], data=yaml.safe_load(CONFIG)), nranks=3,
                        ranks_per_node=3, server_alone=False)
    elements = size.exchanged // 4
    assert plan.client_bytes - plain.client_bytes >= 4 * (4 * elements)  # 4 hosted clients' fp32 models


def test_the_plan_counts_the_personal_model_held_until_a_clients_round_stands_under_accept_failures():
    def client_bytes(*overrides: str) -> int:
        return estimate(load_config(None, list(overrides), data=yaml.safe_load(CONFIG)), nranks=3,
                        ranks_per_node=3, server_alone=False)[1].client_bytes

    size, _ = estimate(load_config(None, [], data=yaml.safe_load(CONFIG)), nranks=3, ranks_per_node=3,
                       server_alone=False)
    assert client_bytes("clients.accept_failures=true") - client_bytes() == 4 * (size.exchanged // 4)


@pytest.mark.parametrize("overrides,message", [
    (("model.local=['3.*']", "clients.ranks_per_client=2"), "a group of ranks .* does not train yet"),
    (("train.prox_mu=0.1",), "train.prox_mu: .* FedProx's term would pull it towards where it started"),
    (("clock.mode=fedbuff", "clock.concurrency=6"), "with clock.mode 'fedbuff' a client may train again"),
])
def test_ditto_is_refused_beside_what_it_cannot_share_a_rank_with(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*overrides], data=yaml.safe_load(CONFIG))


def test_a_diverged_personal_model_is_named_warned_about_and_left_out_of_the_personal_scores(tmp_path):
    """lr x lambda far past SGD's stability bound (0.1 x 1000 against 2 (1 + 0.9)): a client whose personal model
    goes NaN/Inf keeps none that round, the round's record names it (``personal_diverged``), rank 0 warns naming it
    with the keys to lower, and the federated personal scores are over the other clients (``personal_clients``).
    The run was silent, and its diverged personal models were scored and averaged as if valid."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), "data.val_fraction=0.2",
                     "eval.federated_every=1", "rounds=2", "train.lr=0.1", "train.momentum=0.9",
                     "train.ditto_lambda=1000")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: train.ditto_lambda: train.lr x train.ditto_lambda = 0.1 x 1000 = 100 is at or past 3.8" \
        in result.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(record["personal_diverged"] for record in records)
    for record in records:
        diverged, federated = record["personal_diverged"], record["federated_eval"]
        scored = sorted(map(int, federated.get("personal_accuracy_per_client", {})))
        assert sorted(diverged + scored) == record["participants"], record
        assert federated["personal_clients"] == len(scored)
        assert federated.get("personal_loss", 0.0) is not None  # no NaN written as null
        if diverged:
            clients = f"client{'s' if len(diverged) > 1 else ''} {range_list(diverged)}"
            assert f"round {record['round']}: Ditto: the personal training of logical {clients} went non-finite" \
                in result.stderr
    assert "Lower train.lr or train.ditto_lambda" in result.stderr
