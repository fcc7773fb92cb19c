"""The robust kernels (sorting network, order keys, tiled trimmed mean / median) against numpy's sort.

The rule (kernels.trimmed_mean_columns): values are ordered -inf < ... < -0.0 < +0.0 < ... < +inf
< NaN. Wherever numpy's np.sort result is a nonzero number the kernel's is bitwise equal; where
numpy's is a zero, numpy's sign depends on how its sort happened to place -0.0 and +0.0, so the
kernel is compared bitwise with a total-order sort instead; a NaN result is a NaN (any payload).
"""
from __future__ import annotations

import itertools
import os
import shutil

import numpy as np
import pytest
import torch
from reference import median, round_to, trimmed_mean

from mpifl.aggregation import kernels, native, networks

BETAS = (0.0, 0.1, 0.25, 0.49)
NATIVE_PARTICIPANTS = (1, 2, 3, 5, 6, 8, 9, 16, 33)  # the counts the C kernels are built for here


@pytest.fixture(autouse=True, params=["native", "numpy"])
def kernel_path(request, monkeypatch):
    """Every test runs twice: on the fused C kernel (built here; a machine with a C compiler must
    build it) and on the numpy network. Both must give the same bits."""
    params = getattr(request.node, "callspec", None)
    if request.param == "native" and params and params.params.get("p", 8) not in NATIVE_PARTICIPANTS:
        pytest.skip("the C kernel is compiled per participant count: a sample of counts is enough")
    if request.param == "numpy":
        monkeypatch.setattr(native, "trimmed_mean", lambda *args: False)
    elif native.kernel(8, 3, torch.float32) is None:
        assert shutil.which(os.environ.get("CC", "cc")) is None, "a C compiler is here but the kernel did not build"
        pytest.skip("no C compiler: the numpy network alone")
    return request.param


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.int32)


def total_order_sort(stack: np.ndarray) -> np.ndarray:
    """Columns sorted with -0.0 before +0.0 and every NaN last (an independent lexsort)."""
    nan = np.isnan(stack)
    order = np.lexsort((~np.signbit(stack), np.where(nan, 0, stack), nan), axis=0)
    return np.take_along_axis(stack, order, axis=0)


def window_mean_reference(s: np.ndarray, k: int) -> np.ndarray:
    """tests/reference.py's median (k = (p-1)//2) and trimmed mean formulas on sorted columns."""
    p = len(s)
    if k == kernels.median_count(p):
        return s[p // 2] if p % 2 else (s[p // 2 - 1] + s[p // 2]) * np.float32(0.5)
    acc = s[k].copy()
    for row in s[k + 1:p - k]:
        acc += row
    return acc / np.float32(p - 2 * k)


def assert_numpy_rule(got: np.ndarray, stack: np.ndarray, k: int, numpy_result: np.ndarray, where: str) -> None:
    """got is bitwise numpy's result where that is a nonzero number, the total-order result everywhere
    (zeros included), and NaN exactly where numpy's result is NaN."""
    with np.errstate(invalid="ignore", over="ignore"):
        exact = window_mean_reference(total_order_sort(stack), k)
    nan = np.isnan(numpy_result)
    assert np.array_equal(np.isnan(got), nan), where
    assert np.array_equal(np.isnan(exact), nan), where
    assert np.array_equal(bits(got)[~nan], bits(exact)[~nan]), where
    nonzero = ~nan & (numpy_result != 0)
    assert np.array_equal(bits(got)[nonzero], bits(numpy_result)[nonzero]), where


def stack_of(kind: str, p: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """(p, n) fp32 test values: plain normals, heavy ties, or ties among specials (signed zeros, infinities, NaNs)."""
    if kind == "normal":
        return rng.standard_normal((p, n)).astype(np.float32)
    if kind == "ties":
        return rng.integers(-3, 4, (p, n)).astype(np.float32)
    neg_nan = np.array([0xFFC00000, 0xFF800001, 0x7F800001], dtype=np.uint32).view(np.float32)
    pool = np.concatenate([np.array([-0.0, 0.0, 0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 2.5,
                                     1e-45, -1e-45, 3.4e38, -3.4e38], dtype=np.float32), neg_nan])
    stack = rng.choice(pool, (p, n))
    if kind == "zeros":  # columns of signed zeros only, and zeros with a few numbers
        stack = rng.choice(np.array([-0.0, 0.0, 1.0], dtype=np.float32), (p, n), p=[0.45, 0.45, 0.1])
    return stack


def run_kernel(stack: np.ndarray, k: int, width: int, out_dtype=torch.float32) -> torch.Tensor:
    rows = torch.from_numpy(stack.copy())
    out = torch.full((stack.shape[1],), float("nan"), dtype=out_dtype)
    kernels.trimmed_mean_columns(out, rows, k, torch.empty(stack.shape[0] + 2, width))
    assert np.array_equal(bits(rows.numpy()), bits(stack)), "rows are only read"
    return out


@pytest.mark.parametrize("p", range(1, 17))
def test_the_sorting_network_sorts_every_zero_one_column_and_the_window_networks_select(p):
    columns = np.array(list(itertools.product((0, 1), repeat=p)), dtype=np.int8).T  # the 0-1 principle
    want = np.sort(columns, axis=0)
    for k in range(kernels.median_count(p) + 1):
        network = networks.window_network(p, k)
        rows = list(columns.copy())
        kernels.compare_exchange(rows, network, np.empty_like(columns[0]))
        got = np.stack(rows[k:p - k])
        if p - 2 * k == 2:  # a two-value window is summed in either order
            got = np.sort(got, axis=0)
        assert np.array_equal(got, want[k:p - k]), (p, k)
    known = {1: 0, 2: 1, 3: 3, 4: 5, 8: 19, 16: 63}  # Batcher's counts (19 is optimal for 8)
    assert len(networks.sorting_network(p)) == known.get(p, len(networks.sorting_network(p)))


def test_the_median_of_8_takes_26_minimum_or_maximum_and_a_full_sort_38():
    assert sum(low + high for _, _, low, high in networks.window_network(8, 3)) == 26
    assert sum(low + high for _, _, low, high in networks.window_network(8, 0)) == 38


def test_order_keys_are_a_total_order_with_nan_last_and_invert_exactly():
    rng = np.random.default_rng(0)
    special = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                        0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x00000001, 0x80000001, 0x7F7FFFFF, 0xFF7FFFFF,
                        0x3F800000, 0xBF800000], dtype=np.uint32)
    patterns = np.concatenate([special, rng.integers(0, 2**32, 100_000, dtype=np.uint32)]).view(np.int32)
    keys = kernels.order_keys(patterns, np.empty_like(patterns))
    assert len(np.unique(keys)) == len(np.unique(patterns))  # a bijection
    back = kernels.key_bits(keys.copy(), np.empty_like(keys))
    assert np.array_equal(back, patterns)
    ordered = patterns[np.argsort(keys, kind="stable")].view(np.float32)
    nan = np.isnan(ordered)
    assert not nan[:np.argmax(nan)].any() and nan[np.argmax(nan):].all()  # every NaN last, whatever its sign
    numbers = ordered[~nan]
    assert np.all(numbers[:-1] <= numbers[1:])
    zeros = np.signbit(numbers[numbers == 0])
    assert zeros.tolist() == sorted(zeros.tolist(), reverse=True)  # -0.0 before +0.0


@pytest.mark.parametrize("p", range(1, 41))
def test_median_and_trimmed_mean_match_numpy_sort_bitwise(p):
    rng = np.random.default_rng(p)
    for kind in ("normal", "ties", "specials", "zeros"):
        n = int(rng.integers(1, 90))
        width = int(rng.choice([1, 3, 16, 64, n])) if p <= 12 else int(rng.choice([16, 64, n]))
        stack = stack_of(kind, p, n, rng)
        with np.errstate(invalid="ignore", over="ignore"):
            cases = [(kernels.median_count(p), median(stack), "median")]
            cases += [(kernels.trimmed_count(p, b), trimmed_mean(stack, b), f"trimmed beta={b}") for b in BETAS]
        for k, numpy_result, name in cases:
            got = run_kernel(stack, k, width).numpy()
            assert_numpy_rule(got, stack, k, numpy_result, f"{name}, p={p}, n={n}, tile={width}, {kind}")


@pytest.mark.parametrize("p", [2, 5, 8])
def test_the_result_may_overwrite_row_0_and_is_rounded_once_into_a_narrower_out(p):
    rng = np.random.default_rng(p)
    stack = stack_of("normal", p, 300, rng)
    k = kernels.median_count(p)
    want = run_kernel(stack, k, 64).numpy()
    rows = torch.from_numpy(stack.copy())
    kernels.trimmed_mean_columns(rows[0], rows, k, torch.empty(p + 2, 64))
    assert np.array_equal(bits(rows[0].numpy()), bits(want))
    narrow = run_kernel(stack, k, 64, torch.bfloat16).float().numpy()
    assert np.array_equal(bits(narrow), bits(round_to(want, "bfloat16")))


def test_tile_widths_are_powers_of_two_and_bounded():
    assert [kernels.tile_width(p) for p in (1, 8, 64, 128, 512, 4096)] == [65536, 65536, 16384, 8192, 4096, 4096]



@pytest.mark.parametrize("name", ["median", "trimmed_mean"])
def test_the_combiner_writes_the_statistic_into_row_0_or_into_out_across_tiles(name):
    from mpifl.aggregation.strategies import make_strategy
    from mpifl.config import StrategyConfig
    rng = np.random.default_rng(1)
    p, n = 8, 3 * kernels.tile_width(8) + 123  # four tiles, the last one short
    stack = np.where(rng.random((p, n)) < 0.01, np.float32(0.0), rng.standard_normal((p, n)).astype(np.float32))
    combiner = make_strategy(StrategyConfig(name=name)).combiner
    acc = torch.full((p + 1, n), float("nan"))  # one spare row, as for a participant that failed
    acc[:p] = torch.from_numpy(stack)
    into = torch.empty(n)
    combiner.combine_into(into, acc, p, float(p))
    combined = combiner.combine(acc, p, float(p))
    k = kernels.median_count(p) if name == "median" else kernels.trimmed_count(p, 0.1)
    want = window_mean_reference(total_order_sort(stack), k)
    assert combined.data_ptr() == acc.data_ptr()
    for got in (into, combined):
        assert np.array_equal(bits(got.numpy()), bits(want))


@pytest.mark.parametrize("name,trim", [("median", 0.1), ("trimmed_mean", 0.2)])
def test_worker_threads_split_the_columns_without_changing_a_bit(name, trim):
    from mpifl.aggregation.combiners import Median, TrimmedMean
    from mpifl.config import StrategyConfig

    combiner = (Median if name == "median" else TrimmedMean)(StrategyConfig(name=name, trim_fraction=trim))
    p = 8
    n = 3 * kernels.tile_width(p) + 5  # several tiles, so several spans
    rows = torch.from_numpy(np.random.default_rng(3).standard_normal((p, n)).astype(np.float32))
    rows[:, 7] = 0.0  # a zero column: redone on exact keys inside a span
    single = torch.empty(n)
    kernels.trimmed_mean_columns(single, rows, combiner.trimmed(p), torch.empty(p + 2, kernels.tile_width(p)))
    combiner.workers = None
    threaded = torch.empty(n)
    combiner.combine_into(threaded, rows.clone(), p, 1.0)
    assert len(combiner._workers()) >= 1
    assert torch.equal(threaded.view(torch.int32), single.view(torch.int32))
    in_place = rows.clone()  # combine() writes into row 0 of the very stack it reads
    assert torch.equal(combiner.combine(in_place, p, 1.0).view(torch.int32), single.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_separate_rows_in_the_wire_dtype_give_the_stacks_bits(dtype):
    """The receive slots themselves as the rows (no stacking copy): each row widened tile by tile,
    zeros redone on exact keys, the same bits as the fp32 stack, by combine_into and combine."""
    from mpifl.aggregation.combiners import Median
    from mpifl.config import StrategyConfig

    combiner, p = Median(StrategyConfig(name="median")), 6
    n = 2 * kernels.tile_width(p) + 77
    rows = [torch.from_numpy(np.random.default_rng(i).standard_normal(n).astype(np.float32)).to(dtype)
            for i in range(p)]
    for row in rows:
        row[11] = 0.0  # a zero column
    stack = torch.stack([row.float() for row in rows])
    want = torch.empty(n)
    kernels.trimmed_mean_columns(want, stack, combiner.trimmed(p), torch.empty(p + 2, kernels.tile_width(p)))
    into = torch.empty(n)
    combiner.combine_into(into, rows, p, float(p))
    combined = combiner.combine(rows, p, float(p))
    assert all(combined.data_ptr() != row.data_ptr() for row in rows), "the slots are only read"
    for got in (into, combined):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_without_a_compiler_the_numpy_network_runs_and_says_so_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MPIFL_CACHE_DIR", str(tmp_path / "cache"))
    native.kernel.cache_clear()
    native._warn_once.cache_clear()
    try:
        stack = stack_of("normal", 7, 100, np.random.default_rng(0))
        with caplog.at_level("WARNING", logger=native.__name__):
            got = run_kernel(stack, 3, 64).numpy()
            run_kernel(stack, 2, 64)
        assert np.array_equal(bits(got), bits(median(stack)))
        assert native.kernel(7, 3, torch.float32) is None
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "no-such-cc" in caplog.records[0].message and "MPIFL_NATIVE=0" in caplog.records[0].message
        assert os.listdir(tmp_path / "cache") == []  # a failed build leaves nothing behind
        monkeypatch.setenv("MPIFL_NATIVE", "0")
        native.kernel.cache_clear()
        assert native.kernel(7, 3, torch.float32) is None
    finally:
        native.kernel.cache_clear()


def test_the_generated_kernel_is_the_window_network_unrolled():
    source = native.kernel_source(8, 3, networks.window_network(8, 3))
    assert source.count(" ? ") == 2 * 26  # 26 minimum/maximum (one ternary each), fp32 and bf16 rows
    assert source.count("out[c] = (float_of(v3) + float_of(v4)) / 2.0f;") == 2  # the middle two, in order
