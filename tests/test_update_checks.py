"""Every update is checked for NaN and Inf before it travels: the fast check (a tensor's sum) must count exactly
what an element-by-element count does, including where finite values overflow their sum."""
from __future__ import annotations

import pytest
import torch

from mpifl.aggregation.kernels import count_nonfinite

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("values,expected", [
    ([1.0, -2.0, 3.0], 0),
    ([1.0, NAN, 3.0], 1),
    ([INF, 0.0, 0.0], 1),
    ([-INF, NAN, INF], 3),
    ([INF, -INF], 2),  # their sum is NaN, not a cancellation
], ids=["finite", "one-nan", "one-inf", "all-kinds", "inf-minus-inf"])
def test_the_count_is_exact_in_every_float_dtype(values, expected, dtype):
    chunks = [torch.tensor(values, dtype=dtype), torch.ones(5, dtype=dtype)]
    assert count_nonfinite(chunks) == expected


@pytest.mark.parametrize("dtype,big", [(torch.float32, 3e38), (torch.float16, 60000.0), (torch.bfloat16, 3e38)])
def test_finite_values_whose_sum_overflows_count_as_finite(dtype, big):
    chunk = torch.full((4,), big, dtype=dtype)
    assert not torch.isfinite(chunk.sum())  # the fast path's sum overflows ...
    assert count_nonfinite([chunk]) == 0  # ... and the exact count says there is nothing wrong


def test_a_large_update_split_in_chunks_is_counted_chunk_by_chunk():
    update = torch.randn(1_000_000)
    update[[7, 500_000, 999_999]] = torch.tensor([NAN, INF, -INF])
    assert count_nonfinite(update.split(65_536)) == 3


@pytest.mark.parametrize("chunk_mb", [4 / 2**20, 1.0])  # one element per chunk; the whole model in one
def test_a_delta_keeps_batchnorm_statistics_as_values_where_the_config_says(chunk_mb):
    """Config.statistics_as_values (the asynchronous modes): the parameters travel as trained - global, the
    running mean and variance as the trained values."""
    from torch import nn

    from mpifl.config import CompressionConfig, TransportConfig
    from mpifl.roles.encoding import UpdateEncoder
    from mpifl.wire.flat import FlatModel
    from mpifl.wire.layout import ExchangeLayout

    torch.manual_seed(0)
    flat = FlatModel(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    plan = ExchangeLayout.build(flat.spec, TransportConfig(chunk_mb=chunk_mb), CompressionConfig(), None, False)
    previous = flat.buffer.clone()
    flat.module.train()(torch.randn(8, 3))  # the running statistics move
    with torch.no_grad():
        for p in flat.module.parameters():
            p.add_(1.0)
    trained = {n: t.detach().clone() for n, t in flat.tensors()}
    before = {n: flat.view(e, previous).clone() for n, e in zip([e.name for e in flat.spec.entries], flat.spec.entries)}
    for as_values in (True, False):
        flat.buffer.copy_(previous)
        for name, t in flat.tensors():
            t.detach().copy_(trained[name])
        UpdateEncoder(flat, plan, delta=True, statistics_as_values=as_values).encode(previous)
        for entry in flat.spec.entries:
            got = flat.view(entry)
            if entry.statistic and as_values:
                assert torch.equal(got, trained[entry.name]), entry.name
            else:
                assert torch.equal(got, trained[entry.name] - before[entry.name]), entry.name
