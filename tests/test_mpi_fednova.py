"""FedNova (Wang et al. 2020): deltas normalised by each client's local steps, streamed chunk by chunk, equal
to the paper's rule computed on whole models, bitwise, on any number of ranks, with reduction groups, and
across a resume."""
from __future__ import annotations

import numpy as np
import pytest
import yaml
from conftest import run_mpi, stopped_and_resumed, write_config
from reference import fednova_divisor, reference_run
from results import assert_bitwise, final_model

from mpifl.aggregation.combiners import NormalizedAverage, fednova_total
from mpifl.config import ConfigError, StrategyConfig, load_config
from mpifl.wire.protocol import UpdateMeta

CONFIG = """
seed: 11
rounds: 3
clients: {num_clients: 8, per_round: 6}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: "fl_helpers:tiny_mlp"}
train: {trainer: "fl_helpers:SteppingNoiseTrainer", lr: 0.02, batch_size: 16, local_epochs: 2}
strategy: {name: fednova, update: delta}
eval: {every: 0}
output: {progress: false}
"""






def reference(*overrides: str) -> dict[str, np.ndarray]:
    return reference_run(load_config(None, list(overrides), data=yaml.safe_load(CONFIG)))


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),  # 2 client ranks, 3 participants each, one after the other
    (5, ("transport.chunk_mb=0.00001",)),  # 4 client ranks, 1 or 2 participants each, 10-byte chunks
    (4, ("clients.groups=3",)),  # the groups' partial sums of (p_i / tau_i) * delta_i
    (4, ("clients.groups=3", "transport.reduce=chain")),  # those sums added rank by rank on the way
], ids=["2-client-ranks", "4-client-ranks-tiny-chunks", "reduction-groups", "chain"])
def test_fednova_equals_the_papers_rule_on_whole_models_bitwise_on_any_number_of_ranks(tmp_path, ranks, overrides):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_bitwise(final_model(tmp_path / "run"), reference(*overrides))


def test_fednova_is_not_fedavg_when_clients_take_different_numbers_of_steps():
    fednova, fedavg = reference(), reference("strategy.name=fedavg")
    assert any(not np.array_equal(fednova[n], fedavg[n]) for n in fednova)


def test_a_resumed_fednova_run_equals_the_uninterrupted_one_bitwise(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    rest = stopped_and_resumed(tmp_path, cfg, resume_ranks=3)
    assert "resum" in rest.stderr.lower()
    assert_bitwise(final_model(tmp_path / "split"), reference())


def test_the_divisor_is_the_sum_of_weights_over_the_effective_local_steps():
    # p = (10, 30), tau = (2, 6): tau_eff = (10 * 2 + 30 * 6) / 40 = 5, so D = sum p / tau_eff = 40 / 5 = 8
    assert fednova_total([(10.0, 2), (30.0, 6)]) == 8.0 == fednova_divisor([(10.0, 2), (30.0, 6)])
    # equal steps: FedNova is FedAvg (D = sum p, weights p / tau scaled back by tau)
    assert fednova_total([(10.0, 4), (30.0, 4)]) == 40.0 / 4


def test_a_trainer_that_reports_no_local_steps_is_named():
    combiner = NormalizedAverage(StrategyConfig(name="fednova", update="delta"))
    with pytest.raises(ValueError, match="logical client 7's update header reports local_steps=None: fednova"):
        combiner.weight_of(UpdateMeta(7, 50, 0.1))


@pytest.mark.parametrize("overrides,message", [
    (("strategy.update=weights",), "strategy.update: strategy 'fednova' divides the weighted sum of deltas"),
    (("privacy.mode=central", "privacy.clip=1.0", "privacy.noise_multiplier=1.0"),
     "privacy.mode: DP-FedAvg divides by a fixed expected count"),
    (("clock.mode=fedbuff",), "clock.mode: 'fedbuff' weighs updates by staleness instead"),
])
def test_fednova_refuses_what_would_replace_its_own_total(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["strategy.name=fednova", "strategy.update=delta", *overrides])


def test_securely_aggregated_fednova_is_the_plain_fixed_point_sum_and_near_the_float_one(tmp_path):
    """Secure aggregation sums each client's (p_i / tau_i) * delta_i in fixed point: masked, it is bitwise the
    unmasked fixed-point sum; against the float sum, each round's mean is off by at most half a step of 2^-f
    (f = secagg.fraction_bits, 16), so after 3 rounds by 3 * 2^-17."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    models = {}
    for name, overrides in (("masked", ("secagg.enabled=true",)),
                            ("unmasked", ("secagg.enabled=true", "secagg.masking=false")), ("float", ())):
        result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / name), *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        models[name] = final_model(tmp_path / name)
    assert_bitwise(models["masked"], models["unmasked"])
    for tensor, want in models["float"].items():
        np.testing.assert_allclose(models["masked"][tensor], want, rtol=0, atol=3 * 2.0**-17, err_msg=tensor)
    assert any(not np.array_equal(models["masked"][n], models["float"][n]) for n in models["float"])  # fixed point
