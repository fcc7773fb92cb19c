"""The bytes of a sharded client group (``clients.sharding: fsdp``): which of the flat layout each rank holds
(``ShardedModel``), and the chunks out and back (``ShardedGroup``): the global model broadcast over the group and
taken piece by piece, the update gathered chunk by chunk at the leader, or widened and compressed there
(``compression.method``), with top-k's residuals scattered back to the ranks that own them.

mpifl.roles.sharded says what the group does with them, round by round.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from mpifl.aggregation.kernels import count_nonfinite
from mpifl.learning.sharding import (
    is_sharded,
    own_rows,
)
from mpifl.metrics import CostMeter, peak_rss_bytes
from mpifl.roles.encoding import UpdateCompressor
from mpifl.storage.residuals import ResidualStore
from mpifl.wire import protocol
from mpifl.wire.codecs import TopK
from mpifl.wire.flat import DTYPES
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import host_bytes
from mpifl.wire.shards import owned_spans, pieces_by_chunk
from mpifl.wire.spec import ModelSpec
from mpifl.wire.transport import wait, wake


def tensors_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a sharded model by the name the flat layout gives it (``state_dict``'s)."""
    return dict(model.state_dict(keep_vars=True))


class ShardedModel:
    """One rank's part of a sharded client: which bytes of the flat layout it holds, where they live in its FSDP
    shard, its copy of the round's global rows, and its pieces of every chunk, out and back."""

    def __init__(self, module: nn.Module, spec: ModelSpec, plan: ExchangeLayout, rank: int, size: int,
                 delta: bool, statistics_as_values: bool, row_buffers: Collection[str] = ()):
        """``row_buffers``: buffers this rank holds only its rows of (``mpifl.learning.sharding.shard_buffers``),
        split as the parameters are."""
        self.module, self.spec, self.plan, self.rank, self.size = module, spec, plan, rank, size
        self.delta, self.statistics_as_values = delta, statistics_as_values
        tensors = tensors_by_name(module)
        missing = [e.name for e in spec.entries if e.name not in tensors]
        if missing:
            raise RuntimeError(f"the sharded model has no tensor {missing[0]!r} of the exchanged layout")
        self.sharded = {e.name for e in spec.entries if is_sharded(tensors[e.name]) or e.name in row_buffers}
        self.dtypes = {e.name: DTYPES[e.dtype] for e in spec.entries}
        # this rank's bytes of each exchanged tensor: a view of its FSDP shard (or of a whole buffer)
        self.local = {e.name: own_rows(tensors[e.name].data).reshape(-1).view(torch.uint8) for e in spec.entries}
        self.receiving = owned_spans(spec, self.sharded, size, rank, receiving=True)
        self.taking = pieces_by_chunk(self.receiving, plan.chunks)
        # what each rank sends of each chunk (the leader unpacks every rank's pieces)
        self.sending = [owned_spans(spec, self.sharded, size, r) for r in range(size)]
        self.giving = [pieces_by_chunk(spans, plan.chunks) for spans in self.sending]
        # the round's global rows, beside the shard (on its GPU where it trains on one)
        self.global_rows = {s.name: torch.empty(s.nbytes, dtype=torch.uint8, device=self.local[s.name].device)
                            for s in self.receiving}
        self.counts = [[sum(p.nbytes for p in chunk) for chunk in rank_pieces] for rank_pieces in self.giving]
        largest = max((max(c, default=0) for c in self.counts), default=0)
        self.packed = torch.empty(max(largest, 1), dtype=torch.uint8)
        self.bad = 0  # NaN/Inf values in this rank's pieces of the update being sent

    @property
    def held_bytes(self) -> int:
        """Bytes of the exchanged layout this rank holds (its rows, and every buffer)."""
        return sum(s.nbytes for s in self.receiving)

    def take(self, index: int, chunk: np.ndarray) -> None:
        """Copy this rank's bytes of model chunk ``index`` into its shard, and into its copy of the global rows."""
        data = torch.from_numpy(chunk)
        with torch.no_grad():
            for piece in self.taking[index]:
                span = self.receiving[piece.span]
                part = data[piece.chunk_start:piece.chunk_stop]
                self.local[span.name][piece.local_start:piece.local_start + piece.nbytes].copy_(part)
                self.global_rows[span.name][piece.local_start:piece.local_start + piece.nbytes].copy_(part)

    def reset(self) -> None:
        """Back to the round's global model before the next logical client trains (and buffers' values too)."""
        with torch.no_grad():
            for span in self.receiving:
                self.local[span.name].copy_(self.global_rows[span.name])

    def scale_update(self, factor: float) -> None:
        """A ``scale`` fault on this rank's rows: the trained w becomes g + factor (w - g), g the round's global
        rows, for every floating-point tensor, as an unsharded client's whole model becomes (``scale_update``)."""
        with torch.no_grad():
            for span in self.receiving:
                dtype = self.dtypes[span.name]
                if dtype.is_floating_point:
                    global_ = self.global_rows[span.name].view(dtype)
                    self.local[span.name].view(dtype).sub_(global_).mul_(factor).add_(global_)

    def pack(self, index: int, values: bool) -> torch.Tensor:
        """The pieces of update chunk ``index`` that this rank holds, back to back: the delta against the global rows (a
        statistic's value under Config.statistics_as_values), or the values when ``values``."""
        out = self.packed[:self.counts[self.rank][index]]
        at = 0
        spans = self.sending[self.rank]
        for piece in self.giving[self.rank][index]:
            span = spans[piece.span]
            here = slice(piece.local_start, piece.local_start + piece.nbytes)
            dest = out[at:at + piece.nbytes]
            current = self.local[span.name][here]
            dtype = self.dtypes[span.name]
            if values or not self.delta or (span.statistic and self.statistics_as_values):
                dest.copy_(current)
            elif current.device == dest.device:  # trained - global, in the model's dtype, as UpdateEncoder forms it
                torch.sub(current.view(dtype), self.global_rows[span.name][here].view(dtype), out=dest.view(dtype))
            else:  # formed on the device, then copied to the host
                dest.view(dtype).copy_(current.view(dtype) - self.global_rows[span.name][here].view(dtype))
            if not values:
                self.bad += count_nonfinite([dest.view(dtype)])  # read only by ShardedGroup.nonfinite
            at += piece.nbytes
        return out

    def pack_widened(self, index: int, residual: torch.Tensor | None) -> torch.Tensor:
        """The pieces of update chunk ``index`` this rank holds, as fp32 (the delta ``pack`` forms, widened), plus its
        error-feedback residual of them where it keeps one (``e + delta``, as an unsharded client corrects it): what
        the leader encodes a compressed chunk from."""
        x = self.pack(index, values=False).view(DTYPES[self.plan.chunks[index].dtype]).float()
        return x.add_(residual) if residual is not None else x

    def widened_counts(self, index: int) -> list[int]:
        """Each rank's elements of chunk ``index``, rank by rank: what it gathers widened to fp32."""
        item = self.plan.chunks[index].itemsize
        return [counts[index] // item for counts in self.counts]

    def widened_places(self, index: int) -> list[tuple[int, int, int]]:
        """(position among the gathered fp32 pieces, first element in the chunk, elements) of every rank's pieces of
        chunk ``index``, rank by rank: ``unpack`` by element, for the leader's fp32 chunk."""
        item, at, places = self.plan.chunks[index].itemsize, 0, []
        for rank_pieces in self.giving:
            for piece in rank_pieces[index]:
                places.append((at, piece.chunk_start // item, piece.nbytes // item))
                at += piece.nbytes // item
        return places

    def unpack(self, index: int, gathered: np.ndarray, into: np.ndarray) -> None:
        """The leader: every rank's pieces of chunk ``index`` (``gathered``, rank by rank) into the chunk ``into``."""
        at = 0
        for rank_pieces in self.giving:
            for piece in rank_pieces[index]:
                into[piece.chunk_start:piece.chunk_stop] = gathered[at:at + piece.nbytes]
                at += piece.nbytes



class ShardedGroup:
    """What every rank of a sharded group does with the chunks: take the model, send an update."""

    def __init__(self, comm: MPI.Comm, model: ShardedModel, plan: ExchangeLayout,
                 compressor: UpdateCompressor | None = None):
        """``compressor``: the leader's, under compression.method (it encodes each gathered chunk)."""
        self.group, self.model, self.plan, self.compressor = comm, model, plan, compressor
        self.leader = comm.Get_rank() == 0
        self.largest = max(c.nbytes for c in plan.chunks)
        self.slots = plan.inflight + 1  # a chunk's slot is free again once the sends after it are posted
        self.ring = [host_bytes(self.largest) for _ in range(self.slots)]
        for slot in self.ring:
            slot[:] = 0  # alignment padding between tensors stays zero on the wire, as in a flat buffer
        self.gathered = host_bytes(self.largest) if self.leader else None
        self.fresh = False  # the shard holds the global model as taken, untrained
        if plan.codec is not None:  # compressed: one fp32 chunk at a time, and a ring of its encodings
            widest = max(c.nbytes // c.itemsize for c in plan.chunks)
            self.wide = torch.zeros(widest)  # the leader's fp32 chunk
            self.rows = np.zeros(widest, dtype=np.float32)  # every rank's pieces gathered, or residuals scattered
            self.mine = torch.zeros(widest)  # this rank's residual rows of a chunk
            self.wire_ring = [host_bytes(max(w.nbytes for w in plan.wire)) for _ in range(self.slots)] \
                if self.leader else []

    def take_model(self, chunks: Iterator[tuple[int, np.ndarray]] | None) -> None:
        """Every rank: the global model, chunk by chunk, broadcast over the group from the leader (which reads
        ``chunks`` as they land from the server)."""
        for index, chunk in enumerate(self.plan.chunks):
            if self.leader:
                assert chunks is not None
                got, buffer = next(chunks)
                assert got == index
            else:
                buffer = self.ring[0][:chunk.nbytes]
            wait(self.group.Ibcast([buffer, MPI.BYTE], root=0))
            self.model.take(index, buffer)
        self.fresh = True

    def gathered_chunks(self, values: bool = False) -> Iterator[np.ndarray]:
        """Every rank: the update (or the values), chunk by chunk; the leader's yields are the chunks to send (a
        ring slot stays untouched until ``plan.inflight`` later chunks were handed out), the others' nothing."""
        for index, chunk in enumerate(self.plan.chunks):
            mine = self.model.pack(index, values).numpy()
            sizes = [counts[index] for counts in self.model.counts]
            if self.leader:
                assert self.gathered is not None
                wait(self.group.Igatherv([mine, MPI.BYTE],
                                         [self.gathered, (sizes, displacements(sizes)), MPI.BYTE], root=0))
                out = self.ring[index % self.slots][:chunk.nbytes]
                self.model.unpack(index, self.gathered, out)
                yield out
            else:
                wait(self.group.Igatherv([mine, MPI.BYTE], None, root=0))

    def update_chunks(self, client: int, round_: int, residuals: ResidualStore | None,
                      usable: bool) -> Iterator[np.ndarray]:
        """Every rank: ``client``'s update as it travels, chunk by chunk: gathered (``gathered_chunks``), or
        compressed by the leader (``compressed_chunks``) under compression.method."""
        if self.plan.codec is None:
            return self.gathered_chunks()
        return self.compressed_chunks(client, round_, residuals, usable)

    def compressed_chunks(self, client: int, round_: int, residuals: ResidualStore | None,
                          usable: bool) -> Iterator[np.ndarray]:
        """Every rank: the update compressed chunk by chunk (compression.method), the leader's yields the encoded
        chunks to send. Each rank widens its pieces to fp32 and adds its rows of the client's error-feedback
        residual (top-k with error feedback); the leader gathers them into the chunk, encodes it as an unsharded
        client encodes its chunk (the same noise by element), and, with error feedback, scatters what was not sent
        back to the ranks that own it, which keep it as the client's new residual rows. An update the server will
        not use (``usable`` false) leaves the residuals as they were, as on an unsharded rank."""
        store = residuals if usable else None  # error feedback for this update
        stream = self.compressor.stream(round_, client) if self.compressor is not None else None
        for index, chunk in enumerate(self.plan.chunks):
            sizes = self.model.widened_counts(index)
            mine = self.model.pack_widened(index, store.read(client, index) if store is not None else None)
            if not self.leader:
                wait(self.group.Igatherv([mine.numpy(), MPI.FLOAT], None, root=0))
                if store is not None:
                    kept = self.mine[:sizes[self.group.Get_rank()]]
                    wait(self.group.Iscatterv(None, [kept.numpy(), MPI.FLOAT], root=0))
                    store.write(client, index, kept)
                continue
            assert self.compressor is not None and self.plan.codec is not None  # the leader's, under compression
            pieces = (sizes, displacements(sizes))
            wait(self.group.Igatherv([mine.numpy(), MPI.FLOAT], [self.rows, pieces, MPI.FLOAT], root=0))
            x = self.wide[:chunk.nbytes // chunk.itemsize].zero_()  # alignment padding: zero, as in a flat buffer
            places = self.model.widened_places(index)
            for at, first, count in places:
                x[first:first + count] = torch.from_numpy(self.rows[at:at + count])
            out = self.wire_ring[index % self.slots][:self.plan.wire[index].nbytes]
            self.compressor.encode_chunk(index, x, stream, out)
            if store is not None:
                assert isinstance(self.plan.codec, TopK)  # the only codec with error feedback (config checks)
                self.plan.codec.subtract(out, x.numel(), x)  # x now holds what was not sent
                for at, first, count in places:
                    self.rows[at:at + count] = x[first:first + count].numpy()
                kept = self.mine[:sizes[0]]
                wait(self.group.Iscatterv([self.rows, pieces, MPI.FLOAT], [kept.numpy(), MPI.FLOAT], root=0))
                store.write(client, index, kept)
            yield out

    def start_client(self) -> None:
        """Before a logical client trains: the round's global model, unless it was just taken."""
        if not self.fresh:
            self.model.reset()
        self.fresh = False

    def nonfinite(self) -> int:
        """NaN and Inf values in the update formed from the trained model, over the group (every rank learns the
        total): one pass over this rank's pieces before anything is sent, as a header says whether its chunks may
        be used."""
        self.model.bad = 0
        for index in range(len(self.plan.chunks)):
            self.model.pack(index, values=False)
        return int(self.group.allreduce(self.model.bad, op=MPI.SUM))

    def costs(self, meter: CostMeter) -> dict[str, float]:
        """The group's cost since the last call: CPU-seconds and bytes written summed over its ranks, and its
        largest peak RSS (every rank learns them)."""
        spent = meter.since_last()
        summed = self.group.allreduce(np.array([spent["cpu_seconds"], spent.get("bytes_written", 0.0)]), op=MPI.SUM)
        peak = self.group.allreduce(peak_rss_bytes(), op=MPI.MAX)
        out = {"rank_cpu_seconds": float(summed[0]), "rank_peak_rss_bytes": int(peak)}
        if "bytes_written" in spent:
            out["rank_bytes_written"] = float(summed[1])
        return out


def receive_ring(comm: MPI.Comm, tag: int, group: ShardedGroup) -> Iterator[tuple[int, np.ndarray]]:
    """The leader: the server's model chunks as they land, at most ``plan.inflight`` in flight; chunk k lands in
    ring slot k mod (inflight + 1), free again once the group has taken chunk k - inflight - 1 (the generator is
    resumed only then)."""
    plan, ring = group.plan, group.ring
    pending: deque[MPI.Request] = deque()
    posted = 0
    for index, chunk in enumerate(plan.chunks):
        while posted < len(plan.chunks) and len(pending) < plan.inflight:
            slot = ring[posted % len(ring)][:plan.chunks[posted].nbytes]
            pending.append(comm.Irecv([slot, MPI.BYTE], source=protocol.SERVER, tag=tag))
            posted += 1
        wait(pending.popleft())
        wake(comm, protocol.SERVER)  # its send is complete: it may post the next
        yield index, ring[index % len(ring)][:chunk.nbytes]


def displacements(sizes: list[int]) -> list[int]:
    """Where each rank's part starts in a gathered buffer of parts ``sizes`` long, back to back (``Igatherv``)."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
