"""A plug-in model is checked before MPI starts: its output width against the data's classes, and an
unknown setting named against what mpifl passes it."""
from __future__ import annotations

from torch import nn

from mpifl.config import ModelConfig
from mpifl.learning.models import build_problem, model_problem


def two_outputs(input_shape, hidden: int = 8) -> nn.Module:
    """A classifier that ignores the data's class count: always two logits."""
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], hidden), nn.ReLU(), nn.Linear(hidden, 2))


def sized(input_shape, num_classes: int) -> nn.Module:
    """A classifier sized from the data, as plug-ins should be."""
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes))


def test_a_classifier_with_the_wrong_number_of_outputs_is_refused_naming_the_classes():
    problem = build_problem(ModelConfig(name=f"{__name__}:two_outputs"), 0, input_shape=(16,), num_classes=10)
    assert problem is not None and "(2, 2)" in problem and "10 classes" in problem and "num_classes" in problem


def test_a_classifier_sized_from_the_data_passes():
    assert build_problem(ModelConfig(name=f"{__name__}:sized"), 0, input_shape=(16,), num_classes=10) is None


def test_an_unknown_setting_names_what_mpifl_passes_the_model():
    problem = model_problem(ModelConfig(name=f"{__name__}:sized", kwargs={"hidden": 4}), has_data=True)
    assert problem is not None and "unknown key 'model.kwargs.hidden'" in problem
    assert "besides what mpifl passes it: input_shape, num_classes" in problem


def test_plan_sizes_a_plug_in_model_that_takes_the_data_shape():
    from mpifl.cli.plan import model_bytes
    from mpifl.config import load_config

    cfg = load_config(None, [f"model.name={__name__}:sized", "data.dataset=synthetic",
                             "data.kwargs={num_samples: 100, num_features: 16, num_classes: 10}"])
    assert model_bytes(cfg).parameters == 16 * 10 + 10  # one Linear(16, 10), sized from the data


def test_a_model_local_pattern_that_names_no_tensor_is_refused_before_mpi_by_validate_and_run(tmp_path):
    """A built-in model as well: the patterns are checked against the built model, so run and validate build it on
    the meta device first, and say which key is wrong instead of every rank failing with a traceback."""
    import subprocess
    import sys

    from conftest import ROOT

    assert build_problem(ModelConfig(name="mlp", local=["3.*"]), 0, input_shape=(64,), num_classes=10) is None
    problem = build_problem(ModelConfig(name="mlp", local=["2.*"]), 0, input_shape=(64,), num_classes=10)
    assert problem is not None and "model.local: '2.*' matches no floating tensor" in problem
    for command in (["validate"], ["run", "--run-dir", str(tmp_path / "run")]):  # run without mpiexec: one rank
        result = subprocess.run([sys.executable, "-m", "mpifl", *command, str(ROOT / "configs" / "quickstart.yaml"),
                                 "model.local=[2.*]"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert "model.local: '2.*' matches no floating tensor" in result.stderr + result.stdout
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing written
