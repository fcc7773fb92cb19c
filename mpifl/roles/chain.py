"""``transport.reduce: chain`` on a client rank: this rank's hops of the chain over the round's reduction groups
(``protocol.chain_hops``), and the host bytes its groups' partial sums wait in until the chain has passed.

Each hop adds its groups' sums, one after another, to the running sum from the hop before and passes that on; the
last hop sends it to the server. Each addition is ``running += own``, the fold the server would do with the groups'
sums arriving point to point in group order, so the chain gives the bits of point-to-point groups on any number of
ranks. A group without a usable update is left out. A rank with k groups keeps k sums until the chain has passed:
each earlier group's sum is handed over in place (``keep``), the next forming in spare host bytes (k - 1 buffers
beside the group sum's own, reused round to round).
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from mpifl.logs import world_rank
from mpifl.roles.encoding import GroupSum
from mpifl.wire import protocol
from mpifl.wire.memory import host_bytes
from mpifl.wire.transport import pass_on, recv_object, send_object


class ChainSender:
    """A client rank's part of the chain: the sums it keeps aside, its hops' headers, and its hops' chunks."""

    def __init__(self, comm: MPI.Comm, inflight: int):
        self.comm, self.rank, self.inflight = comm, comm.Get_rank(), inflight
        self.slots: list[np.ndarray] | None = None  # the running sum's receive ring
        self.free: list[np.ndarray] = []  # host bytes for a group sum, free until the next round's
        self.handed: list[np.ndarray] = []  # the bytes of the sums kept aside this round

    def keep(self, group_sum: GroupSum) -> list[np.ndarray]:
        """Keep ``group_sum``'s sum as it is for the chain; the next group's forms in spare bytes."""
        spare = self.free.pop() if self.free else host_bytes(len(group_sum.buffer))
        kept, chunks = group_sum.hand_over(spare)
        self.handed.append(kept)
        return chunks

    def send(self, header: protocol.RoundOrder, metas: dict[int, tuple[protocol.UpdateMeta, ...]],
             sums: dict[int, list[np.ndarray]]) -> None:
        """Play this rank's hops for its groups' ``metas`` and ``sums``; then the sums kept aside are free again."""
        hops = header.chain
        missing = sorted({g for hop in hops for g in hop.groups} ^ set(metas))
        if missing:
            raise RuntimeError(f"rank {world_rank(self.rank)}: round {header.round}'s chain lists groups that this "
                               "rank does not "
                               f"train, or leaves out groups it does: {missing}")
        running_usable = self._metas(header, metas)
        usable = {g: any(m.error is None for m in metas[g]) for g in metas}
        reduce, update = (protocol.round_tag(k, header.round) for k in (protocol.REDUCE, protocol.UPDATE))

        def combine(j: int, h: int, running: np.ndarray | None) -> np.ndarray:
            out = running if running_usable[h] else None
            for group in hops[h].groups:
                if not usable[group]:
                    continue
                if out is None:
                    out = sums[group][j]
                else:
                    torch.from_numpy(out).view(torch.float32).add_(torch.from_numpy(sums[group][j]).view(torch.float32))
            # nothing usable yet: any bytes of the right size, which every later hop and the server skip
            return out if out is not None else running if running is not None else sums[hops[h].groups[0]][j]

        sizes = [len(b) for b in next(iter(sums.values()))]
        if self.slots is None:
            self.slots = [host_bytes(max(sizes)) for _ in range(self.inflight)]
        pass_on(self.comm, hops, (reduce, update), self.slots, sizes, combine)
        self.free.extend(self.handed)
        self.handed = []

    def _metas(self, header: protocol.RoundOrder, metas: dict[int, tuple[protocol.UpdateMeta, ...]]) -> list[bool]:
        """Each hop's GroupMeta, in the chain's order: every member so far (received from the hop before) and
        this hop's groups' members, sent on to the next hop (REDUCE_META) or the server (META). Whether each
        hop's running sum, as it arrives, holds a usable update."""
        assert header.reduce_stream is not None  # a chain runs only for a header with a stream id
        meta_tag, reduce_meta = (protocol.round_tag(k, header.round) for k in (protocol.META, protocol.REDUCE_META))
        running_usable = []
        for hop in header.chain:
            before: tuple[protocol.UpdateMeta, ...] = ()
            if hop.source is not None:
                received = recv_object(self.comm, hop.source, reduce_meta)
                if not isinstance(received, protocol.GroupMeta):
                    raise RuntimeError(f"rank {world_rank(self.rank)}: rank {world_rank(hop.source)} sent "
                                       f"{received!r} where the chain's "
                                       "GroupMeta belongs")
                before = received.members
            running_usable.append(any(m.error is None for m in before))
            own = tuple(m for group in hop.groups for m in metas[group])
            send_object(self.comm, protocol.GroupMeta(header.reduce_stream, before + own), hop.dest,
                        meta_tag if hop.dest == protocol.SERVER else reduce_meta)
        return running_usable
