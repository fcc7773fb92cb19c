"""In process: every registered strategy, folded and finished chunk by chunk, equals the whole-model reference.

In the style of Flower's aggregate_test.py, but driven the way the streamed reduction drives a
strategy: reused (garbage-filled) accumulators, ascending participant order, one finish per chunk,
server state sliced per chunk and carried across rounds.
"""
from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch
from reference import (
    WHOLE_UPDATE_RULES,
    bulyan_coordinates,
    bulyan_selection,
    median,
    round_to,
    server_step,
    trimmed_mean,
    weighted_mean,
    whole_update_coefficients,
)

from mpifl.aggregation import registry
from mpifl.aggregation.combiners import Combiner, WeightedMean
from mpifl.aggregation.registry import STRATEGIES
from mpifl.aggregation.strategies import ACCUMULATOR_DTYPE, Strategy, make_strategy
from mpifl.aggregation.updates import Mixing, ServerUpdate
from mpifl.config import ConfigError, StrategyConfig, load_config
from mpifl.wire.protocol import UpdateMeta
from mpifl.wire.spec import Chunk, layout

BUILTIN = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "median", "trimmed_mean", "krum", "multi_krum",
           "bulyan", "geometric_median", "fednova",
           "scaffold", "feddyn")
# scaffold's and feddyn's servers are bound to a model and a federation (Strategy.bind), and need their clients'
# vectors: tests/test_mpi_scaffold.py and tests/test_mpi_feddyn.py check them on whole models
WHOLE_MODEL_RULES = tuple(n for n in BUILTIN if n not in ("scaffold", "feddyn"))
OPTIMIZERS = ("fedavgm", "fedadam", "fedyogi", "fedadagrad")
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NUMEL = 37
CHUNKS = (1, 5, 16, NUMEL)  # chunk sizes, in elements


def chunked_round(strategy: Strategy, glob: torch.Tensor, updates: list[torch.Tensor], samples: list[int],
                  chunk: int, state: dict[str, torch.Tensor]) -> None:
    """One round over ``glob`` in place, chunk by chunk, as the streamed reduction calls the strategy."""
    participants = len(updates)
    total = sum(strategy.weight(n) for n in samples)
    if strategy.whole_update:
        whole_update_round(strategy, glob, updates, samples, chunk, state)
        return
    for start in range(0, NUMEL, chunk):
        end = min(start + chunk, NUMEL)
        # reused memory sized for one more participant (say, one that failed): never read before written
        rows = strategy.accumulator_rows(participants + 1)
        acc = torch.full((rows, end - start), float("nan"), dtype=ACCUMULATOR_DTYPE)
        acc = acc if strategy.stacked else acc[0]
        for index, (x, n) in enumerate(zip(updates, samples)):
            strategy.fold(acc, x[start:end], strategy.weight(n), index)
        target = glob[start:end]
        if not strategy.needs_previous_global:
            target.fill_(float("nan"))  # the old chunk must not be read
        strategy.finish(acc, participants, total, target, {k: v[start:end] for k, v in state.items()})


def whole_update_round(strategy: Strategy, glob: torch.Tensor, updates: list[torch.Tensor], samples: list[int],
                       chunk: int, state: dict[str, torch.Tensor]) -> None:
    """One round of a whole-update rule (Krum, the geometric median) as the streamed reduction calls it: every chunk
    of every participant kept as it lands, the rule solved once all have, then each chunk finished."""
    combiner, spans = strategy.combiner, [(a, min(a + chunk, NUMEL)) for a in range(0, NUMEL, chunk)]
    combiner.begin(len(updates) + 1, NUMEL)  # room for one more participant (say, one that failed)
    for start, end in spans:
        for index, (x, n) in enumerate(zip(updates, samples)):
            combiner.keep(index, start, x[start:end], strategy.weight(n), 100 + index)
    combiner.solve(len(updates))
    for start, end in spans:
        strategy.finish(combiner.combined_chunk(start, end - start), len(updates), 1.0, glob[start:end],
                        {k: v[start:end] for k, v in state.items()})


def reference_round(cfg: StrategyConfig, old: np.ndarray, sent: list[tuple[float, np.ndarray]], state: dict,
                    dtype: str) -> np.ndarray:
    """tests/reference.py's whole-model rule for one tensor and one round (as in reference_run)."""
    if cfg.name == "median":
        combined = median(np.stack([u for _, u in sent]))
    elif cfg.name == "trimmed_mean":
        combined = trimmed_mean(np.stack([u for _, u in sent]), cfg.trim_fraction)
    elif cfg.name == "bulyan":
        chosen = bulyan_selection(cfg, [{"x": u} for _, u in sent])
        theta = max(1, len(sent) - 2 * cfg.byzantine_clients)
        combined = bulyan_coordinates([sent[i][1] for i in chosen], max(1, theta - 2 * cfg.byzantine_clients))
    elif cfg.name in WHOLE_UPDATE_RULES:
        coefficients = whole_update_coefficients(cfg, [w for w, _ in sent], [{"x": u} for _, u in sent])
        combined = sum((c * u.astype(np.float64) for c, (_, u) in zip(coefficients, sent) if c != 0.0),
                       np.zeros(old.shape)).astype(np.float32)
    else:
        combined = weighted_mean(sent)
    if cfg.name in OPTIMIZERS:
        delta = combined if cfg.update == "delta" else combined - old
        if not state:
            state.update(velocity=np.zeros_like(delta), m=np.zeros_like(delta),
                         v=np.full_like(delta, np.float32(cfg.tau) ** 2))
        new = server_step(cfg.name, delta, state, cfg) + old
    else:
        new = combined + old if cfg.update == "delta" else combined
    return round_to(new.astype(np.float32), dtype)


def run_both(cfg: StrategyConfig, dtype: str, wire: str, participants: int, chunk: int, seed: int, rounds: int = 2):
    """The chunked strategy and the reference over the same random updates: their final models (fp32)."""
    rng = np.random.default_rng(seed)
    strategy = make_strategy(cfg)
    want = round_to(rng.standard_normal(NUMEL).astype(np.float32), dtype)
    glob = torch.from_numpy(want.copy()).to(TORCH[dtype])
    state = {k: torch.full((NUMEL,), v, dtype=ACCUMULATOR_DTYPE) for k, v in strategy.state_init.items()}
    ref_state: dict = {}
    for _ in range(rounds):
        base = np.zeros_like(want) if cfg.update == "delta" else want
        xs = [round_to(round_to(base + 0.1 * rng.standard_normal(NUMEL).astype(np.float32), dtype), wire)
              for _ in range(participants)]
        samples = [int(n) for n in rng.integers(1, 100, participants)]
        weights = [float(n) if cfg.weighting == "samples" and not strategy.stacked else 1.0 for n in samples]
        chunked_round(strategy, glob, [torch.from_numpy(x).to(TORCH[wire]) for x in xs], samples, chunk, state)
        want = reference_round(cfg, want, list(zip(weights, xs)), ref_state, dtype)
    return glob.float().numpy(), want


@pytest.mark.parametrize("update", ["weights", "delta"])
@pytest.mark.parametrize("dtype,wire", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")])
@pytest.mark.parametrize("name", WHOLE_MODEL_RULES)
def test_chunked_strategy_matches_the_whole_model_reference(name, dtype, wire, update):
    for seed, (participants, chunk) in enumerate(itertools.product((3, 4, 5), CHUNKS)):
        weighting = ("samples", "equal")[seed % 2]  # CHUNKS has an even length: both for every count
        cfg = StrategyConfig(name=name, update=update, weighting=weighting, trim_fraction=0.25,
                             byzantine_clients=1 if name == "bulyan" else 0)  # Bulyan: theta = n - 2, beta = n - 4
        got, want = run_both(cfg, dtype, wire, participants, chunk, seed)
        where = f"{participants} participants, {weighting}, chunks of {chunk}"
        if name in OPTIMIZERS or name == "geometric_median":  # the tolerances of test_mpi_strategies.py (the
            # median: the reference's explicit distances against the Gram matrix's); bf16: a rounding step may flip
            np.testing.assert_allclose(got, want, rtol=2**-7 if dtype == "bfloat16" else 1e-5, atol=1e-6,
                                       err_msg=where)
        else:
            assert np.array_equal(got, want), f"{where}: max |diff| {np.abs(got - want).max()}"


# a parameter, a BatchNorm's running statistics, a parameter: 22 fp32 elements, statistics at 10..16
WITH_STATISTICS = layout([("w", (10,), "float32"), ("bn.running_mean", (3,), "float32"),
                          ("bn.running_var", (4,), "float32"), ("b", (5,), "float32")],
                         statistics={"bn.running_mean", "bn.running_var"})
STATISTICS = slice(10, 17)


def finish_in_chunks(strategy: Strategy, glob: torch.Tensor, xs: list[np.ndarray], weights: list[float],
                     state: dict[str, torch.Tensor], chunk: int, total: float | None = None) -> None:
    """One round of WITH_STATISTICS, chunk by chunk, each finish told its chunk (as the streamed reduction does);
    ``total``: the divisor, by default the weights' sum."""
    numel = glob.numel()
    for index, start in enumerate(range(0, numel, chunk)):
        end = min(start + chunk, numel)
        acc = torch.empty(end - start, dtype=ACCUMULATOR_DTYPE)
        for i, (x, w) in enumerate(zip(xs, weights)):
            strategy.fold(acc, torch.from_numpy(x[start:end]), w, i)
        where = Chunk(index, "float32", 4 * start, 4 * (end - start), 4)
        strategy.finish(acc, len(xs), sum(weights) if total is None else total, glob[start:end],
                        {k: v[start:end] for k, v in state.items()}, where)


@pytest.mark.parametrize("chunk", (3, 7, 22))
@pytest.mark.parametrize("update", ["weights", "delta"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_server_optimizer_steps_the_parameters_and_leaves_statistics_to_the_mean(name, update, chunk):
    """BatchNorm's running statistics are estimates, not weights: momentum or an adaptive step on them overshoots
    (FedAvgM drove a running variance below zero within two rounds), so they take the plain combined value."""
    cfg = StrategyConfig(name=name, update=update, server_lr=0.5)
    strategy = make_strategy(cfg)
    strategy.bind(WITH_STATISTICS, num_clients=10)
    rng = np.random.default_rng(0)
    want = rng.standard_normal(22).astype(np.float32)
    glob = torch.from_numpy(want.copy())
    state = {k: torch.full((22,), v, dtype=ACCUMULATOR_DTYPE) for k, v in strategy.state_init.items()}
    ref_state: dict = {}
    for _ in range(3):
        base = np.zeros_like(want) if update == "delta" else want
        xs = [base + 0.1 * rng.standard_normal(22).astype(np.float32) for _ in range(3)]
        weights = [float(w) for w in rng.integers(1, 100, 3)]
        finish_in_chunks(strategy, glob, xs, weights, state, chunk)
        mean = weighted_mean(list(zip(weights, xs)))
        plain = mean + want if update == "delta" else mean
        stepped = reference_round(cfg, want, list(zip(weights, xs)), ref_state, "float32")
        want = np.concatenate([stepped[:10], plain[STATISTICS], stepped[17:]])
        got = glob.numpy()
        assert np.array_equal(got[STATISTICS], want[STATISTICS])  # FedAvg's value, bit for bit
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all((v[STATISTICS] == strategy.state_init[k]).all() for k, v in state.items())  # no state moved there


def test_fedasync_mixes_statistics_like_the_parameters():
    """FedAsync's mixing, x = (1 - a) x + a x_client, is the aggregation itself, not a server optimizer: statistics
    take it too (added whole, a stale client's change would overshoot more)."""
    cfg = StrategyConfig(update="delta")
    mixing = Mixing(cfg)
    mixing.alpha = 0.3
    strategy = make_strategy(cfg).substituted(update=mixing)
    strategy.bind(WITH_STATISTICS, num_clients=10)
    rng = np.random.default_rng(2)
    glob = torch.from_numpy(rng.standard_normal(22).astype(np.float32))
    old = glob.clone()
    x = 0.1 * rng.standard_normal(22).astype(np.float32)
    finish_in_chunks(strategy, glob, [x], [1.0], {}, chunk=4)
    assert torch.allclose(glob, old + 0.3 * torch.from_numpy(x), rtol=0, atol=1e-7)  # statistics included


def test_asynchronously_statistics_arrive_as_values_and_take_their_weights_own_mean():
    """FedBuff: x + sum_i s_i delta_i / K for the parameters; the statistics, sent as values (a change measured from
    an older version would be added to a newer model), become sum_i s_i v_i / sum_i s_i, whatever x was."""
    strategy = make_strategy(StrategyConfig(update="delta"))
    strategy.bind(WITH_STATISTICS, num_clients=10)
    strategy.statistics_absolute = True
    strategy.round_statistics_total = 0.5 + 0.25  # what the reduction sets: the staleness weights' sum
    rng = np.random.default_rng(3)
    glob = torch.from_numpy(rng.standard_normal(22).astype(np.float32))
    old = glob.clone()
    updates = [rng.standard_normal(22).astype(np.float32) for _ in range(2)]  # deltas; values at STATISTICS
    finish_in_chunks(strategy, glob, updates, [0.5, 0.25], {}, chunk=5, total=2.0)  # FedBuff divides by K = 2
    values = (0.5 * updates[0] + 0.25 * updates[1]) / 0.75
    assert np.allclose(glob[STATISTICS].numpy(), values[STATISTICS], rtol=1e-6)
    params = old.numpy() + (0.5 * updates[0] + 0.25 * updates[1]) / 2
    assert np.allclose(glob[:10].numpy(), params[:10], rtol=1e-6) and np.allclose(glob[17:], params[17:], rtol=1e-6)


def test_feddyn_regularises_the_parameters_and_gives_statistics_the_mean_delta():
    strategy = make_strategy(StrategyConfig(name="feddyn", update="delta", weighting="equal", alpha=0.1))
    strategy.bind(WITH_STATISTICS, num_clients=6)
    rng = np.random.default_rng(1)
    glob = torch.from_numpy(rng.standard_normal(22).astype(np.float32))
    h = torch.zeros(22)
    for _ in range(3):
        old = glob.clone()
        xs = [0.1 * rng.standard_normal(22).astype(np.float32) for _ in range(3)]
        finish_in_chunks(strategy, glob, xs, [1.0] * 3, {"h": h}, chunk=5)
        mean = torch.from_numpy(weighted_mean([(1.0, x) for x in xs]))
        assert torch.equal(glob[STATISTICS], mean[STATISTICS] + old[STATISTICS])
        assert not torch.equal(glob[:10], mean[:10] + old[:10])  # h/alpha pulls the parameters
    assert not h[STATISTICS].any() and h[:10].any()


def test_fednova_scales_the_parameters_by_tau_eff_and_keeps_statistics_within_the_clients_values():
    """tau_eff * sum_i q_i / tau_i >= 1 extrapolates (3 with steps of 10 and 100): a running variance scaled so goes
    below zero. Statistics take the fold's own weights p_i / tau_i, normalised: a convex combination."""
    strategy = make_strategy(StrategyConfig(name="fednova", update="delta"))
    strategy.bind(WITH_STATISTICS, num_clients=10)
    metas = [UpdateMeta(client=c, num_samples=n, train_seconds=0.0, local_steps=tau)
             for c, (n, tau) in enumerate([(100, 10), (1000, 100)])]
    weights = [strategy.weight_of(m) for m in metas]
    total = strategy.total_weight(metas)
    strategy.round_statistics_total = strategy.statistics_total(metas)  # what the reduction keeps for the round
    glob = torch.ones(22)
    deltas = [np.full(22, -0.5, dtype=np.float32), np.full(22, -0.6, dtype=np.float32)]  # both clients: lower
    for index, start in enumerate(range(0, 22, 5)):
        end = min(start + 5, 22)
        acc = torch.empty(end - start, dtype=ACCUMULATOR_DTYPE)
        for i, (x, w) in enumerate(zip(deltas, weights)):
            strategy.fold(acc, torch.from_numpy(x[start:end]), w, i)
        strategy.finish(acc, 2, total, glob[start:end], {}, Chunk(index, "float32", 4 * start, 4 * (end - start), 4))
    assert (glob[STATISTICS] >= 1 - 0.6).all() and (glob[STATISTICS] <= 1 - 0.5).all()  # within the clients'
    assert (glob[:10] < 1 - 0.6).all()  # the parameters: tau_eff's scaling, past either client's own step


def test_the_registry_lists_exactly_the_builtin_names_and_their_stages_resolve():
    assert registry.STRATEGIES == STRATEGIES == BUILTIN
    for name in BUILTIN:
        combiner, update = registry.stages(name)
        assert issubclass(combiner, Combiner) and issubclass(update, ServerUpdate), name


@pytest.mark.parametrize("name,stacked,state,state_bytes", [
    ("fedavg", False, {}, 0), ("fedavgm", False, {"velocity": 0.0}, 4),
    ("fedadam", False, {"m": 0.0, "v": 1e-6}, 8), ("fedyogi", False, {"m": 0.0, "v": 1e-6}, 8),
    ("fedadagrad", False, {"m": 0.0, "v": 1e-6}, 8), ("median", True, {}, 0), ("trimmed_mean", True, {}, 0),
    ("fednova", False, {}, 0), ("krum", False, {}, 0), ("multi_krum", False, {}, 0), ("bulyan", False, {}, 0),
    ("geometric_median", False, {}, 0),
])
def test_each_strategy_declares_its_stack_state_and_weights(name, stacked, state, state_bytes):
    s = make_strategy(StrategyConfig(name=name, update="weights"))
    assert (s.name, s.stacked, s.delta) == (name, stacked, False)
    assert s.state_init.keys() == state.keys() and all(s.state_init[k] == pytest.approx(v) for k, v in state.items())
    assert s.needs_previous_global == bool(state)  # server optimizers form delta = combined - old global
    deltas = make_strategy(StrategyConfig(name=name, update="delta"))
    assert deltas.delta and deltas.needs_previous_global  # new = old global + combined deltas
    assert s.state_bytes(1000) == 1000 * state_bytes
    assert s.accumulator_rows(6) == (6 if stacked else 1)
    assert s.weight(7) == (1.0 if stacked else 7.0)
    assert make_strategy(StrategyConfig(name=name, weighting="equal")).weight(7) == 1.0


class HalfStep(ServerUpdate):
    """A user's server update: move half way from the old global to the mean."""

    reads_previous = True

    def step(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        delta.mul_(0.5)


def half_step(cfg: StrategyConfig) -> Strategy:
    return Strategy(cfg, WeightedMean(cfg), HalfStep(cfg))


class HalfStepStrategy(Strategy):
    def __init__(self, cfg: StrategyConfig) -> None:
        super().__init__(cfg, WeightedMean(cfg), HalfStep(cfg))


def not_a_strategy(cfg: StrategyConfig) -> str:
    return "fedavg"


@pytest.mark.parametrize("attr", ["half_step", "HalfStepStrategy"])
def test_an_import_path_strategy_validates_and_runs(attr):
    cfg = load_config(None, [f"strategy.name={__name__}:{attr}", "strategy.weighting=equal"]).strategy
    strategy = make_strategy(cfg)
    assert isinstance(strategy, Strategy) and strategy.name == f"{__name__}:{attr}"
    old = np.linspace(-1, 1, NUMEL, dtype=np.float32)
    xs = [old + np.float32(i) for i in (1, 2, 6)]
    glob = torch.from_numpy(old.copy())
    chunked_round(strategy, glob, [torch.from_numpy(x) for x in xs], [10, 20, 30], 5, {})
    np.testing.assert_allclose(glob.numpy(), old + 1.5, rtol=1e-6)


def test_an_unknown_or_broken_strategy_is_a_config_error_naming_the_key_and_the_choices():
    allowed = ", ".join(map(repr, BUILTIN))
    with pytest.raises(ConfigError, match=r"strategy\.name: 'zeno' is not allowed; choose one of (.*)") as err:
        load_config(None, ["strategy.name=zeno"])
    assert allowed in str(err.value) and "import path" in str(err.value)
    with pytest.raises(ConfigError, match=r"strategy\.name: 'zeno' is not allowed") as err:
        make_strategy(StrategyConfig(name="zeno"))
    assert allowed in str(err.value)
    with pytest.raises(ConfigError, match=r"strategy\.name: cannot import module 'no_such_module'"):
        make_strategy(StrategyConfig(name="no_such_module:build"))
    with pytest.raises(ConfigError, match=r"strategy\.name: .* returned str, not a"):
        make_strategy(StrategyConfig(name=f"{__name__}:not_a_strategy"))


def test_the_config_lists_strategy_names_without_importing_torch():
    code = ("import sys, mpifl.config.sections as s; assert 'torch' not in sys.modules; "
            "print(s.STRATEGIES)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and "trimmed_mean" in out.stdout, out.stderr
