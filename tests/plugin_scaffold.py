"""SCAFFOLD as a plug-in, on ``mpifl.api`` alone: its client half named by ``Capabilities.client_rule`` as an import
path, with the built-in's storage, summed streams, checkpoints and put-backs. The test holds it to the paper's rule
bitwise, as the built-in is held (tests/test_mpi_scaffold.py)."""
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
                            sgd_steps=True, client_rule="plugin_scaffold:CLIENT", corrects_steps=True,
                            summed_streams=True)


class Controls(nn.Module):
    """c: one fp32 buffer per trainable parameter, named as the built-in names them."""

    def __init__(self, model: nn.Module, local):
        super().__init__()
        self.pairs = []
        for i, (name, p) in enumerate(trainable(model, local)):
            buffer = f"c{i:04d}_{name.replace('.', '_')}"
            self.register_buffer(buffer, torch.zeros(p.shape, dtype=torch.float32, device=p.device))
            self.pairs.append((name, buffer))

    def forward(self, x):
        return x


def pairs(model: nn.Module):
    controls = getattr(model, SUMMED_STREAMS)
    params, buffers = dict(model.named_parameters()), dict(controls.named_buffers())
    return [(params[n], buffers[b]) for n, b in controls.pairs]


class Leader:
    def __init__(self, work, store, cfg):
        found = pairs(work.module)
        self.params, self.server = [p for p, _ in found], [c for _, c in found]
        self.work, self.store, self.lr = work, store, cfg.train.lr
        self.shared = torch.empty(sum(p.numel() for p in self.params), device=work.device)

    @contextlib.contextmanager
    def training(self, client: int, global_bytes: torch.Tensor) -> Iterator[None]:
        corrections = split(self.shared, self.params)
        for k, c in zip(corrections, self.server):
            k.copy_(c)
        self.shared.sub_(self.store.read(client, 0).to(self.shared.device))
        with corrected_steps(self.params, corrections):
            yield

    def update(self, client: int, global_bytes: torch.Tensor, steps: int, weight: float) -> None:
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
    def __init__(self, work, cfg):
        self.params = [p for p, _ in pairs(work.module)]
        self.vector = torch.empty(sum(p.numel() for p in self.params), device=work.device)

    def training(self):
        return corrected_steps(self.params, split(self.vector, self.params))


CLIENT = ClientAlgorithm(state="c_i", leader=Leader, member=Member, streams=Controls)


class Mean(WeightedMean):
    capabilities = CAPABILITIES


class Average(Strategy):
    def bind(self, spec, num_clients):
        super().bind(spec, num_clients)
        entries = [e for e in spec.entries if e.name.startswith(SUMMED_STREAMS + ".")]
        self.section, self.num_clients = (entries[0].offset, entries[-1].offset + entries[-1].nbytes), num_clients

    def finish(self, acc, count, total_weight, target, state, chunk=None):
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


def mismatched(cfg):
    """Declares SCAFFOLD's client half on the builder, but builds a plain mean: refused before MPI starts."""
    return Strategy(cfg, WeightedMean(cfg), Replace(cfg))


mismatched.capabilities = CAPABILITIES
