"""Secure aggregation in process: the range its fixed point holds (one formula for the encoder's clamp, the
warning, the advice and the check before a run), what rank 0 says when values are clamped, and the minimum
cohort (secagg.min_cohort) in the config, the sampler and the reduction's abort."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import mpifl_here, write_config

from mpifl.config import ConfigError, SecAggConfig, load_config
from mpifl.privacy.ring import clamp_limit, fitting_fraction_bits, range_problem, value_range

SECAGG = ["secagg.enabled=true"]


def clamped_by_the_encoder(values: torch.Tensor, weight: float, cohort: int, fraction_bits: int = 16) -> int:
    """How many of ``values`` a client of ``weight`` in a cohort of ``cohort`` clamps as it masks them."""
    from mpifl.privacy.secagg import SecureAggregation

    secure = SecureAggregation(SecAggConfig(enabled=True, fraction_bits=fraction_bits, masking=False), seed=1)
    return secure.mask([values.clone()], [0], weight, tuple(range(cohort)), round_=1, client=0)["secagg_clamped"]


@pytest.mark.parametrize("fraction_bits,cohort,weight", [(16, 10, 9519.0), (30, 2, 1.0), (20, 7, 3.0), (1, 1, 1.0)])
def test_values_inside_the_range_pass_the_encoder_and_values_outside_are_clamped(fraction_bits, cohort, weight):
    bound = value_range(fraction_bits, cohort, weight)
    assert bound == pytest.approx(2 ** (31 - fraction_bits) / (cohort * weight), rel=1e-6)  # the docs' formula
    inside = torch.tensor([0.999 * bound, -0.999 * bound, 0.0])
    outside = torch.tensor([1.001 * bound, -1.001 * bound, 0.5 * bound])
    assert clamped_by_the_encoder(inside, weight, cohort, fraction_bits) == 0
    assert clamped_by_the_encoder(outside, weight, cohort, fraction_bits) == 2


def test_the_fraction_bits_advised_are_the_most_that_hold_the_value():
    rng = random.Random(3)
    for _ in range(2000):
        cohort, weight = rng.randint(1, 1000), rng.choice([1.0, float(rng.randint(1, 60000))])
        largest = 10 ** rng.uniform(-6, 6)
        bits = fitting_fraction_bits(cohort, weight, largest)
        assert value_range(bits, cohort, weight) >= largest > value_range(bits + 1, cohort, weight)
    bound = value_range(16, 10, 9519.0)  # exactly a range: its own bits hold it
    assert fitting_fraction_bits(10, 9519.0, bound) == 16


def test_the_clamp_keeps_a_whole_cohort_s_sum_inside_the_ring():
    for cohort in (1, 2, 3, 10, 1000, 2 ** 31 - 1):
        assert cohort * clamp_limit(cohort) <= 2 ** 31 - 1 < cohort * (clamp_limit(cohort) + 1)


def test_a_fraction_bits_that_cannot_hold_min_range_is_refused_with_the_numbers_and_the_bits_that_would():
    cfg = SecAggConfig(enabled=True, fraction_bits=16)
    said = range_problem(cfg, cohort=10, weight=9519.0, whose="logical client 2's")
    assert said is not None and said.startswith("secagg.fraction_bits: 16 holds values only within ±0.3442 = "
                                                "(2^31 - 1) / (10 x 9519 x 2^16)")
    assert "below secagg.min_range=1" in said and "set secagg.fraction_bits to 14 or less (±1.377)" in said
    assert range_problem(SecAggConfig(enabled=True, fraction_bits=14), 10, 9519.0, "") is None
    assert range_problem(SecAggConfig(enabled=True, fraction_bits=16, min_range=0.3), 10, 9519.0, "") is None
    assert range_problem(SecAggConfig(enabled=True, fraction_bits=16, min_range=0), 10, 9519.0, "") is None
    hopeless = range_problem(SecAggConfig(enabled=True, min_range=1e6), 1000, 60000.0, "")
    assert hopeless is not None and "no secagg.fraction_bits can" in hopeless


def test_the_check_before_mpi_refuses_fraction_bits_that_even_a_weight_of_one_cannot_use():
    from mpifl.cli.preflight import check_plugins

    with pytest.raises(ConfigError, match=r"secagg.fraction_bits: 30 holds values only within ±0.2 = \(2\^31 - 1\) "
                                          r"/ \(10 x 1 x 2\^30\) for a cohort of 10"):
        check_plugins(load_config(None, [*SECAGG, "clients.num_clients=10", "secagg.fraction_bits=30"]))
    check_plugins(load_config(None, [*SECAGG, "clients.num_clients=10", "secagg.fraction_bits=27"]))  # ±1.6


def test_before_the_data_is_read_the_advised_bits_are_a_ceiling_and_the_message_says_where_the_figure_is():
    from mpifl.cli.preflight import check_plugins

    with pytest.raises(ConfigError) as by_samples:
        check_plugins(load_config(None, [*SECAGG, "clients.num_clients=10", "secagg.fraction_bits=30"]))
    assert "27 or less (±1.6) at the very most: the largest client's sample count lowers it, and `mpifl " \
           "validate`, which reads the data, gives the figure" in str(by_samples.value)
    with pytest.raises(ConfigError) as equal:  # a weight of 1 is every client's: the advice is exact
        check_plugins(load_config(None, [*SECAGG, "clients.num_clients=10", "secagg.fraction_bits=30",
                                         "strategy.weighting=equal"]))
    assert "27 or less (±1.6)" in str(equal.value) and "at the very most" not in str(equal.value)


def test_advice_never_goes_past_the_largest_fraction_bits_the_schema_takes():
    from mpifl.privacy.ring import advisable_fraction_bits, most_fraction_bits

    assert most_fraction_bits() == 30
    assert fitting_fraction_bits(2, 1.0, 1e-6) > 30 and advisable_fraction_bits(2, 1.0, 1e-6) == 30
    assert advisable_fraction_bits(10, 9519.0, 1.0) == fitting_fraction_bits(10, 9519.0, 1.0) == 14


def test_validate_checks_the_range_for_the_partition_s_largest_client(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", "clients: {num_clients: 4}\nsecagg: {enabled: true, fraction_bits: 24}\n"
                                            "data: {dataset: synthetic, kwargs: {num_samples: 500}}\n")
    refused = mpifl_here("validate", str(cfg))  # 100 training samples a client: ±0.32 < 1
    assert refused.returncode == 2
    assert ("(2^31 - 1) / (4 x 100 x 2^24) for a cohort of 4 (clients.per_round) whose largest client weight is 100 "
            "(logical client 0's: 100 training samples, strategy.weighting='samples')") in refused.stderr
    assert "set secagg.fraction_bits to 22 or less (±1.28)" in refused.stderr
    assert mpifl_here("validate", str(cfg), "strategy.weighting=equal").returncode == 0
    # bits that even a weight of 1 cannot use: validate still advises from the largest client, not from 1
    beyond = mpifl_here("validate", str(cfg), "secagg.fraction_bits=30")
    assert beyond.returncode == 2 and "(4 x 100 x 2^30)" in beyond.stderr and "22 or less" in beyond.stderr


def test_fednova_s_weights_are_left_to_the_rounds_as_they_depend_on_the_local_steps():
    from mpifl.aggregation.strategies import make_strategy
    from mpifl.privacy.secagg import largest_weight

    fednova = load_config(None, [*SECAGG, "strategy.name=fednova", "strategy.update=delta"])
    assert largest_weight(make_strategy(fednova.strategy), [100, 5000]) is None
    fedavg = load_config(None, SECAGG)
    assert largest_weight(make_strategy(fedavg.strategy), [100, 5000])[0] == 5000.0
    assert largest_weight(make_strategy(fedavg.strategy))[0] == 1.0  # without the data: one sample, at least


def entry(round_: int, clamped: int, fits: int, cohort: int = 10, weight: float = 9519.0) -> dict:
    """A round's record as the server writes it, its secagg entry as ``secagg_record`` makes it."""
    return {"round": round_, "secagg": {"dropped": 0, "mask_seconds": 0.01, "clamped": clamped, "cohort": cohort,
                                        "largest_weight": weight, "range": value_range(16, cohort, weight),
                                        "range_used": 2.0 ** (16 - fits) * 0.9, "max_fraction_bits": fits}}


def test_clamping_is_warned_of_in_its_first_round_and_again_only_when_a_round_needs_fewer_bits(capfd):
    from mpifl.roles.records import note_secagg

    cfg, history, said = SecAggConfig(enabled=True), [], {}
    for record in (entry(1, 0, 17), entry(2, 33, 14), entry(3, 21, 14), entry(4, 40, 15), entry(5, 2, 12)):
        history.append(record)
        note_secagg(history, cfg)
        said[record["round"]] = capfd.readouterr().err
    assert said[1] == said[3] == said[4] == ""
    assert said[2] == ("[rank 0] warning: round 2: secure aggregation clamped 33 values into the ring's range, so the "
                       "model is not the plain sum's: secagg.fraction_bits=16 holds ±0.3442 = (2^31 - 1) / (10 x 9519 "
                       "x 2^16) for the heaviest client of this cohort of 10, of weight 9519 (a lighter client's "
                       "range is wider in proportion), and a value reached 3.6 times its client's range; "
                       "secagg.fraction_bits=14 would have held every value of this round. Said again only for a "
                       "round that needs fewer bits; metrics.jsonl's secagg.clamped counts every round's\n")
    assert "round 5: secure aggregation clamped 2 values" in said[5] and "secagg.fraction_bits=12 would" in said[5]


def test_the_run_s_end_sums_up_the_clamped_rounds_and_the_withheld_ones():
    from mpifl.roles.records import secagg_summary

    cfg = SecAggConfig(enabled=True)
    assert secagg_summary([entry(1, 0, 17), entry(2, 0, 17)], cfg) == []
    withheld = entry(3, 0, 17)
    withheld["secagg"] = {"dropped": 0, "mask_seconds": 0.0, "clamped": 0, "cohort": 0, "withheld": [4]}
    assert secagg_summary([entry(1, 5, 15), entry(2, 40, 14), withheld, entry(4, 0, 17)], cfg) == [
        "warning: secure aggregation clamped values in 2 of 4 rounds, 45 in all (most: 40 in round 2); "
        "secagg.fraction_bits=14 would have held every round's values (docs/how-to/secure-aggregation.md)",
        "secagg.min_cohort: 1 of 4 rounds (round 3) drew fewer than 2 clients and ran without updates"]


def test_the_record_gives_the_range_of_the_heaviest_client_and_the_bits_every_client_fits_in():
    from mpifl.roles.records import secagg_record
    from mpifl.wire.protocol import UpdateMeta

    metas = {c: UpdateMeta(c, n, 0.0, {"secagg_clamped": k, "secagg_peak": peak})
             for c, n, k, peak in ((0, 100, 0, 0.5), (1, 4000, 7, 2.0), (2, 50, 0, 30.0))}
    record = secagg_record(metas, 3, 16, lambda m: float(m.num_samples))
    assert record["clamped"] == 7 and record["largest_weight"] == 4000.0
    assert record["range"] == value_range(16, 3, 4000.0)
    assert record["range_used"] == pytest.approx(2.0 / value_range(16, 3, 4000.0))  # client 1's, not client 2's 30
    assert record["max_fraction_bits"] == min(fitting_fraction_bits(3, 4000.0, 2.0), fitting_fraction_bits(3, 50, 30))


def test_a_fixed_cohort_below_min_cohort_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"secagg.min_cohort: 2 is more than the 1 clients sampled per round: the "
                                          r"masked sum of fewer than 2 reveals what they sent \(one client's update, "
                                          r"exactly\)"):
        load_config(None, [*SECAGG, "clients.per_round=1"])
    with pytest.raises(ConfigError, match=r"secagg.min_cohort: 5 is more than the 4 clients sampled per round"):
        load_config(None, [*SECAGG, "clients.per_round=4", "secagg.min_cohort=5"])
    load_config(None, [*SECAGG, "clients.per_round=1", "secagg.min_cohort=1"])  # accepted on purpose
    load_config(None, ["clients.per_round=1"])  # without secure aggregation, nothing to reveal


def test_a_poisson_round_drawing_fewer_than_min_cohort_is_withheld_whole():
    from mpifl.planning.federation import Sampler, placement_for, poisson_sample

    clients = load_config(None, ["clients.num_clients=6", "clients.per_round=2"]).clients
    placement = placement_for(clients, 2, None)
    sampler = Sampler(0, clients, placement, poisson=True, min_cohort=2)
    drawn = {r: poisson_sample(0, r, 6, 2 / 6) for r in (1, 2, 3)}
    assert [len(drawn[r]) for r in (1, 2, 3)] == [3, 1, 3]  # seed 0: round 2 draws one client
    lone = sampler.plan(2)
    assert lone.participants == () and lone.withheld == tuple(drawn[2]) and not any(lone.train.values())
    assert sampler.plan(1).participants == tuple(drawn[1]) and sampler.plan(1).withheld == ()
    assert Sampler(0, clients, placement, poisson=True).plan(2).participants == tuple(drawn[2])  # no minimum: as before


def test_a_round_left_with_fewer_usable_updates_than_min_cohort_is_aborted_before_anything_is_written():
    from mpifl.aggregation.round_task import ReductionRound, RoundAborted, checked_totals
    from mpifl.aggregation.strategies import make_strategy
    from mpifl.wire.protocol import UpdateMeta

    strategy = make_strategy(load_config(None, SECAGG).strategy)
    metas = {0: UpdateMeta(0, 10, 0.0, {}), 1: UpdateMeta(1, 10, 0.0, {}, "dropped"), 2: UpdateMeta(2, 10, 0.0, {},
                                                                                                   "dropped")}
    task = ReductionRound(4, {1: [0, 1, 2]}, layout=None, min_cohort=2)  # type: ignore[arg-type]
    with pytest.raises(RoundAborted, match=r"round 4: only 1 of 3 participants sent a usable update, fewer than "
                                           r"secagg.min_cohort=2: the securely aggregated sum of so few would reveal "
                                           r"what they sent \(one update, exactly\)"):
        checked_totals(strategy, metas, task, [0, 1, 2])
    metas[1] = UpdateMeta(1, 10, 0.0, {})
    assert checked_totals(strategy, metas, task, [0, 1, 2])[0] == 20.0  # two survivors: applied
