"""What a client rank sends: its update encoded for the wire, a reduction group's partial sum, or a
compressed update. Each fills the buffers the transport sends from; none of them communicates."""
from __future__ import annotations

import numpy as np
import torch

from mpifl.aggregation.kernels import count_nonfinite, fold
from mpifl.aggregation.strategies import parameter_spans, section_span, statistic_ranges
from mpifl.planning.seeds import COMPRESSION
from mpifl.privacy.noise import BLOCK, ElementStream
from mpifl.storage.residuals import ResidualStore
from mpifl.wire.codecs import TopK
from mpifl.wire.flat import DTYPES, FlatModel
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import host_bytes
from mpifl.wire.spec import element_offsets, fp32_chunks


class GroupSum:
    """A reduction group's fp32 partial sum on its rank: its members' weighted updates, in ascending id.

    The same fused fold as the server's (``acc = w0*x0``, then ``acc += w*x``), so a group's sum
    is what the server would have folded from the same updates in the same order. The sum lives
    where ``source`` trains (a device replica's device); ``buffers`` are the host bytes it is
    sent from, filled by one copy per group.
    """

    def __init__(self, source: FlatModel, plan: ExchangeLayout, separate: bool = False):
        self.source, self.chunks, self.separate = source, plan.chunks, separate
        self.layout = plan.wire if plan.codec is None else fp32_chunks(plan.chunks)  # compressed: quantized after
        self._use(host_bytes(self.layout[-1].offset + self.layout[-1].nbytes))
        if separate:
            self.sums = [torch.empty_like(h, device=source.device) for h in self.host_sums]
        self.scratch: torch.Tensor | None = None
        self.count = 0

    def _use(self, buffer: np.ndarray) -> None:
        """Keep the sum's host bytes in ``buffer``: the sum itself, or (``separate``) its copy from the device."""
        self.buffer = buffer
        self.buffers = [buffer[w.offset:w.offset + w.nbytes] for w in self.layout]
        self.host_sums = [torch.from_numpy(b).view(torch.float32) for b in self.buffers]
        if not self.separate:
            self.sums = self.host_sums

    def reset(self) -> None:
        """Start a new group."""
        self.count = 0

    def add(self, weight: float) -> None:
        """Fold the update now in ``source``'s flat buffer, with ``weight``."""
        for c, acc in zip(self.chunks, self.sums):
            x = self.source.chunk_view(c)
            fold(acc, x, weight, self.count == 0, self._scratch(x, acc) if x.dtype != acc.dtype else None)
        self.count += 1

    def _scratch(self, x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """A reused fp32 buffer to widen narrow chunks into (the fast fold)."""
        if self.scratch is None or self.scratch.numel() < x.numel():
            self.scratch = torch.empty(x.numel(), dtype=acc.dtype, device=acc.device)
        return self.scratch

    def hand_over(self, spare: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """The finished sum on the host, handed over without a copy: its bytes, and the same bytes by chunk as
        ``to_host`` gives them. The next group's sum forms in ``spare``, host bytes of ``len(buffer)``: so the
        chain reduction keeps a rank's earlier groups' sums while the next one forms."""
        handed = self.buffer, self.to_host()
        self._use(spare)
        return handed

    def to_host(self) -> list:
        """The sum's bytes on the host, ready to send (one device-to-host copy when it lives on a device)."""
        for acc, host in zip(self.sums, self.host_sums):
            if acc is not host:
                host.copy_(acc)
        return self.buffers


class UpdateCompressor:
    """Compresses a client's fp32 update into its own wire buffer (``compression.method``).

    Quantization noise is addressed by model element and keyed by (seed, round, client):
    reproducible on any ranks. With ``residuals`` (top-k with error feedback, after Stich et al.
    2018 and Karimireddy et al. 2019) a client sends the top-k of its delta plus its residual and
    keeps the rest: ``c = delta + e``, send ``s = topk(c)``, then ``e = c - s`` (``s`` after any DP
    rescaling), chunk by chunk. So the sum of what a client sent plus its residual equals the sum
    of its deltas, up to the fp32 rounding of each ``delta + e``.
    """

    def __init__(self, plan: ExchangeLayout, seed: int, residuals: ResidualStore | None = None,
                 whole: bool = True):
        """``whole``: a wire buffer for the whole compressed update (``compress``); a sharded client's leader, which
        encodes one chunk at a time into its own ring (``encode_chunk``), has none."""
        self.codec, self.seed, self.chunks = plan.codec, seed, plan.chunks
        self.residuals = residuals
        self.buffer = host_bytes(plan.wire_buffer_bytes if whole else 0)
        self.buffers = [self.buffer[w.offset:w.offset + w.nbytes] for w in plan.wire] if whole else []
        self.firsts = element_offsets(plan.chunks)

    def stream(self, round_: int, client: int, key: int = COMPRESSION) -> ElementStream | None:
        """The quantization noise of ``client``'s update in ``round_``, addressed by element (None for a codec that
        takes none)."""
        assert self.codec is not None  # a compressor is made only for a layout with a codec
        return ElementStream(self.seed, key, round_, client, draw=lambda g: torch.rand(BLOCK, generator=g)) \
            if self.codec.stochastic else None

    def encode_chunk(self, index: int, x: torch.Tensor, stream: ElementStream | None, out: np.ndarray) -> float:
        """Chunk ``index`` of an update (``x``, fp32) encoded into ``out``, with its elements' noise from
        ``stream``; the squared L2 norm of what was encoded. A sharded client's leader encodes each chunk it has
        gathered this way, one at a time."""
        assert self.codec is not None  # a compressor is made only for a layout with a codec
        uniform = torch.cat([v for _, v in stream.pieces(self.firsts[index], x.numel())]) if stream else None
        # uniform is None only for a codec that takes no noise (top-k): mypy cannot tie it to .stochastic
        return self.codec.encode(x, out, uniform)  # type: ignore[arg-type]

    def compress(self, chunks: list[torch.Tensor], round_: int, client: int, bound: float | None,
                 usable: bool = True, key: int = COMPRESSION) -> list[np.ndarray]:
        """The encoded update; with ``bound`` (DP), values shrink so the decoded update stays within it.
        An update the server will not use (``usable`` false) leaves the client's residual as it was.
        ``key`` keeps the noise of different kinds of streams apart (a group's sum: GROUP_COMPRESSION)."""
        codec, residuals = self.codec, self.residuals
        assert codec is not None  # a compressor is made only for a layout with a codec
        feedback = residuals is not None and usable
        stream = self.stream(round_, client, key)
        squared = 0.0
        for i, (x, out) in enumerate(zip(chunks, self.buffers)):
            if not feedback:
                squared += self.encode_chunk(i, x.float(), stream, out)
                continue
            assert residuals is not None and isinstance(codec, TopK)  # residuals exist for top-k only (runner)
            corrected = residuals.read(client, i).add_(x)
            squared += codec.encode(corrected, out)
            if bound is None:  # what was sent is final: keep the rest
                codec.subtract(out, x.numel(), corrected)
            residuals.write(client, i, corrected)
        if bound is not None and squared > bound ** 2:
            for c, out in zip(self.chunks, self.buffers):
                codec.rescale(out, c.numel, bound / squared ** 0.5)
        if feedback and bound is not None:  # what was sent is known only now: keep the rest
            assert residuals is not None and isinstance(codec, TopK)  # residuals exist for top-k only (runner)
            for i, (c, out) in enumerate(zip(self.chunks, self.buffers)):
                residual = residuals.read(client, i)
                codec.subtract(out, c.numel, residual)
                residuals.write(client, i, residual)
        return self.buffers


class UpdateEncoder:
    """Turns the trained model into what a client sends: its weights or its delta, in the wire dtype.

    Weights in the model's dtype go straight from the flat buffer (zero copy); a delta is
    formed in place in the flat buffer; a narrower wire dtype adds one wire buffer
    (half the model's float32 bytes for bf16).
    """

    def __init__(self, flat: FlatModel, plan: ExchangeLayout, delta: bool, statistics_as_values: bool = False):
        self.flat, self.chunks, self.delta = flat, plan.chunks, delta
        # Config.statistics_as_values: each chunk's statistics (element spans) stay values in a delta
        ranges = statistic_ranges(plan.spec) if delta and statistics_as_values else ()
        self.values = [[(lo, hi) for lo, hi in (section_span(c, *r) for r in ranges) if lo < hi] for c in self.chunks]
        self.narrowed = plan.narrowed and not plan.grouped  # group sums are folded from the flat buffer
        self.wire = plan.wire if self.narrowed else plan.chunks
        if self.narrowed:
            self.wire_bytes = host_bytes(plan.wire_buffer_bytes)
            self.buffers = [self.wire_bytes[w.offset:w.offset + w.nbytes] for w in plan.wire]
        else:
            assert flat.bytes is not None  # updates leave from the host model, whose bytes are numpy
            self.buffers = plan.chunk_slices(flat.bytes)

    def encode(self, previous: torch.Tensor | None) -> list[np.ndarray]:
        """Fill and return the outgoing chunk buffers; ``previous`` is the global model's bytes (delta mode)."""
        for c, w, buf, values in zip(self.chunks, self.wire, self.buffers, self.values):
            x = self.flat.chunk_view(c)
            if self.delta:
                assert previous is not None  # delta mode always passes the global model
                old = previous[c.offset:c.offset + c.nbytes].view(x.dtype)
                for lo, hi in parameter_spans(values, x.numel()):  # the whole chunk where no statistic stays a value
                    x[lo:hi].sub_(old[lo:hi])
            if self.narrowed:
                torch.from_numpy(buf).view(DTYPES[w.dtype]).copy_(x)
        return self.buffers

    def count_nonfinite(self) -> int:
        """NaN and Inf values in what is about to be sent (after any narrowing)."""
        return count_nonfinite(torch.from_numpy(buf).view(DTYPES[w.dtype]) for w, buf in zip(self.wire, self.buffers))
