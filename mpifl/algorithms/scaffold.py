"""SCAFFOLD, both halves: Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning" (ICML), Algorithm 1 with option II.

**The model's side.** The server control variate ``c`` travels *inside the model*: one fp32 buffer per trainable
parameter, in the summed-stream section this algorithm appends (``streams``, named ``CONTROL``). So ``c`` is
broadcast with the weights, reduced chunk by chunk as the clients' control deltas arrive, checkpointed, resumed and
kept out of core exactly like them, and a model spec says whether a run has it.

**The client half** (``ClientControls``). Each logical client's own ``c_i`` is its per-client vector on the rank
that hosts it, one fp32 value per ``trainable`` element (0 for a client never sampled). A client corrects every
local step by ``-lr * (c - c_i)`` (``mpifl.learning.steps.corrected_steps``), and after its K local steps at
learning rate lr forms (``control_delta``)::

    delta_c_i = (x - y) / (K * lr) - c          so that  c_i+ = c_i + delta_c_i

with x the global and y its trained weights. It sends ``delta_c_i / w_i`` in the control section (w_i its weight in
the fold), so that the fused weighted sum of the section is the plain sum of the deltas.

**The server half** (``ControlledAverage``): ``x += eta_g * (weighted mean of the deltas)`` and
``c += (1/N) * sum_i delta_c_i`` over the round's participants, N = clients.num_clients.

The model the client half works on is the one that trains: the rank's host model or its device replica
(``train.device: cuda``). The store stays in host memory; the training client's vector goes to the model's device
once before it trains and its new value back once after, so every step's correction runs where the step does.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
from torch import nn

from mpifl.aggregation.combiners import WeightedMean
from mpifl.aggregation.kernels import Rows
from mpifl.aggregation.strategies import Strategy, section_span
from mpifl.algorithms.contract import ClientAlgorithm, ShardRows
from mpifl.config.capabilities import CONTROLLED_MEAN
from mpifl.config.client_state import RULE_VECTORS
from mpifl.learning.steps import corrected_steps, split, trainable
from mpifl.storage.residuals import ResidualStore
from mpifl.wire.flat import FlatModel
from mpifl.wire.spec import CONTROL, Chunk, ModelSpec

T = TypeVar("T")


# --- the math -----------------------------------------------------------------------------------------------------

def control_delta(global_weights: torch.Tensor, trained: torch.Tensor, server_control: torch.Tensor,
                  steps: int, lr: float) -> torch.Tensor:
    """Option II of the paper: delta_c_i = (x - y) / (K * lr) - c, in fp32 (x, y, c as flat fp32 vectors)."""
    if steps <= 0 or lr <= 0:
        raise ValueError(f"SCAFFOLD needs local steps > 0 and a learning rate > 0 (got {steps} steps, lr {lr})")
    return (global_weights - trained).div_(steps * lr).sub_(server_control)


# --- the model's side: c as a summed stream -----------------------------------------------------------------------

class ControlVariates(nn.Module):
    """One fp32 buffer per controlled parameter of the model it is attached to, zero at the start (c = 0)."""

    def __init__(self, params: Sequence[tuple[str, torch.Tensor]]):
        super().__init__()
        self.names: list[str] = []  # the buffers, in order
        self.controlled: list[str] = []  # the parameter each corrects, by its name in the model
        for i, (name, param) in enumerate(params):
            buffer = f"c{i:04d}_{name.replace('.', '_')}"
            self.register_buffer(buffer, torch.zeros(param.shape, dtype=torch.float32, device=param.device))
            self.names.append(buffer)
            self.controlled.append(name)

    def forward(self, x: T) -> T:
        """The identity: the buffers only travel with the model, and in an ``nn.Sequential`` model, which calls
        every submodule in turn, this one is the last and passes the output through unchanged."""
        return x


def control_variates(model: nn.Module, local: Sequence[str] = ()) -> nn.Module:
    """The section SCAFFOLD appends to ``model`` (``ClientAlgorithm.streams``): one buffer per parameter
    ``trainable`` names."""
    return ControlVariates(trainable(model, local))


def attach_control_variates(model: nn.Module, local: Sequence[str] = ()) -> nn.Module:
    """``model`` with the ``CONTROL`` section appended (last, so its buffers come last in the model's tensors)."""
    if hasattr(model, CONTROL):
        raise ValueError(f"the model already has a submodule named {CONTROL!r}")
    model.add_module(CONTROL, control_variates(model, local))
    return model


def controlled_pairs(model: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, its server control buffer) for every controlled parameter, in order."""
    control = getattr(model, CONTROL)
    assert isinstance(control, ControlVariates)  # attach_control_variates put it there
    params, buffers = dict(model.named_parameters()), dict(control.named_buffers())
    return [(params[name], buffers[buffer]) for name, buffer in zip(control.controlled, control.names, strict=True)]


# --- the client half ----------------------------------------------------------------------------------------------

class ClientControls:
    """The hosted clients' c_i, the correction c - c_i while one trains, and its control delta afterwards."""

    def __init__(self, flat: FlatModel, store: ResidualStore, lr: float):
        pairs = controlled_pairs(flat.module)
        self.params = [p for p, _ in pairs]
        self.server = [c for _, c in pairs]  # views of the model's control section: the global c on arrival
        self.flat, self.store, self.lr = flat, store, lr
        self.corrections = torch.empty(sum(p.numel() for p in self.params), device=flat.device)

    @property
    def shared(self) -> torch.Tensor:
        """What a group's members need while the client trains (``GroupCorrections``): its correction c - c_i."""
        return self.corrections

    @contextlib.contextmanager
    def training(self, client: int, global_bytes: torch.Tensor) -> Iterator[None]:
        """Train ``client`` inside: each step corrected by -lr * (c - c_i) (c is the model's, c_i the store's)."""
        self._fill_correction(client, self.corrections)
        with corrected_steps(self.params, split(self.corrections, self.params)):
            yield

    def correction(self, client: int) -> torch.Tensor:
        """The correction c - c_i in a new flat tensor over the controlled parameters (``LaneCorrections``: a
        batched lane's k)."""
        return self._fill_correction(client, torch.empty_like(self.corrections))

    def _fill_correction(self, client: int, out: torch.Tensor) -> torch.Tensor:
        """``out`` (flat, fp32) set to c - c_i in place (``fill_correction``)."""
        return fill_correction(out, self.server, self.params, self.store.read(client, 0))

    def update(self, client: int, global_bytes: torch.Tensor, steps: int, weight: float) -> None:
        """After ``client`` trained ``steps`` steps from the global model (``global_bytes``, a copy of the flat
        buffer on the model's device): c_i += delta_c_i in the store, and the model's control section set to
        c + delta_c_i / weight, so that its delta (what is sent) is the control delta over the client's weight in
        the server's fold. A client whose training diverged (a NaN or Inf delta) keeps its c_i: its update is
        refused, never folded."""
        check_weight(client, weight)
        deltas = [control_delta(x.float(), p.detach().float(), c, steps, self.lr)
                  for p, c, x in zip(self.params, self.server, self.flat.views_in(self.params, global_bytes))]
        if not all(bool(torch.isfinite(d).all()) for d in deltas):
            return  # a diverged client: its update is refused (NaN/Inf), and its c_i stays as it was
        keep_control_deltas(self.store, client, deltas, self.server, self.params, weight)


def check_weight(client: int, weight: float) -> None:
    """SCAFFOLD divides a client's control delta by its weight in the server's fold: it must be positive."""
    if weight <= 0:
        raise ValueError(f"logical client {client}: SCAFFOLD divides its control delta by its weight, which is "
                         f"{weight}")


def fill_correction(out: torch.Tensor, server: Sequence[torch.Tensor], like: Sequence[torch.Tensor],
                    stored: torch.Tensor) -> torch.Tensor:
    """``out`` (flat, fp32) set to c - c_i in place: the server's c (``server``, shaped like ``like``) copied in
    tensor by tensor, then the stored c_i subtracted (no model-sized temporary)."""
    for k, c in zip(split(out, like), server):
        k.copy_(c)
    return out.sub_(stored.to(out.device))


def keep_control_deltas(store: ResidualStore, client: int, deltas: Sequence[torch.Tensor],
                        server: Sequence[torch.Tensor], like: Sequence[torch.Tensor], weight: float) -> None:
    """c_i += delta_c_i in the store, and each ``server`` tensor (the model's control section, where the update
    carries it) set to c + delta_c_i / ``weight``; ``deltas`` are consumed."""
    own = store.read(client, 0)
    for c, mine, delta in zip(server, split(own, like), deltas):
        mine.add_(delta.to(mine.device))
        c.add_(delta.div_(weight))
    store.write(client, 0, own)


class ShardControls:
    """``ClientControls`` on one rank of a sharded client (``clients.sharding: fsdp``): c_i over this rank's rows of
    the trained parameters, their correction while a client trains and their control deltas afterwards, elementwise
    as ``ClientControls`` forms them over whole tensors; the rows of c are this rank's rows of the model's control
    section, which the group shards like the parameters."""

    def __init__(self, rows: ShardRows, store: ResidualStore, lr: float):
        if len(rows.streams) != len(rows.rows):
            raise ValueError(f"SCAFFOLD on a sharded client: {len(rows.rows)} trained parameters but "
                             f"{len(rows.streams)} control buffers")
        self.rows, self.store, self.lr = rows, store, lr
        self.corrections = torch.empty(rows.elements, device=rows.device)

    @contextlib.contextmanager
    def training(self, client: int) -> Iterator[None]:
        """Train ``client`` inside: each step's rows corrected by -lr * (c - c_i)."""
        fill_correction(self.corrections, self.rows.streams, self.rows.rows, self.store.read(client, 0))
        with corrected_steps(self.rows.params, split(self.corrections, self.rows.rows)):
            yield

    def update(self, client: int, steps: int, weight: float) -> None:
        """As ``ClientControls.update``, on this rank's rows; a client diverged on any rank keeps its c_i on all."""
        check_weight(client, weight)
        deltas = [control_delta(x.float(), y.detach().float(), c, steps, self.lr)
                  for y, c, x in zip(self.rows.rows, self.rows.streams, self.rows.anchors)]
        if self.rows.all_ranks(all(bool(torch.isfinite(d).all()) for d in deltas)):
            keep_control_deltas(self.store, client, deltas, self.rows.streams, self.rows.rows, weight)


class GroupCorrections:
    """A group member's side of SCAFFOLD (``clients.ranks_per_client``): the correction c - c_i of the client its
    group trains. The leader keeps c_i, computes the correction (``ClientControls.training``) and broadcasts it
    with the global model; the member corrects each of its steps by it, as the leader does, so the group's ranks
    take the same steps."""

    def __init__(self, flat: FlatModel):
        self.params = [p for p, _ in controlled_pairs(flat.module)]
        self.vector = torch.empty(sum(p.numel() for p in self.params), device=flat.device)

    def training(self) -> contextlib.AbstractContextManager[None]:
        """Train inside: each step corrected by -lr * (the received correction)."""
        return corrected_steps(self.params, split(self.vector, self.params))


CLIENT = ClientAlgorithm(state=RULE_VECTORS["control_variates"],
                         leader=lambda work, store, cfg: ClientControls(work, store, cfg.train.lr),
                         member=lambda work, cfg: GroupCorrections(work), streams=control_variates,
                         shard=lambda rows, store, cfg: ShardControls(rows, store, cfg.train.lr))


# --- the server half ----------------------------------------------------------------------------------------------

class ControlledMean(WeightedMean):
    """SCAFFOLD's combination: FedAvg's weighted mean over the model's chunks. The clients' control-variate deltas
    travel in the same chunks, each divided by its client's weight, so that the same fused weighted sum yields their
    plain sum (``ControlledAverage`` finishes that section)."""

    capabilities = CONTROLLED_MEAN


class ControlledAverage(Strategy):
    """SCAFFOLD's server: x += eta_g * (weighted mean of the deltas), c += (1/N) * sum_i delta_c_i over the round's
    participants, N = clients.num_clients.

    The server control variate c is the model's ``CONTROL`` section, so it is broadcast, checkpointed and kept out
    of core with the weights. Each client sends its control delta divided by its own weight in that section; the
    weighted fold then sums the deltas exactly as they were sent, and ``finish`` divides that section by N instead
    of the total weight.
    """

    def bind(self, spec: ModelSpec, num_clients: int) -> None:
        """Find the control section (one contiguous byte range: its buffers come last in their segment)."""
        super().bind(spec, num_clients)
        entries = [e for e in spec.entries if e.name.startswith(CONTROL + ".")]
        if not entries:
            raise ValueError(f"strategy {self.name!r}: the model has no {CONTROL!r} section (it must be built "
                             "with SCAFFOLD's streams, mpifl.algorithms.scaffold.CLIENT)")
        start, end = entries[0].offset, entries[-1].offset + entries[-1].nbytes
        if sum(e.nbytes for e in entries) != end - start:
            raise ValueError(f"strategy {self.name!r}: the control variates are not contiguous in the model")
        self.control, self.num_clients = (start, end), num_clients

    def finish(self, acc: Rows, count: int, total_weight: float, target: torch.Tensor,
               state: dict[str, torch.Tensor], chunk: Chunk | None = None) -> None:
        """The weights' elements as FedAvg with a global step; the control section's as c += sum / N."""
        assert chunk is not None  # the reduction always says which chunk it finishes
        summed: torch.Tensor = acc  # type: ignore[assignment]  # a weighted mean folds into one accumulator
        lo, hi = section_span(chunk, *self.control)
        if lo == hi:
            super().finish(summed, count, total_weight, target, state, chunk)
            return
        for a, b in ((0, lo), (hi, summed.numel())):  # the weights around the control section (either may be empty)
            if a < b:
                part = dataclasses.replace(chunk, offset=chunk.offset + a * chunk.itemsize,
                                           nbytes=(b - a) * chunk.itemsize)  # so statistics are found in it
                super().finish(summed[a:b], count, total_weight, target[a:b],
                               {k: v[a:b] for k, v in state.items()}, part)
        target[lo:hi].add_(summed[lo:hi].div_(self.num_clients))
