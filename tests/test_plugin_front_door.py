"""What a plug-in author gets besides the hooks themselves: settings typed by their annotations (``1e6`` is a
number), ``train.kwargs`` for trainers, a trainer that knows which client and round it trains, and what plug-ins
measure recorded each round in metrics.jsonl and the trackers; and the plug-in API's mistakes named where mpifl
meets them (a trainer class without train or modifies_weights, a combine of the wrong shape, a server step whose
result would be dropped)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import MPI_TIMEOUT, mpifl_here, run_mpi

from mpifl.aggregation.compatibility import checked_strategy
from mpifl.aggregation.strategies import make_strategy
from mpifl.cli.preflight import check_plugins
from mpifl.config import ConfigError, load_config
from mpifl.errors import JobFailure
from mpifl.learning.trainers import TrainResult, make_trainer
from mpifl.plugins import typed_kwargs
from mpifl.roles.records import client_metrics
from mpifl.trackers import scalars
from mpifl.wire.protocol import UpdateMeta

SYNTHETIC = {"data": {"dataset": "synthetic", "kwargs": {"num_samples": 300}}}


def annotated(cfg, clip: float, steps: int = 1, sizes: list[float] | None = None, tag: str = "",
              flag: bool = False, window: Optional[int] = None, anything=None):  # noqa: UP045 - both spellings
    return cfg


@pytest.mark.parametrize(("given", "expected"), [
    ({"clip": "1e6"}, {"clip": 1e6}),
    ({"clip": 3}, {"clip": 3.0}),
    ({"clip": 1, "steps": "1e3"}, {"clip": 1.0, "steps": 1000}),
    ({"clip": 1.0, "steps": 4.0}, {"clip": 1.0, "steps": 4}),
    ({"clip": 1.0, "sizes": [1, "2e-1"]}, {"clip": 1.0, "sizes": [1.0, 0.2]}),
    ({"clip": 1.0, "sizes": None, "window": "8"}, {"clip": 1.0, "sizes": None, "window": 8}),
    ({"clip": 1.0, "anything": "1e6"}, {"clip": 1.0, "anything": "1e6"}),
])
def test_plugin_settings_take_the_types_their_parameters_are_annotated_with(given, expected):
    converted, problem = typed_kwargs(annotated, given, "strategy.kwargs")
    assert problem is None and converted == expected
    assert all(type(converted[k]) is type(v) for k, v in expected.items())


@pytest.mark.parametrize(("given", "message"), [
    ({"clip": "high"}, "strategy.kwargs.clip: expected a number, got 'high'"),
    ({"clip": True}, "strategy.kwargs.clip: expected a number, got True"),
    ({"clip": 1.0, "steps": 2.5}, "strategy.kwargs.steps: expected an integer, got 2.5"),
    ({"clip": 1.0, "flag": "yes"}, "strategy.kwargs.flag: expected true or false"),
    ({"clip": 1.0, "tag": 3}, "strategy.kwargs.tag: expected a string"),
    ({"clip": float("inf")}, "strategy.kwargs.clip: must be a finite number"),
])
def test_a_plugin_setting_that_cannot_take_its_type_is_named(given, message):
    assert typed_kwargs(annotated, given, "strategy.kwargs")[1].startswith(message)


def test_strategy_kwargs_written_1e6_reach_the_plugin_as_a_float():
    cfg = load_config(None, data={**SYNTHETIC, "strategy": {"name": "plugin_helpers:counting",
                                                            "kwargs": {"clip": "1e6"}}})
    assert cfg.strategy.kwargs == {"clip": 1e6}
    assert checked_strategy(cfg).clip == 1e6
    with pytest.raises(ConfigError, match=r"strategy\.kwargs\.clip: expected a number, got 'big'"):
        load_config(None, data={**SYNTHETIC, "strategy": {"name": "plugin_helpers:counting",
                                                          "kwargs": {"clip": "big"}}})


def trainer_config(**kwargs):
    return load_config(None, data={**SYNTHETIC, "train": {"trainer": "plugin_helpers:ContextRecorder",
                                                          "kwargs": kwargs}})


def test_train_kwargs_reach_a_plugin_trainer_typed_and_checked_against_its_signature(tmp_path):
    cfg = trainer_config(out=str(tmp_path), scale="2e0")
    assert cfg.train.kwargs == {"out": str(tmp_path), "scale": 2.0}
    assert check_plugins(cfg) == []
    with pytest.raises(ConfigError, match=r"unknown key 'train\.kwargs\.scal': not a parameter of ContextRecorder; "
                                          r"did you mean 'train\.kwargs\.scale'\?"):
        check_plugins(trainer_config(out=str(tmp_path), scal=2.0))
    with pytest.raises(ConfigError, match=r"train\.kwargs\.out: ContextRecorder takes out without a default"):
        check_plugins(trainer_config())
    with pytest.raises(ConfigError, match=r"train\.kwargs: the built-in trainer 'torch' takes its settings"):
        load_config(None, data={**SYNTHETIC, "train": {"kwargs": {"lr": 0.1}}})


def test_a_setting_the_trainer_itself_refuses_is_named_by_validate_and_by_the_ranks_as_train_kwargs(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({**SYNTHETIC, "rounds": 1, "output": {"progress": False},
                               "train": {"trainer": "plugin_helpers:ContextRecorder",
                                         "kwargs": {"out": str(tmp_path), "scale": -1}}}))
    said = (f"train.kwargs: building train.trainer 'plugin_helpers:ContextRecorder' with {{'out': '{tmp_path}', "
            "'scale': -1.0} failed: ValueError: scale must be > 0, got -1.0")
    checked = mpifl_here("validate", str(cfg))
    assert checked.returncode == 2 and said in checked.stderr, checked.stderr
    ran = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"))  # built on the client ranks, after MPI
    assert ran.returncode == 2 and "MPI_Abort" not in ran.stderr, ran.stderr[-3000:]  # every rank left, no abort
    assert ran.stderr.count(f"[rank 0] mpifl: rank 1: {said}") == 1, ran.stderr[-3000:]  # said once, naming the rank
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before round 1


def meta(client: int, samples: int, **metrics) -> UpdateMeta:
    return UpdateMeta(client, samples, 0.1, metrics)


def test_client_metrics_are_sample_weighted_means_with_their_range_leaving_out_what_is_reported_elsewhere():
    metas = [meta(3, 30, norm=2.0, within=True, loss=9.0, val_loss=1.0, rank_peak_rss_bytes=5, group_x_seconds=1.0),
             meta(1, 10, norm=6.0, within=False, loss=1.0),
             meta(2, 0, note="text")]
    assert client_metrics(metas) == {"norm": {"mean": 3.0, "min": 2.0, "max": 6.0, "clients": 2},
                                     "val_loss": {"mean": 1.0, "min": 1.0, "max": 1.0, "clients": 1},  # the trainer's
                                     "within": {"mean": 0.75, "min": 0.0, "max": 1.0, "clients": 2}}
    assert client_metrics([meta(1, 10, loss=1.0)]) is None


def test_client_metrics_do_not_depend_on_the_order_updates_arrive_in():
    metas = [meta(c, 7 + c, x=0.1 * c + 1e-9 * c * c) for c in range(20)]
    assert json.dumps(client_metrics(metas)) == json.dumps(client_metrics(list(reversed(metas))))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A run of 3 client ranks with per-round placement, the recording trainer and the counting strategy."""
    root = tmp_path_factory.mktemp("front_door")
    out = root / "contexts"
    out.mkdir()
    config = root / "config.yaml"
    config.write_text(json.dumps({
        "rounds": 3, "seed": 5, "clients": {"num_clients": 7, "per_round": 4, "placement": "per_round"},
        "data": {"dataset": "synthetic", "kwargs": {"num_samples": 400}},
        "model": {"name": "mlp", "kwargs": {"hidden": [8]}},
        "train": {"trainer": "plugin_helpers:ContextRecorder", "kwargs": {"out": str(out), "scale": "1e0"}},
        "strategy": {"name": "plugin_helpers:counting", "kwargs": {"clip": "1e6"}},
        "eval": {"every": 0}, "output": {"trackers": ["tensorboard"]}}))
    result = run_mpi(4, "run", str(config), "--run-dir", str(root / "run"), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return out, records


def test_a_trainer_learns_which_client_it_trains_in_which_round_on_any_placement(recorded):
    out, records = recorded
    seen = sorted((c["round"], c["client"], c["participants"], c["num_clients"])
                  for path in out.glob("rank*.jsonl") for c in map(json.loads, path.read_text().splitlines()))
    expected = sorted((r["round"], c, len(r["participants"]), 7) for r in records for c in r["participants"])
    assert seen == expected


def test_what_plugins_measure_is_in_every_rounds_record_and_its_tracker_scalars(recorded):
    _, records = recorded
    for record in records:
        ids = record["participants"]
        assert record["client_metrics"]["client_id"] == {
            "mean": pytest.approx(record["client_metrics"]["client_id"]["mean"]), "min": min(ids), "max": max(ids),
            "clients": 4}
        assert record["client_metrics"]["trained"]["mean"] == 1.0
        assert record["strategy_metrics"] == {"round": record["round"], "sampled": 4, "of": 7, "folded": 4,
                                              "clip": 1e6}
        flat = scalars(record)
        assert flat["client_metrics/client_id/max"] == max(ids) and flat["strategy_metrics/folded"] == 4


def test_plugin_metrics_reach_tensorboard(recorded):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, records = recorded
    events = EventAccumulator(str(out.parent / "run" / "tensorboard"))
    events.Reload()
    steps = {e.step: e.value for e in events.Scalars("client_metrics/client_id/max")}
    assert steps == {r["round"]: max(r["participants"]) for r in records}
    assert {e.step: e.value for e in events.Scalars("strategy_metrics/sampled")} == {1: 4, 2: 4, 3: 4}


def test_an_annotation_only_a_type_checker_can_resolve_leaves_the_other_settings_typed():
    def annotated_with_a_checker_only_name(cfg, clip: float, model: NotImportedHere = None):  # noqa: F821 - a name only a type checker sees
        return cfg

    converted, problem = typed_kwargs(annotated_with_a_checker_only_name, {"clip": "1e6", "model": "x"},
                                      "strategy.kwargs")
    assert problem is None and converted == {"clip": 1e6, "model": "x"} and type(converted["clip"]) is float


def test_a_trainer_class_without_train_is_refused_before_mpi_naming_train_trainer():
    cfg = load_config(None, data={**SYNTHETIC, "train": {"trainer": "plugin_helpers:WithoutTrain"}})
    with pytest.raises(ConfigError, match=re.escape("train.trainer: 'plugin_helpers:WithoutTrain' has no train "
                                                    "method; a trainer defines train(self, model, data, seed")):
        check_plugins(cfg)


def test_a_trainer_whose_train_cannot_take_mpifls_call_is_refused_before_mpi_naming_train_trainer_and_the_call():
    cfg = load_config(None, data={**SYNTHETIC, "train": {"trainer": "plugin_helpers:TrainWithoutSeed"}})
    with pytest.raises(ConfigError, match=re.escape("train.trainer: 'plugin_helpers:TrainWithoutSeed': "
                                                    "TrainWithoutSeed.train(self, model, data) cannot take mpifl's "
                                                    "call train(model, data, seed): too many positional arguments")):
        check_plugins(cfg)


def test_a_trainer_with_a_personalised_model_to_score_but_no_context_in_train_is_refused_naming_train_trainer():
    cfg = load_config(None, data={**SYNTHETIC, "train": {"trainer": "plugin_helpers:PersonalizedWithoutContext"}})
    with pytest.raises(ConfigError, match=re.escape("defines personalized(model, context), which reads the client's "
                                                    "state from the TrainContext of its training: give train a "
                                                    "keyword parameter context")):
        make_trainer(cfg.train)


def test_a_trainer_without_modifies_weights_is_refused_where_it_is_built_and_one_its_init_sets_runs():
    """``modifies_weights`` may be set by the trainer's ``__init__`` (an instance attribute, which the class before
    MPI starts does not show): only the object built can be judged."""
    cfg = load_config(None, data={**SYNTHETIC, "train": {"trainer": "plugin_helpers:WithoutModifiesWeights"}})
    assert check_plugins(cfg) == []
    with pytest.raises(ConfigError, match=r"train\.trainer: 'plugin_helpers:WithoutModifiesWeights' has no "
                                          r"modifies_weights; a trainer class sets it: True"):
        make_trainer(cfg.train)
    in_init = load_config(None, data={**SYNTHETIC, "train": {"trainer": "plugin_helpers:ModifiesWeightsInInit"}})
    assert check_plugins(in_init) == [] and make_trainer(in_init.train).modifies_weights is True


def test_a_builder_functions_trainer_missing_modifies_weights_is_refused_where_it_is_built():
    cfg = load_config(None, data={**SYNTHETIC, "train": {"trainer": "plugin_helpers:without_modifies_weights"}})
    assert check_plugins(cfg) == []  # a function: what it builds is seen only once built
    with pytest.raises(ConfigError, match=r"train\.trainer: 'plugin_helpers:without_modifies_weights' has no "
                                          r"modifies_weights"):
        make_trainer(cfg.train)


def finish_chunk(name: str, **strategy) -> tuple[torch.Tensor, torch.Tensor]:
    """Finish one 6-element chunk of two participants with plug-in strategy ``name``: the old global chunk and the
    new one, and the server state after the step."""
    built = make_strategy(load_config(None, data={**SYNTHETIC, "strategy": {"name": name, **strategy}}).strategy)
    rows = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    acc = rows.clone() if built.stacked else torch.zeros(6)
    for i, row in enumerate(rows):
        built.fold(acc, row, 1.0, i)
    target = torch.ones(6)
    state = {k: torch.full((6,), v) for k, v in built.state_init.items()}
    built.finish(acc, 2, 2.0, target, state, None)
    return target, state.get("m", torch.zeros(0))


@pytest.mark.parametrize(("name", "got"), [
    ("plugin_helpers:short_combine", "ShortCombine.combine returned a float32 tensor of shape (5,)"),
    ("plugin_helpers:wide_combine", "WideCombine.combine returned a float64 tensor of shape (6,)"),
    ("plugin_helpers:squeezed_stack", "SqueezedStack.combine returned a float32 tensor of shape (1,)"),
])
def test_a_combine_that_returns_the_wrong_shape_or_dtype_ends_the_job_naming_strategy_name_and_both(name, got):
    with pytest.raises(JobFailure, match=re.escape(f"strategy.name {name!r}: {got} where the combined chunk, a "
                                                   "float32 tensor of shape (6,), was expected")):
        finish_chunk(name)


def test_a_weighted_mean_subclass_that_overrides_combine_alone_is_combined_by_it():
    """FedAvg's combine_into divides the sums straight into the model; a subclass's own combine must still be what
    combines (it was skipped without a word)."""
    target, _ = finish_chunk("plugin_helpers:halved_mean")
    assert torch.equal(target, (torch.arange(6, dtype=torch.float32) + torch.arange(6, 12)) / 2 * 0.5)


def test_a_server_step_that_works_in_place_moves_the_model_and_keeps_its_state():
    target, m = finish_chunk("plugin_helpers:step_in_place")
    delta = torch.arange(3, 9, dtype=torch.float32) - 1  # the mean of the two rows less the old chunk
    assert torch.equal(m, delta) and torch.equal(target, 1 + 2 * delta)


@pytest.mark.parametrize(("name", "did"), [
    ("plugin_helpers:step_returns", "Step_returns.step returned a new tensor instead of writing into delta"),
    ("plugin_helpers:step_rebinds", "Step_rebinds.step bound state['m'] to a new tensor instead of changing it "
                                    "in place"),
])
def test_a_server_step_whose_result_mpifl_would_drop_ends_the_job_naming_strategy_name_and_the_rule(name, did):
    with pytest.raises(JobFailure, match=re.escape(f"strategy.name {name!r}: {did}, which mpifl would drop; write "
                                                   "the step into delta and change each state tensor in place")):
        finish_chunk(name)


def test_what_a_trainer_returns_other_than_a_train_result_is_named_with_what_it_must_return():
    from mpifl.learning.trainers import result_problem

    assert result_problem("pkg.T", TrainResult(3, {})) is None
    said = result_problem("pkg.T", (3, {"loss": 0.5}))
    assert said == ("trainer pkg.T: train() returned tuple (3, {'loss': 0.5}); it must return "
                    "mpifl.api.TrainResult(num_samples, metrics, local_steps)")
