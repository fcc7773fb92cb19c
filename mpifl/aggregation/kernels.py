"""Aggregation kernels: small pure functions over one chunk, in fp32, rounded once into the model's dtype.

Combining (McMahan et al. 2017, FedAvg): a weighted mean folded into an fp32 accumulator in
ascending client order (``acc = w0*x0``, then ``acc += w*x`` with torch's fused multiply-add,
one rounding, bitwise reproducible). Robust combining (Yin et al. 2018): the coordinate-wise
median or trimmed mean of a (participants, chunk) stack, its columns ordered by a sorting
network of whole-row minimum/maximum ufuncs over cache-sized tiles (bitwise numpy's sort).

Server steps turn the pseudo-gradient ``delta`` (fp32) into the step added to the global chunk,
in place: FedAvgM (Hsu et al. 2019) and FedAdam / FedYogi / FedAdagrad (Reddi et al. 2021,
Algorithm 2), with their moments in fp32 server-state vectors.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from mpifl.aggregation import native
from mpifl.aggregation.networks import Comparator, window_network

ACCUMULATOR_DTYPE = torch.float32  # accumulators, stacks and server-state vectors
SecondMoment = Callable[[torch.Tensor, torch.Tensor, float], None]


# -- combining participants' chunks -------------------------------------------------------------

def count_nonfinite(tensors: Iterable[torch.Tensor]) -> int:
    """NaN and Inf values in these tensors (integer tensors hold none).

    Every update is checked on its client and every new global chunk on the server, so the check must cost little:
    a tensor whose sum is finite holds no NaN or Inf (either one anywhere makes the sum NaN or Inf), and the sum is
    one read pass that allocates nothing. Only a tensor whose sum is not finite (a NaN or Inf, or finite values whose
    sum overflows) is counted element by element. On a 93 MB fp32 update in 4 MiB chunks on one core: 5 ms, against
    68 ms for counting every chunk (``profiling/client_slowdown.py`` found the count taking longer than the training).
    """
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors
               if t.is_floating_point() and not bool(torch.isfinite(t.sum())))


def fold(acc: torch.Tensor, x: torch.Tensor, weight: float, first: bool, scratch: torch.Tensor | None = None) -> None:
    """Acc = weight * x for the first term, else acc += weight * x fused (x may be bf16; acc is fp32).

    A narrower ``x`` is widened (exactly) into ``scratch`` first when one is given: torch's
    mixed-dtype ``add_`` runs about 3x slower than widening then adding in fp32 (same result).
    """
    if first and x.dtype == acc.dtype:
        torch.mul(x, weight, out=acc)
    elif first:  # torch.mul would compute a bf16 product: widen first (exact), then scale in fp32
        acc.copy_(x).mul_(weight)
    elif x.dtype != acc.dtype and scratch is not None:
        wide = scratch[:x.numel()]
        wide.copy_(x)
        acc.add_(wide, alpha=weight)
    else:
        acc.add_(x, alpha=weight)


def weighted_mean_into(out: torch.Tensor, acc: torch.Tensor, total_weight: float) -> None:
    """Out = acc / total_weight, computed in fp32 and rounded once to out's dtype; ``acc`` is spent.

    A narrower ``out`` gets the quotient computed in place in ``acc`` and then copied (rounded): torch's
    mixed-dtype ``div`` into a bf16 ``out`` runs about 6x slower, with the same result.
    """
    if out.dtype == acc.dtype:
        torch.div(acc, total_weight, out=out)
    else:
        out.copy_(acc.div_(total_weight))


def trimmed_count(participants: int, trim_fraction: float) -> int:
    """How many values a trimmed mean drops from each end: floor(beta * participants)."""
    return min(math.floor(trim_fraction * participants + 1e-9), (participants - 1) // 2)


def median_count(participants: int) -> int:
    """The median as a trimmed mean: drop (p-1)//2 values from each end, leaving the middle one or two."""
    return (participants - 1) // 2


def compare_exchange(rows: list[np.ndarray], network: tuple[Comparator, ...], spare: np.ndarray) -> np.ndarray:
    """Apply ``network`` to equal-length rows by whole-row minimum/maximum; ``rows[i]`` then names
    the row holding the i-th smallest values (where the network defines it). The minimum goes to
    ``spare`` and the freed row becomes the next spare (no copies); returns the last spare.

    Exact for any values that min/max order totally (int32 keys); on floats, NaN spreads and
    the order of -0.0 and +0.0 is arbitrary (see ``trimmed_mean_columns``).
    """
    for i, j, low, high in network:
        a, b = rows[i], rows[j]
        if low:
            np.minimum(a, b, out=spare)
        if high:
            np.maximum(a, b, out=b)
        if low:
            rows[i], spare = spare, a
    return spare


_SIGN_OFF, _NAN_SHIFT = np.int32(0x7FFFFFFF), np.int32(0x7FFFFF)


def order_keys(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """int32 keys of fp32 bit patterns, ordered as -inf < ... < -0.0 < +0.0 < ... < +inf < NaN.

    Negative floats have their magnitude bits flipped; the shift by 2^23 - 1 (wrapping) moves
    -inf to the bottom and wraps the sign-set NaNs above the others. A bijection: see ``key_bits``.
    """
    np.right_shift(bits, 31, out=out)
    np.bitwise_and(out, _SIGN_OFF, out=out)
    np.bitwise_xor(out, bits, out=out)
    return np.subtract(out, _NAN_SHIFT, out=out)


def key_bits(keys: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """Invert ``order_keys`` in place (keys become fp32 bit patterns); ``scratch`` is a same-size int32 row."""
    np.add(keys, _NAN_SHIFT, out=keys)
    np.right_shift(keys, 31, out=scratch)
    np.bitwise_and(scratch, _SIGN_OFF, out=scratch)
    return np.bitwise_xor(keys, scratch, out=keys)


def window_mean(window: list[np.ndarray], out: np.ndarray) -> np.ndarray:
    """Mean of sorted rows, summed in ascending order into ``out`` (one row needs no arithmetic:
    it is returned as is); the divide is exact scaling for two rows, as (a + b) * 0.5."""
    if len(window) == 1:
        return window[0]
    np.add(window[0], window[1], out=out)
    for row in window[2:]:
        np.add(out, row, out=out)
    return np.divide(out, np.float32(len(window)), out=out)


def tile_width(participants: int) -> int:
    """Columns per tile: a power of two in 4K..64K keeping the (participants + 2)-row tile within ~8 MiB
    of cache (64K columns for 8 participants, 16K for 64, 4K from 256 on; measured fastest)."""
    width = (1 << 21) // (participants + 2)
    return max(4096, min(65536, 1 << (width.bit_length() - 1)))


def column_spans(n: int, width: int, workers: int) -> list[tuple[int, int]]:
    """Split n columns into at most ``workers`` spans of whole ``width``-column tiles, as even as possible."""
    tiles = -(-n // width) if n else 0
    per, extra = divmod(tiles, max(1, min(workers, tiles))) if tiles else (0, 0)
    spans, start = [], 0
    for i in range(max(1, min(workers, tiles))):
        stop = min(n, start + (per + (i < extra)) * width)
        spans.append((start, stop))
        start = stop
    return spans


Rows = torch.Tensor | Sequence[torch.Tensor]  # a (p, n) stack, or p separate length-n rows


def trimmed_mean_columns(out: torch.Tensor, rows: Rows, k: int, scratch: torch.Tensor,
                         columns: slice = slice(None)) -> None:
    """Out = per column of the p rows, the mean of its sorted values k..p-k-1, summed in ascending
    order; the median is k = median_count(p). ``rows`` is a (p, n) stack or p separate rows of n
    values (any float dtype, widened exactly: the receive slots themselves), only read; ``columns``
    picks the span of them to do. ``out`` (the span's values, any float dtype, rounded once; it may
    be part of a row) is written tile by tile. ``scratch`` is a (p + 2, width) fp32 buffer: the
    columns go through in tiles of its width.

    Values are ordered -inf < ... < -0.0 < +0.0 < ... < +inf < NaN (NaN last, as numpy sorts).
    Each tile first runs ``window_network`` on floats. That is exact unless a NaN is present
    (min/max spread it to the result) or the result is a zero: the network may give a zero
    either sign, and that changes an ascending sum only when every summand is a zero.
    A tile with a zero or NaN result is redone on int32 ``order_keys``, a total order. So the
    result is bitwise that of numpy's sort wherever numpy's is a nonzero number; a zero takes
    the sign of the total order (numpy's order of -0.0 and +0.0 is its sort's accident); a
    NaN result is a NaN, its payload unspecified.
    """
    p = len(rows)
    first, n = _span(columns, rows[0].numel())
    if _native_columns(out, [rows[i] for i in range(p)], first, n, k, scratch):
        return  # the fused kernel: the same bits, faster
    network, width = window_network(p, k), max(1, scratch.shape[1])
    tile = scratch.numpy()
    sources = [_source(row) for row in rows]
    # a separate fp32 out takes the sum itself (no copy); part of a row must wait: a redo re-reads it
    direct = (out.dtype == torch.float32 and out.device.type == "cpu" and p - 2 * k > 1
              and not any(_shares(out, row) for row in rows))
    sums = out.numpy() if direct else None
    with np.errstate(all="ignore"):  # inf - inf and overflow are results here, as in torch
        for start in range(0, n, width):
            stop = min(n, start + width)
            t = tile[:, :stop - start]
            span = slice(first + start, first + stop)
            for i, source in enumerate(sources):
                _widen(t[i], source, span)
            ordered = list(t[:p])
            spare = compare_exchange(ordered, network, t[p])
            result = window_mean(ordered[k:p - k], sums[start:stop] if sums is not None else spare)  # set iff direct
            low = np.minimum.reduce(np.abs(result, out=t[p + 1]))
            if not low > 0:  # a zero (of either sign) or a NaN: redo this tile on total-order keys
                exact = _exact_tile(t, sources, span, network, k)
                if direct:
                    np.copyto(result, exact)
                else:
                    result = exact
            if not direct:
                out[start:stop].copy_(torch.from_numpy(result))


def _native_columns(out: torch.Tensor, rows: list[torch.Tensor], first: int, n: int, k: int,
                    scratch: torch.Tensor) -> bool:
    """``trimmed_mean_columns`` by the native kernel, if there is one for these rows (else False):
    straight into an fp32 ``out`` that is no other column's memory, else tile by tile through
    ``scratch``'s first row, rounded once into ``out``."""
    if out.dtype == torch.float32 and out.device.type == "cpu" and out.is_contiguous() and not any(
            _shares(out, row) and out.data_ptr() != row.data_ptr() + first * row.element_size() for row in rows):
        return native.trimmed_mean(out.numpy(), rows, first, k)
    width, tile = max(1, scratch.shape[1]), scratch[0].numpy()
    for start in range(0, n, width):
        stop = min(n, start + width)
        if not native.trimmed_mean(tile[:stop - start], rows, first + start, k):
            return False  # nothing written yet: a kernel is had for all tiles or none
        out[start:stop].copy_(torch.from_numpy(tile[:stop - start]))
    return True


def _span(columns: slice, n: int) -> tuple[int, int]:
    """(first column, how many) of ``columns`` within n."""
    start, stop, _ = columns.indices(n)
    return start, max(0, stop - start)


def _source(row: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A row to read tiles from: a numpy view of an fp32 row (np.copyto is cheapest), else the tensor."""
    return row.numpy() if row.dtype == torch.float32 and row.device.type == "cpu" else row


def _widen(into: np.ndarray, source: np.ndarray | torch.Tensor, span: slice) -> None:
    """Copy ``source[span]`` into the fp32 tile row ``into``, widening exactly (bf16, fp16 -> fp32)."""
    if isinstance(source, np.ndarray):
        np.copyto(into, source[span])
    else:
        torch.from_numpy(into).copy_(source[span])


def _shares(out: torch.Tensor, row: torch.Tensor) -> bool:
    return row.device.type == "cpu" and row.dtype == out.dtype and np.may_share_memory(out.numpy(), row.numpy())


def _exact_tile(t: np.ndarray, sources: list, span: slice, network: tuple[Comparator, ...], k: int) -> np.ndarray:
    """``trimmed_mean_columns`` for one tile on int32 keys: the network is exact, -0.0 < +0.0, NaN last."""
    p = len(sources)
    keys = t.view(np.int32)
    for i, source in enumerate(sources):  # each row is widened into the free row, then keyed into its own
        _widen(t[p], source, span)
        order_keys(keys[p], keys[i])
    ordered = list(keys[:p])
    spare = compare_exchange(ordered, network, keys[p])
    window = [key_bits(row, keys[p + 1]).view(np.float32) for row in ordered[k:p - k]]
    return window_mean(window, spare.view(np.float32))


# -- server optimizer steps: delta (fp32) becomes the step added to the global chunk ------------

def momentum_step(delta: torch.Tensor, state: dict[str, torch.Tensor], lr: float, beta: float) -> None:
    """FedAvgM (Hsu et al. 2019): v = beta*v + delta; step = lr*v."""
    v = state["velocity"]
    v.mul_(beta).add_(delta)
    torch.mul(v, lr, out=delta)


def first_moment(delta: torch.Tensor, m: torch.Tensor, beta1: float) -> None:
    """M = beta1*m + (1-beta1)*delta."""
    m.mul_(beta1).add_(delta, alpha=1 - beta1)


def adam_second_moment(d2: torch.Tensor, v: torch.Tensor, beta2: float) -> None:
    """FedAdam: v = beta2*v + (1-beta2)*delta^2."""
    v.mul_(beta2).add_(d2, alpha=1 - beta2)


def yogi_second_moment(d2: torch.Tensor, v: torch.Tensor, beta2: float) -> None:
    """FedYogi: v = v - (1-beta2)*delta^2*sign(v - delta^2)."""
    v.sub_(d2 * torch.sign(v - d2), alpha=1 - beta2)


def adagrad_second_moment(d2: torch.Tensor, v: torch.Tensor, beta2: float) -> None:
    """FedAdagrad: v = v + delta^2."""
    v.add_(d2)


def adaptive_step(delta: torch.Tensor, state: dict[str, torch.Tensor], second_moment: SecondMoment, lr: float,
                  beta1: float, beta2: float, tau: float) -> None:
    """Reddi et al. 2021, Algorithm 2: step = lr * m / (sqrt(v) + tau), v by ``second_moment``."""
    m, v = state["m"], state["v"]
    first_moment(delta, m, beta1)
    delta.mul_(delta)  # delta is no longer needed: reuse it for delta^2, then for the step
    second_moment(delta, v, beta2)
    torch.sqrt(v, out=delta)
    delta.add_(tau)
    torch.div(m, delta, out=delta)
    delta.mul_(lr)
