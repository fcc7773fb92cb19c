"""What a run costs, per round and per rank: CPU-seconds, bytes moved and written, GPU time and energy where NVML
counts it; the totals at the end in metrics.jsonl, the log, the trackers and `mpifl report`."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch
from conftest import run_mpi, stopped_and_resumed, write_config

from mpifl.learning.device import GpuEnergy
from mpifl.metrics import CostMeter, bytes_written
from mpifl.roles.costs import UpdateCosts
from mpifl.roles.records import cost_line, cost_to_date, plus_late, plus_server, round_cost
from mpifl.trackers import scalars

RUN = """
seed: 2
rounds: 4
clients: {num_clients: 6}
data: {dataset: synthetic, kwargs: {num_samples: 300}}
model: {name: mlp, kwargs: {hidden: [16]}}
eval: {every: 2}
checkpoint: {every: 2}
output: {progress: false}
"""


def test_a_rank_reads_its_counters_with_the_round_s_last_header_which_gives_the_same_sums_and_peak(tmp_path):
    costs = UpdateCosts(replica=None, rank=1)
    costs.begin_round(3)
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    (tmp_path / "f").write_bytes(b"x" * 100_000)
    assert costs.of_update(0.1) == {} and costs.of_update(0.1) == {}  # on the CPU, nothing until the last
    last = costs.of_update(0.1)
    assert last["rank_cpu_seconds"] >= 0.05 and last["rank_bytes_written"] >= 100_000
    assert last["rank_peak_rss_bytes"] > 0 and "rank_gpu_seconds" not in last
    costs.begin_round(1)
    assert costs.of_update(0.1)["rank_cpu_seconds"] < 0.05  # the next round counts from this reading on


def test_an_asynchronous_rank_reads_its_counters_with_the_step_s_last_header_sent_after_its_training():
    """A held update leaves in a later step: read as it trained, the step that applies it would count another
    step's work, and a step whose arrivals carried no reading would count none of what its ranks spent."""
    costs = UpdateCosts(replica=None, rank=1)
    costs.begin_step(2)
    assert costs.of_update(0.1) == {}  # training a held update reads nothing
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert costs.at_send() == {}
    last = costs.at_send()
    assert last["rank_cpu_seconds"] >= 0.05 and last["rank_peak_rss_bytes"] > 0
    costs.begin_step(0)  # a step that only trains: its work goes with the rank's next header sent
    costs.of_update(0.1)
    costs.begin_round(1)
    assert "rank_cpu_seconds" in costs.of_update(0.1)


def storage_accounts_writes(folder) -> bool:
    """Whether the file system under ``folder`` accounts its writes in write_bytes (tmpfs does not)."""
    before = bytes_written()
    (folder / "probe").write_bytes(b"x" * 100_000)
    return before is not None and (bytes_written() or 0) - before >= 100_000


def test_socket_writes_are_not_bytes_written_but_file_writes_are(tmp_path):
    """A sharded client's gloo traffic is socket writes: counted as written, it showed 1.4 GB for a 185 MB
    checkpoint."""
    if not storage_accounts_writes(tmp_path):
        pytest.skip(f"{tmp_path}'s file system does not account its writes (tmpfs)")
    a, b = socket.socketpair()
    with a, b:
        before = bytes_written()
        for _ in range(16):
            os.write(a.fileno(), b"y" * 65_536)  # a write call, as gloo's
            b.recv(65_536, socket.MSG_WAITALL)
        assert (bytes_written() or 0) - (before or 0) < 65_536  # a page or two of unrelated accounting at most
    before = bytes_written()
    (tmp_path / "f").write_bytes(b"x" * 1_000_000)
    assert (bytes_written() or 0) - (before or 0) >= 1_000_000


def test_the_meter_counts_this_process_s_cpu_and_the_bytes_it_writes(tmp_path):
    meter = CostMeter()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    (tmp_path / "f").write_bytes(b"x" * 100_000)
    spent = meter.since_last()
    assert spent["cpu_seconds"] >= 0.05
    assert spent["bytes_written"] >= 100_000
    assert meter.since_last()["bytes_written"] < 100_000  # from the last reading on


def test_a_round_s_cost_adds_the_server_and_every_rank_and_the_run_s_sums_the_rounds():
    ranks = {"1": {"cpu_seconds": 1.0, "bytes_written": 10}, "2": {"cpu_seconds": 2.0, "bytes_written": 0}}
    cost = round_cost({"cpu_seconds": 0.5, "bytes_written": 100}, ranks, bytes_moved=4096)
    assert cost == {"cpu_seconds": 3.5, "server_cpu_seconds": 0.5, "client_cpu_seconds": 3.0, "bytes_moved": 4096.0,
                    "bytes_written": 110}
    assert "gpu_seconds" not in cost  # no rank trained on a GPU: nothing recorded, not a zero
    saved = plus_server(cost, {"cpu_seconds": 0.25, "bytes_written": 1000})  # the checkpoint, once written
    assert saved["cpu_seconds"] == 3.75 and saved["server_cpu_seconds"] == 0.75 and saved["bytes_written"] == 1110
    total = cost_to_date(cost_to_date(None, saved), saved)
    assert total["cpu_seconds"] == 7.5 and total["bytes_moved"] == 8192.0
    gpu = round_cost({"cpu_seconds": 0.0}, {"1": {"cpu_seconds": 1.0, "gpu_seconds": 2.0, "gpu_energy_joules": 3.6e5}},
                     bytes_moved=0)
    assert "bytes_written" not in gpu  # a rank that could not count its writes: no total that leaves it out
    assert cost_line(gpu) == "cost: 1 CPU-s (0 on the server), 0 MiB moved, 2 GPU-s, 0.1 kWh of GPU energy"


def test_gpu_energy_is_totalled_only_where_every_gpu_rank_counted_it_else_the_line_says_it_was_not():
    """A GPU without NVML's energy counter would make a total of the others' a silent underestimate: the round
    records how many GPU ranks went uncounted instead, the run's total carries that count, and the cost line says
    the energy was not counted. CPU ranks (no gpu_seconds) are no gap."""
    counted = {"cpu_seconds": 1.0, "gpu_seconds": 2.0, "gpu_energy_joules": 3.6e5}
    uncounted = {"cpu_seconds": 1.0, "gpu_seconds": 2.0}
    mixed = round_cost({"cpu_seconds": 1.0}, {"1": counted, "2": uncounted, "3": {"cpu_seconds": 1.0}}, 0)
    assert mixed["gpu_seconds"] == 4.0 and "gpu_energy_joules" not in mixed
    assert mixed["gpu_energy_uncounted_ranks"] == 1.0
    assert cost_line(mixed).endswith(", 4 GPU-s, GPU energy not counted (no NVML energy counter in 1 rank-round; "
                                     "each rank's log says why)")
    whole = round_cost({"cpu_seconds": 1.0}, {"1": counted, "3": {"cpu_seconds": 1.0}}, 0)
    assert "gpu_energy_uncounted_ranks" not in whole and whole["gpu_energy_joules"] == 3.6e5
    total = cost_to_date(cost_to_date(None, whole), mixed)  # one round counted, then one with a gap
    assert "GPU energy not counted (no NVML energy counter in 1 rank-round" in cost_line(total)
    assert cost_line(cost_to_date(None, whole)).endswith("2 GPU-s, 0.1 kWh of GPU energy")
    late = plus_late(whole, {"cpu_seconds": 1.0, "gpu_seconds": 1.0})  # a dropped GPU rank's late header
    assert late["gpu_energy_uncounted_ranks"] == 1.0 and "not counted" in cost_line(late)
    assert "GPU" not in cost_line(round_cost({"cpu_seconds": 1.0}, {"1": {"cpu_seconds": 1.0}}, 0))


def test_a_rank_whose_headers_carried_no_reading_leaves_the_round_s_bytes_written_whole():
    """Asynchronous FL: a rank's update sent without a reading (another of its headers carried it, or will) is no
    rank that cannot count its writes."""
    ranks = {"1": {"cpu_seconds": 1.0, "bytes_written": 10}, "2": {"clients": 1, "train_seconds": 0.5}}
    cost = round_cost({"cpu_seconds": 0.5, "bytes_written": 100}, ranks, bytes_moved=0)
    assert cost["bytes_written"] == 110 and cost["client_cpu_seconds"] == 1.0


def test_without_an_nvml_energy_counter_the_run_records_none_and_says_why():
    energy = GpuEnergy(torch.device("cuda", 0))
    if energy.joules() is not None:
        pytest.skip("this machine's GPU has an energy counter")
    assert energy.why.startswith(("NVML has no energy counter here", "nvidia-ml-py is not installed"))


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_every_round_records_its_cost_per_rank_and_the_run_s_totals_which_a_resume_carries_on(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", RUN)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "whole"))
    assert result.returncode == 0, result.stderr
    whole = records(tmp_path / "whole")
    for record in whole:
        assert record["cost"]["client_cpu_seconds"] == pytest.approx(
            sum(rank["cpu_seconds"] for rank in record["ranks"].values()))
        assert record["cost"]["bytes_moved"] == record["bytes_sent"] + record["bytes_received"]
        assert all(rank["cpu_seconds"] > 0 for rank in record["ranks"].values())
    assert whole[-1]["cost_to_date"]["cpu_seconds"] == pytest.approx(sum(r["cost"]["cpu_seconds"] for r in whole))
    checkpointed = [r["cost"]["bytes_written"] for r in whole]
    assert checkpointed[1] > 10_000 and checkpointed[3] > 10_000  # rounds 2 and 4 wrote a checkpoint each
    assert f"[rank 0] {cost_line(whole[-1]['cost_to_date'])}" in result.stderr
    assert scalars(whole[-1])["cost_to_date/cpu_seconds"] == whole[-1]["cost_to_date"]["cpu_seconds"]  # trackers
    report = run_mpi(1, "report", str(tmp_path / "whole"))
    assert report.returncode == 0 and "cost.png" in report.stdout
    assert f"{cost_line(whole[-1]['cost_to_date'])} (rounds 1-4)" in report.stdout
    stopped_and_resumed(tmp_path, cfg, resume_ranks=3)
    split = records(tmp_path / "split")
    assert split[-1]["cost_to_date"]["cpu_seconds"] > split[1]["cost_to_date"]["cpu_seconds"]
    # across the resume too, each record's totals are the previous one's plus its own cost, key by key: the resume
    # carries on from round 2's line, which holds what writing its checkpoint cost
    for previous, record in zip(split, split[1:]):
        assert record["cost_to_date"] == pytest.approx(cost_to_date(previous["cost_to_date"], record["cost"]))
    assert split[-1]["cost_to_date"]["bytes_moved"] == whole[-1]["cost_to_date"]["bytes_moved"]


def test_members_costs_are_summed_with_their_largest_peak_and_bytes_only_where_every_rank_counted_them():
    """A replicated client group (clients.ranks_per_client) sends its updates from its leader alone: each member
    sends the leader what it spent on each order, and the leader's reading adds them, so that the group counts as
    one rank, as a sharded group does (the group runs of test_mpi_ranks_per_client take this path every round)."""
    from mpifl.roles.costs import with_members
    from mpifl.roles.group import summed_costs

    members = summed_costs([{"cpu_seconds": 1.0, "bytes_written": 10.0, "peak_rss_bytes": 5.0},
                            {"cpu_seconds": 2.0, "bytes_written": 20.0, "peak_rss_bytes": 7.0}])
    assert members == {"cpu_seconds": 3.0, "bytes_written": 30.0, "peak_rss_bytes": 7.0}
    leader = {"rank_cpu_seconds": 0.5, "rank_bytes_written": 1.0, "rank_peak_rss_bytes": 9.0}
    assert with_members(leader, members) == {"rank_cpu_seconds": 3.5, "rank_bytes_written": 31.0,
                                             "rank_peak_rss_bytes": 9.0}
    uncounted = summed_costs([{"cpu_seconds": 1.0, "peak_rss_bytes": 5.0}, {"cpu_seconds": 1.0, "bytes_written": 2.0,
                                                                           "peak_rss_bytes": 5.0}])
    assert "bytes_written" not in uncounted and "rank_bytes_written" not in with_members(leader, uncounted)
    assert with_members(leader, summed_costs([])) == leader


def test_a_resume_carries_the_totals_on_from_the_line_metrics_jsonl_wrote_after_the_checkpoint(tmp_path):
    """The checkpoint copies its round's record before it is written; the JSON line, written after, adds what writing
    it cost. A resume carries on from the line, so each record's totals stay the previous one's plus its own cost
    across the resume; where the file lost the line, from the checkpoint's own copy, consistent with itself."""
    from pathlib import Path

    from mpifl.metrics import json_line
    from mpifl.storage.rundir import ResumePoint, resume_line, rewind_metrics

    def record(round_: int, cost: float, total: float) -> dict:
        return {"round": round_, "cost": {"cpu_seconds": cost, "bytes_written": cost},
                "cost_to_date": {"cpu_seconds": total, "bytes_written": total}}

    copied = [record(1, 1.0, 1.0), record(2, 2.0, 3.0)]  # round 2's copy: before its checkpoint was written
    lines = [record(1, 1.0, 1.0), record(2, 2.5, 3.5), record(3, 9.0, 12.5)]  # the killed attempt's file
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json_line(r) + "\n" for r in lines))
    point = rewind_metrics(metrics, ResumePoint(Path("ckpt-r000002.h5"), 2, copied, None))
    assert point.metrics == lines[:2] and records(tmp_path) == lines[:2]
    # the resume's first line says which recorded rounds it dropped, to be trained again
    assert point.redone == (3,)
    assert resume_line(Path("runs/a"), point, 5) == (
        "resuming run runs/a from ckpt-r000002.h5 (round 2 of 5 done; rounds 3..5 to go); round 3, recorded in "
        "metrics.jsonl after that checkpoint, dropped from it and trained again")
    metrics.write_text(json_line(lines[0]) + "\n")  # round 2's line lost: the checkpoint's copy stands
    point = rewind_metrics(metrics, ResumePoint(Path("ckpt-r000002.h5"), 2, copied, None))
    assert point.metrics == copied and records(tmp_path) == copied
    assert point.redone == () and resume_line(Path("runs/a"), point, 3).endswith("(round 2 of 3 done; round 3 to go)")


def test_a_dropped_ranks_work_counts_in_the_round_its_discarded_header_lands():
    cost = {"cpu_seconds": 3.0, "server_cpu_seconds": 1.0, "client_cpu_seconds": 2.0, "bytes_moved": 10.0,
            "bytes_written": 100.0}
    late = plus_late(cost, {"cpu_seconds": 0.5, "bytes_written": 20.0, "gpu_seconds": 1.0})
    assert late == {**cost, "cpu_seconds": 3.5, "client_cpu_seconds": 2.5, "late_cpu_seconds": 0.5,
                    "bytes_written": 120.0}  # no GPU-seconds where the round counted none: no partial total


ASYNC = """
seed: 3
rounds: 8
clients: {num_clients: 6, accept_failures: true}
data: {dataset: synthetic, kwargs: {num_samples: 300}}
model: {name: mlp, kwargs: {hidden: [16]}}
clock: {mode: fedbuff, concurrency: 4, buffer: 2}
checkpoint: {every: 2}
output: {progress: false}
faults:
  - {kind: raise, clients: [3]}
"""


def test_an_asynchronous_run_s_steps_each_carry_what_they_cost_and_sum_exactly_to_its_totals(tmp_path):
    """Each step's cost holds what its ranks reported with the step's headers and the server's own, so a step's
    keys are the run's keys (bytes written in every step, whatever rank sent nothing it could read) and the steps
    add up, key by key and step by step, to cost_to_date (the fb3 walkthrough: 413,696 of 585,728 bytes)."""
    cfg = write_config(tmp_path / "c.yaml", ASYNC)
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = records(tmp_path / "run")
    assert len(steps) == 8 and any(r["dropped"] for r in steps)  # client 3 raised: its updates were dropped
    keys = set(steps[-1]["cost_to_date"])
    total: dict[str, float] = {}
    for step in steps:
        assert set(step["cost"]) == keys
        assert step["cost"]["client_cpu_seconds"] > 0  # every step applied updates whose ranks trained
        total = {key: total.get(key, 0.0) + step["cost"][key] for key in keys}
        assert step["cost_to_date"] == total
