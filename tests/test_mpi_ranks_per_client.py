"""clients.ranks_per_client: a logical client trained by a group of ranks (gloo DDP on the CPU), each on its share
of every batch. The result depends on the group size R, never on how many groups run (bitwise, in synchronous
rounds and under FedCompass's per-client local steps) nor on the run;
it is the model one rank per client trains, up to float rounding, BatchNorm included (the group normalizes over the
whole batch, not each rank's share); the process group is built once per run
(the setup time shows in round 1 only); and rank counts that cannot form whole groups are refused."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import MPI_TIMEOUT, mpiexec, run_mpi, write_config
from results import assert_bitwise, final_model

from mpifl.cli.plan import estimate
from mpifl.config import ConfigError, load_config
from mpifl.learning.parallel import backend_for, device_identity, share_of, share_weight
from mpifl.roles.group import GroupLayout
from mpifl.roles.launch import SetupError
from mpifl.roles.runner import check_world

CONFIG = """
seed: 3
rounds: 3
clients: {num_clients: 6, per_round: 4, ranks_per_client: 2}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [16]}}
train: {lr: 0.05, momentum: 0.5, batch_size: 15, local_epochs: 1, device: cpu}
eval: {every: 0}
output: {progress: false}
"""


def run(tmp_path: Path, name: str, ranks: int, *overrides: str) -> Path:
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / name), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / name


def assert_one_ranks_model_up_to_rounding(grouped: dict, single: dict) -> None:
    """A group's final model is the one a single rank trains, but for float rounding (the gradient summed in parts)."""
    for name in single:
        np.testing.assert_allclose(grouped[name], single[name], rtol=1e-4, atol=1e-5, err_msg=name)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Pairs of ranks per client, one group (3 ranks) and two groups (5 ranks); one rank per client."""
    tmp = tmp_path_factory.mktemp("ranks_per_client")
    return {"one group": run(tmp, "one", 3), "two groups": run(tmp, "two", 5),
            "one rank per client": run(tmp, "single", 3, "clients.ranks_per_client=1")}


def test_two_ranks_per_client_give_the_same_model_bitwise_on_one_or_two_groups(runs):
    """Two separate jobs, on 3 and on 5 ranks, end bitwise equal: so does the same job run again."""
    assert_bitwise(final_model(runs["two groups"]), final_model(runs["one group"]))


def test_the_chain_over_several_groups_per_leader_gives_the_bits_of_point_to_point_groups(tmp_path):
    """Two reduction groups on each of two client groups' leaders: the running sum goes leader 1 -> leader 3 ->
    leader 1 -> leader 3 (ranks 1 and 3) and on to the server, group by group in id order, as on one leader."""
    grouped = ("clients.groups=4",)
    chain = final_model(run(tmp_path, "chain", 5, *grouped, "transport.reduce=chain"))
    assert_bitwise(chain, final_model(run(tmp_path, "direct", 5, *grouped)))
    assert_bitwise(chain, final_model(run(tmp_path, "one leader", 3, *grouped, "transport.reduce=chain")))


def test_a_group_trains_the_model_one_rank_would_up_to_float_rounding(runs):
    grouped, single = final_model(runs["one group"]), final_model(runs["one rank per client"])
    assert_one_ranks_model_up_to_rounding(grouped, single)
    assert records(runs["one group"])[-1]["train_loss"] == pytest.approx(
        records(runs["one rank per client"])[-1]["train_loss"], rel=1e-4)


def test_a_group_trains_each_client_with_its_own_local_tensors_as_one_rank_would(tmp_path):
    """model.local (FedPer's head here): the leader keeps each client's local tensors and sends them to its group
    with the global model. Were the members left with the built values, the group's averaged gradients would
    move the model far from one rank's (0.16 relative L2 after 3 rounds, measured) instead of by rounding."""
    fedper = ("model.local=['3.*']",)
    one, two = run(tmp_path, "fedper-one", 3, *fedper), run(tmp_path, "fedper-two", 5, *fedper)
    assert_bitwise(final_model(two), final_model(one))
    grouped = final_model(one)
    single = final_model(run(tmp_path, "fedper-single", 3, *fedper, "clients.ranks_per_client=1"))
    assert_one_ranks_model_up_to_rounding(grouped, single)
    assert records(one)[-1]["train_loss"] == pytest.approx(records(tmp_path / "fedper-single")[-1]["train_loss"],
                                                           rel=1e-4)


@pytest.mark.parametrize("strategy", [
    ("strategy.name=scaffold",),                              # each step corrected by c - c_i
    ("strategy.name=feddyn", "strategy.weighting=equal"),     # each gradient regularised by alpha (y - x) - g_i
    ("compression.method=topk", "compression.error_feedback=true"),  # residuals: the leader's alone, as it encodes
], ids=["scaffold", "feddyn", "topk-error-feedback"])
def test_a_group_trains_each_client_with_the_state_its_leader_keeps_as_one_rank_would(tmp_path, strategy):
    """SCAFFOLD and FedDyn: the leader keeps each client's vector (c_i, g_i), checkpointed so a resume goes on
    bitwise, and sends the group what it trains with (c - c_i, g_i) beside the global model; every rank applies
    it. Were the members to train without it, the run would end 0.047 (SCAFFOLD) and 0.013 (FedDyn) from one
    rank's (relative L2, measured) instead of by rounding. Top-k's error-feedback residuals need nothing on the
    members: only the leader encodes the update they correct."""
    overrides = (*strategy, "strategy.update=delta", "checkpoint.every=1")
    one, two = run(tmp_path, "one", 3, *overrides), run(tmp_path, "two", 5, *overrides)
    assert_bitwise(final_model(two), final_model(one))
    # the leaders' vectors travel with the checkpoint: resumed from round 2 on two groups, the run ends the same
    resumed = run(tmp_path, "resumed", 5, *overrides, "--resume", str(one / "checkpoints" / "ckpt-r000002.h5"))
    assert sorted(p.name for p in (resumed / "checkpoints").glob("*.h5")) == ["ckpt-r000003.h5"]  # round 3 only
    assert_bitwise(final_model(resumed), final_model(one))
    grouped = final_model(one)
    single = final_model(run(tmp_path, "single", 3, *overrides, "clients.ranks_per_client=1"))
    assert_one_ranks_model_up_to_rounding(grouped, single)


def test_a_group_trains_each_clients_ditto_personal_model_as_one_rank_would(tmp_path):
    """Ditto: the leader keeps each client's personal model v_i and sends it to the group with the global w it is
    regularised towards; the group updates v_i together, then trains w. Federated evaluation scores each v_i on
    its client's validation split: the same, up to rounding, as with one rank per client; bitwise on one or two
    groups, like the global model."""
    ditto = ("train.ditto_lambda=0.5", "eval.federated_every=1", "data.val_fraction=0.2")
    one, two = run(tmp_path, "one", 3, *ditto), run(tmp_path, "two", 5, *ditto)
    assert_bitwise(final_model(two), final_model(one))
    single = run(tmp_path, "single", 3, *ditto, "clients.ranks_per_client=1")
    for grouped, alone, again in zip(records(one), records(single), records(two)):
        assert grouped["federated_eval"] == again["federated_eval"]
        assert grouped["federated_eval"]["personal_loss"] == pytest.approx(alone["federated_eval"]["personal_loss"],
                                                                           rel=1e-4)
        assert grouped["federated_eval"]["personal_accuracy"] == pytest.approx(
            alone["federated_eval"]["personal_accuracy"], abs=1e-9)


@pytest.mark.parametrize("state", [
    ("strategy.name=scaffold", "strategy.update=delta", "model.local=['3.*']"),  # c - c_i and the head, sent
    ("train.ditto_lambda=0.5", "eval.federated_every=1", "data.val_fraction=0.2"),  # w and v_i, sent
], ids=["scaffold-with-local-head", "ditto"])
def test_a_group_training_on_device_replicas_keeps_each_clients_state_as_on_the_host_bitwise(tmp_path, state):
    """The GPU path's copies on the CPU (train.device_copy): the leader loads the client's state into its replica
    and broadcasts it from there (over NCCL on GPUs), and the group trains the replicas; the run is the host one."""
    host = run(tmp_path, "host", 3, *state)
    replica = run(tmp_path, "replica", 3, *state, "train.device_copy=true")
    assert_bitwise(final_model(replica), final_model(host))
    assert [r.get("federated_eval") for r in records(replica)] == [r.get("federated_eval") for r in records(host)]


def test_a_group_normalizes_batchnorm_over_the_whole_batch_as_one_rank_would(tmp_path):
    """BatchNorm's statistics come from the group's whole batch (summed over the ranks, forward and backward), so
    a model with BatchNorm trains as on one rank: per-share statistics would differ by far more than rounding."""
    bn = ("model.name=fl_helpers:bn_mlp", "model.kwargs={width: 16}", "train.batch_size=16")
    grouped = final_model(run(tmp_path, "grouped", 3, *bn))
    single = final_model(run(tmp_path, "single", 3, *bn, "clients.ranks_per_client=1"))
    assert any("running_var" in name for name in single)
    assert_one_ranks_model_up_to_rounding(grouped, single)


def test_group_batchnorm_gives_each_share_what_one_batchnorm_gives_the_whole_batch(tmp_path):
    """Uneven shares (5 and 4 samples), BatchNorm1d/2d/3d, with and without affine weights, momentum or a
    cumulative mean: outputs, input gradients, summed weight gradients and running statistics match one plain
    BatchNorm on the whole batch (tests/group_batch_norm_ranks.py, fp64)."""
    script = Path(__file__).parent / "group_batch_norm_ranks.py"
    done = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=MPI_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count(": ok") == 2


def test_the_process_group_is_built_once_per_run_and_the_round_split_shows_it(runs):
    rounds = records(runs["two groups"])
    assert rounds[0]["client_group"]["setup"] > 0
    assert all(r["client_group"]["setup"] == 0.0 for r in rounds[1:])
    for r in rounds:
        assert set(r["client_group"]) == {"setup", "dispatch", "train", "other"}
        assert r["client_group"]["train"] > 0
    assert "client_group" not in records(runs["one rank per client"])[0]


def test_fedcompass_gives_each_groups_client_its_own_local_steps_bitwise_on_one_or_two_groups(tmp_path):
    compass = ("clock.mode=fedcompass", "clock.concurrency=4", "strategy.update=delta", "rounds=4")
    assert_bitwise(final_model(run(tmp_path, "two", 5, *compass)), final_model(run(tmp_path, "one", 3, *compass)))


def test_a_rank_count_that_leaves_a_group_incomplete_is_refused_naming_the_key(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(4, "run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "clients.ranks_per_client=2" in result.stderr + result.stdout
    assert "3" in result.stderr + result.stdout  # the client ranks it found


@pytest.mark.parametrize("batch,size", [(15, 2), (16, 2), (7, 3), (1, 2), (32, 4)])
def test_each_rank_takes_a_contiguous_share_and_the_weighted_shares_make_the_batch_mean(batch, size):
    indices = torch.arange(batch)
    shares = [share_of(indices, r, size) for r in range(size)]
    assert torch.equal(torch.cat(shares), indices)
    losses = torch.rand(batch, dtype=torch.float64)
    means = [losses[s].mean() if len(s) else torch.tensor(0.0, dtype=torch.float64) for s in shares]
    ddp_average = sum(m * share_weight(len(s), batch, size) for m, s in zip(means, shares)) / size
    assert float(ddp_average) == pytest.approx(float(losses.mean()))


@pytest.mark.parametrize("identities,backend", [
    (["cpu", "cpu"], "gloo"),
    (["GPU-1f0c", "GPU-77ab", "GPU-90d2"], "nccl"),
    (["GPU-1f0c", "GPU-1f0c"], "gloo"),  # two ranks on one GPU: NCCL refuses ("Duplicate GPU detected")
    (["GPU-1f0c", "GPU-77ab", "GPU-1f0c"], "gloo"),
    (["GPU-1f0c", "cpu"], "gloo"),
])
def test_a_group_talks_over_nccl_only_when_each_of_its_ranks_has_a_gpu_of_its_own(identities, backend):
    assert backend_for(identities) == backend


def test_the_cpu_is_one_device_identity_whatever_the_rank():
    assert device_identity(torch.device("cpu")) == "cpu"


def test_the_layout_makes_groups_of_consecutive_ranks_led_by_the_first():
    layout = GroupLayout(3)
    assert layout.groups(7) == 2
    assert [layout.group_of(r) for r in range(7)] == [None, 0, 0, 0, 1, 1, 1]
    assert [layout.position(r) for r in range(7)] == [0, 0, 1, 2, 0, 1, 2]
    assert [layout.federation_rank(r) for r in range(7)] == [0, 1, 1, 1, 2, 2, 2]
    assert [layout.leader_of(r) for r in range(7)] == [0, 1, 1, 1, 4, 4, 4]
    assert layout.problem(7) is None and "3 x G + 1" in layout.problem(6)


@pytest.mark.parametrize("trainer", ["none", "examples.custom_trainer.trainer:DecayTrainer"])
def test_a_trainer_that_does_not_split_its_batches_over_a_group_is_refused_naming_the_key(trainer):
    data = {"clients": {"num_clients": 6, "ranks_per_client": 2}}
    with pytest.raises(ConfigError, match="train.trainer: clients.ranks_per_client=2"):
        load_config(None, [f"train.trainer={trainer}"], data=data)


def test_the_plan_counts_every_rank_of_a_group_and_ddps_gradient_buckets():
    alone = load_config(None, ["clients.ranks_per_client=1"], data=yaml.safe_load(CONFIG))
    grouped = load_config(None, [], data=yaml.safe_load(CONFIG))
    size, one_rank = estimate(alone, 1 + 4, 4, False)
    _, two_ranks = estimate(grouped, 1 + 2 * 4, 4, False)  # the same 4 hosts of clients, two ranks each
    assert two_ranks.client_bytes == one_rank.client_bytes + size.exchanged  # the mlp trains every tensor
    assert two_ranks.server_bytes == one_rank.server_bytes  # the server still hears one stream per client


def test_rank_count_messages_count_groups_and_the_ranks_they_need():
    cfg = load_config(None, ["clients.num_clients=2", "clients.per_round=2"], data=yaml.safe_load(CONFIG))
    with pytest.raises(SetupError, match=r"3 client groups of 2 ranks but clients.num_clients=2: use at most 5 ranks"):
        check_world(7, cfg)
    check_world(5, cfg)  # two groups of two for two clients


def test_closing_a_group_frees_its_ddp_wrappers_before_ending_the_process_group():
    """What a group leaves to the interpreter's exit can abort a finished run (gloo's threads torn down late): after
    ``close`` no DDP wrapper, and so no reference to the process group, is left alive. One rank, in a process of its
    own, so that this test's process group never meets another test's."""
    script = """
import gc, weakref, torch
from torch import distributed as dist
from mpifl.learning.parallel import DataParallel
group = DataParallel(0, 1)
group.start(dist.HashStore(), torch.device("cpu"), 30.0)
model = torch.nn.Linear(3, 2)
wrapper = weakref.ref(group.wrap(model))
wrapper()(torch.ones(4, 3)).sum().backward()
group.close()
print(wrapper() is None, dist.is_initialized())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=MPI_TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]


@pytest.mark.parametrize("rank,overrides,fail_after,expected", [
    (2, (), 0, "'s training failed on rank 2, a member of its client group"),  # then every rank is aborted
    (1, ("clients.accept_failures=true",), 0,
     "on rank 1 failed in round 1: RuntimeError: deliberate failure inside a client group (its group of ranks "
     "(clients.ranks_per_client) cannot go on mid-collective"),
    (2, ("clients.accept_failures=true",), 3, "failed on rank 2, a member of its client group"),  # mid-training
    # Ditto trains each client's personal model v_i first, in the group too
    (1, ("clients.accept_failures=true", "train.ditto_lambda=0.1"), 0,
     "on rank 1 failed in round 1 while training its personal model: RuntimeError"),
    (2, ("clients.accept_failures=true", "train.ditto_lambda=0.1"), 0,
     "'s personal model failed on rank 2, a member of its client group"),
], ids=["member", "leader-failures-accepted", "member-mid-training", "ditto-leader", "ditto-member"])
def test_a_failure_inside_a_client_group_ends_the_job_naming_the_rank(tmp_path, rank, overrides, fail_after, expected):
    """A group's ranks are inside one collective while they train a client: none can be dropped alone, and the
    others must not wait on it forever. Whichever rank fails, the job ends at once, naming it, even where failing
    clients are otherwise accepted and dropped."""
    import time

    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace("model: {name: mlp, kwargs: {hidden: [16]}}",
                                                          "model: {name: 'fl_helpers:FailsOnOneRank'}"))
    began = time.monotonic()
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides, timeout=MPI_TIMEOUT,
                     env={"FL_HELPERS_FAIL_RANK": str(rank), "FL_HELPERS_FAIL_AFTER": str(fail_after)})
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr[-3000:]
    assert "deliberate failure inside a client group" in result.stderr
    assert time.monotonic() - began < 60


# Every kind of fault that strikes a client, not a rank: the leader injects it (members train only what it orders).
GROUP_FAULTS = ("faults=[{kind: raise, clients: [1], rounds: [2]}, {kind: nan, clients: [2], rounds: [3]}, "
                "{kind: lose, clients: [0], stage: send, rounds: [3]}, {kind: scale, clients: [4], factor: -1}, "
                "{kind: corrupt, clients: [3], bits: 4, rounds: [1]}, "
                "{kind: stall, clients: [5], seconds: 0.2, stage: send}, "
                "{kind: slowdown, clients: [3], factor: 1.5, rounds: [3]}]")


def test_a_group_takes_the_configs_faults_through_its_leader_as_one_rank_would(tmp_path):
    """A client trained by a group of ranks is struck by the config's faults as one rank's client is: a ``raise``
    before the group is ordered to train, a ``nan`` in the trained model and a lost update drop the client under
    accept_failures (the group never strands a member mid-collective), a scale, a corruption, a stall and a
    slowdown are folded. The same strikes and drops on one group, two groups and one rank per client; the bits of
    one group on two; one rank's model up to float rounding."""
    faulted = ("clients.accept_failures=true", GROUP_FAULTS)
    one, two = run(tmp_path, "one", 3, *faulted), run(tmp_path, "two", 5, *faulted)
    single = run(tmp_path, "single", 3, *faulted, "clients.ranks_per_client=1")
    assert_bitwise(final_model(two), final_model(one))
    assert_one_ranks_model_up_to_rounding(final_model(one), final_model(single))

    def outcomes(run_dir: Path) -> list[list[tuple]]:
        return [sorted((f["kind"], f["client"], f["outcome"]) for f in r.get("faults", [])) for r in records(run_dir)]

    struck = outcomes(one)
    assert struck == outcomes(two) == outcomes(single)
    kinds = {(kind, outcome) for round_ in struck for kind, _, outcome in round_}
    assert {k for k, _ in kinds} == {"raise", "nan", "lose", "scale", "corrupt", "stall", "slowdown"}  # each struck
    assert {k for k, outcome in kinds if outcome == "dropped"} == {"raise", "nan", "lose"}
    assert {k for k, outcome in kinds if outcome == "folded"} == {"scale", "corrupt", "stall", "slowdown"}
    dropped = [sorted(d["client"] for d in r["dropped"]) for r in records(one)]
    assert dropped == [sorted(c for k, c, o in round_ if o == "dropped") for round_ in struck]
    assert "InjectedFault: faults[0]" in next(d["reason"] for r in records(one) for d in r["dropped"]
                                               if d["client"] == 1)
    # records name the leaders by their own MPI ranks (groups of ranks 1-2 and 3-4), not by the groups' places 1, 2
    named = {run_dir: {f["rank"] for r in records(run_dir) for f in r.get("faults", []) + r["dropped"]}
             for run_dir in (one, two)}
    assert named == {one: {1}, two: {1, 3}}
    assert {rank for r in records(two) for rank in r["ranks"]} == {"1", "3"}  # mpifl calibrate reads ranks.txt
    assert {rank for r in records(two) for _, rank, _, _ in r["timing"]} == {1, 3}  # by them


def test_a_fault_naming_ranks_is_refused_where_groups_of_ranks_train_the_clients(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    assert load_config(cfg, ["faults=[{kind: raise, fraction: 0.5}]"]).faults[0].fraction == 0.5
    with pytest.raises(ConfigError, match=r"faults\[0\]\.ranks: names client ranks, and with "
                                          r"clients.ranks_per_client=2 each client is trained by a group of ranks"):
        load_config(cfg, ["faults=[{kind: slowdown, ranks: [1], factor: 2}]"])


def test_a_sweep_that_runs_groups_then_single_ranks_in_one_process_names_each_runs_ranks_its_own_way(tmp_path):
    """The naming of leaders by their MPI ranks belongs to the run that has groups: the next run of the same
    processes (mpifl sweep), with one rank per client, names its ranks as they are (it named client 1's rank 3,
    its group leader's rank in the run before, instead of 2)."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(5, "sweep", str(cfg), "--grid", "clients.ranks_per_client=2,1", "--runs-dir",
                     str(tmp_path / "runs"), "rounds=1", "clients.accept_failures=true",
                     "faults=[{kind: raise, clients: [1]}]")
    assert result.returncode == 0, result.stderr[-3000:]
    named = {r: [d["rank"] for d in records(tmp_path / "runs" / f"clients.ranks_per_client={r}")[0]["dropped"]]
             for r in (2, 1)}
    assert named == {2: [3], 1: [2]}  # client 1: the second group's leader, then the second of 4 client ranks
