"""The NIID-Bench grid's kept records (profiling/niid_records.py): a finished full-protocol run becomes one JSON
record, a recorded cell is read instead of run again, the grid table is built from the records alone, and the
benchmarks page shows exactly that table, so every figure in it comes from a committed record. No MPI, no dataset."""
from __future__ import annotations

import json
import stat

import pytest
from conftest import ROOT

BEGIN, END = "<!-- niid-grid: python profiling/niid_bench.py --grid -->", "<!-- /niid-grid -->"


@pytest.fixture
def records(monkeypatch):
    """profiling.niid_records, with the repository root on sys.path."""
    monkeypatch.syspath_prepend(str(ROOT))
    from profiling import niid_records
    return niid_records


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from profiling import niid_bench
    return niid_bench


def a_record(records, label="fedavg", seed=0, curve=(0.5, 0.8, 0.8, 0.7), setting="label2"):
    return records.record_from_curve(list(curve), setting=setting, label=label, seed=seed, commit="c" * 40,
                                     date="2026-11-30", machine="test", command="python profiling/niid_bench.py")


def test_a_record_keeps_the_last_round_and_the_first_round_that_reached_the_best(records):
    record = a_record(records)
    assert (record.last, record.best, record.best_round, record.rounds) == (0.7, 0.8, 2, 4)
    with pytest.raises(ValueError, match="label2 fedavg seed 0: a record needs at least one evaluated round"):
        a_record(records, curve=())


def test_a_record_round_trips_through_its_file_named_after_the_run(records, tmp_path):
    record = a_record(records, label="fedprox (mu=0.01)", seed=2)
    path = records.write_record(record, tmp_path)
    assert path == tmp_path / "label2" / "fedprox-mu0.01-seed2.json"
    assert records.find_record("label2", "fedprox (mu=0.01)", 2, tmp_path) == record
    assert records.find_record("label2", "fedprox (mu=0.01)", 1, tmp_path) is None
    path.write_text('{"seed": 2}')
    with pytest.raises(ValueError, match="fedprox-mu0.01-seed2.json: not a NIID-Bench run record"):
        records.read_records(tmp_path)


def test_the_grid_gives_mean_and_sample_std_over_seeds_beside_flower(records):
    kept = [a_record(records, seed=0, curve=(0.7, 0.8)), a_record(records, seed=1, curve=(0.9, 0.6))]
    table = records.grid_table(kept, {"label2": {"fedavg": 81.0}}, settings=["label2"], algorithms=["fedavg",
                                                                                                      "scaffold"])
    rows = table.splitlines()
    # last: 80 and 60 -> 70.0 ± 14.1; best: 80 and 90 -> 85.0 ± 7.1; Flower 81.0 -> +4.0
    assert rows[2] == "| `label2` | fedavg | 0 1 | 70.0 ± 14.1 | 85.0 ± 7.1 | 81.0 | +4.0 |"
    assert rows[3] == "| `label2` | scaffold | not run yet |  |  | no row |  |"


def test_the_grid_refuses_two_fedprox_mus_in_one_cell(records):
    kept = [a_record(records, label="fedprox (mu=0.01)"), a_record(records, label="fedprox (mu=0.1)", seed=1)]
    with pytest.raises(ValueError, match=r"label2 fedprox: records of more than one variant"):
        records.grid_table(kept, {}, settings=["label2"], algorithms=["fedprox"])


@pytest.mark.parametrize("root", ["niid_bench", "niid_bench_flower_split"])
def test_every_kept_record_is_a_whole_protocol_run_named_after_its_contents(records, bench, root):
    kept = records.read_records(records.RECORDS.parent / root)
    assert kept, f"profiling/results/{root} holds finished runs"
    for record in kept:
        where = records.record_path(record, records.RECORDS.parent / root)
        assert where.is_file(), f"{where}: a record must live at its own cell's path"
        assert record.setting in bench.SETTINGS and record.algorithm in bench.ALGORITHMS, where
        whole = record.diverged_round - 1 if record.diverged_round else bench.PROTOCOL["rounds"]
        assert record.rounds == whole and len(record.commit) == 40, where
        assert 0 < record.last <= record.best <= 1 and 1 <= record.best_round <= record.rounds, where
        if record.accuracy is None:
            assert "per-round curve is not kept" in record.note, where  # only the runs from before records
        else:
            assert len(record.accuracy) == record.rounds and record.last == record.accuracy[-1], where
            assert (record.best, record.best_round) == records.best_of(record.accuracy), where


def test_the_benchmarks_page_shows_the_grid_the_records_give(records, bench):
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert BEGIN in page and END in page, f"docs/benchmarks.md: the grid sits between {BEGIN} and {END}"
    shown = page.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == records.grid_table(records.read_records(), bench.FLOWER_FMNIST), (
        "docs/benchmarks.md's NIID-Bench grid differs from the records: paste `python profiling/niid_bench.py --grid`")


def fake_mpiexec(tmp_path, monkeypatch, rounds: int, fails_with: str = ""):
    """A stand-in mpiexec that records its arguments and writes a run of ``rounds`` evaluated rounds; with
    ``fails_with``, it then prints that line and exits 1, as a run that stopped part way."""
    fake = tmp_path / "bin"
    fake.mkdir()
    lines = "".join(f'{{"round": {r}, "num_samples": 10, "time": {{"round": 2.0, "eval": 0.1}}, '
                    f'"eval": {{"accuracy": {0.5 + r / 1000}}}}}\n' for r in range(1, rounds + 1))
    (tmp_path / "metrics.jsonl").write_text(lines)
    script = fake / "mpiexec"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{tmp_path}/calls"\n'
                      'while [ "$1" != "--run-dir" ]; do shift; done\n'
                      f'mkdir -p "$2"\ncp "{tmp_path}/metrics.jsonl" "$2/metrics.jsonl"\n'
                      + (f"echo '{fails_with}'\nexit 1\n" if fails_with else ""))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr("profiling.niid_bench.dataset_problem", lambda folder=None: None)
    monkeypatch.setattr("profiling.niid_bench.write_partition",
                        lambda path, seed, folder=None, setting="labeldir": path)
    return fake


def test_a_finished_run_is_recorded_and_then_read_instead_of_run_again(bench, records, tmp_path, monkeypatch,
                                                                         capsys):
    fake = fake_mpiexec(tmp_path, monkeypatch, rounds=50)
    argv = ["--setting", "iid", "--algorithms", "fedavg", "--seeds", "1", "--bin", str(fake), "--work",
            str(tmp_path / "work"), "--records", str(tmp_path / "records")]
    assert bench.main(argv) == 0
    record = records.find_record("iid", "fedavg", 1, tmp_path / "records")
    assert (record.rounds, record.last, record.best_round) == (50, 0.55, 50)
    assert record.command == "python profiling/niid_bench.py --setting iid --algorithms fedavg --seeds 1"
    assert bench.main(argv) == 0
    assert len((tmp_path / "calls").read_text().splitlines()) == 1  # the second call read the record
    assert "recorded: 0.5500 after round 50" in capsys.readouterr().err
    assert bench.main([*argv, "--rerun"]) == 0
    assert len((tmp_path / "calls").read_text().splitlines()) == 2


NAN_UPDATE = ("[mpifl rank 1 on host] failed, aborting the job: round 12: logical client 0 (rank 1): update contains "
              "42156 NaN/Inf values (clients.accept_failures=false); if its training diverged, lower train.lr")
NAN_UPDATE_BEFORE = ("FloatingPointError: logical client 0 on rank 1: update contains 42156 NaN/Inf values "
                     "(clients.accept_failures=false); if its training diverged, lower train.lr")  # until 2026-12-01


@pytest.mark.parametrize("line", [NAN_UPDATE, NAN_UPDATE_BEFORE], ids=["one-line", "traceback"])
def test_a_run_whose_training_diverged_is_recorded_as_diverged_and_shown_so_in_the_grid(bench, records, tmp_path,
                                                                                      monkeypatch, line):
    fake = fake_mpiexec(tmp_path, monkeypatch, rounds=11, fails_with=line)
    argv = ["--setting", "label1", "--algorithms", "scaffold", "--seeds", "0", "--bin", str(fake), "--work",
            str(tmp_path / "work"), "--records", str(tmp_path / "records")]
    assert bench.main(argv) == 0  # the algorithm's result on this split, not a failure of the harness
    record = records.find_record("label1", "scaffold", 0, tmp_path / "records")
    assert (record.rounds, record.diverged_round, record.last) == (11, 12, 0.511)
    table = records.grid_table([record], {"label1": {"scaffold": 10.0}}, settings=["label1"],
                               algorithms=["scaffold"])
    assert table.splitlines()[2] == ("| `label1` | scaffold | 0 (seed 0 diverged in round 12) | 51.1 | 51.1 | 10.0 "
                                     "| +41.1 |")


@pytest.mark.parametrize("line", ["mpifl: error: rank 2 made no progress",
                                  "round 3: logical client 0 (rank 1): update contains 5 NaN/Inf values, put there by "
                                  "faults[0] (nan) (clients.accept_failures=false)"], ids=["watchdog", "injected"])
def test_a_run_that_failed_otherwise_is_not_recorded(bench, records, tmp_path, monkeypatch, line):
    fake = fake_mpiexec(tmp_path, monkeypatch, rounds=11, fails_with=line)
    assert bench.main(["--setting", "label1", "--algorithms", "scaffold", "--seeds", "0", "--bin", str(fake),
                       "--work", str(tmp_path / "work"), "--records", str(tmp_path / "records")]) == 1
    assert records.find_record("label1", "scaffold", 0, tmp_path / "records") is None


def test_a_shortened_run_is_never_recorded(bench, tmp_path, monkeypatch):
    fake = fake_mpiexec(tmp_path, monkeypatch, rounds=1)
    assert bench.main(["--setting", "iid", "--algorithms", "fedavg", "--seeds", "0", "--rounds", "1", "--bin",
                       str(fake), "--work", str(tmp_path / "work"), "--records", str(tmp_path / "records")]) == 0
    assert not (tmp_path / "records").exists()


def test_no_run_starts_past_start_before(bench, tmp_path, monkeypatch, capsys):
    fake = fake_mpiexec(tmp_path, monkeypatch, rounds=50)
    assert bench.main(["--setting", "iid", "--algorithms", "fedavg", "scaffold", "--seeds", "0", "--bin", str(fake),
                       "--work", str(tmp_path / "work"), "--records", str(tmp_path / "records"),
                       "--start-before", "2000-01-01T00:00"]) == 0
    assert not (tmp_path / "calls").exists()
    assert "Not started (past --start-before): fedavg, seed 0; scaffold, seed 0." in capsys.readouterr().out


def test_the_grid_is_printed_from_the_records_alone(bench, records, tmp_path, capsys):
    records.write_record(a_record(records, setting="iid"), tmp_path)
    assert bench.main(["--grid", "--records", str(tmp_path)]) == 0
    assert "| `iid` | fedavg | 0 | 70.0 | 80.0 | 89.0 | -9.0 |" in capsys.readouterr().out


def test_records_are_json_a_diff_can_read(records, tmp_path):
    path = records.write_record(a_record(records), tmp_path)
    text = path.read_text()
    assert text.endswith("\n") and json.loads(text)["best_round"] == 2 and text.index('"accuracy"') < text.index(
        '"best"')  # keys sorted


def test_the_grid_figures_draw_each_setting_with_curves_and_leave_out_records_without_one(bench, records, tmp_path):
    for seed in (0, 1):
        records.write_record(a_record(records, setting="iid", seed=seed), tmp_path / "records")
    lost = records.RunRecord(setting="label1", label="fedavg", seed=0, rounds=4, last=0.7, best=0.8, best_round=2,
                             commit="c" * 40, date="2026-11-30", machine="test", command="-", note="lost")
    records.write_record(lost, tmp_path / "records")
    assert bench.main(["--grid", "--records", str(tmp_path / "records"), "--plot", str(tmp_path / "figures")]) == 0
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["niid_grid-iid.png"]
    assert (tmp_path / "figures" / "niid_grid-iid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_describe_gives_the_figures_the_page_quotes_of_a_run_from_its_record(records):
    """The page's paragraph of each run quotes its range and largest swing from round 10, its last 10 rounds' mean
    and how it lies against FedAvg on the same seed: ``--describe`` computes them from the record."""
    curve = [0.1] * 9 + [0.5, 0.8, 0.4, 0.7, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.9]  # 20 rounds
    fedavg = [0.2] * 9 + [0.6] * 11
    assert records.settled_range(curve) == (0.4, 0.9)
    assert records.largest_change(curve) == pytest.approx((-0.4, 12))  # 0.8 -> 0.4 beats +0.3 and +0.3
    assert records.last_rounds_mean(curve) == pytest.approx(0.64)
    above, both, gap = records.against(curve, fedavg)
    assert (above, both) == (3, 20) and gap == pytest.approx((0.2 - 0.2 + 0.1 + 0.0 * 6 + 0.3) / 10)
    run = a_record(records, label="fednova", seed=1, curve=curve, setting="label1")
    lines = records.describe(run, a_record(records, seed=1, curve=fedavg, setting="label1"))
    assert lines[1] == "  after round 20: 90.00%; best 90.00% (round 20)"
    assert lines[2] == "  from round 10: 40.00-90.00%; largest change -40.00 points (80.00% -> 40.00%, round 12)"
    assert lines[3] == "  rounds 11-20: 64.00% on average"
    assert lines[4].startswith("  against fedavg seed 1: above it in 3 of 20 rounds; +4.00 points on average from "
                               "round 11; its rounds 11-20: 60.00%")
    lost = records.RunRecord(setting="label2", label="fedavg", seed=0, rounds=50, last=0.8, best=0.81, best_round=40,
                             commit="c" * 40, date="2026-11-30", machine="test", command="", note="lost")
    assert records.describe(lost)[2] == "  no per-round curve kept (the record's note says why)"


def test_describe_prints_each_seed_against_fedavg_and_the_cell_over_its_seeds(bench, records, tmp_path, capsys):
    for seed, curve in ((0, [0.5, 0.7]), (1, [0.6, 0.9])):
        records.write_record(a_record(records, label="fednova", seed=seed, curve=curve), tmp_path)
    records.write_record(a_record(records, seed=1, curve=(0.7, 0.8)), tmp_path)
    assert bench.main(["--describe", "--setting", "label2", "--algorithms", "fednova", "--seeds", "1", "2",
                       "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("label2 fednova seed 1 (commit ccccccc, 2026-11-30)")
    assert out[3].startswith("  against fedavg seed 1: above it in 1 of 2 rounds")
    assert out[4] == "label2 fednova seed 2: no record"
    assert out[5] == "label2 fednova over seeds 0 1: after the last round 80.0 ± 14.1, best 80.0 ± 14.1"
