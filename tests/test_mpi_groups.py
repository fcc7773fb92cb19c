"""Under mpiexec: reduction groups (clients.groups) sum updates on their rank before anything travels.

Results are bitwise the whole-model reference's with the same grouping, whatever the number
of client ranks; the server receives one fp32 partial sum per group, not one update per client.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import MPI_TIMEOUT, run_mpi, write_config
from reference import reference_run
from test_mpi_strategies import CONFIG, assert_bitwise, assert_close, expected, run

from mpifl.config import load_config
from mpifl.storage.hdf5 import load_tensors

GROUPED = ("clients.groups=2",)


@pytest.mark.parametrize("ranks,overrides", [
    # 6 participants on 2 client ranks: 3 per rank summed there; fp32, chunks dividing nothing
    (3, ("transport.chunk_mb=0.00095",)),
    # the same groups hosted by one client rank: same result (groups, not ranks, fix the sums)
    (2, ("transport.chunk_mb=0.00095",)),
    # bf16 model, deltas, equal weighting
    (3, ("model.dtype=bfloat16", "strategy.update=delta", "strategy.weighting=equal")),
])
def test_grouped_fedavg_equals_the_grouped_reference_bitwise_on_any_rank_count(tmp_path, ranks, overrides):
    assert_bitwise(run(tmp_path, "run", ranks, *GROUPED, *overrides), expected(*GROUPED, *overrides))


@pytest.mark.parametrize("ranks,overrides", [
    (3, ("strategy.name=fedavgm", "strategy.server_lr=0.7")),
    (3, ("strategy.name=fedadam", "strategy.update=delta", "strategy.server_lr=0.05")),
    (2, ("strategy.name=fedyogi", "strategy.server_lr=0.05")),
    (3, ("strategy.name=fedadagrad", "strategy.update=delta", "strategy.server_lr=0.03")),
])
def test_grouped_server_optimizers_match_the_reference(tmp_path, ranks, overrides):
    assert_close(run(tmp_path, "run", ranks, *GROUPED, *overrides), expected(*GROUPED, *overrides), rtol=1e-5)


def test_the_server_receives_one_partial_sum_per_group(tmp_path):
    run(tmp_path, "plain", 3, "rounds=1")
    run(tmp_path, "grouped", 3, "rounds=1", *GROUPED)
    got = {name: json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
           for name in ("plain", "grouped")}
    assert got["grouped"]["bytes_received"] * 3 == got["plain"]["bytes_received"]  # 6 updates -> 2 fp32 sums
    assert got["grouped"]["participants"] == got["plain"]["participants"]


@pytest.mark.parametrize("reduce,groups", [
    ("direct", 2),
    ("chain", 2),
    ("chain", 5),  # client 3 is all of group 3, a hop in the middle of the chain: its rank passes the sum on
])
def test_a_dropped_client_leaves_its_group_sum_and_the_rest_is_averaged(tmp_path, reduce, groups):
    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace('"fl_helpers:NoiseTrainer"', '"fl_helpers:FailingClients"'))
    env = {"FL_HELPERS_RAISE": "3", "FL_HELPERS_SEED": "5"}
    grouped = [f"clients.groups={groups}"]
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *grouped, "clients.accept_failures=true",
                     f"transport.reduce={reduce}", env=env, timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    rounds = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    dropped = [d["client"] for r in rounds for d in r["dropped"]]
    assert dropped and set(dropped) == {3}
    want = reference_run(load_config(None, grouped, data=yaml.safe_load(CONFIG)), drop=frozenset({3}))
    got = {n: t.float().numpy() for n, t in load_tensors(tmp_path / "run" / "model.h5").items()}
    assert_bitwise(got, want)


def test_out_of_core_server_takes_many_clients_per_rank_with_groups(tmp_path):
    memory = run(tmp_path, "memory", 3, *GROUPED)
    disk = run(tmp_path, "disk", 3, *GROUPED, "server.state=disk")
    assert_bitwise(disk, memory)


def test_the_out_of_core_server_takes_several_groups_per_rank_along_a_chain_and_resumes_on_another_count(tmp_path):
    """The chain hands the server one stream, however many groups each rank holds: G is no longer tied to the
    number of client ranks, so an out-of-core run can go on on another number of ranks, bitwise."""
    grouped = ("clients.groups=4", "server.state=disk", "transport.reduce=chain", "transport.chunk_mb=0.00095")
    memory = run(tmp_path, "memory", 3, "clients.groups=4")  # point-to-point, in memory
    assert_bitwise(run(tmp_path, "disk", 3, *grouped), memory)
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    first = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "resumed"), *grouped, "rounds=1",
                    timeout=MPI_TIMEOUT)
    assert first.returncode == 0, first.stderr
    rest = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "resumed"), "--resume", *grouped,
                   timeout=MPI_TIMEOUT)  # 3 client ranks now: groups 0 and 3 on rank 1
    assert rest.returncode == 0, rest.stderr
    assert_bitwise({n: t.float().numpy() for n, t in load_tensors(tmp_path / "resumed" / "model.h5").items()}, memory)


@pytest.mark.parametrize("overrides,message", [
    (("clients.groups=2", "strategy.name=median"), "clients.groups: strategy 'median' needs every participant"),
    (("clients.groups=2", "strategy.wire_dtype=bfloat16"), "strategy.wire_dtype: with clients.groups"),
    (("clients.groups=1",), "clients.groups=1 < 2 client ranks"),
    (("clients.groups=4", "server.state=disk"), "clients.groups=4 > 2 client ranks"),
])
def test_groups_that_cannot_work_are_refused_naming_the_key(tmp_path, overrides, message):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides, timeout=MPI_TIMEOUT)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("groups", [(), GROUPED])
def test_placement_balanced_by_work_changes_where_clients_run_not_the_result(tmp_path, groups):
    skewed = ("data.partition=unbalanced", "data.size_sigma=1.5")
    balanced = run(tmp_path, "balanced", 3, *skewed, *groups, "clients.placement=balanced")
    assert_bitwise(balanced, run(tmp_path, "round-robin", 3, *skewed, *groups))


@pytest.mark.parametrize("overrides", [GROUPED, (*GROUPED, "transport.reduce=chain"), ("clients.groups=4",)])
def test_a_strategy_dividing_by_count_is_told_the_usable_participants_not_the_group_sums(tmp_path, overrides):
    """``finish`` and ``combine`` get ``count``, the usable updates (docs/reference/plugins.md): under groups that is
    still the 6 participants, not the 2 (or 4) partial sums nor the chain's one. Before, such a mean came out 3
    times too large with 2 groups."""
    got = run(tmp_path, "counted", 3, *overrides, "strategy.name=plugin_helpers:counted_mean")
    assert_close(got, expected(*overrides, "strategy.weighting=equal"), rtol=1e-6)


@pytest.mark.parametrize("ranks", [3, 5, 9])
def test_a_chain_reduction_equals_the_grouped_reference_and_the_server_receives_one_sum(tmp_path, ranks):
    grouped = (f"clients.groups={ranks - 1}",)  # one group per client rank: the chain adds them in group order
    got = run(tmp_path, "chain", ranks, *grouped, "transport.reduce=chain", "transport.chunk_mb=0.00095")
    assert_bitwise(got, expected(*grouped, "transport.chunk_mb=0.00095"))
    for line in (tmp_path / "chain" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        fp32_sum = sum(4 * t.numel() for t in load_tensors(tmp_path / "chain" / "model.h5").values())
        assert record["bytes_received"] == fp32_sum  # one fp32 partial sum per round, whatever the ranks
        assert len(record["participants"]) == 6


def test_the_chain_visits_the_groups_in_the_servers_fold_order_a_run_of_them_per_hop():
    from mpifl.wire.protocol import SERVER, ChainHop, chain_hops

    # 7 groups round robin on 3 ranks, then group 6 moved to rank 1 as a balanced placement might: 0 1 2 3 4 5 6
    hops = chain_hops({1: [0, 3, 6], 2: [1, 4], 3: [2, 5]})
    assert hops == {1: (ChainHop((0,), None, 2), ChainHop((3,), 3, 2), ChainHop((6,), 3, SERVER)),
                    2: (ChainHop((1,), 1, 3), ChainHop((4,), 1, 3)),
                    3: (ChainHop((2,), 2, 1), ChainHop((5,), 2, 1))}
    # consecutive groups on one rank are one hop, added there one after another
    assert chain_hops({2: [2, 3], 1: [0, 1, 4]}) == {1: (ChainHop((0, 1), None, 2), ChainHop((4,), 2, SERVER)),
                                                     2: (ChainHop((2, 3), 1, 1),)}
    assert chain_hops({1: [0, 1, 2]}) == {1: (ChainHop((0, 1, 2), None, SERVER),)}


@pytest.mark.parametrize("ranks,overrides", [
    (2, ()),  # one client rank: every group in one hop
    (3, ()),  # groups 0 2 4 on rank 1, 1 3 on rank 2: the sum goes back and forth
    (4, ("clients.placement=balanced",)),  # groups placed by their work: runs of consecutive groups on one rank
])
def test_a_chain_over_several_groups_per_rank_gives_the_bits_of_point_to_point_groups(tmp_path, ranks, overrides):
    grouped = ("clients.groups=5", "transport.chunk_mb=0.00095")
    got = run(tmp_path, "chain", ranks, *grouped, *overrides, "transport.reduce=chain")
    assert_bitwise(got, expected(*grouped))
    for line in (tmp_path / "chain" / "metrics.jsonl").read_text().splitlines():
        fp32_sum = sum(4 * t.numel() for t in load_tensors(tmp_path / "chain" / "model.h5").values())
        assert json.loads(line)["bytes_received"] == fp32_sum  # still one sum per round


def test_a_chain_under_per_round_placement_with_groups_by_cost_is_rank_count_independent(tmp_path):
    grouped = ("clients.groups=3", "clients.placement=per_round", "clients.group_by=cost", "transport.reduce=chain")
    on_two = run(tmp_path, "two", 3, *grouped)
    assert_bitwise(run(tmp_path, "three", 4, *grouped), on_two)
    assert_bitwise(run(tmp_path, "direct", 3, *grouped[:-1]), on_two)  # and the point-to-point groups' bits


def test_quantized_group_sums_are_rank_count_independent_and_a_quarter_of_the_bytes(tmp_path):
    grouped = ("clients.groups=2", "strategy.update=delta", "rounds=2")
    on_two = run(tmp_path, "int8-2", 2, *grouped, "compression.method=int8")
    on_three = run(tmp_path, "int8-3", 3, *grouped, "compression.method=int8")
    assert_bitwise(on_two, on_three)  # the noise is keyed by (seed, round, group), not by rank
    plain = run(tmp_path, "fp32", 3, *grouped)
    for name in plain:  # the quantized sums are unbiased estimates of the fp32 ones
        assert np.abs(on_three[name] - plain[name]).max() < 0.05 * np.abs(plain[name]).max() + 1e-6, name
    bytes_in = {name: json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])["bytes_received"]
                for name in ("int8-3", "fp32")}
    assert 0.25 < bytes_in["int8-3"] / bytes_in["fp32"] < 0.27  # one int8 per value plus a scale per 256


def test_a_chain_hop_whose_every_client_failed_passes_the_running_sum_on_unchanged(tmp_path):
    grouped = ("clients.groups=4",)  # 4 client ranks, one group each; group 1 = clients 1 and 5, on rank 2
    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace('"fl_helpers:NoiseTrainer"', '"fl_helpers:FailingClients"'))
    env = {"FL_HELPERS_RAISE": "1,5", "FL_HELPERS_SEED": "5"}
    result = run_mpi(5, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *grouped, "clients.accept_failures=true",
                     "transport.reduce=chain", env=env, timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    want = reference_run(load_config(None, list(grouped), data=yaml.safe_load(CONFIG)), drop=frozenset({1, 5}))
    got = {n: t.float().numpy() for n, t in load_tensors(tmp_path / "run" / "model.h5").items()}
    assert_bitwise(got, want)


@pytest.mark.parametrize("reduce", ["direct", "chain"])
def test_a_group_of_a_thousand_members_sends_its_header_whole(tmp_path, reduce):
    """A group's header lists each member's: past mpi4py's 32 KiB default for a pickled nonblocking receive it used
    to be truncated (MPI_ERR_TRUNCATE on the server at 1,000 clients a round), so the server sizes the receive by
    the most members a header can list (``protocol.header_bytes``)."""
    cfg = write_config(tmp_path / "c.yaml", """
seed: 1
rounds: 1
clients: {num_clients: 1000, per_round: 1000, groups: 2}
data: {dataset: synthetic, partition: iid, kwargs: {num_samples: 4000, num_features: 8, test_fraction: 0.1}}
model: {name: mlp, kwargs: {hidden: [4]}}
train: {local_steps: 1, batch_size: 4}
eval: {every: 0}
output: {progress: false}
""")
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), f"transport.reduce={reduce}")
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(record["participants"]) == 1000 and not record["dropped"]
