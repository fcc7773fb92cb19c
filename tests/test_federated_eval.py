"""Federated evaluation's record (``federated_eval``): mpifl's own scores of each sampled client's validation split,
never a trainer's metrics; the mean weighted by validation samples, and for each accuracy its spread across the
clients (unweighted mean, standard deviation, worst 10%, every client's own value), the same bits on any number of
ranks."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import ran

from mpifl.learning.trainers import TrainResult
from mpifl.roles.records import client_metrics, client_spread, federated_evaluation, summary
from mpifl.trackers import scalars
from mpifl.wire.protocol import UpdateMeta


def scored(client: int, metrics: dict | None = None, **evaluation) -> UpdateMeta:
    """A client's update header: the trainer's ``metrics`` and mpifl's own ``evaluation`` of its validation split."""
    return UpdateMeta(client, 50, 0.1, metrics or {}, evaluation=evaluation)


def test_a_trainers_val_metrics_never_replace_mpifls_own_evaluation():
    metas = [scored(1, {"val_accuracy": 0.99, "val_loss": 0.01, "val_samples": 3}, accuracy=0.2, loss=2.0,
                    samples=10),
             scored(2, {"val_accuracy": 0.99, "val_loss": 0.01, "val_samples": 3}, accuracy=0.6, loss=1.0,
                    samples=30)]
    federated = federated_evaluation(metas)
    assert federated is not None
    assert (federated["accuracy"], federated["loss"], federated["samples"]) == (0.5, 1.25, 40)
    assert client_metrics(metas)["val_accuracy"] == {"mean": 0.99, "min": 0.99, "max": 0.99, "clients": 2}


def test_a_trainer_metric_named_like_mpifls_own_records_is_refused_naming_it():
    """``rank_*``, ``group_*`` and ``secagg_*`` are the header's names for mpifl's own records: a trainer's
    ``rank_score`` would have been left out of client_metrics, and a ``rank_peak_rss_bytes`` read as the rank's
    peak memory."""
    for name in ("rank_score", "group_train_seconds", "secagg_masked"):
        with pytest.raises(ValueError, match=rf"TrainResult.metrics\['{name}'\]: .*mpifl's own records"):
            TrainResult(10, {"loss": 0.5, name: 1.0})
    assert TrainResult(10, {"loss": 0.5, "ranking": 1.0, "my_rank_score": 2.0}).metrics["ranking"] == 1.0


def test_a_trainers_val_metrics_alone_make_no_federated_evaluation():
    assert federated_evaluation([scored(1, {"val_accuracy": 0.99, "val_samples": 3})]) is None


def test_the_weighted_mean_stays_beside_the_spread_across_clients():
    metas = [scored(c, accuracy=a, loss=1.0 - a, samples=n)
             for c, n, a in [(4, 10, 0.5), (1, 30, 0.9), (9, 20, 0.3), (2, 40, 0.7)]]
    federated = federated_evaluation(metas)
    assert federated is not None
    accuracies = np.array([0.9, 0.7, 0.5, 0.3])  # in client order 1, 2, 4, 9
    assert federated["accuracy"] == (0.9 * 30 + 0.7 * 40 + 0.5 * 10 + 0.3 * 20) / 100
    assert federated["accuracy_unweighted"] == accuracies.mean()
    assert math.isclose(federated["accuracy_std"], accuracies.std(), rel_tol=1e-15)
    assert federated["accuracy_worst10"] == 0.3  # ceil(4 / 10) = 1 client: the worst one
    assert federated["accuracy_per_client"] == {"1": 0.9, "2": 0.7, "4": 0.5, "9": 0.3}
    assert "loss_worst10" not in federated  # a spread is recorded for accuracies only
    assert (federated["clients"], federated["samples"]) == (4, 100)


def test_the_worst_tenth_is_the_mean_of_the_lowest_ceil_n_over_10_clients():
    assert client_spread({c: float(c) for c in range(30)})["worst10"] == 1.0  # 3 of 30: 0, 1, 2
    assert client_spread({c: float(c) for c in range(31)})["worst10"] == 1.5  # 4 of 31: 0, 1, 2, 3
    assert client_spread({7: 0.25})["worst10"] == 0.25  # one client: itself


def test_dittos_personal_accuracy_is_spread_like_the_global_models():
    metas = [scored(c, accuracy=0.5, loss=1.0, personal_accuracy=p, personal_loss=0.5, samples=10)
             for c, p in [(3, 0.8), (5, 0.6)]]
    federated = federated_evaluation(metas)
    assert federated is not None
    assert federated["personal_accuracy_per_client"] == {"3": 0.8, "5": 0.6}
    assert federated["personal_accuracy_worst10"] == 0.6
    assert federated["accuracy_std"] == 0.0


def test_the_record_does_not_depend_on_the_order_updates_arrive_in():
    metas = [scored(c, accuracy=0.1 * c + 1e-9 * c * c, loss=1.0, samples=5 + c) for c in range(20)]
    assert json.dumps(federated_evaluation(metas)) == json.dumps(federated_evaluation(list(reversed(metas))))


def test_per_client_values_stay_out_of_the_log_line_and_the_trackers():
    federated = federated_evaluation([scored(c, accuracy=0.5, loss=1.0, samples=10) for c in range(3)])
    record = {"round": 1, "federated_eval": federated}
    assert "per_client" not in summary(record) and "federated_accuracy_worst10 0.5000" in summary(record)
    flat = scalars(record)
    assert flat["federated_eval/accuracy_worst10"] == 0.5
    assert not any("per_client" in key for key in flat)


CONFIG = """
seed: 3
rounds: 1
clients: {num_clients: 6, per_round: 4}
data: {dataset: digits, partition: dirichlet, alpha: 0.5, val_fraction: 0.25}
model: {name: mlp, kwargs: {hidden: [9]}}
train: {trainer: plugin_helpers:ReportsValidation, kwargs: {claim: CLAIM}, lr: 0.05, batch_size: 16, local_steps: 3}
eval: {every: 0, federated_every: 1}
output: {progress: false}
"""


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_plugin_trainer_reporting_val_accuracy_leaves_mpifls_evaluation_alone_under_mpiexec(tmp_path):
    """The trainer's ``val_accuracy`` 0.99 is recorded as its own client metric; ``federated_eval`` is what mpifl
    measured, bitwise what the same run without the trainer's claim records, on 2 client ranks as on 3."""
    (tmp_path / "claimed").mkdir()
    (tmp_path / "honest").mkdir()
    claimed = records(ran(tmp_path / "claimed", CONFIG.replace("CLAIM", "true"), 3))
    honest = records(ran(tmp_path / "honest", CONFIG.replace("CLAIM", "false"), 4))
    assert [r["federated_eval"] for r in claimed] == [r["federated_eval"] for r in honest]
    for record in claimed:
        assert record["federated_eval"]["accuracy"] < 0.99
        reported = record["client_metrics"]["val_accuracy"]  # the trainer's own number, kept as its own
        assert (reported["min"], reported["max"], reported["clients"]) == (0.99, 0.99, 4)
        assert sorted(record["federated_eval"]["accuracy_per_client"]) == sorted(map(str, record["participants"]))
