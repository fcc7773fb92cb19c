"""SCAFFOLD (Karimireddy et al. 2020): the server control variate streamed inside the model, each client's c_i
kept on the rank that hosts it, equal to the paper's rule computed on whole models, bitwise, on any number of
ranks, with reduction groups, with c_i in RAM or on disk, and across a resume on another number of ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from conftest import run_mpi, stopped_and_resumed, write_config
from reference import one_thread, reference_run, scaffold_reference
from results import assert_bitwise, reference_controls_numbered, run_controls_numbered

from examples.client_half.scaffold import Leader, Member
from mpifl.aggregation.strategies import make_strategy, section_span
from mpifl.algorithms.scaffold import ControlledAverage, control_delta
from mpifl.cli.plan import estimate
from mpifl.config import ConfigError, StrategyConfig, load_config
from mpifl.learning.steps import corrected_steps
from mpifl.wire.spec import Chunk

EXAMPLE = "examples.client_half.scaffold"  # the shipped SCAFFOLD plug-in, both halves on mpifl.api
CONFIG = """
seed: 5
rounds: 3
clients: {num_clients: 8, per_round: 6}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: mlp, kwargs: {hidden: [9]}}
train: {lr: 0.05, momentum: 0.5, batch_size: 16, local_epochs: 1, device: cpu}
strategy: {name: scaffold, update: delta}
eval: {every: 0}
output: {progress: false}
"""


def reference(*overrides: str) -> dict[str, np.ndarray]:
    return reference_controls_numbered(scaffold_reference(load_config(None, list(overrides),
                                                                      data=yaml.safe_load(CONFIG))))


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),  # 2 client ranks, 3 participants each, one after the other
    (5, ("transport.chunk_mb=0.00001",)),  # 4 client ranks, 10-byte chunks: chunks straddle the control section
    (4, ("clients.groups=3", "strategy.weighting=equal")),  # the groups' partial sums, equal weights
    (4, ("strategy.control_ram_mb=0", "strategy.server_lr=0.5")),  # c_i in one HDF5 file per rank; eta_g
    # the GPU path's copies on the CPU: c - c_i and the control deltas on the replica, the groups' sums folded there
    (4, ("clients.groups=3", "train.device_copy=true")),
], ids=["2-client-ranks", "4-client-ranks-tiny-chunks", "reduction-groups", "controls-on-disk", "device-replica"])
def test_scaffold_equals_the_papers_rule_on_whole_models_bitwise_on_any_number_of_ranks(tmp_path, ranks, overrides):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    got, want = run_controls_numbered(tmp_path / "run"), reference(*overrides)
    assert_bitwise(got, want)
    assert any(np.abs(want[n]).max() > 0 for n in want if n.startswith("control."))  # c moved away from 0
    if "strategy.control_ram_mb=0" in overrides:
        assert sorted(p.name for p in (tmp_path / "run" / "controls").iterdir()) == ["rank00001.h5", "rank00002.h5",
                                                                                    "rank00003.h5"]


def test_scaffold_is_fedavg_in_round_one_and_departs_from_it_once_control_variates_are_nonzero():
    def fedavg(*overrides: str) -> dict[str, np.ndarray]:  # trained with one thread, as scaffold_reference is
        with one_thread():
            return reference_run(load_config(None, ["strategy.name=fedavg", *overrides], data=yaml.safe_load(CONFIG)))

    weights = lambda run: {n: t for n, t in run.items() if not n.startswith("control.")}  # noqa: E731
    # round 1 starts from c = c_i = 0, so its weights are FedAvg's (of deltas); from round 2 the corrections act
    assert_bitwise(weights(reference("rounds=1")), fedavg("rounds=1"))
    three = weights(reference())
    assert any(not np.array_equal(three[n], v) for n, v in fedavg().items())


def test_a_resumed_scaffold_run_on_another_number_of_ranks_equals_the_uninterrupted_one_bitwise(tmp_path):
    """Stopped with its control variates on disk (strategy.control_ram_mb=0), resumed with them in RAM."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    rest = stopped_and_resumed(tmp_path, cfg, first_overrides=("strategy.control_ram_mb=0",))
    assert "resume: SCAFFOLD control variates of" in rest.stderr
    assert list((tmp_path / "split" / "controls").glob("rank*.h5"))  # the first part kept them on disk
    assert_bitwise(run_controls_numbered(tmp_path / "split"), reference())


def test_the_control_delta_is_option_two_of_the_paper():
    x, y, c = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 2.5]), torch.tensor([0.25, -0.25])
    # (x - y) / (K lr) - c with K = 5 steps at lr 0.1: (0.5, -0.5) / 0.5 - c
    assert torch.equal(control_delta(x, y, c, steps=5, lr=0.1), torch.tensor([0.75, -0.75]))
    with pytest.raises(ValueError, match="local steps > 0"):
        control_delta(x, y, c, steps=0, lr=0.1)


def test_inside_the_correction_every_step_is_followed_by_minus_lr_times_c_minus_c_i_outside_the_momentum():
    w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    optimizer = torch.optim.SGD([w], lr=0.5, momentum=0.9)
    with corrected_steps([w], [torch.tensor([0.5, 2.0])]):
        for _ in range(2):
            optimizer.zero_grad()
            w.sum().backward()  # g = 1: momentum buffer 1, then 1.9
            optimizer.step()
    # w0 - 0.5 * (1 + 1.9) - 2 * 0.5 * (c - c_i): the correction is not in the momentum buffer
    assert torch.allclose(w.detach(), torch.tensor([1.0 - 1.45 - 0.5, -1.0 - 1.45 - 2.0]))
    assert torch.allclose(optimizer.state[w]["momentum_buffer"], torch.tensor([1.9, 1.9]))
    optimizer.zero_grad()
    w.sum().backward()
    optimizer.step()  # outside: no correction
    assert torch.allclose(w.detach(), torch.tensor([1.0 - 1.45 - 0.5 - 0.5 * 2.71, -1.0 - 1.45 - 2.0 - 0.5 * 2.71]))


def test_a_chunk_is_split_at_the_control_sections_bytes():
    chunk = Chunk(index=3, dtype="float32", offset=96, nbytes=64, itemsize=4)  # elements 24..39
    assert section_span(chunk, 128, 512) == (8, 16)  # the control section starts inside it
    assert section_span(chunk, 0, 112) == (0, 4)  # ... or ends inside it
    assert section_span(chunk, 512, 640) == (16, 16)  # none of it
    strategy = make_strategy(StrategyConfig(name="scaffold", update="delta"))
    assert isinstance(strategy, ControlledAverage) and strategy.capabilities.client_state


def test_the_plan_counts_the_control_section_and_the_clients_control_variates():
    fedavg = estimate(load_config(None, ["strategy.name=fedavg"], data=yaml.safe_load(CONFIG)), nranks=3,
                      ranks_per_node=3, server_alone=False)
    scaffold = estimate(load_config(None, [], data=yaml.safe_load(CONFIG)), nranks=3, ranks_per_node=3,
                        server_alone=False)
    (size, plan), (plain_size, plain) = scaffold, fedavg
    params = 64 * 9 + 9 + 9 * 10 + 10  # mlp 64-9-10 on the digits
    assert size.control == 4 * params and size.parameters == plain_size.parameters
    assert size.exchanged >= plain_size.exchanged + size.control
    # a client rank hosts 4 of the 8 clients: their c_i, the correction and a control delta, beyond FedAvg's
    # model (which now carries c) and its copies
    assert plan.client_bytes - plain.client_bytes >= 4 * size.control + 2 * size.control


@pytest.mark.parametrize("overrides,message", [
    (("strategy.update=weights",), "strategy.update: strategy 'scaffold' keeps a vector per client"),
    (("privacy.mode=central", "privacy.clip=1.0", "privacy.noise_multiplier=1.0"), "privacy.mode: clipping"),
    (("secagg.enabled=true",), "secagg.enabled: masked fixed-point updates"),
    (("compression.method=int8",), "compression.method: a compressed update"),
    (("clock.mode=fedbuff",), "clock.mode: 'fedbuff' applies stale updates"),
    (("train.trainer=fl_helpers:SteppingNoiseTrainer",), "train.trainer: strategy 'scaffold'"),
    (("strategy.wire_dtype=bfloat16",), "strategy.wire_dtype: a bfloat16 update loses low bits"),
])
def test_scaffold_refuses_what_would_rewrite_or_skip_its_control_variates(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["strategy.name=scaffold", "strategy.update=delta", *overrides])


def test_a_client_whose_training_diverged_keeps_its_control_variate():
    from mpifl.algorithms.scaffold import ClientControls, control_variates
    from mpifl.config import ModelConfig
    from mpifl.learning.models import build_flat_model
    from mpifl.learning.steps import trainable_elements
    from mpifl.storage.residuals import RamResiduals

    flat = build_flat_model(ModelConfig(name="mlp", kwargs={"hidden": [3]}), 0, streams=control_variates,
                            input_shape=(4,), num_classes=2)
    controls = ClientControls(flat, RamResiduals([0, trainable_elements(flat.module)]), lr=0.1)
    keep = flat.buffer.clone()
    with torch.no_grad():
        next(flat.module.parameters()).add_(1.0)  # a trained model
    controls.update(7, keep, steps=2, weight=1.0)
    kept = controls.store.read(7, 0).clone()
    assert kept.abs().sum() > 0
    flat.buffer.copy_(keep)
    with torch.no_grad():
        next(flat.module.parameters())[0, 0] = float("nan")  # a diverged one
    controls.update(7, keep, steps=2, weight=1.0)
    assert torch.equal(controls.store.read(7, 0), kept)


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "fedavg"])
@pytest.mark.parametrize("placement", ["balanced", "per_round"])
def test_under_accept_failures_a_slow_rank_is_dropped_and_only_client_state_that_the_servers_matches_is_journaled(
        name, placement):
    """A dropped rank learns of the drop from its next header; SCAFFOLD's c_i and FedDyn's g_i are then put back
    (UndoJournal: by the rank, or under per_round placement by each client's home rank), so those strategies
    journal them and every strategy drops slow ranks."""
    from mpifl.roles.build_server import straggler_rule as _straggler_rule

    overrides = ["clients.accept_failures=true", f"strategy.name={name}", "strategy.update=delta",
                 f"clients.placement={placement}", "timeouts.straggler=30"]
    if name == "feddyn":
        overrides.append("strategy.weighting=equal")
    cfg = load_config(None, overrides)
    assert _straggler_rule(cfg) is not None
    assert cfg.undoes_dropped_state == (name != "fedavg")
    without = load_config(None, overrides[1:-1])
    assert _straggler_rule(without) is None  # without accept_failures nothing is dropped
    assert not without.undoes_dropped_state


@pytest.mark.parametrize("strategy", ["scaffold", "fednova"])
def test_an_adaptive_local_optimizer_under_a_rule_that_assumes_sgd_steps_is_warned_of(strategy):
    from mpifl.config import config_warnings

    cfg = load_config(None, [f"strategy.name={strategy}", "strategy.update=delta", "train.optimizer=adam"])
    assert any(w.startswith("train.optimizer:") and "as plain SGD steps" in w for w in config_warnings(cfg))
    plain = load_config(None, [f"strategy.name={strategy}", "strategy.update=delta", "train.momentum=0.9"])
    assert not any(w.startswith("train.optimizer:") for w in config_warnings(plain))


@pytest.mark.parametrize("ranks,overrides", [
    (3, ()),
    (4, ("strategy.control_ram_mb=0", "clients.groups=3", "strategy.weighting=equal")),
], ids=["2-client-ranks", "on-disk-with-reduction-groups"])
def test_a_scaffold_of_ones_own_on_the_public_contract_equals_the_papers_rule_bitwise(tmp_path, ranks, overrides):
    # examples/client_half/scaffold.py: both halves on mpifl.api alone, its client half named by
    # Capabilities.client_rule
    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace("strategy: {name: scaffold,",
                                                           f"strategy: {{name: '{EXAMPLE}:scaffold',"))
    result = run_mpi(ranks, "run", str(cfg), "--run-dir", str(tmp_path / "run"), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_bitwise(run_controls_numbered(tmp_path / "run"), reference(*overrides))


def test_a_plugin_strategy_must_build_the_client_half_its_builder_declares(tmp_path):
    from examples.client_half import scaffold
    from mpifl.aggregation.compatibility import checked_strategy

    cfg = load_config(None, [f"strategy.name={EXAMPLE}:scaffold"], data=yaml.safe_load(CONFIG))
    assert cfg.client_rule == f"{EXAMPLE}:CLIENT" and cfg.summed_streams
    assert cfg.client_state() is not None and cfg.client_state().rule == f"{EXAMPLE}:CLIENT"
    original = scaffold.scaffold.capabilities
    try:
        scaffold.scaffold.capabilities = StrategyConfig  # not a Capabilities: no client half is read
        assert load_config(None, [f"strategy.name={EXAMPLE}:scaffold"],
                           data=yaml.safe_load(CONFIG)).client_rule == ""
    finally:
        scaffold.scaffold.capabilities = original
    assert checked_strategy(cfg).capabilities.client_rule == f"{EXAMPLE}:CLIENT"
    mismatched = load_config(None, ["strategy.name=plugin_scaffold:mismatched"], data=yaml.safe_load(CONFIG))
    with pytest.raises(ConfigError, match=r"strategy.name: 'plugin_scaffold:mismatched' declares "
                                          rf"client_rule='{EXAMPLE}:CLIENT'.* builds declares client_rule=''"):
        checked_strategy(mismatched)


@pytest.mark.parametrize("module,rule,says", [
    ("missing_attribute", "examples.client_half.scaffold:CLIENTX", "did you mean 'CLIENT'"),
    ("no_colon", "examples.client_half.scaffold.CLIENT", "nor an import path"),
], ids=["missing-attribute", "no-colon"])
def test_validate_refuses_a_client_half_path_that_does_not_import_naming_strategy_name(tmp_path, monkeypatch, capsys,
                                                                                        module, rule, says):
    from mpifl.cli import main

    (tmp_path / f"{module}.py").write_text(
        "import dataclasses\nfrom examples.client_half import scaffold as example\n"
        f"CAPS = dataclasses.replace(example.CAPABILITIES, client_rule={rule!r})\n"
        "def scaffold(cfg):\n"
        "    return example.Average(cfg, example.Mean(cfg), example.Replace(cfg), capabilities=CAPS)\n"
        "scaffold.capabilities = CAPS\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    assert main(["validate", str(cfg), f"strategy.name={module}:scaffold"]) == 2
    said = capsys.readouterr().err
    assert f"strategy.name: '{module}:scaffold' names its client half by Capabilities.client_rule" in said
    assert says in said and "Traceback" not in said


def test_a_plugin_client_half_that_corrects_no_step_is_refused_lanes_before_mpi_naming_the_key_and_its_class(tmp_path):
    """train.batched_clients trains clients as lanes, which take a client half only as a correction of every step
    (mpifl.api.LaneCorrections). The shipped example's Leader has none: validate refuses it, and so does the run
    before MPI starts, naming the key and the class, with a config error's exit status and nothing written."""
    from conftest import mpifl_here

    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace("strategy: {name: scaffold,",
                                                           f"strategy: {{name: '{EXAMPLE}:scaffold',"))
    said = "config error: train.batched_clients: the strategy's client half (Leader) has no correction a lane can take"
    checked = mpifl_here("validate", str(cfg), "train.batched_clients=2")
    assert checked.returncode == 2 and said in checked.stderr and "Traceback" not in checked.stderr, checked.stderr
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), "train.batched_clients=2")
    assert result.returncode == 2 and said in result.stderr, result.stderr[-3000:]
    assert "MPI_Abort" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_the_type_of_a_client_half_tells_lanes_whether_it_corrects_steps_and_an_undeclared_one_is_left_to_the_rank():
    """lanes_problem reads the half's class from ClientAlgorithm.leader: the class itself, or a builder's return
    annotation. A lambda declares nothing, so the rank checks the half it builds (batched_clients)."""
    from mpifl.algorithms import lanes_problem
    from mpifl.api import ClientAlgorithm

    class Corrected(Leader):
        def correction(self, client: int) -> torch.Tensor:
            return torch.zeros(1)

    def annotated(work, store, cfg) -> Leader:
        return Leader(work, store, cfg)

    halves = {"plain": Leader, "corrected": Corrected, "annotated": annotated,
              "lambda": lambda work, store, cfg: Leader(work, store, cfg)}
    found = {}
    for name, leader in halves.items():
        module = type(torch)(f"halves_{name}")
        module.CLIENT = ClientAlgorithm(state="c_i", leader=leader, member=Member)
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(__import__("sys").modules, module.__name__, module)
            found[name] = lanes_problem(f"{module.__name__}:CLIENT", 2)
            assert lanes_problem(f"{module.__name__}:CLIENT", 0) is None  # lanes off: nothing to refuse
    assert found["plain"] is not None and "(Leader)" in found["plain"]
    assert found["annotated"] == found["plain"]
    assert found["corrected"] is None and found["lambda"] is None
    assert lanes_problem("control_variates", 2) is None  # SCAFFOLD's built-in half trains as lanes


@pytest.mark.parametrize("builder,says", [
    ("leader_without_cfg", "LeaderWithoutCfg.__init__(work, store) cannot take mpifl's call leader(work, store, cfg)"),
    ("member_without_cfg", "MemberWithoutCfg.__init__(work) cannot take mpifl's call member(work, cfg)"),
    ("update_without_weight", "UpdateWithoutWeight.update(self, client, global_bytes, steps) cannot take mpifl's call "
                              "update(client, global_bytes, steps, weight)"),
])
def test_a_client_half_that_cannot_take_mpifls_calls_is_refused_before_mpi_naming_it_and_the_call(builder, says):
    """The builders and the methods of the classes they are (or declare) are checked against the contract's calls
    by validate and by the run before MPI, rather than failing on every client rank once training starts."""
    from mpifl.cli.preflight import check_plugins

    cfg = load_config(None, [f"strategy.name=plugin_scaffold:{builder}"], data=yaml.safe_load(CONFIG))
    with pytest.raises(ConfigError) as refused:
        check_plugins(cfg)
    assert str(refused.value) == (f"strategy.name: 'plugin_scaffold:{builder}', its client half "
                                  f"'plugin_scaffold:{builder.upper()}': {says}: too many positional arguments")


def test_a_client_half_whose_training_is_no_context_manager_ends_the_job_naming_it_the_client_and_the_round(tmp_path):
    named = "strategy: {name: 'plugin_scaffold:training_without_context',"
    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace("strategy: {name: scaffold,", named))
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1
    assert ("failed in round 1: the client half plugin_scaffold.TrainingWithoutContext, in training: TypeError: "
            "returned NoneType, not a context manager (decorate the method with @contextlib.contextmanager and "
            "yield inside it) (clients.accept_failures=false)") in result.stderr, result.stderr[-3000:]
