"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1, option II) as a plug-in with both halves, on ``mpifl.api``
alone: a template for an algorithm whose clients keep a vector each and read server state while they train.

- The **server half** is a ``Strategy``: FedAvg's mean of the deltas for the model, and c += (sum of the clients'
  control deltas) / N for the server's control c, which travels as summed streams (``Controls``).
- The **client half** is a ``ClientAlgorithm`` named by ``Capabilities.client_rule``: ``Leader`` corrects every
  step by c - c_i and keeps each client's c_i in the store mpifl gives it (RAM or disk, checkpointed, resumed, lent
  under per-round placement, put back when its client is dropped); ``Member`` does the same steps on the other
  ranks of a client group (``clients.ranks_per_client``).

``tests/test_mpi_scaffold.py`` holds it to the paper's rule bitwise, as it holds the built-in ``scaffold``."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from mpifl.api import (
    SUMMED_STREAMS,
    Capabilities,
    ClientAlgorithm,
    Replace,
    Strategy,
    WeightedMean,
    corrected_steps,
    section_span,
    split,
    trainable,
)

CAPABILITIES = Capabilities(summable=True, needs_every_row=False, server_state=True, client_state=True,
                            sgd_steps=True, client_rule="examples.client_half.scaffold:CLIENT", corrects_steps=True,
                            summed_streams=True)


class Controls(nn.Module):
    """The server's c, as summed streams: one fp32 buffer per trainable parameter, named as the built-in names them.
    mpifl appends it to the model as the submodule ``SUMMED_STREAMS``, broadcasts it with the model, and sums what
    each client's update leaves in it, as it sums the deltas; ``Average.finish`` turns that sum into c's step."""

    def __init__(self, model: nn.Module, local):
        super().__init__()
        self.pairs = []
        for i, (name, p) in enumerate(trainable(model, local)):
            buffer = f"c{i:04d}_{name.replace('.', '_')}"
            self.register_buffer(buffer, torch.zeros(p.shape, dtype=torch.float32, device=p.device))
            self.pairs.append((name, buffer))

    def forward(self, x):
        """Never called: the buffers only travel with the model."""
        return x


def pairs(model: nn.Module):
    """Each trainable parameter beside its buffer of c."""
    controls = getattr(model, SUMMED_STREAMS)
    params, buffers = dict(model.named_parameters()), dict(controls.named_buffers())
    return [(params[n], buffers[b]) for n, b in controls.pairs]


class Leader:
    """The client half on a rank that trains clients: each step corrected by c - c_i, then c_i's new value kept
    and c's share (the client's control delta / its weight, summed by mpifl) left in the streams."""

    def __init__(self, work, store, cfg):
        found = pairs(work.module)
        self.params, self.server = [p for p, _ in found], [c for _, c in found]
        self.work, self.store, self.lr = work, store, cfg.train.lr
        self.shared = torch.empty(sum(p.numel() for p in self.params), device=work.device)

    @contextlib.contextmanager
    def training(self, client: int, global_bytes: torch.Tensor) -> Iterator[None]:
        """Around the client's local training: k = c - c_i in ``shared`` (what a group's members receive), and
        every optimizer step followed by p -= lr * k."""
        corrections = split(self.shared, self.params)
        for k, c in zip(corrections, self.server):
            k.copy_(c)
        self.shared.sub_(self.store.read(client, 0).to(self.shared.device))
        with corrected_steps(self.params, corrections):
            yield

    def update(self, client: int, global_bytes: torch.Tensor, steps: int, weight: float) -> None:
        """Option II: c_i+ = c_i - c + (x - y) / (K lr); keep it, and leave (c_i+ - c_i) / weight in the streams
        (the update's weight multiplies what is summed). A diverged client's vector is left as it was."""
        globals_ = self.work.views_in(self.params, global_bytes)
        deltas = [(x.float() - p.detach().float()).div_(steps * self.lr).sub_(c)
                  for p, c, x in zip(self.params, self.server, globals_)]
        if not all(bool(torch.isfinite(d).all()) for d in deltas):
            return
        own = self.store.read(client, 0)
        for c, mine, delta in zip(self.server, split(own, self.params), deltas):
            mine.add_(delta.to(mine.device))
            c.add_(delta.div_(weight))
        self.store.write(client, 0, own)


class Member:
    """A client group's other ranks: ``vector`` receives the leader's ``shared`` (k), and their steps are corrected
    the same way."""

    def __init__(self, work, cfg):
        self.params = [p for p, _ in pairs(work.module)]
        self.vector = torch.empty(sum(p.numel() for p in self.params), device=work.device)

    def training(self):
        """Around the member's share of each step: p -= lr * k after every optimizer step."""
        return corrected_steps(self.params, split(self.vector, self.params))


CLIENT = ClientAlgorithm(state="c_i", leader=Leader, member=Member, streams=Controls)


class Mean(WeightedMean):
    """FedAvg's weighted mean, declaring SCAFFOLD's capabilities."""

    capabilities = CAPABILITIES


class Average(Strategy):
    """The model's chunks as FedAvg combines them; c's section (the streams) stepped by its sum / N."""

    def bind(self, spec, num_clients):
        """Where c's section lies in the model's bytes, and N."""
        super().bind(spec, num_clients)
        entries = [e for e in spec.entries if e.name.startswith(SUMMED_STREAMS + ".")]
        self.section, self.num_clients = (entries[0].offset, entries[-1].offset + entries[-1].nbytes), num_clients

    def finish(self, acc, count, total_weight, target, state, chunk=None):
        """A chunk may hold model bytes and stream bytes: each part finished by its own rule."""
        lo, hi = section_span(chunk, *self.section)
        for a, b in ((0, lo), (hi, acc.numel())) if lo < hi else ((0, acc.numel()),):
            if a < b:
                part = dataclasses.replace(chunk, offset=chunk.offset + a * chunk.itemsize,
                                           nbytes=(b - a) * chunk.itemsize)
                super().finish(acc[a:b], count, total_weight, target[a:b], {k: v[a:b] for k, v in state.items()},
                               part)
        if lo < hi:
            target[lo:hi].add_(acc[lo:hi].div_(self.num_clients))


def scaffold(cfg):
    """The strategy: FedAvg's mean of the deltas, c += sum of the control deltas / N."""
    return Average(cfg, Mean(cfg), Replace(cfg), capabilities=CAPABILITIES)


scaffold.capabilities = CAPABILITIES  # read before MPI starts: the client half it names, the streams it appends
