"""`mpifl report` and memray profiles per rank."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, run_mpi

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("profiled")
    result = run_mpi(3, "run", str(ROOT / "configs" / "quickstart.yaml"), "rounds=4", "--run-dir", str(base / "run"),
                     "--memray", str(base / "memray"))
    assert result.returncode == 0, result.stderr
    return base


def test_report_writes_the_plots(profiled_run, tmp_path):
    result = subprocess.run([sys.executable, "-m", "mpifl", "report", str(profiled_run / "run"), "--out",
                             str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for name in ("quality.png", "time_split.png", "bytes.png", "memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG, name


def test_memray_writes_one_profile_per_rank_and_a_report(profiled_run):
    from mpifl.cli.profiling import summarize

    prof = profiled_run / "memray"
    assert sorted(p.name for p in prof.glob("*.bin")) == ["rank00000.bin", "rank00001.bin", "rank00002.bin"]
    result = subprocess.run([sys.executable, "-m", "mpifl", "profile-report", str(prof)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert "| 0 | server |" in (prof / "peaks.md").read_text()
    for rank in range(3):
        assert (prof / f"rank{rank:05d}-memory.png").read_bytes()[:8] == PNG
    server = summarize(prof / "rank00000.bin")
    ru_maxrss = json.loads((profiled_run / "run" / "metrics.jsonl").read_text().splitlines()[-1])[
        "server_peak_rss_bytes"]
    assert abs(server["peak_rss_bytes"] - ru_maxrss) <= 0.2 * ru_maxrss


def test_virtual_time_runs_get_accuracy_against_virtual_time_staleness_and_participation(tmp_path):
    from mpifl.cli.report import compare_table, write_report

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
    assert "| run | fedavg | fedbuff | 3 | 7.5 | 0.8000 | 0.8000 |" in compare_table([str(run_dir)], 0.6)
