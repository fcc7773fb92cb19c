"""Virtual time under mpiexec: asynchronous FL is bitwise reproducible, independent of the rank count,
equal to a single-process reference, and resumes bitwise after kill -9; synchronous rounds drop stragglers.

Run to run: every asynchronous run here equals the deterministic reference (or a run on other ranks)
bitwise, and so does the run resumed after kill -9, so the same config gives the same model every
time."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from conftest import MPI_TIMEOUT, rounds_logged, run_mpi, same_model, spawn_mpi, wait_for, write_config
from reference import async_reference, one_thread

from mpifl.config import load_config
from mpifl.storage.hdf5 import load_tensors

RUN = """
seed: 3
rounds: {rounds}
clients: {{num_clients: 12, per_round: 4}}
data: {{dataset: synthetic, kwargs: {{num_samples: 480, num_features: 8, num_classes: 4}}}}
model: {{name: mlp, kwargs: {{hidden: [8]}}}}
train: {{lr: 0.1, batch_size: 8}}
eval: {{every: 0}}
output: {{progress: false}}
{extra}
"""
FEDBUFF = "strategy: {update: delta}\nclock: {mode: fedbuff, buffer: 3, concurrency: 6, staleness: polynomial}"
FEDASYNC = "clock: {mode: fedasync, concurrency: 4, alpha: 0.8, staleness: hinge, staleness_a: 1, staleness_b: 1}"


def run(tmp_path, name: str, extra: str, ranks: int = 2, rounds: int = 6, *args: str):
    cfg = write_config(tmp_path / f"{name}.yaml", RUN.format(rounds=rounds, extra=extra))
    result = run_mpi(ranks + 1, "run", str(cfg), "--run-dir", str(tmp_path / name), *args, timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    return cfg, tmp_path / name


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# a buffer larger than the clients in flight: each arrival dispatches another client, so it fills
FEDBUFF_WIDE = FEDBUFF.replace("buffer: 3, concurrency: 6", "buffer: 5, concurrency: 3")


@pytest.mark.parametrize("mode,ranks", [("fedbuff", 5), ("fedbuff-buffer-over-concurrency", 4), ("fedasync", 3)])
def test_asynchronous_runs_equal_the_single_process_reference_on_any_number_of_ranks(tmp_path, mode, ranks):
    extra = {"fedbuff": FEDBUFF, "fedbuff-buffer-over-concurrency": FEDBUFF_WIDE, "fedasync": FEDASYNC}[mode]
    cfg, two = run(tmp_path, "two", extra, ranks=2)
    _, more = run(tmp_path, "more", extra, ranks=ranks)
    assert same_model(two / "model.h5", more / "model.h5")
    assert_equals_reference(two, cfg)
    steps = records(two)
    assert [r["round"] for r in steps] == list(range(1, 7))
    buffer = {"fedbuff": 3, "fedbuff-buffer-over-concurrency": 5, "fedasync": 1}[mode]
    assert all(len(r["participants"]) == buffer for r in steps)
    assert any(s > 0 for r in steps for s in r["staleness"])  # some updates are stale
    assert [r["virtual_time"] for r in steps] == sorted(r["virtual_time"] for r in steps)


@pytest.mark.parametrize("mode", ["fedbuff", "fedasync"])
def test_batchnorm_statistics_travel_as_values_and_stay_a_variance_asynchronously(tmp_path, mode):
    """A client's change of a running variance, measured from the version it trained on and added to a newer
    model, can take it below zero; sent as values, the server takes their staleness-weighted mean (FedBuff) or
    mixes them in (FedAsync). Equal to the reference bitwise, on 2 client ranks."""
    extra = FEDBUFF if mode == "fedbuff" else FEDASYNC  # FedAsync mixes weights: statistics are values there
    text = RUN.format(rounds=6, extra=extra).replace("{name: mlp, kwargs: {hidden: [8]}}",
                                                     '{name: "fl_helpers:bn_mlp"}')
    cfg = write_config(tmp_path / "bn.yaml", text)
    run_dir = tmp_path / "bn"
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert_equals_reference(run_dir, cfg)
    variances = [t for name, t in load_tensors(run_dir / "model.h5").items() if name.endswith("running_var")]
    assert variances and all((v > 0).all() for v in variances)


RAISES = "\nfaults:\n  - {kind: raise, clients: [3]}"  # logical client 3's every training raises


def with_failures(extra: str) -> str:
    """``extra`` (a clock section) with clients.accept_failures and logical client 3 raising whenever it trains."""
    return extra.replace("clock:", "clients: {num_clients: 12, per_round: 4, accept_failures: true}\nclock:") + RAISES


@pytest.mark.parametrize("mode", ["fedasync", "fedbuff"])
def test_a_failed_update_under_accept_failures_is_dropped_from_its_step_and_the_run_goes_on(tmp_path, mode):
    """clients.accept_failures: a FedAsync step whose one update raised keeps the model as it was, recorded with
    why, and the run goes on; a FedBuff buffer divides by the updates it applies, so the dropped one does not
    shrink the step. Bitwise the reference without client 3's updates, the same on 2 and 3 client ranks."""
    extra = with_failures(FEDASYNC if mode == "fedasync" else FEDBUFF)
    text = RUN.format(rounds=6, extra=extra).replace("clients: {num_clients: 12, per_round: 4}\n", "")
    cfg = write_config(tmp_path / f"{mode}.yaml", text)
    for name, ranks in (("two", 2), ("three", 3)):
        result = run_mpi(ranks + 1, "run", str(cfg), "--run-dir", str(tmp_path / name), timeout=MPI_TIMEOUT)
        assert result.returncode == 0, result.stderr
    assert same_model(tmp_path / "two" / "model.h5", tmp_path / "three" / "model.h5")
    with one_thread():
        expected = async_reference(load_config(cfg), drop=frozenset({3}))
    got = load_tensors(tmp_path / "two" / "model.h5")
    for name, value in expected.items():
        assert np.array_equal(got[name].numpy().view(np.uint32), value.view(np.uint32)), name
    steps = records(tmp_path / "two")
    assert [r["round"] for r in steps] == list(range(1, 7))
    struck = [r for r in steps if 3 in r["arrival_order"]]
    assert struck and all([d["client"] for d in r["dropped"]] == [3] for r in struck)
    assert all("InjectedFault" in r["dropped"][0]["reason"] for r in struck)
    unapplied = [r["round"] for r in steps if "unapplied" in r]
    assert unapplied == [r["round"] for r in struck if r["arrival_order"] == [3]]
    if mode == "fedasync":
        assert unapplied and "fewer than clients.min_participants=1" in steps[unapplied[0] - 1]["unapplied"]
    def same_on_any_ranks(record: dict) -> tuple:  # a client's rank differs with the rank count
        dropped = [(d["client"], d["reason"]) for d in record["dropped"]]
        return dropped, record["arrival_order"], record["staleness"], record.get("unapplied")

    assert list(map(same_on_any_ranks, steps)) == list(map(same_on_any_ranks, records(tmp_path / "three")))


def test_synchronous_virtual_rounds_drop_stragglers_and_report_the_clock(tmp_path):
    _, plain = run(tmp_path, "plain", "", ranks=1)
    _, untimed = run(tmp_path, "untimed", "clock: {mode: sync}", ranks=1)
    assert same_model(plain / "model.h5", untimed / "model.h5")  # no deadline, no over-selection: the same run
    _, timed = run(tmp_path, "timed", "clock: {mode: sync, deadline: 0.05, over_selection: 0.5, "
                                      "bandwidth_mbps: 2, seconds_per_sample: 0.001}")
    rounds = records(timed)
    assert all(r["selected"] == 6 and len(r["participants"]) <= 4 for r in rounds)
    assert all(not set(r["participants"]) & set(r["stragglers"]) for r in rounds)
    assert sum(len(r["stragglers"]) for r in rounds) > 0 and all(r["wasted_seconds"] >= 0 for r in rounds)
    assert [r["virtual_time"] for r in rounds] == sorted(r["virtual_time"] for r in rounds)


COMPASS = ("strategy: {update: delta}\n"
           "clock: {mode: fedcompass, concurrency: 5, min_steps: 2, max_steps: 12, speed_sigma: 1.0}")
KILL_AND_RESUME = {"fedbuff": FEDBUFF, "fedasync": FEDASYNC, "fedcompass": COMPASS}
KEEP_ONE = "\ncheckpoint: {keep: 1}"  # pruning must still spare the model versions that updates in flight need


@pytest.fixture(scope="module")
def compass_on_two_ranks(tmp_path_factory):
    """FedCompass for 10 steps on 2 client ranks, uninterrupted: it has no single-process reference, so the runs on
    other rank counts and the resumed run are compared with this one."""
    return run(tmp_path_factory.mktemp("compass"), "two", COMPASS + KEEP_ONE, 2, 10)[1]


def assert_equals_reference(run_dir, cfg) -> None:
    """The run's final model is bitwise the single-process virtual-time reference's (reference.async_reference)."""
    with one_thread():  # as every rank trains: a BatchNorm's batch statistics sum by thread
        expected = async_reference(load_config(cfg))
    got = load_tensors(run_dir / "model.h5")
    for name, value in expected.items():
        assert np.array_equal(got[name].numpy().view(np.uint32), value.view(np.uint32)), name


def test_fedcompass_runs_each_client_for_its_own_steps_and_is_rank_count_independent(tmp_path, compass_on_two_ranks):
    _, three = run(tmp_path, "three", COMPASS + KEEP_ONE, 3, 10)
    assert same_model(compass_on_two_ranks / "model.h5", three / "model.h5")
    steps = [s for r in records(compass_on_two_ranks) for s in r["local_steps"]]
    assert min(steps) >= 2 and max(steps) <= 12 and len(set(steps)) > 1


def test_every_asynchronous_mode_has_a_kill_and_resume_case():
    from mpifl.config.sections import ASYNCHRONOUS_MODES

    assert set(KILL_AND_RESUME) == set(ASYNCHRONOUS_MODES), "add the new mode's config to KILL_AND_RESUME"


@pytest.mark.parametrize("mode", list(KILL_AND_RESUME))
def test_each_asynchronous_mode_killed_mid_way_resumes_to_the_uninterrupted_model(tmp_path, mode, request):
    cfg = write_config(tmp_path / "killed.yaml", RUN.format(rounds=10, extra=KILL_AND_RESUME[mode] + KEEP_ONE))
    run_dir = tmp_path / "killed"
    proc = spawn_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), env={"FL_HELPERS_SLEEP": "0"})
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(rounds_logged(run_dir)) >= 4, proc, "step 4")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert len(rounds_logged(run_dir)) < 10
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(run_dir), "--resume", timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert "nothing to resume" not in result.stderr and "starting fresh" not in result.stderr
    if mode == "fedbuff":
        assert "retrained logical clients" in result.stderr  # the updates in flight were rebuilt
    assert rounds_logged(run_dir) == list(range(1, 11))
    if mode == "fedcompass":  # the uninterrupted run on the same ranks (no single-process reference)
        assert same_model(run_dir / "model.h5", request.getfixturevalue("compass_on_two_ranks") / "model.h5")
    else:  # what every uninterrupted run gives (the reference tests above)
        assert_equals_reference(run_dir, cfg)


def test_a_finished_fedbuff_run_goes_on_when_rounds_are_raised_and_ends_as_the_longer_run(tmp_path):
    """After its last step, the versions that clients then in flight trained on are kept (``open_versions``): a run
    raised past its end retrains them from there, and comes to the model of a run planned that long from the start."""
    short = write_config(tmp_path / "six.yaml", RUN.format(rounds=6, extra=FEDBUFF + KEEP_ONE))
    run_dir = tmp_path / "run"
    first = run_mpi(3, "run", str(short), "--run-dir", str(run_dir), timeout=MPI_TIMEOUT)
    assert first.returncode == 0, first.stderr
    longer = write_config(tmp_path / "ten.yaml", RUN.format(rounds=10, extra=FEDBUFF + KEEP_ONE))
    raised = run_mpi(3, "run", str(longer), "--run-dir", str(run_dir), "--resume", timeout=MPI_TIMEOUT)
    assert raised.returncode == 0, raised.stderr
    assert "retrained logical clients" in raised.stderr
    assert rounds_logged(run_dir) == list(range(1, 11))
    assert_equals_reference(run_dir, longer)


SECAGG_SYNC = ("clients: {num_clients: 12, per_round: 2}\nsecagg: {enabled: true}\n"
               "clock: {mode: sync, deadline: 0.05, speed_sigma: 2, seconds_per_sample: 0.001}")


def test_a_sync_round_with_too_few_on_time_for_secagg_withholds_them_says_so_and_counts_them(tmp_path):
    """docs/how-to/secure-aggregation.md: a synchronous round keeping fewer than secagg.min_cohort by its deadline runs
    empty as a Poisson round drawing too few does: secagg.withheld names the on-time clients (not stragglers), rank
    0 says so once, the run's end counts such rounds; bitwise the same on 2 and 3 client ranks."""
    text = RUN.format(rounds=6, extra=SECAGG_SYNC).replace("clients: {num_clients: 12, per_round: 4}\n", "")
    cfg = write_config(tmp_path / "s.yaml", text)
    results = {n: run_mpi(n + 1, "run", str(cfg), "--run-dir", str(tmp_path / f"r{n}"), timeout=MPI_TIMEOUT)
               for n in (2, 3)}
    assert all(r.returncode == 0 for r in results.values()), results[2].stderr + results[3].stderr
    rounds = records(tmp_path / "r2")
    withheld = [r for r in rounds if r["secagg"].get("withheld")]
    assert withheld and any(r["participants"] for r in rounds)
    for r in withheld:
        assert r["participants"] == [] and len(r["secagg"]["withheld"]) == 1
        assert not set(r["secagg"]["withheld"]) & set(r["stragglers"])
    said = results[2].stderr
    assert said.count("finished in time (clock.mode sync), fewer than secagg.min_cohort=2: left out") == 1
    assert [r["round"] for r in withheld] == [3, 5, 6]  # seed 3: the rounds that keep one client in time
    assert ("secagg.min_cohort: 3 of 6 rounds (round 3,5-6) kept fewer than 2 clients in time and ran without "
            "updates") in said
    assert same_model(tmp_path / "r2" / "model.h5", tmp_path / "r3" / "model.h5")
    clock_fields = ("participants", "stragglers", "secagg", "virtual_time", "wasted_seconds")
    strip = [{k: r[k] for k in clock_fields} for r in rounds]
    for r in strip:
        r["secagg"] = {k: v for k, v in r["secagg"].items() if k != "mask_seconds"}
    other = [{k: r[k] for k in clock_fields} for r in records(tmp_path / "r3")]
    for r in other:
        r["secagg"] = {k: v for k, v in r["secagg"].items() if k != "mask_seconds"}
    assert strip == other


def test_a_sync_run_whose_availability_trace_runs_out_is_refused_before_round_1_naming_the_key_and_round(tmp_path):
    """The synchronous schedule is planned whole from the config and the seed as the job starts, as the asynchronous
    ones are: a trace that cannot carry every round ends the job before round 1 (exit 2, one line), and status does
    not advise a resume that would fail the same way."""
    trace = tmp_path / "avail.json"  # client c online only in [100 + 50c, 120 + 50c]
    trace.write_text(json.dumps({str(c): [[100 + 50 * c, 120 + 50 * c]] for c in range(12)}))
    cfg = write_config(tmp_path / "t.yaml", RUN.format(rounds=14, extra=(
        f"clock: {{mode: sync, availability: trace, availability_trace: {trace}, seconds_per_sample: 1}}")))
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "t"), timeout=MPI_TIMEOUT)
    assert result.returncode == 2
    assert (f"config error: cannot plan the virtual-time schedule: clock.availability_trace '{trace}': no client is "
            "online at or after virtual time ") in result.stderr and "the trace runs out at round 13" in result.stderr
    assert "Traceback" not in result.stderr and "MPI_Abort" not in result.stderr  # every rank leaves with it
    assert not (tmp_path / "t" / "metrics.jsonl").exists()
    status = run_mpi(1, "status", str(tmp_path / "t"))
    assert "fix the config first: a --resume with this one fails the same way" in status.stdout
