"""DP-FedAvg under mpiexec: the noise is bitwise the same for any chunk size and rank count, the
reported epsilon is dp-accounting's, and an epsilon budget stops the run with a checkpoint."""
from __future__ import annotations

import json

import pytest
from conftest import MPI_TIMEOUT, mpifl_here, run_mpi, same_model, write_config

from mpifl.config import load_config
from mpifl.privacy.accounting import epsilon

pytest.importorskip("dp_accounting")

RUN = """
seed: 2
rounds: {rounds}
clients: {{num_clients: 20, per_round: 5}}
data: {{dataset: synthetic, kwargs: {{num_samples: 800, num_features: 8, num_classes: 4}}}}
model: {{name: mlp, kwargs: {{hidden: [8]}}}}
train: {{lr: 0.1, batch_size: 8}}
strategy: {{name: fedadam, update: delta, weighting: equal, server_lr: 0.05}}
privacy: {{mode: central, clip: 0.3, noise_multiplier: 1.2{extra}}}
eval: {{every: 0}}
output: {{progress: false}}
"""


def run(tmp_path, name, ranks=2, rounds=3, extra="", *overrides):
    cfg = write_config(tmp_path / f"{name}.yaml", RUN.format(rounds=rounds, extra=extra))
    result = run_mpi(ranks + 1, "run", str(cfg), "--run-dir", str(tmp_path / name), *overrides, timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return cfg, tmp_path / name, records, result.stderr


def test_dp_fedadam_noise_is_identical_across_chunk_sizes_and_rank_counts(tmp_path):
    cfg, base, records, _ = run(tmp_path, "base")
    _, other, _, _ = run(tmp_path, "other", 3, 3, "", "transport.chunk_mb=0.0003")  # 3 ranks, 314-byte chunks
    assert same_model(base / "model.h5", other / "model.h5")
    expected = [epsilon(load_config(cfg).privacy, r, 20, 5) for r in (1, 2, 3)]
    assert [r["privacy"]["epsilon"] for r in records] == expected  # dp-accounting's, round by round


def test_an_epsilon_budget_ends_the_run_complete_after_the_last_round_it_allows(tmp_path):
    cfg = load_config(None, data={"clients": {"num_clients": 20, "per_round": 5},
                                  "strategy": {"update": "delta", "weighting": "equal"},
                                  "privacy": {"mode": "central", "noise_multiplier": 1.2}})
    budget = (epsilon(cfg.privacy, 2, 20, 5) + epsilon(cfg.privacy, 3, 20, 5)) / 2  # room for 2 rounds, not 3
    spent = f", epsilon_budget: {budget}"
    evaluation = ("eval.every=5", "eval.federated_every=5", "data.val_fraction=0.2")
    config, run_dir, records, stderr = run(tmp_path, "budget", 2, 6, spent, *evaluation)
    assert [r["round"] for r in records] == [1, 2] and records[-1]["privacy"]["epsilon"] <= budget
    assert "privacy.epsilon_budget: round 3 would take epsilon" in stderr
    # a complete run: its last round evaluated, held out and on the clients' own splits, as any last round is
    # (neither is due by its schedule in round 2), and marked; model.h5 is its checkpoint
    assert "eval" in records[-1] and records[-1]["privacy"]["budget_spent"] is True
    assert records[-1]["federated_eval"]["clients"] == 5 and "federated_eval" not in records[0]
    assert "budget_spent" not in records[0]["privacy"]
    assert same_model(run_dir / "model.h5", run_dir / "checkpoints" / "ckpt-r000002.h5")
    closing = stderr.strip().splitlines()[-1]
    assert closing.startswith("[rank 0] finished after round 2 of 6: the privacy budget is spent "
                              f"(privacy.epsilon_budget {budget:g}: epsilon ") and "final round 2: " in closing
    status = mpifl_here("status", str(run_dir))  # what the job scripts' final check runs
    assert status.returncode == 0 and status.stdout.splitlines()[-1].startswith(
        f"complete: privacy.epsilon_budget {budget:g} spent after round 2 of 6")
    # RESUME=auto: a resubmitted job finds nothing to run, and leaves the run complete
    again = run_mpi(3, "run", str(config), "--run-dir", str(run_dir), "--resume", *evaluation, timeout=MPI_TIMEOUT)
    assert again.returncode == 0 and "nothing to run, as the privacy budget is spent" in again.stderr
    assert mpifl_here("status", str(run_dir)).returncode == 0


SECAGG = """
seed: 5
rounds: 3
clients: {{num_clients: 10, per_round: 6, accept_failures: true}}
data: {{dataset: synthetic, kwargs: {{num_samples: 600, num_features: 8, num_classes: 4}}}}
model: {{name: mlp, kwargs: {{hidden: [8]}}}}
train: {{trainer: "fl_helpers:FailingClients", lr: 0.05}}
secagg: {{enabled: true, masking: {masking}}}
eval: {{every: 0}}
output: {{progress: false}}
"""


@pytest.mark.parametrize("drop", [False, True])
def test_the_securely_aggregated_sum_is_exactly_the_plain_fixed_point_sum(tmp_path, drop):
    """Masked updates, with pairwise masks cancelling and a dropped client's masks removed, give bitwise the
    model that the unmasked fixed-point updates give."""
    # logical client 4 raises: rank 1's second client of round 1, its only round (FailingClients reads the variables
    # at each call, so the jobs run in the suite's job pool)
    env = {"FL_HELPERS_RAISE": "4", "FL_HELPERS_SEED": "5"} if drop else {}
    models = {}
    for masking in ("true", "false"):
        cfg = write_config(tmp_path / f"{masking}.yaml", SECAGG.format(masking=masking))
        result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / masking), env=env or None,
                         timeout=MPI_TIMEOUT)
        assert result.returncode == 0, result.stderr
        models[masking] = tmp_path / masking / "model.h5"
        records = [json.loads(line) for line in (tmp_path / masking / "metrics.jsonl").read_text().splitlines()]
        assert sum(r["secagg"]["dropped"] for r in records) == (1 if drop else 0)
    assert same_model(models["true"], models["false"])


SMALL_SECAGG = """
seed: {seed}
rounds: {rounds}
clients: {{num_clients: {clients}, per_round: {per_round}, accept_failures: true}}
data: {{dataset: synthetic, kwargs: {{num_samples: 300, num_features: 8, num_classes: 4}}}}
model: {{name: mlp, kwargs: {{hidden: [8]}}}}
train: {{lr: 0.05}}
secagg: {{enabled: true}}
eval: {{every: 0}}
output: {{progress: false}}
"""


def small_secagg(tmp_path, name, *overrides, seed=5, rounds=1, clients=6, per_round=3):
    """A few-second secure-aggregation run: 6 clients of 40 training samples, 3 a round, a tiny MLP."""
    cfg = write_config(tmp_path / f"{name}.yaml", SMALL_SECAGG.format(seed=seed, rounds=rounds, clients=clients,
                                                                      per_round=per_round))
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / name), *overrides, timeout=MPI_TIMEOUT)
    metrics = tmp_path / name / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return result, records


def test_clamped_values_are_warned_of_with_the_round_the_range_and_fraction_bits_that_hold_them(tmp_path):
    """Weights of 40 samples in a cohort of 3 at 28 fraction bits fit only within ±0.0667 (the check before the run
    is lowered with secagg.min_range so that the run shows it); the advised bits then clamp nothing."""
    result, records = small_secagg(tmp_path, "tight", "secagg.fraction_bits=28", "secagg.min_range=0.001")
    assert result.returncode == 0, result.stderr
    entry = records[0]["secagg"]
    assert entry["clamped"] > 0 and entry["range"] == pytest.approx(0.0667, abs=1e-4)
    advised = entry["max_fraction_bits"]
    lines = [line for line in result.stderr.splitlines() if "warning: " in line and "secure aggregation" in line]
    assert lines == [
        f"[rank 0] warning: round 1: secure aggregation clamped {entry['clamped']:,} values into the ring's range, so "
        f"the model is not the plain sum's: secagg.fraction_bits=28 holds ±0.06667 = (2^31 - 1) / (3 x 40 x 2^28) "
        f"for the heaviest client of this cohort of 3, of weight 40 (a lighter client's range is wider in "
        f"proportion), and a value reached {entry['range_used']:.3g} times its client's range; "
        f"secagg.fraction_bits={advised} would have held every value of this round. Said again only for a round "
        "that needs fewer bits; metrics.jsonl's secagg.clamped counts every round's",
        f"[rank 0] warning: secure aggregation clamped values in 1 of 1 rounds, {entry['clamped']:,} in all (most: "
        f"{entry['clamped']:,} in round 1); secagg.fraction_bits={advised} would have held every round's values "
        "(docs/how-to/secure-aggregation.md)"]
    result, records = small_secagg(tmp_path, "advised", f"secagg.fraction_bits={advised}", "secagg.min_range=0.001")
    assert result.returncode == 0, result.stderr
    assert records[0]["secagg"]["clamped"] == 0 and "secure aggregation clamped" not in result.stderr


def test_a_poisson_round_drawing_fewer_than_min_cohort_runs_without_their_updates(tmp_path):
    """Seed 0 draws clients 0, 1, 3 in round 1 and client 2 alone in round 2 (q = 2/6): its update would be the
    sum itself, so it is not trained or sent; DP's noise alone moves the model, as in a round that draws nobody."""
    result, records = small_secagg(
        tmp_path, "poisson", "privacy.mode=central", "privacy.sampling=poisson", "privacy.clip=1.0",
        "privacy.noise_multiplier=0.5", seed=0, rounds=2, per_round=2)
    assert result.returncode == 0, result.stderr
    assert [r["participants"] for r in records] == [[0, 1, 3], []]
    assert records[1]["secagg"]["withheld"] == [2] and records[1]["num_samples"] == 0
    assert "round 2: Poisson sampling drew 1 client (2), fewer than secagg.min_cohort=2: left out" in result.stderr
    assert "secagg.min_cohort: 1 of 2 rounds (round 2) drew fewer than 2 clients and ran without updates" \
        in result.stderr


def test_a_round_left_with_fewer_survivors_than_min_cohort_is_not_unmasked_and_ends_the_job(tmp_path):
    result, _ = small_secagg(tmp_path, "lone", "faults=[{kind: raise, clients: [0, 2], rounds: [2]}]", rounds=2,
                             clients=3)
    assert result.returncode != 0
    assert ("round 2: only 1 of 3 participants sent a usable update, fewer than secagg.min_cohort=2: the securely "
            "aggregated sum of so few would reveal what they sent (one update, exactly)") in result.stderr
    from mpifl.storage.hdf5 import Checkpoint

    with Checkpoint(tmp_path / "lone" / "checkpoints" / "ckpt-r000001.h5") as ckpt:
        assert ckpt.round == 1  # round 1's model was saved; round 2 is not applied


def test_a_fraction_bits_the_largest_client_cannot_use_ends_the_run_before_its_first_round(tmp_path):
    """The data is read only once MPI has started: the server checks the range for the partition's largest client
    (40 samples) before round 1, as ``mpifl validate`` does."""
    result, records = small_secagg(tmp_path, "refused", "secagg.fraction_bits=28")
    assert result.returncode == 2 and records == []  # a config error's exit status, as before MPI starts
    assert "MPI_Abort" not in result.stderr  # every rank leaves with the reason, none is aborted
    assert ("config error: secagg.fraction_bits: 28 holds values only within ±0.06667 = (2^31 - 1) / (3 x 40 x 2^28) "
            "for a cohort of 3 (clients.per_round) whose largest client weight is 40") in result.stderr


COMPRESSED = """
seed: 6
rounds: 2
clients: {{num_clients: 8, per_round: 4}}
data: {{dataset: synthetic, kwargs: {{num_samples: 400, num_features: 8, num_classes: 4}}}}
model: {{name: mlp, kwargs: {{hidden: [300]}}}}
train: {{lr: 0.05, batch_size: 8}}
strategy: {{name: fedadam, update: delta, weighting: equal, server_lr: 0.02}}
compression: {{method: {method}, block: 128}}
privacy: {{mode: central, clip: 0.5, noise_multiplier: 0.3}}
eval: {{every: 0}}
output: {{progress: false}}
"""


@pytest.mark.parametrize("method,ratio", [("int4", 8)])  # int8's codec is tested in process (test_codecs.py)
def test_quantized_dp_fedadam_is_rank_count_independent_and_as_small_as_planned(tmp_path, method, ratio):
    runs = {}
    for ranks in (2, 3):
        cfg = write_config(tmp_path / f"{ranks}.yaml", COMPRESSED.format(method=method))
        result = run_mpi(ranks + 1, "run", str(cfg), "--run-dir", str(tmp_path / str(ranks)), timeout=MPI_TIMEOUT)
        assert result.returncode == 0, result.stderr
        runs[ranks] = [json.loads(line) for line in (tmp_path / str(ranks) / "metrics.jsonl").read_text().splitlines()]
    assert same_model(tmp_path / "2" / "model.h5", tmp_path / "3" / "model.h5")
    fp32 = 4 * (8 * 300 + 300 + 300 * 4 + 4) * 4  # four fp32 updates of the MLP
    assert fp32 / ratio < runs[2][-1]["bytes_received"] < fp32 / ratio * 1.15  # values plus one scale per block
