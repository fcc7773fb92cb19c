"""What a trained client's model becomes on its way out, step by step, in the manner of Flower's client mods:
encode (a delta, a narrowed dtype), check (NaN/Inf), protect (DP's clip and noise, secure aggregation's mask),
compress. None of the steps communicates; the client rank sends what comes out.

A reduction group's members skip the host steps when their update stays on the device for the group's sum
(``on_device``): only the delta and the check run there, and the group's sum is compressed, not its members.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from mpifl.aggregation.kernels import count_nonfinite
from mpifl.learning.device import DeviceReplica
from mpifl.learning.trainers import TrainResult
from mpifl.privacy.dp import ClientPrivacy
from mpifl.privacy.secagg import SecureAggregation
from mpifl.roles.encoding import UpdateCompressor, UpdateEncoder
from mpifl.wire import protocol
from mpifl.wire.flat import DTYPES, FlatModel
from mpifl.wire.layout import ExchangeLayout


class UpdatePipeline:
    """A client rank's update steps, configured once; ``begin_round`` gives each round's DP bound and cohort."""

    def __init__(self, encoder: UpdateEncoder, layout: ExchangeLayout, work: FlatModel, *,  # noqa: PLR0913 - keyword-only steps, each optional
                 replica: DeviceReplica | None, delta: bool, privacy: ClientPrivacy | None,
                 secagg: SecureAggregation | None, compressor: UpdateCompressor | None, grouped: bool,
                 weight: Callable[[protocol.UpdateMeta], float]):
        """``grouped``: updates are summed into a reduction group's partial sum on the rank (the sum is compressed,
        not its members); ``weight``: a participant's weight from its header (secure aggregation masks it in)."""
        self.encoder, self.layout, self.work, self.replica = encoder, layout, work, replica
        self.delta, self.privacy, self.secagg, self.compressor = delta, privacy, secagg, compressor
        self.grouped, self.weight = grouped, weight
        self.clip: float | None = None  # DP: this round's L2 bound
        self.cohort: tuple[int, ...] = ()  # secure aggregation: the round's participants

    def begin_round(self, clip: float | None, cohort: tuple[int, ...]) -> None:
        """The round's DP bound and secure-aggregation cohort, from its header."""
        self.clip, self.cohort = clip, cohort

    def on_device(self, check: bool) -> int:
        """The update stays on the device for the group's sum: make it a delta there; its NaN/Inf count."""
        if self.delta:
            assert self.replica is not None  # updates stay on the device only with a replica
            for c in self.layout.chunks:
                self.work.chunk_view(c).sub_(self.replica.global_view(c))
        return count_nonfinite(self.work.chunk_view(c) for c in self.layout.chunks) if check else 0

    def on_host(self, round_: int, client: int, keep: torch.Tensor | None, result: TrainResult, *,
                usable: bool, check: bool) -> tuple[list, int]:
        """Encode, check, protect and compress on the host (``keep``: the global model a delta is formed from;
        ``usable``: the client trained). Returns the wire buffers and the NaN/Inf count."""
        if self.replica is not None:
            self.replica.to_host()
        buffers = self.encoder.encode(keep)
        bad = self.encoder.count_nonfinite() if check else 0
        if usable and not bad:
            self._protect(buffers, round_, client, result)
        if self.compressor is not None and not self.grouped:  # a group's sum is compressed, not its members
            began = time.perf_counter()
            chunks = [torch.from_numpy(b).view(DTYPES[c.dtype]) for c, b in zip(self.layout.chunks, buffers)]
            buffers = self.compressor.compress(chunks, round_, client, self.clip if self.privacy else None,
                                               usable=usable and not bad)
            result.metrics["compress_seconds"] = time.perf_counter() - began
        return buffers, bad

    def _protect(self, buffers: list[np.ndarray], round_: int, client: int, result: TrainResult) -> None:
        """DP: clip (and, local DP, noise) the update; secure aggregation: mask it in fixed point. In place."""
        if self.privacy is None and self.secagg is None:
            return
        chunks = [torch.from_numpy(b).view(DTYPES[w.dtype]) for w, b in zip(self.encoder.wire, buffers)]
        if self.privacy is not None:
            assert self.clip is not None  # with DP every header carries the round's clip bound (roles.server)
            result.metrics.update(self.privacy.apply(chunks, self.layout.first_elements, self.clip, round_, client))
        if self.secagg is not None:
            # the header is not complete yet: the weight sees what the server's will (samples, steps, metrics)
            weight = self.weight(protocol.UpdateMeta(client, result.num_samples, 0.0, dict(result.metrics),
                                                     local_steps=result.local_steps))
            first = self.layout.first_elements
            result.metrics.update(self.secagg.mask(chunks, first, weight, self.cohort, round_, client))
