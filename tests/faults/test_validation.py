"""Bad input is refused before MPI starts, naming the key; legal values that are surely mistakes are warned about."""
from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import mpifl_here

from mpifl.cli import main
from mpifl.cli.preflight import check_plugins
from mpifl.config import ConfigError, load_config
from mpifl.roles.records import log_final
from mpifl.storage.hdf5 import CheckpointWriter
from mpifl.wire.flat import FlatModel

BASE = "data: {dataset: synthetic, kwargs: {num_samples: 300}}\n"


def checked(tmp_path, text: str, *overrides: str) -> list[str]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return check_plugins(load_config(path, list(overrides)))


@pytest.mark.parametrize("text,overrides,message", [
    ("clients: []\n", (), "clients: expected a mapping, got list"),
    ("", (), "the file is empty"),
    (BASE, ("clients.num_clients=1e9",), "clients.num_clients: must be <= 10000000, got 1000000000"),
    (BASE, ("model.kwargs.hiddn=[8]",), "unknown key 'model.kwargs.hiddn': not a parameter of mlp; did you mean "
                                        "'model.kwargs.hidden'?"),
    (BASE, ("data.kwargs.num_sample=10",), "unknown key 'data.kwargs.num_sample': not a parameter of synthetic; "
                                           "did you mean 'data.kwargs.num_samples'?"),
    (BASE, ("model.kwargs.num_classes=3",), "model.kwargs.num_classes: mpifl passes num_classes itself"),
    (BASE, ("clients.fraction=.nan",), "clients.fraction: must be a finite number, got nan"),
    (BASE, ("train.lr=.nan",), "train.lr: must be a finite number, got nan"),
    (BASE, ("train.lr=.inf",), "train.lr: must be a finite number, got inf"),
    (BASE, ("seed=1000000000000000000000000000000",), "seed: must be <= 4294967295"),
    (BASE, ("model.kwargs.hidden=[0]",), "model.kwargs.hidden: layer widths must be integers >= 1, got [0]"),
    (BASE, ("model.name=cnn", "model.kwargs.channels=[4, -1]"), "model.kwargs.channels: layer widths must be"),
    (BASE, ("transport.chunk_mb=1e-9",), "transport.chunk_mb: must be >= 1 byte"),
])
def test_refused_with_the_key_named(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]").replace("?", r"\?").replace(".", r"\.")):
        checked(tmp_path, text, *overrides)


def test_an_explicitly_empty_mapping_runs_every_default_on_purpose(tmp_path):
    assert checked(tmp_path, "{}\n") == []


@pytest.mark.parametrize("overrides,warning", [
    (("clients.num_clients=8", "clients.per_round=20"), "clients.per_round: 20 is more than clients.num_clients=8"),
    (("transport.chunk_mb=0.001",), "transport.chunk_mb: 1048-byte chunks make the exchange slow"),
])
def test_legal_but_surely_mistaken_values_are_warned_about(tmp_path, overrides, warning):
    assert any(warning in w for w in checked(tmp_path, BASE, *overrides))


def test_validate_prints_the_warning_and_still_passes(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(BASE)
    assert main(["validate", str(tmp_path / "c.yaml"), "clients.per_round=20"]) == 0
    assert "warning: clients.per_round: 20 is more than" in capsys.readouterr().out


def test_too_many_clients_for_the_data_is_named_at_partitioning(tmp_path):
    from mpifl.learning.datasets import load_dataset
    from mpifl.learning.partitions import partition

    cfg = load_config(None, data={"data": {"dataset": "synthetic", "kwargs": {"num_samples": 300}},
                                  "clients": {"num_clients": 1000}})
    with pytest.raises(ValueError, match="clients.num_clients: 240 training samples cannot be split across 1000"):
        partition(cfg.data, load_dataset(cfg.data).y_train, 1000, 0)


@pytest.fixture
def checkpoint(tmp_path):
    flat = FlatModel(torch.nn.Linear(3, 2))
    with CheckpointWriter(tmp_path / "c.h5", flat.spec, {"round": 1}) as writer:
        writer.write_tensors(flat.tensors())
        writer.write_metrics([])
        return writer.publish()


def export(*args: str) -> subprocess.CompletedProcess:
    return mpifl_here("export", *args)


def test_export_refuses_to_overwrite_the_checkpoint(checkpoint):
    before = checkpoint.read_bytes()
    result = export(str(checkpoint), str(checkpoint))
    assert result.returncode == 2 and "refusing to overwrite it" in result.stderr
    assert "Traceback" not in result.stderr and checkpoint.read_bytes() == before


def test_export_to_a_missing_folder_is_a_clear_error(checkpoint, tmp_path):
    result = export(str(checkpoint), str(tmp_path / "nowhere" / "m.safetensors"))
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_the_closing_line_after_a_sigterm_says_the_run_stopped_early(capsys):
    log_final([{"round": r, "eval": {"accuracy": 0.5}} for r in range(1, 62)], 200, "runs/x")
    line = capsys.readouterr().err
    assert "stopped after round 61 of 200 (continue with --resume)" in line
    assert "last evaluation after round 61" in line
