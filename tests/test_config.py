"""Config: strict validation with messages that name the key, before any MPI work."""
import re
import subprocess
import sys

import pytest

from mpifl.config import ConfigError, config_warnings, load_config

ROOT = __import__("pathlib").Path(__file__).parent.parent


def load(**data):
    return load_config(None, data=data)


def test_defaults_are_valid():
    cfg = load()
    assert cfg.rounds == 10 and cfg.clients.num_clients == 8 and cfg.transport.chunk_bytes == 16 * 2**20


def test_unknown_key_names_it_and_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown key 'train\.lrr'; did you mean 'train\.lr'\?"):
        load(train={"lrr": 0.1})
    with pytest.raises(ConfigError, match=r"unknown key 'roundz'; did you mean 'rounds'"):
        load(roundz=3)
    # another framework's name, even misspelt, where the spelling alone is no help
    with pytest.raises(ConfigError, match=r"unknown key 'train\.lerning_rate'; did you mean 'train\.lr'\?"):
        load(train={"lerning_rate": 0.1})
    with pytest.raises(ConfigError, match=r"unknown key 'clients\.n_clients'; did you mean 'clients\.num_clients'"):
        load(clients={"n_clients": 4})


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError, match=r"rounds: expected an integer, got 'ten'"):
        load(rounds="ten")
    with pytest.raises(ConfigError, match=r"output.save_model: expected true or false"):
        load(output={"save_model": "yes"})


def test_out_of_range_and_bad_choice_list_what_is_allowed():
    with pytest.raises(ConfigError, match=r"clients.fraction: must be <= 1.0"):
        load(clients={"fraction": 1.5})
    with pytest.raises(ConfigError, match=r"train.optimizer: 'rmsprop' is not allowed; choose one of 'sgd', 'adam'"):
        load(train={"optimizer": "rmsprop"})


def test_import_paths_must_resolve():
    with pytest.raises(ConfigError, match=r"model.name: cannot import module 'no_such_pkg.models'"):
        load(model={"name": "no_such_pkg.models:net"})
    with pytest.raises(ConfigError, match=r"has no attribute 'nope'"):
        load(model={"name": "mpifl.learning.models:nope"})
    assert load(model={"name": "mpifl.learning.models:mlp"}).model.name == "mpifl.learning.models:mlp"


def test_overrides_are_typed_yaml_values(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("rounds: 3\ntrain: {lr: 0.1}\n")
    cfg = load_config(path, ["rounds=7", "train.lr=0.5", "clients.per_round=2", "model.kwargs={hidden: [8]}"])
    assert (cfg.rounds, cfg.train.lr, cfg.clients.per_round, cfg.model.kwargs) == (7, 0.5, 2, {"hidden": [8]})
    assert cfg.name == "exp"
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(path, ["rounds"])


def test_off_on_yes_and_no_are_words_as_in_yaml_1_2_and_only_true_and_false_are_booleans(tmp_path):
    """PyYAML reads YAML 1.1, where ``off`` is False: ``mode: off``, as the docs write it, was refused as
    'expected str, got bool False'. A config reads booleans as YAML 1.2 does, in files and overrides alike."""
    path = tmp_path / "exp.yaml"
    path.write_text("clock: {mode: off}\nprivacy: {mode: off}\noutput: {progress: False}\n")
    cfg = load_config(path, ["transport.doorbells=false"])
    assert (cfg.clock.mode, cfg.privacy.mode, cfg.output.progress, cfg.transport.doorbells) == ("off", "off", False,
                                                                                                False)
    assert load_config(path, ["privacy.mode=off", "clock.mode=off"]).privacy.mode == "off"
    with pytest.raises(ConfigError, match="output.progress: expected true or false, got 'no'"):
        load_config(path, ["output.progress=no"])


def test_an_override_reaches_into_a_list_by_index_so_a_sweep_can_vary_one_faults_setting(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("clients: {accept_failures: true}\nfaults: [{kind: raise, fraction: 0.1}, "
                        "{kind: nan, clients: [2]}]\n")
    cfg = load_config(str(cfg_file), ["faults.0.fraction=0.3", "faults.1.clients=[3, 4]"])
    assert cfg.faults[0].fraction == 0.3 and cfg.faults[1].clients == [3, 4]
    with pytest.raises(ConfigError, match=r"override 'faults.2.fraction=0.3': faults is a list of 2, so '2' must "
                                          r"be one of its indices, 0 to 1"):
        load_config(str(cfg_file), ["faults.2.fraction=0.3"])


def test_an_override_that_is_not_yaml_names_the_key_and_shows_it_quoted():
    # A bare glob starts with '*', which YAML reads as an alias: the shell user meant a string.
    quoted = r"""model.local='\["\*bn\*", "fc\.\*"\]'"""
    with pytest.raises(ConfigError, match=r"the value of 'model.local' is not valid YAML .* " + quoted):
        load_config(None, ["model.local=[*bn*, fc.*]"])
    with pytest.raises(ConfigError, match=r"""as in train.optimizer='"\*sgd"'"""):
        load_config(None, ["train.optimizer=*sgd"])
    assert load_config(None, ['model.local=["*bn*"]'], data={"model": {"name": "cnn"}}).model.local == ["*bn*"]


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "llama3.1-70b-lora.yaml").write_text("rounds: 1\n")  # a file the misspelt name is close to
    with pytest.raises(ConfigError, match=re.escape(f"lorra.yaml' does not exist; did you mean "
                                                    f"'{tmp_path / 'llama3.1-70b-lora.yaml'}'?")):
        load_config(tmp_path / "llama3.1-70b-lorra.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)


def test_a_yaml_error_names_the_file_and_line_not_pyyamls_unicode_string(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: 3\nclients:\n  num_clients: [1\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert f'in "{bad}", line 3' in str(err.value) and "<unicode string>" not in str(err.value)


def test_a_key_written_twice_is_refused_naming_both_lines_and_a_merged_key_may_be_overridden(tmp_path):
    """PyYAML keeps the last of two equal keys silently; YAML 1.2 says keys are unique, and a config whose second
    ``rounds:`` quietly wins is a run nobody asked for."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("rounds: 3\nseed: 1\nclients:\n  num_clients: 8\nrounds: 4\n")
    with pytest.raises(ConfigError, match="found the key 'rounds' twice, first on line 1") as err:
        load_config(twice)
    assert f'in "{twice}", line 5' in str(err.value)
    merged = tmp_path / "merged.yaml"
    merged.write_text("train: &t {lr: 0.1, batch_size: 8}\neval:\n  every: 0\nx_train: {<<: *t, lr: 0.2}\n")
    from mpifl.config.schema import read_yaml

    assert read_yaml(merged.read_text())["x_train"] == {"lr": 0.2, "batch_size": 8}


def test_every_key_level_problem_is_reported_at_once_in_the_order_the_keys_are_read():
    with pytest.raises(ConfigError) as err:
        load(rounds=0, clients={"num_clientz": 4}, train={"lr": "abc", "learning_rate": 1})
    assert str(err.value).splitlines() == [
        "4 problems:",
        "  - rounds: must be >= 1, got 0",
        "  - unknown key 'clients.num_clientz'; did you mean 'clients.num_clients'?",
        "  - unknown key 'train.learning_rate'; did you mean 'train.lr'?",
        "  - train.lr: expected float, got str 'abc'"]


def test_clients_per_round():
    assert load(clients={"num_clients": 10, "fraction": 0.25}).clients_per_round() == 2
    assert load(clients={"num_clients": 10, "per_round": 20}).clients_per_round() == 10


@pytest.mark.parametrize("clients,fraction,sampled", [
    (12, 0.3, 4),  # 3.6: the nearest whole number, not the floor
    (12, 0.25, 3),
    (10, 0.25, 2), (10, 0.35, 4), (6, 0.25, 2),  # 2.5, 3.5, 1.5: a tie goes to the even count
    (10, 0.01, 1), (100, 0.004, 1),  # at least one client a round
    (8, 1.0, 8)])
def test_clients_fraction_samples_fraction_times_clients_rounded_half_to_even_and_at_least_one(clients, fraction,
                                                                                                sampled):
    """The rule clients.fraction's description states (docs/reference/config.md)."""
    assert load(clients={"num_clients": clients, "fraction": fraction}).clients_per_round() == sampled


def test_shipped_configs_validate():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


def test_validate_command_exit_codes(tmp_path):
    good = ROOT / "configs" / "quickstart.yaml"
    ok = subprocess.run([sys.executable, "-m", "mpifl", "validate", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "mpifl", "validate", str(good), "train.batchsize=3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unknown key 'train.batchsize'; did you mean 'train.batch_size'?" in bad.stderr


def test_validate_and_plan_warn_that_train_threads_other_than_1_make_results_depend_on_the_thread_count(
        tmp_path, capsys):
    """A thread count other than 1 on the CPU is the one setting whose results depend on the ranks' layout: the
    checks before the run say so (validate, plan, and rank 0 of the run once), not only the run itself."""
    from mpifl.cli import main
    from mpifl.config import config_warnings

    path = tmp_path / "c.yaml"
    path.write_text("data: {dataset: synthetic}\nrounds: 1\n")
    assert main(["validate", str(path), "train.threads=2"]) == 0
    out = capsys.readouterr().out
    assert "warning: train.threads=2: training on the CPU, torch's kernels split their sums by thread, so the " \
           "results depend on the thread count; train.threads=1 keeps them bitwise equal on any number of ranks" in out
    assert main(["validate", str(path), "train.threads=1"]) == 0
    assert "thread count" not in capsys.readouterr().out
    assert main(["plan", str(path), "train.threads=2"]) == 0
    assert "results depend on the thread count" in capsys.readouterr().out
    (auto,) = [w for w in config_warnings(load_config(None, ["train.threads=auto"])) if w.startswith("train.threads")]
    assert "depend on the thread count, which 'auto' takes from the cores per rank" in auto
    assert not [w for w in config_warnings(load_config(None, ["train.threads=4", "train.device=cuda"]))
                if w.startswith("train.threads")]  # a GPU's kernels do not split their sums by CPU thread


@pytest.mark.parametrize("overrides,says", [
    ((), "weighted by samples"),
    (("strategy.weighting=equal",), "equal weights"),
    (("clock.mode=fedbuff",), "each update weighted by s(staleness) (polynomial), the sum divided by the updates "
                              "applied"),
    (("clock.mode=fedasync",), "each update mixed in at alpha x s(staleness), alpha 0.6, s polynomial"),
    (("strategy.name=median",), "the coordinate-wise median of the round's updates, unweighted"),
    (("strategy.name=trimmed_mean",), "the coordinate-wise trimmed mean of the round's updates, unweighted"),
    (("strategy.name=median", "clock.mode=fedbuff"),
     "the coordinate-wise median of each step's updates, unweighted: a stale update counts as much as a fresh one "
     "(s(staleness) is not applied)"),
    (("strategy.name=trimmed_mean", "clock.mode=fedcompass", "clock.concurrency=8"),
     "the coordinate-wise trimmed mean of each step's updates, unweighted: a stale update counts as much as a fresh "
     "one (s(staleness) is not applied)"),
    (("strategy.name=krum", "strategy.byzantine_clients=1"),
     "the one of the round's updates with the lowest of the Krum scores (f=1: squared distances to the n - f - 2 "
     "nearest others)"),
    (("strategy.name=multi_krum", "strategy.byzantine_clients=2", "strategy.weighting=equal"),
     "the mean weighted by equal weights of the n - f = n - 2 of the round's updates with the lowest Krum scores "
     "(f=2: squared distances to the n - f - 2 nearest others)"),
    (("strategy.name=geometric_median", "clock.mode=fedbuff"),
     "the geometric median of each step's updates weighted by s(staleness) (polynomial) (at most 4 smoothed "
     "Weiszfeld iterations)"),
    # a plug-in combiner with its own weight_of: strategy.weighting is not read, so validate does not echo it
    (("strategy.name=examples.custom_strategy.strategy:build", "strategy.weighting=equal"),
     "weighted by examples.custom_strategy.strategy.PowerMean.weight_of, the plug-in's own "
     "(strategy.weighting='equal' is not read)"),
    (("strategy.name=examples.client_half.scaffold:scaffold",), "weighted by samples"),  # mpifl's weights
])
def test_validate_says_how_a_round_weighs_the_updates_as_the_run_will(overrides, says):
    from mpifl.cli.commands import validated_weighting

    assert validated_weighting(load_config(ROOT / "configs" / "quickstart.yaml", list(overrides))) == says


def test_a_robust_rules_key_beside_a_strategy_that_does_not_read_it_is_warned_of():
    warnings = config_warnings(load_config(None, ["strategy.name=median", "strategy.byzantine_clients=2",
                                                  "strategy.geomed_iterations=9"]))
    assert "strategy.byzantine_clients: read only by strategy.name 'krum' or 'multi_krum' or 'bulyan', and " \
           "strategy.name is 'median': ignored" in warnings
    assert any(w.startswith("strategy.geomed_iterations: read only by strategy.name 'geometric_median'")
               for w in warnings)
    assert not [w for w in config_warnings(load_config(None, ["strategy.name=multi_krum", "strategy.krum_keep=3",
                                                              "strategy.byzantine_clients=1"]))
                if w.startswith("strategy.")]


def test_krum_with_fewer_participants_than_its_guarantee_needs_is_warned_of():
    (said,) = [w for w in config_warnings(load_config(None, ["strategy.name=krum", "strategy.byzantine_clients=2",
                                                             "clients.num_clients=10", "clients.per_round=6"]))
               if w.startswith("strategy.")]
    assert "needs n >= 2f + 3 updates per server step, and clients.per_round gives 6 for f=2 (each update scored " \
           "over its 2 nearest others): a Byzantine update may be kept; raise clients.per_round to 7" in said


def test_krums_n_under_fedbuff_is_the_buffer_and_f_at_least_n_is_refused():
    cfg = load_config(None, ["strategy.name=multi_krum", "strategy.byzantine_clients=2", "clients.num_clients=10",
                             "clients.per_round=8", "clock.mode=fedbuff", "clock.buffer=5", "clock.concurrency=8"])
    (said,) = [w for w in config_warnings(cfg) if w.startswith("strategy.byzantine_clients")]
    assert "clock.buffer gives 5 for f=2" in said
    with pytest.raises(ConfigError, match=r"strategy.byzantine_clients: f=8 is not below the 8 updates per server "
                                          r"step \(clients.per_round\)"):
        load_config(None, ["strategy.name=krum", "strategy.byzantine_clients=8", "clients.num_clients=8",
                           "clients.per_round=8"])


def test_every_strategy_key_beside_a_built_in_strategy_that_does_not_read_it_is_warned_of():
    warnings = config_warnings(load_config(None, ["strategy.name=krum", "strategy.server_lr=0.5",
                                                  "strategy.beta1=0.5", "strategy.alpha=0.1"]))
    for key in ("server_lr", "beta1", "alpha"):
        assert any(w.startswith(f"strategy.{key}: read only by strategy.name") for w in warnings), key
    assert not [w for w in config_warnings(load_config(None, ["strategy.name=fedadam", "strategy.server_lr=0.5",
                                                              "strategy.beta1=0.5", "strategy.tau=0.01"]))
                if w.startswith("strategy.")]


def test_krum_and_the_geometric_median_take_top_k_updates_where_a_coordinate_wise_rule_or_bulyan_does_not():
    for name in ("krum", "multi_krum", "geometric_median"):
        load_config(None, [f"strategy.name={name}", "compression.method=topk"])
    for name in ("median", "bulyan"):  # Bulyan ends in a coordinate-wise statistic: mostly zeros of sparse updates
        with pytest.raises(ConfigError, match="compression.method: 'topk'"):
            load_config(None, [f"strategy.name={name}", "compression.method=topk"])


def test_strategy_and_evaluation_combinations_are_checked():
    with pytest.raises(ConfigError,
                       match=r"strategy.name: 'centered_clipping' is not allowed; choose one of 'fedavg', 'fedavgm'"):
        load(strategy={"name": "centered_clipping"})
    with pytest.raises(ConfigError, match=r"strategy.trim_fraction: must be <= 0.49"):
        load(strategy={"name": "trimmed_mean", "trim_fraction": 0.5})
    with pytest.raises(ConfigError, match=r"eval.federated_every: .* set data.val_fraction"):
        load(eval={"federated_every": 2})
    with pytest.raises(ConfigError, match=r"clients.min_participants: 5 is more than the 4 clients sampled"):
        load(clients={"num_clients": 8, "per_round": 4, "min_participants": 5})
    cfg = load(strategy={"name": "fedadam", "update": "delta", "wire_dtype": "bfloat16"})
    assert (cfg.strategy.tau, cfg.strategy.server_lr) == (1e-3, None)


@pytest.mark.parametrize("data,update,weighting", [
    ({}, "weights", "samples"),  # what every config that ran before auto existed resolves to
    ({"strategy": {"name": "fedadam"}}, "weights", "samples"),
    ({"strategy": {"name": "scaffold"}}, "delta", "samples"),
    ({"strategy": {"name": "fednova"}}, "delta", "samples"),
    ({"strategy": {"name": "feddyn"}}, "delta", "equal"),
    ({"privacy": {"mode": "central"}}, "delta", "equal"),
    ({"privacy": {"mode": "local"}}, "delta", "equal"),
    ({"strategy": {"update": "delta"}, "compression": {"method": "topk"}}, "delta", "samples"),
    ({"compression": {"method": "topk"}}, "delta", "samples"),
    ({"compression": {"method": "int8"}}, "weights", "samples"),
    ({"clock": {"mode": "fedbuff", "concurrency": 5}}, "delta", "samples"),
    ({"clock": {"mode": "fedasync", "concurrency": 2}}, "weights", "samples"),
    ({"strategy": {"name": "fedavg", "update": "delta", "weighting": "equal"}}, "delta", "equal"),  # explicit: kept
])
def test_update_and_weighting_left_at_auto_take_what_the_strategy_and_run_modes_need(data, update, weighting):
    cfg = load(**data)
    assert (cfg.strategy.update, cfg.strategy.weighting) == (update, weighting)
    assert load(**{**data, "strategy": {**data.get("strategy", {}), "update": update, "weighting": weighting}}) == cfg


@pytest.mark.parametrize("clients,clock,concurrency", [
    (8, {"mode": "fedbuff", "buffer": 4}, 8),  # fewer clients than 10: all of them (was refused: 10 > 8)
    (100, {"mode": "fedasync"}, 10),  # what the key's default was before it could be left unset
    (100, {"mode": "fedcompass", "concurrency": 30}, 30),  # set: kept
    (4, {"mode": "fedbuff", "concurrency": 6}, None),  # set beyond the clients: still refused
])
def test_clients_in_flight_default_to_ten_or_every_client_where_there_are_fewer(clients, clock, concurrency):
    data = {"clients": {"num_clients": clients}, "clock": clock}
    if concurrency is None:
        with pytest.raises(ConfigError, match="clock.concurrency: 6 is more than the 4 clients"):
            load(**data)
    else:
        assert load(**data).clock.concurrency == concurrency


def test_an_explicit_update_or_weighting_a_strategy_cannot_take_is_still_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"strategy.update: strategy 'scaffold' .* set strategy.update='delta'"):
        load(strategy={"name": "scaffold", "update": "weights"})
    with pytest.raises(ConfigError, match=r"strategy.weighting: strategy 'feddyn' .* set strategy.weighting='equal'"):
        load(strategy={"name": "feddyn", "weighting": "samples"})
    with pytest.raises(ConfigError, match=r"clock.mode: 'fedasync' .* needs strategy.update='weights'"):
        load(strategy={"update": "delta"}, clock={"mode": "fedasync", "concurrency": 2})


def test_the_run_directorys_config_records_the_resolved_values_not_auto():
    import yaml

    from mpifl.config import dump_config
    saved = yaml.safe_load(dump_config(load(strategy={"name": "feddyn"})))["strategy"]
    assert (saved["update"], saved["weighting"]) == ("delta", "equal")


@pytest.mark.parametrize("name,where", [("ditto", "train.ditto_lambda"), ("FedProx", "train.prox_mu"),
                                        ("fedbn", "model.local"), ("fedper", "model.local"),
                                        ("fedbuff", "clock.mode=fedbuff")])
def test_an_algorithm_that_is_not_a_server_strategy_is_refused_with_the_key_that_gives_it(name, where):
    with pytest.raises(ConfigError, match=rf"strategy.name: '{name}' is not allowed; choose one of .*{where}"):
        load(strategy={"name": name})


def test_a_chain_reduction_without_reduction_groups_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"transport.reduce: 'chain' adds the ranks' partial sums, which needs "
                                          r"clients.groups > 0"):
        load(transport={"reduce": "chain"})
    assert load(transport={"reduce": "chain", "dispatch_fanout": 2}, clients={"groups": 2}).transport.reduce == "chain"


def test_compression_with_reduction_groups_quantizes_group_sums_but_top_k_and_the_chain_are_refused():
    assert load(clients={"groups": 2}, compression={"method": "int8"}).compression.method == "int8"
    with pytest.raises(ConfigError, match=r"clients.groups: compression.method 'topk' needs clients.groups=0 \(top-k "
                                          r"sparsifies each client's own update"):
        load(clients={"groups": 2}, strategy={"update": "delta"}, compression={"method": "topk"})
    with pytest.raises(ConfigError, match=r"transport.reduce: compression.method 'int4' needs 'direct'"):
        load(clients={"groups": 2}, transport={"reduce": "chain"}, compression={"method": "int4"})


@pytest.mark.parametrize("lora, named", [
    ({"alpha": 32, "target_modules": ["q_proj", "v_proj"]}, "model.lora.alpha, model.lora.target_modules: set"),
    ({"dropout": 0.1}, "model.lora.dropout: set"),
])
def test_lora_settings_without_a_rank_are_refused_naming_them_not_run_as_full_fine_tuning(lora, named):
    with pytest.raises(ConfigError, match=f"^{named}, but model.lora.r is 0"):
        load(model={"lora": lora})
    assert load(model={"lora": {"r": 0, "alpha": 16.0}}).model.lora.r == 0  # the defaults, written out, are fine


def test_settings_of_a_feature_that_is_switched_off_are_warned_of_as_ignored():
    """A forgotten switch runs without the feature and nothing else would say so: a clip without privacy.mode, a
    deadline without clock.mode, top-k's fraction beside int8."""
    from mpifl.config import config_warnings

    def said(*overrides: str) -> list[str]:
        return config_warnings(load_config(None, list(overrides)))

    assert said() == []
    assert said("privacy.clip=2", "privacy.noise_multiplier=0.5") == [
        "privacy.clip, privacy.noise_multiplier: read only with privacy.mode set, and it is 'off': ignored; set "
        "privacy.mode (central or local) to use them"]
    assert said("secagg.fraction_bits=20") == [
        "secagg.fraction_bits: read only with secagg.enabled set, and it is False: ignored; set secagg.enabled=true "
        "to use them"]
    assert said("compression.method=int8", "compression.fraction=0.1") == [
        "compression.fraction: read only with compression.method 'topk', not 'int8': ignored"]
    assert said("clock.deadline=5")[0].startswith("clock.deadline: read only under virtual time")
    assert said("compression.method=topk", "compression.fraction=0.1", "strategy.update=delta") == []
    local = ("privacy.mode=local", "strategy.update=delta", "strategy.weighting=equal")
    assert said(*local, "privacy.adaptive_clip=true", "privacy.target_quantile=0.7") == [
        "privacy.adaptive_clip, privacy.target_quantile: adaptive clipping is central DP's (the server learns the "
        "clipped count from the clients' noised bits); under privacy.mode 'local' it is ignored and every client clips "
        "at privacy.clip for the whole run"]
    assert said(*local) == []


def test_ditto_is_warned_of_when_lr_times_lambda_reaches_the_regularisers_stability_bound():
    """SGD's step on Ditto's term lambda/2 ||v - w||^2 multiplies v - w by 1 - lr lambda: past lr lambda = 2, or
    2 (1 + beta) with momentum beta, the personal models grow to NaN/Inf. The run was silent about it."""
    from mpifl.config import config_warnings

    def said(*overrides: str) -> list[str]:
        return [w for w in config_warnings(load_config(None, list(overrides))) if w.startswith("train.ditto_lambda")]

    assert said("train.lr=0.1", "train.ditto_lambda=19.9") == []  # lr x lambda = 1.99 < 2
    assert said("train.lr=0.1", "train.ditto_lambda=20") == [
        "train.ditto_lambda: train.lr x train.ditto_lambda = 0.1 x 20 = 2 is at or past 2, where SGD's step on Ditto's "
        "regulariser is unstable (stable while lr x lambda < 2): the personal models will diverge to NaN/Inf and not "
        "be kept. Lower train.lr or train.ditto_lambda"]
    assert said("train.lr=0.1", "train.momentum=0.9", "train.ditto_lambda=37") == []  # 3.7 < 2 (1 + 0.9)
    assert "with train.momentum=0.9 (stable while lr x lambda < 2 x (1 + momentum))" in \
        said("train.lr=0.1", "train.momentum=0.9", "train.ditto_lambda=100")[0]
    assert said("train.lr=0.1", "train.optimizer=adam", "train.ditto_lambda=100") == []  # no such bound for Adam


def test_ditto_stability_warning_counts_weight_decay_with_lambda():
    """The optimiser's weight decay wd/2 ||v||^2 adds its curvature to Ditto's: SGD multiplies the personal model by
    1 - lr (lambda + wd), so lr x lambda below the bound can still diverge once weight decay is added."""
    from mpifl.config import config_warnings

    def said(*overrides: str) -> list[str]:
        return [w for w in config_warnings(load_config(None, list(overrides))) if w.startswith("train.ditto_lambda")]

    assert said("train.lr=0.1", "train.ditto_lambda=15", "train.weight_decay=4.9") == []  # 0.1 x 19.9 < 2
    assert said("train.lr=0.1", "train.ditto_lambda=15", "train.weight_decay=5") == [
        "train.ditto_lambda: train.lr x (train.ditto_lambda + train.weight_decay) = 0.1 x (15 + 5) = 2 is at or past "
        "2, where SGD's step on Ditto's regulariser is unstable (stable while lr x (lambda + weight_decay) < 2): the "
        "personal models will diverge to NaN/Inf and not be kept. Lower train.lr, train.ditto_lambda or "
        "train.weight_decay"]


@pytest.mark.parametrize("overrides,message", [
    (("strategy.name=scaffold", "compression.method=int8"), "set compression.method='none' or choose fedavg"),
    (("strategy.name=feddyn", "compression.method=int4"), "set compression.method='none' or choose fedavg"),
    (("strategy.name=scaffold", "strategy.wire_dtype=bfloat16"), "unset strategy.wire_dtype or choose fedavg"),
    (("secagg.enabled=true", "compression.method=int8"),
     "secagg.enabled: compression.method 'int8' needs secagg.enabled=false (secure aggregation sends its own "
     "fixed-point values, one encoding at a time); or set compression.method='none' to keep secure aggregation"),
    (("secagg.enabled=true", "strategy.wire_dtype=bfloat16"),
     "strategy.wire_dtype: secagg.enabled needs strategy.wire_dtype unset (masked updates travel as fixed-point "
     "ring values in fp32's bytes, which bfloat16 cannot hold): unset strategy.wire_dtype, or set "
     "secagg.enabled=false to keep it"),
], ids=["scaffold-int8", "feddyn-int4", "scaffold-bf16-wire", "secagg-int8", "secagg-bf16-wire"])
def test_a_refused_encoding_names_both_ways_out(overrides, message):
    """A refusal says what to change on either side: the encoding, or the strategy or secure aggregation that
    refuses it (a SCAFFOLD run told only to drop compression may rather drop SCAFFOLD)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["strategy.update=delta", *overrides])
    assert message in str(err.value)


def test_below_quorum_keep_without_accept_failures_is_warned_of():
    """Only clients.accept_failures leaves a round with too few usable updates: without it 'keep' does nothing."""
    from mpifl.config import config_warnings

    def said(*overrides: str) -> list[str]:
        return [w for w in config_warnings(load_config(None, list(overrides))) if w.startswith("clients.below_quorum")]

    assert said("clients.below_quorum=keep") == [
        "clients.below_quorum: 'keep' acts on a round left with too few usable updates, which only "
        "clients.accept_failures=true leaves (without it a failed client ends the job itself): set "
        "clients.accept_failures=true"]
    assert said("clients.below_quorum=keep", "clients.accept_failures=true") == []


@pytest.mark.parametrize("strategy", ["median", "trimmed_mean"])
def test_robust_rules_are_refused_with_topk_whose_sparse_updates_make_their_order_statistics_mostly_zeros(strategy):
    """A coordinate-wise median of top-k updates is 0 wherever fewer than half the clients kept the coordinate (a
    clean median run reached 0.8635 with top-k, 0.93-0.95 without); the dense quantizers stay allowed."""
    with pytest.raises(ConfigError) as err:
        load(strategy={"name": strategy, "update": "delta"}, compression={"method": "topk"})
    said = str(err.value)
    assert said.startswith(f"compression.method: 'topk' sends each client's update as its largest fraction of "
                           f"coordinates, zeros elsewhere, and strategy {strategy!r} needs every participant's own "
                           "update")
    assert ("a coordinate-wise order statistic (median, trimmed mean, Bulyan's values nearest the median) of sparse "
            "updates is mostly zeros") in said
    assert "set compression.method to 'int8', 'int4' or 'none', or choose a summable strategy.name" in said
    for method in ("int8", "int4"):
        assert load(strategy={"name": strategy}, compression={"method": method}).compression.method == method
    assert load(strategy={"update": "delta"}, compression={"method": "topk"}).strategy.name == "fedavg"


def test_fedcompass_with_more_clients_than_its_concurrency_warns_how_many_never_train():
    """FedCompass keeps clock.concurrency clients in the federation for the whole run: the others never train."""
    from mpifl.config import config_warnings

    def said(*overrides: str) -> list[str]:
        cfg = load_config(None, ["clock.mode=fedcompass", "strategy.update=delta", *overrides])
        return [w for w in config_warnings(cfg) if "never train" in w]

    assert said("clients.num_clients=16", "clock.concurrency=4") == [
        "clock.concurrency: clock.mode 'fedcompass' keeps the same 4 clients (clock.concurrency) in the federation "
        "for the whole run, so 12 of the clients.num_clients=16 never train and their data is never seen: raise "
        "clock.concurrency to 16, or lower clients.num_clients"]
    assert said("clients.num_clients=8") == []  # clock.concurrency unset: every one of the 8
    assert said("clients.num_clients=16", "clock.concurrency=16") == []
    assert "6 of the clients.num_clients=16 never train" in said("clients.num_clients=16")[0]  # the automatic 10


@pytest.mark.parametrize("overrides,warned", [
    (("clock.mode=fedbuff", "clock.deadline=4", "clock.over_selection=0.5"), [
        "clock.deadline: read only under clock.mode 'sync', and clock.mode is 'fedbuff': ignored",
        "clock.over_selection: read only under clock.mode 'sync', and clock.mode is 'fedbuff': ignored"]),
    (("clock.mode=fedasync", "clock.deadline=4"),
     ["clock.deadline: read only under clock.mode 'sync', and clock.mode is 'fedasync': ignored"]),
    (("clock.mode=fedcompass", "clock.over_selection=0.5"),
     ["clock.over_selection: read only under clock.mode 'sync', and clock.mode is 'fedcompass': ignored"]),
    (("clock.mode=sync", "clock.buffer=2", "clock.concurrency=4"), [
        "clock.buffer: read only under clock.mode 'fedbuff', and clock.mode is 'sync': ignored",
        "clock.concurrency: read only under clock.mode 'fedasync' or 'fedbuff' or 'fedcompass', and clock.mode is "
        "'sync': ignored"]),
    (("clock.buffer=2", "clock.concurrency=4"), [
        "clock.buffer, clock.concurrency: read only under virtual time, and clock.mode is 'off' (rounds in real "
        "time): ignored; set clock.mode (sync, fedasync, fedbuff or fedcompass) to use them"]),
    (("clock.mode=sync", "clock.deadline=4", "clock.over_selection=0.5"), []),
    (("clock.mode=fedbuff", "clock.buffer=2", "clock.concurrency=4"), []),
    (("clock.mode=sync",), []),  # clock.concurrency filled in by load_config is not the user's
])
def test_clock_keys_that_the_chosen_mode_does_not_read_are_warned_of_naming_key_and_mode(overrides, warned):
    from mpifl.config import config_warnings

    update = "weights" if "clock.mode=fedasync" in overrides else "delta"
    cfg = load_config(None, [f"strategy.update={update}", *overrides])
    assert [w for w in config_warnings(cfg) if w.startswith("clock.") and "never train" not in w] == warned
