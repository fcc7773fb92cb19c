"""``clients.groups`` on a client rank: each reduction group's members (ascending id) are trained one after another
and folded into the group's fp32 partial sum, which travels instead of their updates: straight to the server, or
along a chain of hops (``transport.reduce: chain``, mpifl.roles.chain).

The sum is the same fused fold as the server's, in the same order, so a group's sum is what the server would have
folded from the same updates: the results stay the same on any number of ranks.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from mpifl.aggregation.kernels import count_nonfinite
from mpifl.planning.federation import group_of
from mpifl.planning.seeds import GROUP_COMPRESSION
from mpifl.roles.chain import ChainSender
from mpifl.roles.encoding import GroupSum, UpdateCompressor
from mpifl.wire import protocol
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.transport import send_chunks, send_object

# train one logical client: (round, client, the kept global model, first of the round, check its update) -> its
# header and wire buffers (None: the update stays in the group's sum on the device)
TrainClient = Callable[[int, int, torch.Tensor | None, bool, bool], tuple[protocol.UpdateMeta, list[np.ndarray] | None]]


def group_members(clients: tuple[int, ...], groups: int, assigned: tuple[int, ...] = ()) -> list[tuple[int, list[int]]]:
    """A rank's participants by reduction group: (group, members), both ascending. A client's group is c mod
    ``groups``, or its entry in ``assigned`` (the header's groups under clients.group_by 'cost')."""
    group = dict(zip(clients, assigned)) if assigned else {c: group_of(c, groups) for c in clients}
    out: dict[int, list[int]] = {}
    for c in sorted(clients):
        out.setdefault(group[c], []).append(c)
    return sorted(out.items())


class GroupedClients:
    """A client rank's reduction groups: train, fold, and send each group's sum."""

    def __init__(self, comm: MPI.Comm, group_sum: GroupSum, layout: ExchangeLayout, groups: int,
                 weight: Callable[[protocol.UpdateMeta], float], compressor: UpdateCompressor | None,
                 check_deferred: bool, train: TrainClient):
        """``check_deferred``: retraining a member is free of side effects (nothing kept per client, no update
        protected on its own, no group of ranks), so the members' NaN/Inf check may be one check of the sum."""
        self.comm, self.group_sum, self.layout, self.groups = comm, group_sum, layout, groups
        self.weight, self.compressor, self.check_deferred, self.train = weight, compressor, check_deferred, train
        self.chain = ChainSender(comm, layout.inflight)  # transport.reduce=chain: this rank's hops

    def serve(self, header: protocol.RoundOrder, keep: torch.Tensor | None) -> None:
        """Train and send the header's clients group by group (``keep``: the global model kept on the host)."""
        if header.reduce_stream is not None:
            self._serve_chain(header, keep)
            return
        meta_tag, update_tag = (protocol.round_tag(kind, header.round) for kind in (protocol.META, protocol.UPDATE))
        trained = 0
        for group, members in group_members(header.clients, self.groups, header.groups):
            metas = self._sum_clients(header.round, members, keep, first=trained == 0)
            trained += len(members)
            send_object(self.comm, protocol.GroupMeta(group, metas), protocol.SERVER, meta_tag)
            send_chunks(self.comm, [protocol.SERVER], update_tag, self._wire(header.round, group),
                        self.layout.inflight)

    def _sum_clients(self, round_: int, clients: list[int], keep: torch.Tensor | None,
                     first: bool) -> tuple[protocol.UpdateMeta, ...]:
        """Train ``clients`` (ascending id) and fold their usable updates into a fresh partial sum; their headers.
        ``first``: the first of them is the first this rank trains this round (the model is the global one).

        Where retraining is free of side effects (``check_deferred``), the members' NaN/Inf check is one check of
        the group's sum: a finite sum has finite terms, since a NaN or an Inf in any member makes it NaN or Inf.
        Only a sum that is not finite has its members trained again (the same seeds, data and starting model: the
        same updates), each checked on its own as without deferral. On the 93 MB MLP of the cross-device task the
        check was 5 ms of a client's 80 (``profiling/client_slowdown.py``)."""
        deferred = keep is not None and self.check_deferred
        metas = self._fold_members(round_, clients, keep, first, check=not deferred)
        if deferred and count_nonfinite(self.group_sum.sums):
            metas = self._fold_members(round_, clients, keep, first=False, check=True)
        return metas

    def _fold_members(self, round_: int, clients: list[int], keep: torch.Tensor | None, first: bool,
                      check: bool) -> tuple[protocol.UpdateMeta, ...]:
        """Train each of ``clients`` and fold its usable update into a fresh partial sum (``check``: each update's
        NaN/Inf first); their headers."""
        self.group_sum.reset()
        metas = []
        for i, client in enumerate(clients):
            meta, _ = self.train(round_, client, keep, first and i == 0, check)
            if meta.error is None:
                self.group_sum.add(self.weight(meta))
            metas.append(meta)
        return tuple(metas)

    def _wire(self, round_: int, group: int) -> list[np.ndarray]:
        """A group's partial sum as it travels: fp32, or quantized (compression.method) with noise keyed by
        (seed, round, group): the same on any number of ranks."""
        sums = self.group_sum.to_host()
        if self.compressor is None:
            return sums
        chunks = [torch.from_numpy(b).view(torch.float32) for b in sums]
        return self.compressor.compress(chunks, round_, group, None, key=GROUP_COMPRESSION)

    def _serve_chain(self, header: protocol.RoundOrder, keep: torch.Tensor | None) -> None:
        """transport.reduce=chain: sum each of this rank's groups (ascending id) into a partial sum of its own, then
        play this rank's hops of the chain (``roles.chain``)."""
        metas: dict[int, tuple[protocol.UpdateMeta, ...]] = {}
        sums: dict[int, list[np.ndarray]] = {}
        members = group_members(header.clients, self.groups, header.groups)
        trained = 0
        for i, (group, clients) in enumerate(members):
            metas[group] = self._sum_clients(header.round, clients, keep, first=trained == 0)
            trained += len(clients)
            sums[group] = self.chain.keep(self.group_sum) if i + 1 < len(members) else self.group_sum.to_host()
        self.chain.send(header, metas, sums)
