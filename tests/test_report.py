"""`mpifl report` and memray profiles per rank."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import ROOT, mpifl_here, run_mpi

from mpifl.units import MIB

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("profiled")
    result = run_mpi(3, "run", str(ROOT / "configs" / "quickstart.yaml"), "rounds=4", "--run-dir", str(base / "run"),
                     "--memray", str(base / "memray"), fresh=True)
    assert result.returncode == 0, result.stderr
    return base


def test_report_writes_the_plots(profiled_run, tmp_path):
    result = mpifl_here("report", str(profiled_run / "run"), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for name in ("quality.png", "time_split.png", "bytes.png", "memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG, name


def test_an_out_that_is_a_file_or_cannot_be_made_is_refused_in_one_line_and_the_file_kept(profiled_run, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("kept")
    for out, says in ((afile, f"--out {afile} is a file, not a folder for the plots"),
                      (afile / "plots", f"--out {afile / 'plots'}: cannot make the folder")):
        result = mpifl_here("report", str(profiled_run / "run"), "--out", str(out))
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().startswith(f"mpifl report: {says}"), result.stderr
    assert afile.read_text() == "kept"


def test_a_run_that_failed_before_its_first_round_gets_a_clear_refusal_and_no_empty_plots(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    result = mpifl_here("report", str(run))
    assert result.returncode == 1
    assert "metrics.jsonl holds no round yet, so there is nothing to plot; `mpifl status" in result.stderr
    assert "Traceback" not in result.stderr and not (run / "report").exists()


def test_memray_writes_one_profile_per_rank_and_a_report(profiled_run):
    from mpifl.cli.profiling import summarize

    prof = profiled_run / "memray"
    assert sorted(p.name for p in prof.glob("*.bin")) == ["rank00000.bin", "rank00001.bin", "rank00002.bin"]
    result = mpifl_here("profile-report", str(prof))
    assert result.returncode == 0, result.stderr
    assert "| 0 | server |" in (prof / "peaks.md").read_text()
    for rank in range(3):
        assert (prof / f"rank{rank:05d}-memory.png").read_bytes()[:8] == PNG
    # a rank killed while it profiled leaves its file torn: left out, named, and the others still reported
    torn = profiled_run / "torn"
    shutil.copytree(prof, torn)
    (torn / "rank00002.bin").write_bytes((torn / "rank00002.bin").read_bytes()[:2000])
    result = mpifl_here("profile-report", str(torn))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert f"warning: {torn / 'rank00002.bin'} cannot be read, left out" in result.stderr
    assert "| 1 | client |" in (torn / "peaks.md").read_text() and "| 2 |" not in (torn / "peaks.md").read_text()
    for missing in (profiled_run / "nowhere", prof / "rank00000.bin"):
        refused = mpifl_here("profile-report", str(missing))
        assert refused.returncode == 1 and refused.stderr.startswith(f"mpifl profile-report: {missing} "), refused
    server = summarize(prof / "rank00000.bin")
    ru_maxrss = json.loads((profiled_run / "run" / "metrics.jsonl").read_text().splitlines()[-1])[
        "server_peak_rss_bytes"]
    assert abs(server["peak_rss_bytes"] - ru_maxrss) <= 0.2 * ru_maxrss


def test_a_queue_trace_named_relative_to_the_launch_folder_is_drawn_there_and_skipped_elsewhere(tmp_path):
    """config.yaml keeps clock.queue_trace as given (relative to where the run was launched, so that a resume
    there compares equal): mpifl report from another folder skips the availability plot, saying why."""
    run = tmp_path / "run"
    ran = run_mpi(3, "run", "configs/hpc_queue.yaml", "rounds=2", "--run-dir", str(run), cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    there, elsewhere = mpifl_here("report", str(run)), mpifl_here("report", str(run), cwd=tmp_path)
    assert f"wrote {run / 'report' / 'availability.png'}" in there.stdout, there.stderr
    assert elsewhere.returncode == 0 and "availability.png" not in elsewhere.stdout
    assert ("mpifl report: skipped availability.png: No such file or directory: 'configs/traces/hpc_queue.swf', "
            "which the run's config.yaml names relative to the folder it was launched from") in elsewhere.stderr


def test_virtual_time_runs_get_accuracy_against_virtual_time_staleness_and_participation(tmp_path):
    from mpifl.cli.compare import compare_runs
    from mpifl.cli.report import write_report

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"round": r, "participants": [r % 3, 3 + r % 2], "train_loss": 1.0 / r, "bytes_sent": 10,
                "bytes_received": 10, "server_rss_bytes": 1, "server_peak_rss_bytes": 1, "time": {"round": 0.1},
                "virtual_time": 2.5 * r, "staleness": [r % 3, 0], "eval": {"accuracy": 0.2 * r, "loss": 1.0 / r}}
               for r in range(1, 5)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "config.yaml").write_text("strategy: {name: fedavg}\nclock: {mode: fedbuff}\n")
    written = {p.name for p in write_report(run_dir, tmp_path / "out")}
    assert {"virtual_time.png", "staleness.png", "participation.png"} <= written
    assert all((tmp_path / "out" / n).read_bytes()[:8] == PNG for n in written)
    assert "| run | fedavg | fedbuff | 3 | 7.5 | 0.8000 | 0.8000 |" in compare_runs([str(run_dir)], target=0.6)[0]


def test_participation_counts_an_update_as_applied_only_if_its_client_was_not_dropped():
    from mpifl.cli.report import participation_counts

    failed = [{"client": 1, "rank": 1, "reason": "raised ValueError"}]
    records = [
        # client 1 took part and was dropped in both rounds: it applied nothing
        {"round": 1, "participants": [0, 1, 2], "dropped": failed, "stragglers": [3], "preempted": [],
         "job_ended": []},
        # sync: the tasks its jobs lost (4 to a preemption, 0 to its job's run time) are among the stragglers
        {"round": 2, "participants": [1, 2], "dropped": failed, "stragglers": [0, 3, 4], "preempted": [4],
         "job_ended": [0]},
        # an asynchronous step: its arrivals, and the tasks lost since the last step (no stragglers)
        {"round": 3, "participants": [2, 5], "preempted": [], "job_ended": [6]},
    ]
    assert participation_counts(records) == {"applied": {0: 1, 2: 3, 5: 1}, "rejected": {}, "unapplied": {},
                                             "dropped": {1: 2}, "stragglers": {3: 2}, "preempted": {4: 1},
                                             "job_ended": {0: 1, 6: 1}}


def test_participation_counts_the_usable_updates_of_a_round_not_applied_apart_and_says_how_many():
    """A virtual clock's round with too few usable updates leaves the model unchanged (its record's ``unapplied``):
    its usable updates are not "updates applied", but a stack of their own, and the title counts them."""
    from matplotlib.figure import Figure

    from mpifl.cli.report import _participation, participation_counts

    failed = [{"client": 1, "rank": 1, "reason": "raised ValueError"}]
    records = [{"round": 1, "participants": [0, 1, 2], "dropped": [], "stragglers": []},
               {"round": 2, "participants": [0, 1, 2], "dropped": failed, "stragglers": [3],
                "unapplied": "only 2 of 3 participants sent a usable update, fewer than clients.min_participants=3"}]
    counts = participation_counts(records)
    assert counts["applied"] == {0: 1, 1: 1, 2: 1} and counts["unapplied"] == {0: 1, 2: 1}
    assert counts["dropped"] == {1: 1} and counts["stragglers"] == {3: 1}
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    _participation(fig, ax, records, 4)
    assert ax.get_title() == ("Participation per client\n(2 usable updates to rounds not applied, not counted as "
                              "applied)")
    assert "usable, but its round\nnot applied" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_the_availability_plot_circles_each_lost_task_at_the_end_of_the_stretch_that_lost_it():
    from mpifl.cli.report import lost_tasks

    runs = {0: [(0.0, 100.0, False), (300.0, 400.0, True)], 1: [(50.0, 250.0, True)]}
    records = [{"virtual_time": 120.0, "virtual_round_seconds": 40.0, "preempted": [], "job_ended": [0]},
               {"virtual_time": 260.0, "virtual_round_seconds": 140.0, "preempted": [1], "job_ended": []},
               {"virtual_time": 450.0, "preempted": [0], "job_ended": []}]  # a step: the last stretch ended by then
    assert lost_tasks(records, runs.get) == [(100.0, 0), (250.0, 1), (400.0, 0)]


def _records(totals_first: float = 3.0, rounds: int = 15, rss=None) -> list[dict]:
    """A synthetic run: round 1 ``totals_first`` seconds, later rounds about 0.05 s; RSS from ``rss(round)``."""
    out = []
    for r in range(1, rounds + 1):
        total = totals_first if r == 1 else 0.04 + 0.002 * (r % 5)
        time = {"dispatch": 0.1 * total, "client_train": 0.6 * total, "return": 0.25 * total, "eval": 0.05 * total}
        server = rss(r) if rss else 300 * MIB
        out.append({"round": r, "train_loss": 1.0 / r, "bytes_sent": 10, "bytes_received": 10,
                    "server_rss_bytes": server, "server_peak_rss_bytes": server, "client_peak_rss_bytes": 400 * MIB,
                    "time": {**time, "round": total}})
    return out


def _png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR."""
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_time_axis_is_cut_below_a_60x_first_round_and_left_alone_otherwise():
    from mpifl.cli.report import time_axis_limit

    later = [0.04 + 0.002 * (r % 5) for r in range(2, 16)]
    top = time_axis_limit([60 * 0.05, *later])
    assert top == pytest.approx(1.5 * float(np.percentile(later, 90)))
    assert max(later) < top < 0.1  # every later bar fits, and fills most of the axis
    assert time_axis_limit([0.05, *later]) is None  # nothing to cut
    assert time_axis_limit([3.0]) is None and time_axis_limit([0.0, 0.0]) is None


def test_time_split_has_seconds_and_shares_panels_and_later_rounds_stay_visible(tmp_path):
    from matplotlib.figure import Figure

    from mpifl.cli.report import _time_split, write_report

    records = _records()
    fig = Figure()
    _time_split(fig, fig.subplots(), records)
    seconds, shares = fig.axes
    top = seconds.get_ylim()[1]
    assert top < 0.1, "round 1's 3 s set the axis: rounds 2-15 would be slivers"
    assert min(r["time"]["round"] for r in records[1:]) / top > 0.4
    assert [t.get_text() for t in seconds.texts] == ["round 1: 3.00 s"]  # the cut bar carries its true total
    heights = {}
    for bar in shares.patches:
        heights[round(bar.get_x() + bar.get_width() / 2)] = heights.get(round(bar.get_x() + bar.get_width() / 2),
                                                                         0.0) + bar.get_height()
    assert sorted(heights) == list(range(1, 16)) and all(h == pytest.approx(1.0) for h in heights.values())
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["dispatch", "client_train", "return", "eval"]

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(run_dir, tmp_path / "out")
    assert (tmp_path / "out" / "time_split.png").read_bytes()[:8] == PNG
    width, height = _png_size(tmp_path / "out" / "time_split.png")
    assert height > 0.9 * width  # two panels, not the one-panel 7x4 figure


def _history(server_mib, client_mib=None) -> list[dict]:
    """Records with the given server RSS (and largest client peak) in MiB, one per round."""
    clients = client_mib or [400] * len(server_mib)
    return [{"round": r, "server_rss_bytes": int(s * MIB), "client_peak_rss_bytes": int(c * MIB)}
            for r, (s, c) in enumerate(zip(server_mib, clients), 1)]


def test_memory_growth_warns_of_a_creeping_rank_only():
    from mpifl.roles.records import memory_growth, memory_warning_line

    assert memory_growth(_history([300] * 15)) == []
    assert memory_growth(_history([300 + r for r in range(15)])) == []  # rises every round, but by 1 MiB
    rng = np.random.default_rng(0)
    assert memory_growth(_history(list(300 + rng.uniform(-30, 30, 40)))) == []  # noise
    assert memory_growth(_history([300] * 5 + [500] * 10)) == []  # one step up, then flat
    assert memory_growth(_history([300 + 30 * r for r in range(5)])) == []  # too few rounds to judge

    creeping = memory_growth(_history([300 + 30 * r for r in range(8)]))
    assert [(w["rank"], w["signal"], w["from_round"], w["to_round"], w["rises"]) for w in creeping] == [
        ("server", "server_rss_bytes", 3, 8, 5)]
    assert creeping[0]["per_round_bytes"] == 30 * MIB
    noisy_creep = [300, 330, 380, 370, 420, 460, 500]  # rose in 4 of the last 5 rounds, +170 MiB
    assert [w["rank"] for w in memory_growth(_history(noisy_creep))] == ["server"]
    client = memory_growth(_history([300] * 8, [400 + 20 * r for r in range(8)]))
    assert [(w["rank"], w["per_round_bytes"]) for w in client] == [("client", 20 * MIB)]
    assert memory_growth([{"round": r} for r in range(1, 10)]) == []  # old records without readings
    on_gpu = [dict(r, client_peak_device_bytes=(1000 + 100 * r["round"]) * MIB) for r in _history([300] * 8)]
    assert [(w["rank"], w["signal"], w["per_round_bytes"]) for w in memory_growth(on_gpu)] == [
        ("client", "client_peak_device_bytes", 100 * MIB)]  # GPU memory that creeps warns too
    assert "the largest client rank's peak GPU memory rose in 5" in memory_warning_line(memory_growth(on_gpu)[0])


def test_memory_growth_is_logged_once_recorded_every_round_and_noted_on_the_plot(tmp_path, capfd):
    from mpifl.cli.report import memory_notes, write_report
    from mpifl.roles.records import note_memory_growth

    history: list[dict] = []
    for record in _records(rss=lambda r: (300 + 40 * r) * MIB, rounds=9):
        history.append(record)
        note_memory_growth(history)
    lines = [line for line in capfd.readouterr().err.splitlines() if "memory grows" in line]
    assert lines == ["[rank 0] warning: server memory grows round over round: the server's RSS rose in 5 of "
                     "rounds 2-6, by 200 MiB (59%), about 40.0 MiB per round; if it keeps on, the run ends out "
                     "of memory"]
    assert [r["round"] for r in history if "memory_warning" in r] == [6, 7, 8, 9]
    assert memory_notes(history) == ["warning: server memory grew 40.0 MiB per round (rounds 2-6, 59%)"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    write_report(run_dir, tmp_path / "out")
    assert (tmp_path / "out" / "memory.png").read_bytes()[:8] == PNG


def test_the_quality_plot_draws_every_recorded_accuracy_personal_models_included():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _quality, accuracy_series

    records = [{"round": r, "train_loss": 1.0 / r, "time": {"round": 0.1},
                **({"eval": {"loss": 0.5, "accuracy": 0.6 + r / 100}} if r % 2 == 0 else {}),
                **({"federated_eval": {"accuracy": 0.5, "personal_accuracy": 0.7}} if r == 4 else {})}
               for r in range(1, 5)]
    series = {label: (rounds, values) for label, rounds, values, _, _ in accuracy_series(records)}
    # each label says on which model and when: at one round they are not alike
    assert series == {"held-out: global model, after the round": ([2, 4], [0.62, 0.64]),
                      "clients' validation: global model, before local training": ([4], [0.5]),
                      "clients' validation: personal models, after this round's training": ([4], [0.7])}
    assert [label for label, *_ in accuracy_series(records[:2])] == [
        "held-out: global model, after the round"]  # only what was recorded
    fig = Figure()
    _quality(fig, fig.subplots(), records)
    _, accuracy = fig.axes
    assert [line.get_label() for line in accuracy.get_lines()] == list(series)
    # with model.local no model is the global one: the labels say which local tensors each was evaluated with
    assert [label for label, *_ in accuracy_series(records, local=True)] == [
        "held-out: averaged + built local tensors, after the round",
        "clients' validation: averaged + own local tensors, before local training",
        "clients' validation: personal models, after this round's training"]


def _straggling(clients: int, rounds: int = 3) -> list[dict]:
    """Rounds of a cross-device run: 20 participants a round, client 7 a straggler in every round, and one more
    straggler a round."""
    return [{"round": r, "participants": [(r * 20 + i) % clients for i in range(20)], "dropped": [],
             "stragglers": [7, (r * 331) % clients], "virtual_time": float(r)} for r in range(1, rounds + 1)]


def test_participation_at_cross_device_scale_counts_the_clients_with_each_number_of_rounds():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _participation, bar_columns, participation_counts, participation_histogram

    records = _straggling(1000)
    histogram = participation_histogram(participation_counts(records), 1000)
    assert histogram["applied"] == [940, 60]  # 60 distinct participants, one round each
    assert histogram["stragglers"] == [996, 3, 0, 1]  # client 7 three times, three others once
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    _participation(fig, ax, records, 1000)
    assert 1000 > bar_columns(fig, ax)  # a 7-inch figure has no pixel column for each of 1000 bars
    assert ax.get_title().startswith("Participation of 1000 clients: how many had each number of rounds")
    assert "too many clients for a bar each" in ax.get_title()
    assert ax.get_yscale() == "log"
    heights = [round(bar.get_height()) for bar in ax.patches]
    assert sorted(h for h in heights if h) == sorted([940, 60, 996, 3, 1])


def test_participation_of_a_few_clients_draws_a_bar_each():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _participation

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    _participation(fig, ax, _straggling(40), 40)
    assert ax.get_title() == "Participation per client"
    assert len(ax.patches) == 2 * 40  # applied and stragglers, a bar per client seen


def test_participation_keeps_a_place_and_a_tick_for_each_client_never_sampled():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _participation

    records = [{"round": 1, "participants": [1, 3], "dropped": []}, {"round": 2, "participants": [3, 4], "dropped": []}]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    _participation(fig, ax, records, 6)  # clients 0, 2 and 5 never sampled
    assert list(ax.get_xticks()) == [0, 1, 2, 3, 4, 5]
    assert [round(bar.get_height()) for bar in ax.patches] == [0, 1, 0, 2, 1, 0]
    assert ax.get_title() == "Participation per client\n(3 clients never sampled: no bar)"


def test_participation_hatches_the_applied_rounds_an_attack_altered_and_says_so_in_the_legend():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _participation, attacked_counts, participation_counts

    attack = {"fault": 0, "kind": "scale", "stage": "train", "rank": 1, "outcome": "folded"}
    records = [{"round": 1, "participants": [0, 1, 2], "dropped": [], "faults": [{**attack, "client": 0}]},
               {"round": 2, "participants": [0, 1, 2], "dropped": [],
                "faults": [{**attack, "client": 0}, {**attack, "client": 2, "kind": "noise"},
                           {**attack, "client": 1, "kind": "raise", "outcome": "dropped"}]},
               {"round": 3, "participants": [0, 1], "dropped": [], "unapplied": "too few",
                "faults": [{**attack, "client": 1}]}]  # its round was not applied: nothing altered the model
    assert attacked_counts(records) == {0: 2, 2: 1}
    records[1]["rejected"] = [0]  # Krum left client 0's attacked update out of round 2: not applied, not altering
    records[1]["faults"][0] = {**records[1]["faults"][0], "outcome": "rejected"}
    assert attacked_counts(records) == {0: 1, 2: 1}
    assert participation_counts(records)["rejected"] == {0: 1}
    del records[1]["rejected"]
    records[1]["faults"][0] = {**records[1]["faults"][0], "outcome": "folded"}
    held = [{"round": 1, "participants": [], "faults": [{**attack, "client": 1, "outcome": "held"}]}]
    assert attacked_counts(held) == {1: 1}  # asynchronous: trained on the struck step, applied later
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    _participation(fig, ax, records, 3)
    hatched = [round(p.get_height()) for p in ax.patches if p.get_hatch()]
    assert hatched == [2, 0, 1]
    assert any(t.get_text().startswith("applied, altered by a fault") for t in ax.get_legend().get_texts())


def test_the_staleness_title_gives_the_median_of_the_recorded_values():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _staleness

    values = [0] * 6 + [1] * 9 + [2] * 4 + [3] * 5 + [4] * 4 + [5] * 2  # 30 values: the 15th is 1, the 16th 2
    fig = Figure()
    ax = fig.subplots()
    _staleness(fig, ax, [{"round": 1, "staleness": values[:13]}, {"round": 2, "staleness": values[13:]}])
    assert ax.get_title() == "Staleness of 30 applied updates (median 1.5)"


def test_the_bytes_axis_starts_at_zero_so_heights_compare_as_bytes():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _bytes

    fig = Figure()
    ax = fig.subplots()
    _bytes(fig, ax, [{"round": r, "bytes_sent": 200_000, "bytes_received": 400_000} for r in (1, 2, 3)])
    assert ax.get_ylim()[0] == 0.0


def test_the_staleness_plot_counts_applied_updates_only_and_says_how_many_dropped_ones_it_left_out():
    """A step's staleness is each arrival's, aligned with arrival_order, dropped ones included: the plot's are
    the applied ones only."""
    from matplotlib.figure import Figure

    from mpifl.cli.report import _staleness, applied_staleness

    nan = [{"client": 1, "rank": 2, "reason": "update contains 1 NaN/Inf values"},
           {"client": 7, "rank": 2, "reason": "update contains 1 NaN/Inf values"}]
    records = [{"round": 10, "participants": [0, 1, 7], "dropped": nan, "arrival_order": [7, 0, 1],
                "staleness": [0, 3, 1]},
               {"round": 11, "participants": [2, 4], "dropped": [], "arrival_order": [4, 2], "staleness": [1, 0]}]
    assert applied_staleness(records) == ([3, 1, 0], 2, 0)
    fig = Figure()
    ax = fig.subplots()
    _staleness(fig, ax, records)
    assert ax.get_title() == "Staleness of 3 applied updates (median 1; 2 dropped updates not counted)"
    assert sum(p.get_height() for p in ax.patches) == 3


def test_the_staleness_plot_leaves_out_the_usable_updates_of_a_step_not_applied_and_says_how_many():
    """An asynchronous step with too few usable updates leaves the model unchanged (its record's ``unapplied``): its
    usable updates were not applied, so the histogram leaves them out, apart from the dropped ones, and the title
    counts them, as participation.png does."""
    from matplotlib.figure import Figure

    from mpifl.cli.report import _staleness, applied_staleness

    nan = [{"client": 1, "rank": 2, "reason": "update contains 1 NaN/Inf values"}]
    records = [{"round": 10, "participants": [0, 3], "dropped": [], "arrival_order": [3, 0], "staleness": [2, 0]},
               {"round": 11, "participants": [1, 4, 5], "dropped": nan, "arrival_order": [4, 1, 5],
                "staleness": [1, 4, 3], "unapplied": "step 11: only 2 of 3 arrivals were usable, fewer than "
                                                     "clients.min_participants=3"}]
    assert applied_staleness(records) == ([2, 0], 1, 2)
    fig = Figure()
    ax = fig.subplots()
    _staleness(fig, ax, records)
    assert ax.get_title() == ("Staleness of 2 applied updates (median 1; 1 dropped update not counted)\n"
                              "(2 usable updates to steps not applied, not counted as applied)")
    assert sum(p.get_height() for p in ax.patches) == 2


def test_the_cost_plot_draws_bytes_written_through_the_rounds_that_record_it():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _cost

    cost = {"cpu_seconds": 1.0, "server_cpu_seconds": 0.5, "client_cpu_seconds": 0.5, "bytes_moved": 10.0}
    records = [{"round": r, "cost": {**cost, **({"bytes_written": r * MIB} if r != 2 else {})},
                "cost_to_date": cost} for r in (1, 2, 3)]
    fig = Figure()
    _cost(fig, fig.subplots(), records)
    assert len(fig.axes) == 2  # the bars and, on a second axis, bytes written
    (line,) = fig.axes[1].get_lines()
    assert list(line.get_xdata()) == [1, 3] and list(line.get_ydata()) == [1.0, 3.0]


def test_the_availability_plot_ticks_whole_client_ids(tmp_path):
    from matplotlib.figure import Figure

    from mpifl.cli.report import _availability

    (tmp_path / "config.yaml").write_text("clients: {num_clients: 4}\nclock: {mode: fedbuff, concurrency: 2, "
                                          "availability: diurnal, period: 100}\n")
    fig = Figure()
    ax = fig.subplots()
    _availability(fig, ax, [{"round": r, "virtual_time": 30.0 * r} for r in (1, 2, 3)], tmp_path)
    assert [t for t in ax.get_yticks() if -0.5 <= t <= 3.5] == [0, 1, 2, 3]


def test_the_quality_plot_draws_the_clients_validation_losses_a_diverged_round_as_a_gap():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _quality, loss_series

    records = [{"round": r, "train_loss": 1.0, "federated_eval": {"accuracy": 0.5, "loss": 1.0 / r,
                                                                  "personal_loss": None if r == 2 else 0.5}}
               for r in (1, 2, 3)]
    global_, personal = loss_series(records)
    assert global_ == ("clients' validation loss: global model", [1, 2, 3], [1.0, 0.5, 1 / 3], "tab:purple")
    assert personal[1:3] == ([1, 2, 3], [0.5, None, 0.5])
    fig = Figure()
    _quality(fig, fig.subplots(), records)
    assert {line.get_label() for line in fig.axes[0].get_lines()} >= {global_[0], personal[0]}


def test_a_dp_run_gets_epsilon_against_round_with_its_budget_beside_held_out_accuracy():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _privacy, privacy_series

    records = [{"round": r, "privacy": {"epsilon": 0.5 * r, "delta": 1e-5},
                **({"eval": {"accuracy": 0.1 * r}} if r % 2 == 0 else {})} for r in (1, 2, 3, 4)]
    assert privacy_series(records) == ([1, 2, 3, 4], [0.5, 1.0, 1.5, 2.0])
    assert privacy_series([{"round": 1}]) == ([], [])  # no DP: no plot
    fig = Figure()
    _privacy(fig, fig.subplots(), records, budget=8.0)
    spent, accuracy = fig.axes
    assert [line.get_label() for line in spent.get_lines()] == ["ε (δ = 1e-05)", "privacy.epsilon_budget = 8"]
    assert list(accuracy.get_lines()[0].get_xdata()) == [2, 4]


def test_the_faults_plot_stacks_each_rounds_strikes_by_kind_beside_the_clients_dropped():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _faults, fault_counts

    records = [{"round": 1, "faults": [{"kind": "scale"}, {"kind": "nan"}], "dropped": [{"client": 3}]},
               {"round": 2, "dropped": [{"client": 1}, {"client": 4}]},  # past a deadline: no fault
               {"round": 3, "faults": [{"kind": "nan"}, {"kind": "nan"}], "dropped": []}]
    assert fault_counts(records) == ([1, 2, 3], {"nan": [1, 0, 2], "scale": [1, 0, 0]}, [1, 2, 0])
    fig = Figure()
    ax = fig.subplots()
    _faults(fig, ax, records)
    assert len(ax.patches) == 6  # a bar for each kind and round, stacked
    assert list(ax.get_lines()[0].get_ydata()) == [1, 2, 0]


def test_the_quality_plot_draws_a_diverged_runs_losses_on_a_log_axis_and_the_held_out_loss_dotted_in_green():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _quality

    diverged = [{"round": r, "train_loss": 2.0 * 10 ** (4 * r), "eval": {"loss": 3.0 * 10 ** (4 * r),
                                                                         "accuracy": 0.1}} for r in (1, 2, 3, 4)]
    diverged.append({"round": 5, "train_loss": None, "eval": {"loss": None, "accuracy": 0.1}})  # NaN: a gap
    fig = Figure()
    _quality(fig, ax := fig.subplots(), diverged)
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "loss (log scale)"
    held_out = next(line for line in ax.get_lines() if line.get_label() == "held-out loss")
    assert (held_out.get_color(), held_out.get_linestyle()) == ("tab:green", ":")  # its accuracy's colour, dotted
    calm = [{"round": r, "train_loss": 2.0 / r, "eval": {"loss": 1.0 / r, "accuracy": 0.5}} for r in (1, 2, 3)]
    fig = Figure()
    _quality(fig, ax := fig.subplots(), calm)
    assert ax.get_yscale() == "linear"


def test_the_faults_plot_ticks_whole_clients_only():
    from matplotlib.figure import Figure

    from mpifl.cli.report import _faults

    records = [{"round": 1, "faults": [{"kind": "scale"}], "dropped": []}, {"round": 2, "dropped": []}]
    fig = Figure()
    _faults(fig, ax := fig.subplots(), records)
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_yticks()), ax.get_yticks()
