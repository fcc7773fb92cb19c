"""The plug-in contract: run modes allowed by a strategy's capabilities (never its name), strategy.kwargs,
weights from the whole update header, and plug-in models sized from the data."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mpifl.aggregation.combiners import Median, WeightedMean, declared_capabilities
from mpifl.aggregation.compatibility import checked_strategy, strategy_problem
from mpifl.aggregation.strategies import make_strategy
from mpifl.cli import main
from mpifl.cli.preflight import check_plugins
from mpifl.config import ConfigError, StrategyConfig, load_config
from mpifl.config.capabilities import BUILTIN_CAPABILITIES, UNDECLARED, Capabilities
from mpifl.config.sections import STRATEGIES
from mpifl.learning.models import build_model, model_problem
from mpifl.wire.protocol import UpdateMeta

CHECKS = Path(__file__).resolve().parent.parent / "mpifl" / "config" / "checks.py"
SYNTHETIC = {"data": {"dataset": "synthetic", "kwargs": {"num_samples": 300}}}


def config(strategy: str, **sections):
    return load_config(None, data={**SYNTHETIC, "strategy": {"name": strategy}, **sections})


def test_every_builtin_strategy_declares_what_the_config_table_says():
    assert tuple(BUILTIN_CAPABILITIES) == STRATEGIES
    for name in STRATEGIES:
        strategy = make_strategy(StrategyConfig(name=name))
        assert strategy.declared and strategy.capabilities == BUILTIN_CAPABILITIES[name], name


def test_no_check_in_the_config_compares_a_strategy_name():
    source = CHECKS.read_text()
    assert not re.search(r"strategy\.name\s*(==|!=|in\s*\(|not\s+in\s*\()", source)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            assert not any("strategy.name" in ast.unparse(side) for side in sides), ast.unparse(node)


def test_a_subclass_keeps_its_base_capabilities_unless_it_changes_how_it_combines():
    class Reweighted(WeightedMean):
        def weight(self, num_samples: int) -> float:
            return 2.0

    class Refolded(WeightedMean):
        def fold(self, acc, x, weight, index):
            acc.copy_(x)

    class Redeclared(Refolded):
        capabilities = Capabilities(summable=False, needs_every_row=False)

    cfg = StrategyConfig()
    assert declared_capabilities(Reweighted(cfg)) == BUILTIN_CAPABILITIES["fedavg"]
    assert declared_capabilities(Median(cfg)) == BUILTIN_CAPABILITIES["median"]
    assert declared_capabilities(Refolded(cfg)) is None
    assert declared_capabilities(Redeclared(cfg)) == Capabilities(summable=False, needs_every_row=False)
    instance = Refolded(cfg)
    instance.capabilities = Capabilities(summable=True, needs_every_row=False)
    assert declared_capabilities(instance).summable
    assert UNDECLARED == Capabilities(summable=False, needs_every_row=True, server_state=False)


def test_the_plugin_median_is_refused_with_groups_naming_the_capability():
    cfg = config("plugin_helpers:median", clients={"groups": 2})  # load_config cannot know a plug-in
    with pytest.raises(ConfigError, match=r"clients\.groups: strategy 'plugin_helpers:median' needs every "
                                          r"participant's own update \(summable=False, needs_every_row=True\)"):
        check_plugins(cfg)
    with pytest.raises(ConfigError, match=r"clients\.groups: strategy 'median' needs every participant"):
        config("median", clients={"groups": 2})  # the built-in, already in load_config


@pytest.mark.parametrize("sections,key", [
    ({"clients": {"groups": 2}}, "clients.groups"),
    ({"clients": {"groups": 2}, "transport": {"reduce": "chain"}}, "clients.groups"),
    ({"privacy": {"mode": "central"}, "strategy": {"update": "delta", "weighting": "equal"}}, "strategy.name"),
    ({"secagg": {"enabled": True}}, "strategy.name"),
    ({"clock": {"mode": "fedasync"}, "clients": {"num_clients": 12}}, "clock.mode"),
])
def test_a_plugin_that_declares_nothing_is_refused_where_a_robust_strategy_would_be(sections, key):
    data = {**SYNTHETIC, **sections}
    data["strategy"] = {**sections.get("strategy", {}), "name": "plugin_helpers:undeclared"}
    cfg = load_config(None, data=data)
    with pytest.raises(ConfigError) as err:
        check_plugins(cfg)
    message = str(err.value)
    assert message.startswith(f"{key}:") and "declares no Capabilities" in message
    assert "summable=False" in message and "capabilities = Capabilities(summable=True" in message
    plain = load_config(None, data={**SYNTHETIC, "strategy": {"name": "plugin_helpers:undeclared"}})
    assert check_plugins(plain) == []  # and runs where nothing needs a sum


def test_a_declared_non_sum_names_what_it_is_and_fedasync_refuses_server_state():
    cfg = config("plugin_helpers:declared_max", clients={"groups": 2})
    with pytest.raises(ConfigError, match=r"'plugin_helpers:declared_max' is not summable \(summable=False\)"):
        check_plugins(cfg)
    with pytest.raises(ConfigError, match="'fedasync' mixes each client's trained weights.*keeps server state"):
        config("fedadam", clock={"mode": "fedasync"}, clients={"num_clients": 12})
    strategy = make_strategy(StrategyConfig(name="fedadam"))
    assert strategy.capabilities.server_state and strategy_problem(strategy, config("fedadam")) is None


def test_strategy_kwargs_reach_a_plugin_checked_against_its_signature():
    def scaled(**kwargs):
        return load_config(None, data={**SYNTHETIC, "strategy": {"name": "plugin_helpers:scaled", "kwargs": kwargs}})

    assert checked_strategy(scaled(scale=2.0)).settings == {"scale": 2.0, "offset": 0.0}
    with pytest.raises(ConfigError, match=r"unknown key 'strategy\.kwargs\.scal': not a parameter of scaled; "
                                          r"did you mean 'strategy\.kwargs\.scale'\?"):
        check_plugins(scaled(scal=2.0))
    with pytest.raises(ConfigError, match=r"strategy\.kwargs\.scale: scaled takes scale without a default"):
        check_plugins(scaled())
    with pytest.raises(ConfigError, match=r"strategy\.kwargs\.cfg: mpifl passes cfg itself"):
        check_plugins(scaled(scale=1.0, cfg=1))
    with pytest.raises(ConfigError, match=r"strategy\.kwargs: the built-in strategy 'fedavgm' takes its settings "
                                          r"from strategy's own keys"):
        load_config(None, data={"strategy": {"name": "fedavgm", "kwargs": {"momentum": 0.5}}})


def test_auto_keys_follow_what_a_plugin_declares_as_they_follow_the_builtins(tmp_path, capsys):
    """strategy.update/weighting left at auto read a plug-in's declared capabilities, as they read the built-in
    table: own_total (FedNova-like) gets deltas, equal_weights (FedDyn-like) equal weights, the others the old
    defaults; an explicit value is kept, and refused where it cannot work."""
    names = ("own_total", "equal_state", "declared_max")
    resolved = {name: config(f"plugin_helpers:{name}").strategy for name in names}
    assert {name: (s.update, s.weighting) for name, s in resolved.items()} == {
        "own_total": ("delta", "samples"), "equal_state": ("weights", "equal"), "declared_max": ("weights", "samples")}
    assert check_plugins(config("plugin_helpers:own_total")) == []
    assert check_plugins(config("plugin_helpers:equal_state")) == []
    for strategy, key in (({"update": "weights"}, "update"), ({"weighting": "samples"}, "weighting")):
        name = "plugin_helpers:own_total" if key == "update" else "plugin_helpers:equal_state"
        explicit = load_config(None, data={**SYNTHETIC, "strategy": {"name": name, **strategy}})
        with pytest.raises(ConfigError, match=rf"strategy\.{key}: .*set strategy\.{key}="):
            check_plugins(explicit)
    assert make_strategy(StrategyConfig(name="plugin_helpers:own_total")).cfg.update == "delta"  # built in code
    path = tmp_path / "c.yaml"
    path.write_text("data: {dataset: synthetic}\nstrategy: {name: 'plugin_helpers:own_total'}\n")
    assert main(["validate", str(path)]) == 0
    assert "clients send deltas" in capsys.readouterr().out


def test_a_plugin_that_cannot_be_built_resolves_by_the_run_modes_and_is_reported_by_its_key():
    broken = load_config(None, data={**SYNTHETIC, "privacy": {"mode": "central"},
                                     "strategy": {"name": "plugin_helpers:scaled"}})  # scale is required
    assert (broken.strategy.update, broken.strategy.weighting) == ("delta", "equal")
    with pytest.raises(ConfigError, match=r"strategy\.kwargs\.scale: scaled takes scale without a default"):
        check_plugins(broken)


def test_differential_privacy_refuses_a_plugin_that_weighs_its_own_way():
    privacy = {"privacy": {"mode": "central"}}
    strategy = {"update": "delta", "weighting": "equal"}
    own = load_config(None, data={**SYNTHETIC, **privacy, "strategy": {**strategy, "name": "plugin_helpers:per_step"}})
    with pytest.raises(ConfigError, match=r"strategy\.name: privacy\.mode 'central' needs equal client weights .*"
                                          r"PerStep overrides weight or weight_of"):
        check_plugins(own)
    builtin_weights = {**strategy, "name": "plugin_helpers:scaled", "kwargs": {"scale": 1.0}}
    assert check_plugins(load_config(None, data={**SYNTHETIC, **privacy, "strategy": builtin_weights})) == []


def test_weights_come_from_the_whole_header_and_builtins_are_unchanged():
    meta = UpdateMeta(3, 37, 1.5, {"loss": 0.2}, local_steps=5)
    for name in STRATEGIES:
        for weighting in ("samples", "equal"):
            strategy = make_strategy(StrategyConfig(name=name, weighting=weighting))
            per_step = name == "fednova"  # FedNova weighs each client by its weight per local step
            assert strategy.weight_of(meta) == strategy.weight(37) / (5 if per_step else 1)
    assert make_strategy(StrategyConfig(name="plugin_helpers:per_step")).weight_of(meta) == 37 / 5


def test_a_twin_for_a_run_mode_keeps_the_weights_and_capabilities():
    from mpifl.aggregation.updates import Mixing
    from mpifl.privacy.secagg import RingSum

    cfg = StrategyConfig(name="plugin_helpers:per_step")
    strategy = make_strategy(cfg)
    twin = strategy.substituted(RingSum(cfg), Mixing(cfg))
    meta = UpdateMeta(0, 12, 0.0, {}, local_steps=4)
    assert isinstance(twin.combiner, RingSum) and isinstance(twin.update, Mixing)
    assert twin.weight_of(meta) == 3.0 and twin.capabilities == strategy.capabilities
    assert strategy.combiner is not twin.combiner


@pytest.mark.parametrize("name,kwargs,has_data,problem", [
    ("plugin_helpers:sized", {"hidden": 8}, True, None),
    ("plugin_helpers:sized", {"hidden": 8, "input_shape": [64]}, True, "mpifl passes input_shape itself"),
    ("plugin_helpers:sized", {"hidden": 8, "input_shape": [64], "num_classes": 10}, False, None),
    ("plugin_helpers:sized", {}, True, "model.kwargs.hidden: sized takes hidden without a default"),
    ("plugin_helpers:unsized", {"width": 3}, True, None),
    ("plugin_helpers:unsized", {"num_classes": 3}, True, "unknown key 'model.kwargs.num_classes'"),
    ("plugin_helpers:open_ended", {"width": 3}, True, None),
    ("mlp", {"num_classes": 3}, True, "model.kwargs.num_classes: mpifl passes num_classes itself"),
])
def test_model_kwargs_may_not_set_what_mpifl_supplies_only_when_it_supplies_it(name, kwargs, has_data, problem):
    from mpifl.config import ModelConfig

    found = model_problem(ModelConfig(name=name, kwargs=kwargs), has_data)
    assert (found is None) if problem is None else (problem in found), found


def test_a_plugin_model_gets_the_data_shape_only_when_its_signature_names_it():
    from mpifl.config import ModelConfig

    shape = {"input_shape": (1, 8, 8), "num_classes": 10}
    sized = build_model(ModelConfig(name="plugin_helpers:sized", kwargs={"hidden": 6}), 0, **shape)
    assert sized[1].in_features == 64 and sized[-1].out_features == 10
    assert build_model(ModelConfig(name="plugin_helpers:unsized"), 0, **shape)[1].in_features == 64
    assert build_model(ModelConfig(name="plugin_helpers:open_ended"), 0, **shape)[1].out_features == 5
    assert build_model(ModelConfig(name="plugin_helpers:classes_only"), 0, **shape)[-1].out_features == 10


def test_validate_builds_a_plugin_model_on_meta_and_names_it(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("data: {dataset: digits}\nmodel: {name: 'plugin_helpers:sized', kwargs: {hidden: 16}}\n")
    assert main(["validate", str(path)]) == 0
    assert "valid" in capsys.readouterr().out
    path.write_text("data: {dataset: digits}\nmodel: {name: 'plugin_helpers:broken'}\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.name: building 'plugin_helpers:broken' failed" in err and "Traceback" not in err


def exploding_builder(cfg):
    """A plug-in strategy builder with a bug in it."""
    raise RuntimeError("builder exploded")


def test_a_strategy_builder_that_raises_is_a_config_error_naming_the_key_once(tmp_path, monkeypatch):
    """Before, anything but a ValueError went up as a traceback on every rank."""
    with pytest.raises(ConfigError) as refused:
        checked_strategy(load_config(None, [f"strategy.name={__name__}:exploding_builder"]))
    assert str(refused.value) == (f"strategy.name: building '{__name__}:exploding_builder' failed: RuntimeError: "
                                  "builder exploded")


def test_a_plugin_module_that_does_not_load_is_named_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text("def build(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for key in ("strategy.name", "model.name"):
        with pytest.raises(ConfigError, match=rf"{key}: cannot import module 'broken_plugin' from "
                                              r"'broken_plugin:build': SyntaxError: invalid syntax"):
            load_config(None, [f"{key}=broken_plugin:build"])


def test_no_code_outside_the_registry_compares_strategy_names():
    """Run modes and client rules follow what a strategy declares (Capabilities), never its name: only the registry
    (aggregation/registry.py, config/capabilities.py) and the config's vocabulary of names may spell them."""
    import re

    from conftest import ROOT

    names = "|".join(STRATEGIES)
    comparison = re.compile(rf"strategy\.name\s*(==|!=|\bin\b|\bnot in\b)|(==|!=)\s*[\"'](?:{names})[\"']|"
                            rf"[\"'](?:{names})[\"']\s*(==|!=)")
    allowed = {"mpifl/aggregation/registry.py", "mpifl/config/capabilities.py"}
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "mpifl").rglob("*.py")) if str(path.relative_to(ROOT)) not in allowed
             for n, line in enumerate(path.read_text().splitlines(), 1) if comparison.search(line)]
    assert not found, "strategy names compared outside the registry:\n" + "\n".join(found)
