"""Each client's one vector of per-client state, laid out by one owner (mpifl.config.client_state): any kinds
together, the one- and two-kind layouts of earlier versions unchanged (so their checkpoints resume), a plug-in
trainer's declared vectors after the built-in kinds, and a malformed declaration refused before MPI starts."""
from __future__ import annotations

import pytest

from mpifl.cli.preflight import check_plugins
from mpifl.config import ConfigError, load_config
from mpifl.config.client_state import StateSizes, StateVector, client_state

SIZES = StateSizes(trainable=7, chunks=(5, 3), local=2, tensors=8)
BUDGETS = {"strategy.control_ram_mb": 1.0, "compression.residual_ram_mb": 2.0, "model.local_ram_mb": 4.0,
           "train.personal_ram_mb": 8.0, "train.state_ram_mb": 16.0}


def firsts(rule=None, residuals=False, local=False, personal=False, vectors=None) -> list[int]:
    state = client_state(rule, residuals, local, personal, vectors or {}, BUDGETS)
    assert state is not None
    return state.layout(SIZES).firsts


@pytest.mark.parametrize(("kinds", "before"), [
    ({"rule": "control_variates"}, [0, 7]),  # 'trainable'
    ({"residuals": True}, [0, 5, 8]),  # 'exchanged'
    ({"personal": True}, [0, 5, 8]),  # 'exchanged' (Ditto alone)
    ({"local": True}, [0, 2]),  # 'local'
    ({"rule": "control_variates", "local": True}, [0, 7, 10]),  # 'trainable+local': the local chunk ends in its mark
    ({"residuals": True, "local": True}, [0, 5, 8, 11]),  # 'exchanged+local'
    ({"rule": "dynamic_regularizer", "personal": True}, [0, 7, 12, 15, 16]),  # 'trainable+personal': then a mark
    ({"residuals": True, "personal": True}, [0, 5, 8, 13, 16, 17]),  # 'exchanged+personal'
    ({"local": True, "personal": True}, [0, 3, 8, 11, 13, 14]),  # 'local+personal': v_i's own local tensors too
])
def test_the_layouts_of_one_or_two_kinds_are_those_earlier_checkpoints_hold(kinds, before):
    assert firsts(**kinds) == before


def test_each_marked_part_names_the_element_that_holds_its_mark_and_a_part_alone_has_none():
    state = client_state("control_variates", False, True, True, {}, BUDGETS)
    assert state is not None
    layout = state.layout(SIZES)  # c_i [0, 7), local [7, 9) + mark 9, personal [10, 20) (5, 3, 2) + mark 20
    assert [layout.mark(part) for part in layout.parts] == [None, 9, 20]
    alone = client_state(None, False, False, True, {}, BUDGETS)
    assert alone is not None and alone.layout(SIZES).mark(alone.layout(SIZES).parts[0]) is None


def test_three_built_in_kinds_lay_out_one_after_another_each_with_its_mark():
    # SCAFFOLD's c_i, the client's local tensors and their mark, its personal model with its own local tensors,
    # and that model's mark
    assert firsts(rule="control_variates", local=True, personal=True) == [0, 7, 10, 15, 18, 20, 21]


def test_a_plugins_vectors_follow_the_built_in_kinds_each_with_a_mark():
    vectors = {"previous": StateVector(covers="trainable"), "alpha": StateVector(covers="custom", size=1),
               "both": StateVector(covers="exchanged")}
    assert firsts(local=True, vectors=vectors) == [0, 3, 10, 11, 12, 13, 21, 22]
    alone = client_state(None, False, False, False, {"v": StateVector(covers="local")}, BUDGETS)
    assert alone is not None and alone.layout(SIZES).firsts == [0, 2, 3]  # marked even alone


def test_what_a_dropped_client_puts_back_is_its_rule_and_its_plugin_vectors_with_their_marks():
    state = client_state("control_variates", False, True, True, {"v": StateVector()}, BUDGETS)
    assert state is not None
    layout = state.layout(SIZES)
    assert layout.journaled_chunks() == (0, 6, 7)  # c_i; v and its mark; not the local tensors or personal model
    assert layout.journaled_elements == 7 + 7 + 1


def test_the_state_names_every_kind_and_sums_their_budgets():
    state = client_state("control_variates", False, True, True, {"v": StateVector()}, BUDGETS)
    assert state is not None
    assert state.what == ("SCAFFOLD control variates and local tensors (model.local) and Ditto personal models and "
                          "the trainer's per-client vectors")
    assert state.ram_key == "strategy.control_ram_mb + model.local_ram_mb + train.personal_ram_mb + train.state_ram_mb"
    assert state.ram_mb == 1 + 4 + 8 + 16 and state.folder == "controls"


@pytest.mark.parametrize(("vector", "message"), [
    (StateVector(covers="weights"), "covers='weights'; choose one of 'trainable', 'exchanged', 'local', 'custom'"),
    (StateVector(start="ones"), "start='ones'; choose one of 'zeros', 'global'"),
    (StateVector(covers="custom"), "size > 0 goes with covers='custom' and only with it"),
    (StateVector(size=3), "size > 0 goes with covers='custom' and only with it"),
    (StateVector(covers="custom", size=2, start="global"), "a custom vector covers no tensors to start from"),
])
def test_a_malformed_declaration_says_what_is_wrong(vector, message):
    assert message in (vector.problem("v") or "")


SYNTHETIC = {"data": {"dataset": "synthetic", "kwargs": {"num_samples": 300}}}


def test_a_trainers_declaration_is_checked_when_the_config_loads_naming_the_trainer():
    with pytest.raises(ConfigError, match=r"train\.trainer: BadDeclaration\.client_state\['previous'\] is str, not "
                                          r"a mpifl\.api\.StateVector"):
        load_config(None, data={**SYNTHETIC, "train": {"trainer": "plugin_helpers:BadDeclaration"}})
    cfg = load_config(None, data={**SYNTHETIC, "train": {"trainer": "plugin_helpers:NoContext"}})
    with pytest.raises(ConfigError, match=r"declares per-client vectors \(client_state\), which reach it as "
                                          r"TrainContext\.state: its train\(\) must take a keyword parameter "
                                          r"'context'"):
        check_plugins(cfg)


def test_a_vector_over_the_local_tensors_needs_model_local_to_name_some():
    trainer = {"trainer": "plugin_helpers:LocalHeadState"}
    with pytest.raises(ConfigError, match=r"train\.trainer: the client_state 'head' of 'plugin_helpers:LocalHeadState' "
                                          r"covers 'local', the model\.local tensors, but model\.local names none"):
        load_config(None, data={**SYNTHETIC, "train": trainer})
    state = load_config(None, data={**SYNTHETIC, "train": trainer, "model": {"name": "mlp", "local": ["2.*"]}})
    assert [name for name, _ in state.client_state().vectors] == ["head"]


def test_declared_vectors_need_synchronous_rounds_and_are_kept_with_the_built_in_kinds():
    moon = {**SYNTHETIC, "train": {"trainer": "plugin_helpers:SlowMoonTrainer"}}
    with pytest.raises(ConfigError, match=r"train\.trainer: 'plugin_helpers:SlowMoonTrainer' keeps previous per client "
                                          r"\(its client_state\).*clock\.mode 'fedbuff'"):
        load_config(None, data={**moon, "clock": {"mode": "fedbuff"}})
    state = load_config(None, data={**moon, "model": {"name": "cnn", "local": ["1.*"]}}).client_state()
    assert state is not None and state.local and [name for name, _ in state.vectors] == ["previous"]


def test_scaffold_fedbn_and_ditto_together_are_no_longer_refused_as_three_kinds():
    cfg = load_config(None, data={**SYNTHETIC, "strategy": {"name": "scaffold"}, "model": {"local": ["0.*"]},
                                  "train": {"ditto_lambda": 0.1}})
    state = cfg.client_state()
    assert state is not None and (state.rule, state.local, state.personal) == ("control_variates", True, True)
