"""A client rank's side of the config's ``faults:``: each strike (mpifl.planning.faults) done where it belongs.

Stages: ``receive`` before the rank takes up a round's model (once per round, for any of its clients struck),
``train`` before a client trains (raise, stall, exit, kill; label_flip, on its training data) or on its trained model
and update (nan, inf, scale, noise, slowdown, corrupt), ``send`` after the first chunk of the client's update, or,
for ``lose``, as the update leaves.

A lost update: MPI never loses a message, so the loss is the outcome a lost message has. The client trains, its
update is marked lost in its header and never folded (the rank still streams its chunks, which the server
discards as it does a failed client's), and the client ends the round as if it had not been sampled.

A strike that stops, stalls or ends the rank is logged here as it happens; the server logs every strike at the
start of its round and records each with what came of it (metrics.jsonl, ``faults``).

Under a virtual clock a stall or a slowdown is not done here at all: the clock has already lengthened the struck
task's virtual duration (mpifl.planning.faults, ``delays_virtually``), and a rank that slept would only meet the
wall-clock deadlines, making the run depend on the machine.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from mpifl.learning.datasets import ClientData
from mpifl.logs import log, world_rank
from mpifl.planning.faults import (
    FaultPlan,
    Strike,
    delay_seconds,
    ends_the_job,
    flipped_bits,
    flipped_labels,
    noise_seed,
)
from mpifl.wire.flat import FlatModel
from mpifl.wire.layout import ExchangeLayout

PROGRESS_EVERY = 0.25  # seconds between a slowed rank's progress reports


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws in a client's training; ``index``: the fault's place in the list (-1:
    unknown, as after a pickle)."""

    kind = "raise"

    def __init__(self, message: str, index: int = -1):
        super().__init__(message)
        self.index = index


class LostUpdate(InjectedFault):
    """A ``lose`` fault: the client's update never reaches the server."""

    kind = "lose"


class InjectedExit(SystemExit):
    """An ``exit`` fault via ``sys``: ``sys.exit(code)``, saying which of the config's faults asked for it."""

    def __init__(self, code: int, fault: str):
        super().__init__(code)
        self.fault = fault  # as the job's last message names it: faults[0] ('exit' in round 2)


class FaultInjector:
    """The strikes that fall on this rank, done at each stage. ``tick``: report progress (a slowed rank is slow,
    not silent)."""

    def __init__(self, plan: FaultPlan, rank: int, tick: Callable[[], None],
                 spend: Callable[[Strike], None] | None = None, classes: int = 0):
        """``spend``: record, before it acts, a kill or exit that is about to end the job (so a resume goes past it);
        ``classes``: the dataset's class count, which a label flip needs."""
        self.plan, self.rank, self.tick, self.spend, self.classes = plan, rank, tick, spend, classes
        self._struck: tuple[tuple[int, int], list[Strike]] = ((0, -1), [])  # the last client's strikes, drawn once

    def __bool__(self) -> bool:
        return bool(self.plan)

    @property
    def scales(self) -> bool:
        """Whether a fault may scale an update or replace it by noise, which needs the round's global model beside
        the trained one."""
        return any(f.kind in ("scale", "noise") for f in self.plan.faults)

    def _at(self, round_: int, client: int, stage: str, kinds: Iterable[str] | None = None) -> list[Strike]:
        """The strikes on ``client`` in ``round_`` at ``stage`` (of ``kinds``); a client's are drawn once, however
        many stages ask."""
        if self._struck[0] != (round_, client):  # the virtual clock's delays are done there, not here
            self._struck = (round_, client), [s for s in self.plan.strikes(round_, client, self.rank)
                                              if not self.plan.delays_virtually(s)]
        return [s for s in self._struck[1] if s.fault.stage == stage and (kinds is None or s.fault.kind in kinds)]

    def before_receive(self, round_: int, clients: Sequence[int]) -> None:
        """Stage 'receive': the first strike among the round's clients here, before the model is taken up."""
        struck = [s for c in clients for s in self._at(round_, c, "receive")]
        if struck:
            self._act(struck[0])

    def before_training(self, round_: int, client: int) -> None:
        """Stage 'train', before the client trains: raise (the client's error), stall, exit, kill."""
        for strike in self._at(round_, client, "train", ("raise", "stall", "exit", "kill")):
            self._act(strike)

    def after_training(self, round_: int, client: int, work: FlatModel, layout: ExchangeLayout,
                       anchor: torch.Tensor | None, trained_seconds: float) -> None:
        """Stage 'train', on the trained model: slow it down, scale its update, or put a NaN or Inf in it."""
        self.slow_down(round_, client, trained_seconds)
        for strike in self._at(round_, client, "train", ("scale", "noise", "nan", "inf")):
            kind = strike.fault.kind
            if kind == "scale":
                assert anchor is not None  # FaultInjector.scales keeps the global model on the rank
                scale_update(work, layout, anchor, strike.fault.factor)
            elif kind == "noise":
                assert anchor is not None  # as for scale
                noise_update(work, layout, anchor, strike.fault.std, functools.partial(noise_seed, self.plan.seed,
                                                                                                strike))
            else:
                first_float_view(work, layout)[0] = float("nan") if kind == "nan" else float("inf")

    def poisoned(self, round_: int, client: int, data: ClientData | None) -> ClientData | None:
        """Stage 'train', before the client trains: its training data with every label flipped (``label_flip``),
        else as it is. The validation split stays clean: what the attacked model scores on its own data."""
        strikes = self._at(round_, client, "train", ("label_flip",)) if data is not None else []
        if not strikes:
            return data
        assert data is not None  # no strike is drawn without data
        if self.classes < 2:
            raise ValueError(f"faults[{strikes[0].index}] ('label_flip'): the dataset has no class labels to flip")
        self._announce(strikes[0])
        labels = torch.from_numpy(flipped_labels(data.y.numpy(), self.classes)) if len(strikes) % 2 else data.y
        return dataclasses.replace(data, y=labels)  # two flips in one round put the labels back

    def slow_down(self, round_: int, client: int, trained_seconds: float) -> None:
        """Stage 'train', once the client trained in ``trained_seconds``: a slowdown makes it ``factor`` times as
        long, the rank reporting progress as it waits."""
        for strike in self._at(round_, client, "train", ("slowdown",)):
            self._slow(delay_seconds(strike, trained_seconds))

    def corrupt(self, round_: int, client: int, buffers: Sequence[np.ndarray] | None, work: FlatModel,
                layout: ExchangeLayout, seed: int) -> None:
        """Stage 'train', on the update as it leaves (after every check): flip the fault's bits in its wire
        ``buffers``, or, where the update stays on the device for a group's sum (None), in the model's chunks."""
        for strike in self._at(round_, client, "train", ("corrupt",)):
            chunks = [torch.from_numpy(b) for b in buffers] if buffers is not None else \
                [work.chunk_view(c) for c in layout.chunks]
            flip_bits(chunks, seed, strike)

    def scale_factors(self, round_: int, client: int) -> tuple[float, ...]:
        """The factors of the ``scale`` strikes on ``client`` in ``round_``, in the list's order (a sharded group's
        ranks each scale their rows of the update: ``ShardedModel.scale_update``)."""
        return tuple(s.fault.factor for s in self._at(round_, client, "train", ("scale",)))

    def flipped(self, round_: int, client: int, seed: int, total_bytes: int) -> list[np.ndarray]:
        """The bits each ``corrupt`` strike on ``client`` flips in an update of ``total_bytes`` on the wire, for a
        stream that flips them chunk by chunk as it leaves (``flip_bits_in_chunk``)."""
        return [flipped_bits(seed, s, total_bytes * 8) for s in self._at(round_, client, "train", ("corrupt",))]

    def injected_non_finite(self, round_: int, client: int) -> str | None:
        """The ``nan`` or ``inf`` strike on ``client`` in ``round_``, named as its update's error says it, or None."""
        strikes = self._at(round_, client, "train", ("nan", "inf"))
        return f"faults[{strikes[0].index}] ({strikes[0].fault.kind!r})" if strikes else None

    def lost(self, round_: int, client: int) -> LostUpdate | None:
        """The loss of ``client``'s update in ``round_`` (a ``lose`` strike), or None where it is not lost."""
        for strike in self._at(round_, client, "send", ("lose",)):
            self._announce(strike)
            return LostUpdate(f"faults[{strike.index}]: lost on its way to the server in round {strike.round}",
                              strike.index)
        return None

    def send_strikes(self, round_: int, client: int) -> list[Strike]:
        """Stage 'send': the strikes to do after the first chunk of ``client``'s update (a loss is not one)."""
        return [s for s in self._at(round_, client, "send") if s.fault.kind != "lose"]

    def act(self, strikes: Iterable[Strike]) -> None:
        """Do ``strikes`` now (stage 'send', between the first chunk and the rest)."""
        for strike in strikes:
            self._act(strike)

    def _announce(self, strike: Strike) -> None:
        fault = strike.fault
        log(f"faults[{strike.index}]: injecting {fault.kind!r} into logical client {strike.client} in round "
            f"{strike.round} at stage {fault.stage!r}", rank=world_rank(self.rank))

    def _act(self, strike: Strike) -> None:
        """A fault that stops, stalls, ends or kills the rank, or raises in the client's training."""
        self._announce(strike)
        fault = strike.fault
        if ends_the_job(fault) and self.spend is not None:
            self.spend(strike)
        if fault.kind == "raise":
            raise InjectedFault(f"faults[{strike.index}]: an injected exception in round {strike.round}",
                                strike.index)
        if fault.kind == "stall":
            seconds = delay_seconds(strike, 0.0)
            while seconds == math.inf:  # a hang
                time.sleep(3600)
            time.sleep(seconds)
        elif fault.kind == "exit":
            sys.stdout.flush()
            sys.stderr.flush()
            if fault.via == "sys":
                raise InjectedExit(fault.code, f"faults[{strike.index}] ('exit' in round {strike.round})")
            if fault.via == "os":
                os._exit(fault.code)
            ctypes.CDLL(None)._exit(fault.code)  # C's _exit: no Python cleanup, no atexit
        elif fault.kind == "kill":
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def _slow(self, seconds: float) -> None:
        """Sleep ``seconds`` as a slow device would train: reporting progress as it goes."""
        end = time.perf_counter() + seconds
        while (left := end - time.perf_counter()) > 0:
            time.sleep(min(left, PROGRESS_EVERY))
            self.tick()


def first_float_view(work: FlatModel, layout: ExchangeLayout) -> torch.Tensor:
    """The model's first floating-point chunk (where a NaN or Inf fault puts its value)."""
    views = (work.chunk_view(c) for c in layout.chunks)
    first = next((v for v in views if v.is_floating_point() and v.numel()), None)
    if first is None:
        raise ValueError("the model has no floating-point tensor to put a NaN or Inf in")
    return first


def scale_update(work: FlatModel, layout: ExchangeLayout, anchor: torch.Tensor, factor: float) -> None:
    """The trained model w becomes g + factor (w - g), g the round's global model (``anchor``, the flat bytes)."""
    for chunk in layout.chunks:
        trained = work.chunk_view(chunk)
        if not trained.is_floating_point():
            continue
        global_ = anchor[chunk.offset:chunk.offset + chunk.nbytes].view(trained.dtype)
        trained.sub_(global_).mul_(factor).add_(global_)


def noise_update(work: FlatModel, layout: ExchangeLayout, anchor: torch.Tensor, std: float,
                 seed_of: Callable[[int], int]) -> None:
    """The trained model w becomes g + std * N(0, 1), g the round's global model (``anchor``, the flat bytes): the
    update is Gaussian noise. Drawn tensor by tensor of the exchanged model (``seed_of(entry)``) in float64, rounded
    once to the tensor's dtype, so the same values on any rank count and chunk size."""
    for index, entry in enumerate(layout.spec.entries):
        trained = work.view(entry)
        if not trained.is_floating_point():
            continue
        global_ = anchor[entry.offset:entry.offset + entry.nbytes].view(trained.dtype).reshape(trained.shape)
        noise = np.random.default_rng(seed_of(index)).standard_normal(trained.numel()) * std
        values = global_.double().cpu() + torch.from_numpy(noise).reshape(trained.shape)
        trained.copy_(values.to(trained.dtype))


def flip_bits_in_chunk(chunk: np.ndarray, first_byte: int, bits: np.ndarray) -> None:
    """Flip those of ``bits`` (positions in the whole update) that fall in ``chunk``, which starts at byte
    ``first_byte`` of the update, in place: chunk by chunk, the flips of ``flip_bits`` over the whole."""
    raw = chunk.reshape(-1).view(np.uint8)
    inside = bits[(bits >= first_byte * 8) & (bits < (first_byte + raw.size) * 8)]
    for bit in inside:
        raw[int(bit) // 8 - first_byte] ^= np.uint8(1 << (int(bit) % 8))


def flip_bits(buffers: Sequence[torch.Tensor], seed: int, strike: Strike) -> None:
    """Flip the strike's bits across ``buffers`` (each viewed as bytes, in order), in place."""
    raw = [b.view(torch.uint8).reshape(-1) for b in buffers]
    sizes = np.cumsum([0, *(r.numel() for r in raw)])
    for bit in flipped_bits(seed, strike, int(sizes[-1]) * 8):
        byte = int(bit) // 8
        which = int(np.searchsorted(sizes, byte, side="right")) - 1
        raw[which][byte - sizes[which]] ^= 1 << (int(bit) % 8)
