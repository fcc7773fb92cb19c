"""clients.placement: per_round: each round's participants spread over the ranks by estimated cost (Graham's LPT
rule), the cost being a fitted per-client overhead plus samples x epochs; clients.group_by: cost forms each round's
reduction groups from its participants' work. Pure functions, no MPI."""
from __future__ import annotations

import pytest

from mpifl.config import ConfigError, load_config
from mpifl.planning.federation import (
    RoundAssignment,
    RoundBalancedPlacement,
    Sampler,
    cost_groups,
    fitted_overhead,
    longest_first,
    placement_for,
)


def test_longest_first_gives_each_unit_in_falling_cost_to_the_least_loaded_rank():
    # 5 -> rank 1; 4 -> rank 2; 3 (unit 2) -> rank 2 (4 < 5); 3 (unit 3) -> rank 1 (5 < 7); 3 (unit 4) -> rank 2
    assert longest_first({0: 5.0, 1: 4.0, 2: 3.0, 3: 3.0, 4: 3.0}, 2) == {0: 1, 1: 2, 2: 2, 3: 1, 4: 2}
    assert longest_first({7: 1.0, 3: 1.0}, 2) == {3: 1, 7: 2}  # ties: the lower unit first, to the lower rank


def test_the_overhead_is_the_fitted_fixed_cost_per_client_in_units_of_work():
    a, b = 0.02, 0.001  # 20 ms per client, 1 ms per sample: the overhead is worth 20 samples
    rows = [(n, w, a * n + b * w) for n, w in [(3, 300.0), (5, 200.0), (2, 400.0), (7, 90.0)]]
    assert fitted_overhead(rows) == pytest.approx(20.0)
    assert fitted_overhead(rows[:1]) is None  # one row cannot separate the two costs
    assert fitted_overhead([(2, 100.0, 1.0), (4, 200.0, 2.0)]) is None  # collinear rows neither
    assert fitted_overhead([(1, 100.0, 1.0), (1, 200.0, 0.5)]) is None  # time that falls as work grows
    assert fitted_overhead([(1, 100.0, 0.5), (4, 100.0, 0.5)]) == 0.0  # more clients, no more time: no overhead
    assert fitted_overhead([(1, 100.0, 1.0), (2, 300.0, 2.0), (4, 200.0, 2.0)]) >= 0.0


def test_per_round_placement_balances_samples_first_then_the_measured_cost():
    work = [100.0] + [10.0] * 10
    placement = RoundBalancedPlacement(client_ranks=2, groups=0, work=work)
    everyone = list(range(11))
    assert placement.by_rank(everyone) == {1: [0], 2: list(range(1, 11))}  # 100 samples against 10 x 10
    # measured: every client costs as much as 50 samples whatever its size, so 10 small clients are slow
    placement.observe({1: [0], 2: list(range(1, 11))}, {1: 0.001 * (50 + 100), 2: 0.001 * (10 * 50 + 100)})
    placement.observe({1: [0, 1], 2: list(range(2, 11))}, {1: 0.001 * (100 + 110), 2: 0.001 * (9 * 50 + 90)})
    assert placement.overhead == pytest.approx(50.0)
    spread = placement.by_rank(everyone)
    assert sorted(map(len, spread.values())) == [5, 6]
    loads = [sum(50 + work[c] for c in clients) for clients in spread.values()]
    assert max(loads) - min(loads) <= 60  # within one small client's cost


def test_per_round_placement_keeps_a_groups_members_together_and_any_rank_may_host_any_client():
    placement = RoundBalancedPlacement(client_ranks=3, groups=4, work=[float(1 + c) for c in range(12)])
    spread = placement.by_rank([0, 1, 4, 5, 6, 9, 11])
    assert sorted(c for clients in spread.values() for c in clients) == [0, 1, 4, 5, 6, 9, 11]
    for clients in spread.values():
        for other in spread.values():
            if other is not clients:
                assert not {c % 4 for c in clients} & {c % 4 for c in other}
    assert placement.clients_of(2, 12) == list(range(12))
    with pytest.raises(ValueError, match="RoundAssignment"):
        placement.rank_of(3)


def test_a_round_says_which_rank_trains_each_client():
    plan = RoundAssignment(4, (1, 2, 5), {1: [2], 2: [1, 5]}, {1: [2], 2: [1, 5]})
    assert [plan.rank_of(c) for c in (1, 2, 5, 7)] == [2, 1, 2, None]


def test_the_config_chooses_the_per_round_placement():
    cfg = load_config(None, ["clients.placement=per_round", "clients.num_clients=4"], data={})
    assert isinstance(placement_for(cfg.clients, 2, None), RoundBalancedPlacement)


@pytest.mark.parametrize("overrides,message", [
    (["clock.mode=fedbuff", "strategy.update=delta", "clients.num_clients=40"],
     "clock.mode: clients.placement: 'per_round'"),
    (["secagg.enabled=true"], "secagg.enabled: clients.placement: 'per_round'"),
])
def test_what_ties_a_client_or_a_sum_to_a_rank_refuses_per_round_placement(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["clients.placement=per_round", *overrides], data={})


def test_cost_groups_split_a_rounds_participants_into_groups_of_near_equal_work_heaviest_first():
    work = [float(w) for w in (9, 1, 7, 3, 3, 2, 8, 4)]
    groups = cost_groups([0, 2, 3, 4, 6, 7], work, 2)
    # 9 -> g0; 8 -> g1; 7 -> g1 (8 < 9); 4 -> g0 (9 < 15); 3 (client 3) -> g0 (13 < 15); 3 (client 4) -> g1 (15 < 16)
    assert groups == {0: 0, 2: 1, 3: 0, 4: 1, 6: 1, 7: 0}
    loads = [sum(work[c] for c, g in groups.items() if g == k) for k in (0, 1)]
    assert max(loads) - min(loads) <= max(work)  # LPT: within one client's work


def test_cost_groups_depend_on_the_participants_and_their_work_only_never_on_the_ranks():
    work = [float(1 + (7 * c) % 11) for c in range(40)]
    clients = list(range(0, 40, 3))
    by_rank = {ranks: RoundBalancedPlacement(ranks, 3, work, group_by="cost") for ranks in (1, 2, 3)}
    assert all(p.round_groups(clients) == cost_groups(clients, work, 3) for p in by_rank.values())
    for ranks, placement in by_rank.items():  # each group lies whole on one rank
        spread = placement.by_rank(clients)
        groups = cost_groups(clients, work, 3)
        homes = {groups[c]: r for r, members in spread.items() for c in members}
        assert all(homes[groups[c]] == r for r, members in spread.items() for c in members)
        assert len(spread) == min(ranks, 3)


def test_a_round_with_cost_groups_names_each_participants_group_and_the_streams_follow_it():
    cfg = load_config(None, ["clients.placement=per_round", "clients.num_clients=10", "clients.per_round=6",
                             "clients.groups=2", "clients.group_by=cost"], data={})
    work = [float(1 + c) for c in range(10)]
    placement = placement_for(cfg.clients, 2, work)
    plan = Sampler(3, cfg.clients, placement).plan(1)
    assert plan.groups == cost_groups(list(plan.participants), work, 2)
    assert sorted(g for streams in plan.streams.values() for g in streams) == [0, 1]
    for rank, (stream,) in plan.streams.items():
        assert [c for c in plan.train[rank]] == sorted(c for c, g in plan.groups.items() if g == stream)
        assert plan.group_of(plan.train[rank][0], 2) == stream


@pytest.mark.parametrize("overrides", [["clients.groups=2"], ["clients.placement=per_round"]])
def test_cost_groups_need_groups_and_per_round_placement_and_say_so(overrides):
    with pytest.raises(ConfigError, match="clients.group_by: 'cost' forms each round's reduction groups anew"):
        load_config(None, ["clients.group_by=cost", "clients.num_clients=4", *overrides], data={})


def busy_round(*overrides: str, state_home=None) -> tuple[RoundAssignment, RoundAssignment]:
    """Round 1 of 8 clients, all sampled, on 3 client ranks, as planned and with rank 2 busy since round 0."""
    cfg = load_config(None, ["clients.num_clients=8", "clients.per_round=8", *overrides], data={})
    sampler = Sampler(3, cfg.clients, placement_for(cfg.clients, 3, [1.0] * 8))
    plan = sampler.plan(1)
    return plan, sampler.without_busy(plan, {2: 0}, state_home)


def test_a_busy_ranks_clients_are_left_out_of_the_round_as_if_not_sampled_and_it_gets_nothing():
    plan, busy = busy_round()
    assert plan.train[2] == [1, 4, 7]
    assert busy.busy_ranks == {2: 0} and busy.busy_clients == {1: 2, 4: 2, 7: 2}
    assert busy.participants == (0, 2, 3, 5, 6) and 2 not in busy.train and 2 not in busy.streams
    assert busy.train == {1: [0, 3, 6], 3: [2, 5]} and busy.streams == busy.train


def test_with_reduction_groups_the_ready_ranks_keep_their_groups_partial_sums():
    _, busy = busy_round("clients.groups=3")
    assert busy.train == {1: [0, 3, 6], 3: [2, 5]} and busy.streams == {1: [0], 3: [2]}


def test_placed_per_round_the_busy_ranks_share_goes_to_the_ready_ranks_and_nobody_is_left_out():
    plan, busy = busy_round("clients.placement=per_round")
    assert busy.participants == plan.participants and busy.busy_clients == {}
    assert sorted(busy.train) == [1, 3] and sorted(c for cs in busy.train.values() for c in cs) == list(range(8))


def test_placed_per_round_a_client_whose_state_the_busy_rank_keeps_is_left_out():
    _, busy = busy_round("clients.placement=per_round", state_home=lambda c: 1 + c % 3)
    assert busy.busy_clients == {1: 2, 4: 2, 7: 2} and sorted(busy.train) == [1, 3]


def test_an_asynchronous_step_is_never_cut_short_for_a_busy_rank():
    cfg = load_config(None, ["clients.num_clients=8"], data={})
    sampler = Sampler(3, cfg.clients, placement_for(cfg.clients, 3, None))
    held = RoundAssignment(1, (0, 1), {1: [0], 2: [1]}, {1: [0], 2: [1]}, hold=True)
    assert sampler.without_busy(held, {2: 0}) is held


def test_with_every_rank_busy_or_too_few_participants_left_the_round_waits_as_before():
    cfg = load_config(None, ["clients.num_clients=8", "clients.per_round=8", "clients.placement=per_round"], data={})
    sampler = Sampler(3, cfg.clients, placement_for(cfg.clients, 3, [1.0] * 8))
    plan = sampler.plan(1)
    assert sampler.without_busy(plan, {1: 0, 2: 0, 3: 0}) is plan  # nobody to deal the round to
    fixed = load_config(None, ["clients.num_clients=8", "clients.per_round=8"], data={})
    fixed_sampler = Sampler(3, fixed.clients, placement_for(fixed.clients, 3, None))
    fixed_plan = fixed_sampler.plan(1)
    assert fixed_sampler.without_busy(fixed_plan, {1: 0, 2: 0}, least=3) is fixed_plan  # rank 3's 2 left, 3 needed
    assert fixed_sampler.without_busy(fixed_plan, {1: 0, 2: 0}, least=2).participants == (2, 5)
