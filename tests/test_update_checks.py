"""Every update is checked for NaN and Inf before it travels: the fast check (a tensor's sum) must count exactly
what an element-by-element count does, including where finite values overflow their sum."""
from __future__ import annotations

import pytest
import torch

from mpifl.roles.encoding import count_nonfinite

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
