"""The NIID-Bench harness (profiling/niid_bench.py) without running it: its configs (4 algorithms x 7 settings) load
and hold the protocol it states once, its table prints what it is given, its partitions are NIID-Bench's rules, and
it refuses a machine without Fashion-MNIST. No MPI, no dataset read."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROOT

from mpifl.config import load_config
from mpifl.config.sections import STRATEGIES


@pytest.fixture
def bench(monkeypatch):
    """profiling.niid_bench, with the repository root on sys.path (the configs' plug-in model lives there too)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from profiling import niid_bench
    return niid_bench


def value(cfg, dotted: str):
    """``cfg``'s value at a dotted key ("train.lr")."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("setting", ["labeldir", "noise", "label1", "label2", "label3", "quantity", "iid"])
@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "scaffold", "fednova"])
def test_each_config_loads_with_the_protocol(bench, algorithm, setting):
    if bench.ALGORITHMS[algorithm]["strategy.name"] not in STRATEGIES:
        pytest.skip(f"strategy.name {bench.ALGORITHMS[algorithm]['strategy.name']!r} is not built in yet")
    cfg = load_config(bench.config_path(algorithm, setting))
    expected = bench.expected_keys(algorithm, setting)
    assert {key: value(cfg, key) for key in expected} == expected
    assert cfg.name == f"niid_bench_{bench.SETTINGS[setting].prefix}_{algorithm}"
    assert cfg.data.feature_noise == (0.1 if setting == "noise" else 0.0)
    # no protocol key is left at a default the harness does not state: FedProx alone has mu, seed 0 is the first
    assert cfg.train.prox_mu == (bench.FEDPROX_MU if algorithm == "fedprox" else 0.0)
    assert cfg.seed == bench.SEEDS[0] and cfg.clients_per_round() == 10


def test_the_protocol_is_niid_bench_s(bench):
    # scripts/image-data-without-noise.sh and experiments.py's defaults, as the harness states them
    assert bench.PROTOCOL["rounds"] == 50 and bench.PROTOCOL["train.local_epochs"] == 10
    assert bench.PROTOCOL["clients.num_clients"] == 10 and bench.PROTOCOL["clients.fraction"] == 1.0
    assert (bench.PROTOCOL["train.lr"], bench.PROTOCOL["train.momentum"], bench.PROTOCOL["train.batch_size"],
            bench.PROTOCOL["train.weight_decay"]) == (0.01, 0.9, 64, 1e-5)
    assert bench.SETTINGS["labeldir"].keys == {"data.partition": "dirichlet", "data.alpha": 0.5}
    # scripts/image-data-with-noise.sh: --partition=homo --noise=0.1
    assert bench.SETTINGS["noise"].keys == {"data.partition": "iid", "data.feature_noise": 0.1}
    assert bench.SEEDS == (0, 1, 2) and bench.FEDPROX_MU in bench.FEDPROX_MU_GRID
    for setting in bench.SETTINGS.values():
        assert set(bench.ALGORITHMS) == set(setting.paper) and set(setting.other) <= set(bench.ALGORITHMS)
    # the one published figure a readable source quotes (FedLab-benchmarks' feature-skew-fedavg README)
    assert bench.SETTINGS["noise"].paper["fedavg"] == (89.1, 0.3)


def test_the_model_is_niid_bench_s_simple_cnn(bench):
    import torch

    from profiling.niid_bench_model import simple_cnn_mnist

    model = simple_cnn_mnist((1, 28, 28), 10)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {"conv1.weight": (6, 1, 5, 5), "conv1.bias": (6,), "conv2.weight": (16, 6, 5, 5),
                      "conv2.bias": (16,), "fc1.weight": (120, 256), "fc1.bias": (120,), "fc2.weight": (84, 120),
                      "fc2.bias": (84,), "fc3.weight": (10, 84), "fc3.bias": (10,)}
    assert sum(v.numel() for v in model.parameters()) == 44_426
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_the_table_prints_the_results_it_is_given(bench, monkeypatch):
    monkeypatch.setitem(bench.SETTINGS["labeldir"].paper, "fedavg", (88.0, 0.5))
    table = bench.format_table({"fedavg": [0.881, 0.883, 0.879], "fedprox (mu=0.01)": [0.9]},
                               {"scaffold": "exit 1: strategy.name: 'scaffold' is not one of ..."},
                               best={"fedavg": [0.885, 0.884, 0.886]})
    assert table.splitlines() == [
        "| algorithm | mpifl, last round (mean ± std over seeds) | mpifl, best round | paper's accuracy (Table III) | "
        "difference | Flower's reproduction (1 run) |",
        "|---|---|---|---|---|---|",
        "| fedavg | 88.1% ± 0.2% (n=3) | 88.5% ± 0.1% (n=3) | 88.0% ± 0.5% | +0.1 pp | 88.4% |",
        "| fedprox (mu=0.01) | 90.0% (n=1) | n/a | not found | n/a | 88.6% |",
        "| scaffold | no run finished; failed: exit 1: strategy.name: 'scaffold' is not one of ... | n/a | not found | "
        "n/a | 88.4% |",
    ]


def test_the_partition_is_niid_bench_s_labeldir(bench):
    labels = np.repeat(np.arange(10), 300)  # 3,000 samples, 10 classes
    parts = bench.niid_labeldir(labels, 10, 0.5, seed=0)
    assert parts == bench.niid_labeldir(labels, 10, 0.5, seed=0)  # the seed decides it
    assert parts != bench.niid_labeldir(labels, 10, 0.5, seed=1)
    every = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    assert sorted(every.tolist()) == list(range(len(labels)))  # each sample once
    assert min(map(len, parts)) >= bench.NIID_MIN_REQUIRE_SIZE  # the retry loop's guarantee
    # the legacy stream np.random.seed(0) sets: NIID-Bench's first draws are class 0's shuffle, then Dir(beta); no
    # party holds anything yet, so party 0 takes the first int(p_0 * 300) shuffled samples of class 0
    rng = np.random.RandomState(0)
    first = np.where(labels == 0)[0]
    rng.shuffle(first)
    cut = int(rng.dirichlet(np.repeat(0.5, 10))[0] * 300)
    assert sorted(i for i in parts[0] if labels[i] == 0) == sorted(first[:cut].tolist())
    # 150 samples for 10 parties: whole splits are redrawn until every party holds 10
    assert min(map(len, bench.niid_labeldir(np.repeat(np.arange(10), 15), 10, 0.5, seed=0))) >= 10


def test_the_noise_rows_table_sets_the_published_figure_beside_mpifls(bench):
    table = bench.format_table({"fedavg": [0.890, 0.894, 0.886]}, setting="noise").splitlines()
    assert table[0].endswith("| FedLab's reproduction (5 runs) |")
    assert table[2] == "| fedavg | 89.0% ± 0.4% (n=3) | n/a | 89.1% ± 0.3% | -0.1 pp | 89.4% |"


def test_the_even_split_is_niid_bench_s_homo(bench):
    parts = bench.niid_homo(1003, 10, seed=2)
    order = np.random.RandomState(2).permutation(1003)  # np.random.seed(2); np.random.permutation(n_train)
    assert parts == [p.tolist() for p in np.array_split(order, 10)]
    assert sorted(len(p) for p in parts) == [100] * 7 + [101] * 3
    assert bench.niid_split("noise", np.zeros(1003), 2) == parts


@pytest.mark.parametrize("k", [1, 2, 3, 10])
def test_the_label_quantity_split_is_niid_bench_s_noniid_label_k(bench, k):
    labels = np.repeat(np.arange(10), 300)
    parts = bench.niid_label_quantity(labels, 10, k, seed=0)
    assert parts == bench.niid_label_quantity(labels, 10, k, seed=0)
    held = [sorted(set(labels[p].tolist())) for p in parts]
    assert all(len(h) == k for h in held)  # #C = k labels each
    assert all(i % 10 in h for i, h in enumerate(held))  # party i holds label i mod 10, plus k - 1 drawn ones
    every = sorted(i for p in parts for i in p)
    assert every == list(range(len(labels)))  # each sample once: a label's samples split among its holders
    assert bench.niid_label_quantity(labels, 10, k, seed=1) != parts  # the seed decides the shuffles (and draws)
    if k < 10:
        assert bench.niid_split(f"label{k}", labels, 0) == parts


def test_the_harness_draws_its_label_sets_with_mpifls_own_helpers(bench):
    """mpifl's ``labels`` partition and the harness share one copy of the #C=k rule; the harness passes its own
    draws (Python's random, numpy's legacy stream), so its splits stay NIID-Bench's."""
    from mpifl.learning import partitions

    assert bench.label_sets is partitions.label_sets and bench.deal_label_runs is partitions.deal_label_runs


def test_the_quantity_split_is_niid_bench_s_iid_diff_quantity(bench):
    parts = bench.niid_quantity(3000, 10, 0.5, seed=2)
    rng = np.random.RandomState(2)  # np.random.seed(2): the permutation first, then Dir(0.5) until all hold 10
    order = rng.permutation(3000)
    assert [i for p in parts for i in p] == order.tolist()  # the permutation cut in party order
    assert min(map(len, parts)) >= 10 and len({len(p) for p in parts}) > 5  # sizes skewed
    assert bench.niid_split("quantity", np.zeros(3000), 2) == parts
    assert bench.niid_split("iid", np.zeros(3000), 2) == bench.niid_homo(3000, 10, 2)


def test_every_setting_has_flowers_row_where_flower_ran_one(bench):
    assert set(bench.SETTINGS) == {"labeldir", "noise", "label1", "label2", "label3", "quantity", "iid"}
    assert bench.SETTINGS["label2"].other == {"fedavg": 81.0, "scaffold": 10.0, "fedprox": 78.8, "fednova": 70.5}
    assert bench.SETTINGS["quantity"].other == {}  # Flower's baseline has no quantity-skew row
    assert all(value is None for s in bench.SETTINGS.values() for a, value in s.paper.items()
               if (s.title, a) != (bench.SETTINGS["noise"].title, "fedavg"))


def test_it_refuses_without_fashion_mnist(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "FASHION_MNIST", tmp_path)
    assert "apt-get install dataset-fashion-mnist" in bench.dataset_problem(tmp_path)
    assert bench.main(["--rounds", "1", "--work", str(tmp_path / "work")]) == 2
    assert "dataset-fashion-mnist" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # nothing ran, nothing written


def test_read_run_takes_the_last_evaluated_round(bench, tmp_path):
    records = [{"round": r, "num_samples": 60000, "time": {"round": 40.0 + r, "eval": 0.3},
                **({"eval": {"accuracy": 0.5 + r / 10, "loss": 1.0}} if r != 3 else {})} for r in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = bench.read_run(tmp_path)
    assert (out["accuracy"], out["round"], out["rounds"]) == (0.7, 2, 3)


def test_a_second_invocation_goes_on_from_the_checkpoints_and_keeps_the_first_log(bench, tmp_path, monkeypatch):
    """Every run is started with ``--resume``: mpifl starts it fresh when its directory holds no checkpoint, goes on
    from the newest one otherwise, and only reports a finished run (tests/faults cover those three cases). The
    harness's log of a run keeps what the interrupted invocation wrote. A stand-in mpiexec records its arguments
    and writes the run's metrics."""
    import argparse
    import stat

    fake = tmp_path / "bin"
    fake.mkdir()
    script = fake / "mpiexec"
    script.write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$CALLS"\nwhile [ "$1" != "--run-dir" ]; do shift; done\n'
                      'mkdir -p "$2"\necho \'{"round": 1, "num_samples": 10, "time": {"round": 2.0, "eval": 0.1}, '
                      '"eval": {"accuracy": 0.5}}\' > "$2/metrics.jsonl"\necho "run output"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS", str(calls))
    args = argparse.Namespace(bin=str(fake), ranks=3, run_timeout=60)
    (tmp_path / "work").mkdir()  # main() makes --work
    run_dir = tmp_path / "work" / "fedavg-seed0"
    for _ in range(2):
        assert bench.run_one(args, "fedavg", 0, run_dir, ["rounds=1"])["accuracy"] == 0.5
    commands = calls.read_text().splitlines()
    assert len(commands) == 2 and all(f"--run-dir {run_dir} --resume seed=0" in c for c in commands)
    assert all("clients.placement=balanced" in c for c in commands)  # results unchanged, rounds evenly loaded
    log = run_dir.with_suffix(".log").read_text()
    assert log.count("run output") == 2 and log.count("--resume") == 2


def test_a_run_past_its_time_limit_is_stopped_with_sigterm_and_reported(bench, tmp_path):
    """A hung job must not hold the reproduction forever: past ``--run-timeout`` it gets SIGTERM (mpifl then
    checkpoints its round and exits), and the read-out says so and how to go on."""
    import argparse
    import stat
    import time

    fake = tmp_path / "bin"
    fake.mkdir()
    script = fake / "mpiexec"
    script.write_text("#!/bin/sh\ntrap 'echo stopped by SIGTERM; exit 3' TERM\nwhile :; do sleep 0.1; done\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    run_dir = tmp_path / "work" / "fedavg-seed0"
    run_dir.parent.mkdir()
    began = time.monotonic()
    out = bench.run_one(argparse.Namespace(bin=str(fake), ranks=3, run_timeout=1), "fedavg", 0, run_dir, [])
    assert time.monotonic() - began < 30
    assert "still running after --run-timeout 1 s" in out["error"] and "the same --work goes on" in out["error"]
    assert "stopped by SIGTERM" in run_dir.with_suffix(".log").read_text()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_flowers_split_is_niid_bench_s_rule_drawn_from_one_generator_of_seed_42(bench, k):
    """Flower's baseline trained its published rows on its own #C=k split of seed 42; the harness draws the same
    parties (``--partition flower``), so mpifl can be run on the very clients Flower's figure came from."""
    labels = np.repeat(np.arange(10), 30)
    parts = bench.flower_label_quantity(labels, 10, k)
    assert parts == bench.flower_label_quantity(labels, 10, k, seed=42)  # seed 42 unless told
    assert parts != bench.flower_label_quantity(labels, 10, k, seed=0) or k == 1
    held = [sorted(set(labels[p].tolist())) for p in parts]
    assert all(len(h) == k and i in h for i, h in enumerate(held))  # party i holds label i and k - 1 more
    assert sorted(i for p in parts for i in p) == list(range(300))  # every sample, once
    for label in range(10):  # a label's samples split evenly among the parties holding it
        sizes = [int(np.sum(labels[p] == label)) for p in parts if label in held[parts.index(p)]]
        assert max(sizes) - min(sizes) <= 1
    if k == 2:  # the label pairs of Flower's #C=2 row, as numpy's default_rng(42) draws them
        assert held == [[0, 7], [1, 6], [2, 4], [3, 4], [4, 8], [0, 5], [2, 6], [0, 7], [5, 8], [7, 9]]


def test_flowers_split_exists_for_label_quantity_only(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--partition", "flower", "--setting", "iid"])
    assert "Flower's split is written for label1, label2, label3 only" in capsys.readouterr().err


def test_a_harness_stopped_by_sigterm_stops_its_job_instead_of_leaving_it_orphaned(tmp_path):
    """The job runs in a session of its own, so a signal to the harness never reaches it: the harness passes SIGTERM
    on (each rank checkpoints its round) before it goes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    job = tmp_path / "job.pid"
    harness = subprocess.Popen([sys.executable, "-c", (
        "import sys; sys.path.insert(0, sys.argv[1]); from profiling import niid_bench; "
        "job = ['bash', '-c', 'echo $$ > ' + sys.argv[2] + '; exec sleep 300']; "
        "niid_bench.run_with_time_limit(job, {}, None, 600)"),
        str(ROOT), str(job)])
    deadline = time.monotonic() + 30
    while not (job.exists() and job.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = int(job.read_text())
    harness.send_signal(signal.SIGTERM)
    assert harness.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"the job (pid {pid}) outlived its harness")
