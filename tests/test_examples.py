"""The examples run as their READMEs say (under mpiexec, each launch with a timeout) and reach the accuracy
they state; and the two traps a tester found in the plug-in contract stay closed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MPI_TIMEOUT, ROOT, run_mpi, same_model

from mpifl.cli import main

EXAMPLES = ROOT / "examples"
# folder: (rounds, test accuracy it must beat)
STATED = {
    "apfl": (10, 0.8),
    "client_half": (10, 0.75),
    "custom_model_and_data": (10, 0.9),
    "custom_strategy": (8, 0.9),
    "custom_trainer": (8, 0.8),
    "moon": (10, 0.9),
    "natural_partition": (10, 0.8),
}


def run_example(run_dir: Path, name: str, *overrides: str) -> list[dict]:
    """``mpiexec -n 3 mpifl run examples/<name>/config.yaml`` from the repository root; its metrics."""
    result = run_mpi(3, "run", str(EXAMPLES / name / "config.yaml"), "--run-dir", str(run_dir), *overrides,
                     timeout=MPI_TIMEOUT, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each example's run directory and metrics, run once for the module."""
    done: dict = {}

    def get(name: str) -> tuple[Path, list[dict]]:
        if name not in done:
            run_dir = tmp_path_factory.mktemp(name) / "run"
            done[name] = run_dir, run_example(run_dir, name)
        return done[name]
    return get


def test_every_example_folder_has_its_config_readme_and_package():
    folders = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert folders == sorted(STATED)
    for name in folders:
        for part in ("config.yaml", "README.md", "__init__.py"):
            assert (EXAMPLES / name / part).is_file(), f"examples/{name}/{part}"
        assert "from the repository root" in (EXAMPLES / name / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(STATED))
def test_each_example_validates(name, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    assert main(["validate", str(EXAMPLES / name / "config.yaml")]) == 0
    assert ": valid (" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(STATED))
def test_each_example_runs_and_reaches_its_stated_accuracy(runs, name):
    rounds, accuracy = STATED[name]
    _, records = runs(name)
    assert [r["round"] for r in records] == list(range(1, rounds + 1))
    assert records[-1]["eval"]["accuracy"] > accuracy, records[-1]["eval"]


def test_a_plugin_model_written_like_the_builtins_is_sized_from_the_data(runs):
    """Trap 1: ``net(input_shape, num_classes, hidden)`` used to crash every rank (no input_shape passed)."""
    import h5py

    run_dir, _ = runs("custom_model_and_data")
    with h5py.File(run_dir / "model.h5") as f:
        shapes = {name: f["model"][name].shape for name in f["model"]}
    assert shapes["1.weight"] == (64, 2) and shapes["5.weight"] == (3, 64)  # 2-D spirals, 3 classes


def test_the_plugin_median_with_groups_is_refused_before_mpi_naming_the_capability(tmp_path):
    """Trap 2: a median wrapped as a plug-in used to take the median of the groups' sums."""
    run_dir = tmp_path / "run"
    result = run_mpi(3, "run", str(EXAMPLES / "custom_strategy" / "config.yaml"), "--run-dir", str(run_dir),
                     "strategy.name=plugin_helpers:median", "strategy.kwargs={}", timeout=MPI_TIMEOUT, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("clients.groups: strategy 'plugin_helpers:median' needs every participant's own update "
            "(summable=False, needs_every_row=True)") in result.stderr
    assert not (run_dir / "metrics.jsonl").exists()


SHORT = ("rounds=2", "train.local_steps=4", "eval.every=0")  # the custom_strategy example, with groups, briefly


@pytest.fixture(scope="module")
def fedavg_model(tmp_path_factory) -> Path:
    """The built-in FedAvg's model after the short run."""
    run_dir = tmp_path_factory.mktemp("fedavg") / "run"
    run_example(run_dir, "custom_strategy", *SHORT, "strategy.name=fedavg", "strategy.kwargs={}")
    return run_dir / "model.h5"


@pytest.mark.parametrize("overrides", [
    ("strategy.kwargs.power=1.0",),  # the example's power law at power 1: FedAvg's weights
    ("strategy.name=plugin_helpers:per_step", "strategy.kwargs={}"),  # samples / local steps, all steps equal
])
def test_plugin_weights_from_the_header_equal_fedavg_bitwise_where_they_must(tmp_path, fedavg_model, overrides):
    """With groups the clients weigh their own updates and the server the total, both from the headers
    (per_step fails loudly if a header lacks the trainer's local steps)."""
    run_example(tmp_path / "plugin", "custom_strategy", *SHORT, *overrides)
    assert same_model(fedavg_model, tmp_path / "plugin" / "model.h5")


def test_the_shipped_leaf_files_are_what_make_data_writes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from examples.natural_partition.make_data import write

    write(tmp_path)
    shipped = EXAMPLES / "natural_partition" / "data"
    files = sorted(p.relative_to(shipped) for p in shipped.rglob("*.json"))
    assert files and files == sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.json"))
    assert all((shipped / f).read_bytes() == (tmp_path / f).read_bytes() for f in files)


def test_the_custom_trainer_takes_its_own_setting_and_its_metric_is_recorded_every_round(runs):
    """train.kwargs.final_fraction (written 1e-1) reaches DecayTrainer as a float; its update_norm is recorded."""
    _, records = runs("custom_trainer")
    for record in records:
        norm = record["client_metrics"]["update_norm"]
        assert 0 < norm["min"] <= norm["mean"] <= norm["max"] and norm["clients"] == len(record["participants"])
