"""``clients.sharding: fsdp``: a logical client whose model is sharded over the R ranks of its group.

The server sees the group's first rank, its leader, exactly as it sees an unsharded client rank: the same headers,
the same chunks of the same flat layout, in the same order, out and back. No rank of the group holds the whole model
or the whole update:

- **Out.** The leader receives each chunk of the global model into a small ring of chunk buffers and broadcasts it
  over the group; every rank copies the bytes it owns (``mpifl.wire.shards``) into its FSDP shard and drops the rest.
- **Training.** Every rank trains on its share of each batch; FSDP gathers one unit's parameters at a time and
  reduce-scatters the gradients (``mpifl.learning.sharding``).
- **Back.** Chunk by chunk, every rank forms its pieces of the update (the delta against the global rows it kept,
  elementwise in the model's dtype as an unsharded client forms it) and the leader gathers them into the chunk it
  sends, while the chunks before it are still in flight to the server.

So the server folds a sharded client's update exactly as it folds an unsharded one's: its result differs from an
unsharded client's only by the training's own rounding (the shares' gradient sums), bitwise the same for a fixed R on
any number of groups. Each rank of a group holds its rows of the parameters, gradients, optimizer state and the
global model, one FSDP unit gathered at a time, and a few chunks.

The group's own orders, the chunks and the pieces travel over the group's MPI communicator (non-blocking calls
waited on with the transport's backoff, so a waiting rank sleeps instead of spinning); FSDP's collectives over the
group's ``torch.distributed`` process group, built once at start-up.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from mpifl.aggregation.strategies import make_strategy
from mpifl.algorithms import model_streams
from mpifl.algorithms.ditto import ShardPersonalModels
from mpifl.config import Config
from mpifl.learning.datasets import ClientData
from mpifl.learning.device import resolve_device, use_deterministic_kernels
from mpifl.learning.models import build_model
from mpifl.learning.sharding import (
    ShardedParallel,
    build_sharded,
    is_sharded,
    load_pretrained_rows,
    own_rows,
    shard_buffers,
)
from mpifl.learning.trainers import (
    CausalLMTrainer,
    ConfiguredTrainer,
    TorchTrainer,
    Trainer,
    TrainResult,
    local_steps,
    make_trainer,
)
from mpifl.logs import log
from mpifl.metrics import CostMeter, peak_rss_bytes
from mpifl.planning.seeds import client_seed, personal_seed
from mpifl.roles.client import ClientFailure
from mpifl.roles.encoding import UpdateCompressor, count_nonfinite
from mpifl.roles.group import rendezvous_store
from mpifl.roles.launch import startup_limit
from mpifl.roles.sharded_state import ShardedState, every_rank, open_sharded_state, rows_of
from mpifl.storage.residuals import ResidualStore
from mpifl.storage.rundir import ResumePoint
from mpifl.units import format_bytes
from mpifl.wire import protocol
from mpifl.wire.codecs import TopK
from mpifl.wire.flat import DTYPES, build_spec, split_tensors
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import host_bytes, return_freed_memory
from mpifl.wire.shards import owned_spans, pieces_by_chunk
from mpifl.wire.spec import CONTROL, ModelSpec
from mpifl.wire.transport import ProgressReporter, recv_object, send_chunks, send_object, wait, wake

INIT, MODEL, TRAIN, SETTLE, PERSIST, STOP = "init", "model", "train", "settle", "persist", "stop"


@dataclass(frozen=True)
class GroupStep:
    """The leader to its group: what to do together now."""

    kind: str  # INIT: send the freshly built model (the out-of-core server's round 0); MODEL: take the global model;
    # TRAIN: train ``client`` and send its update; SETTLE: a header arrived, put back the ``dropped`` clients'
    # per-client state; PERSIST: publish this rank's per-client state of ``round`` in ``folder``; STOP: the run is over
    client: int = -1
    seed: int = 0
    steps: int | None = None  # the client's own local steps (fedcompass), else the config's
    personal: int = 0  # the seed of the client's personal-model training (train.ditto_lambda)
    dropped: tuple[int, ...] = ()  # SETTLE: the server's note of clients dropped past their deadline
    round: int = -1  # PERSIST
    folder: str = ""  # PERSIST


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

    def element_spans(self, index: int) -> list[list[tuple[int, int]]]:
        """Each rank's pieces of chunk ``index`` as element ranges of the chunk, rank by rank, in piece order."""
        item = self.plan.chunks[index].itemsize
        return [[(p.chunk_start // item, p.chunk_stop // item) for p in rank_pieces[index]]
                for rank_pieces in self.giving]

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
                displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
                wait(self.group.Igatherv([mine, MPI.BYTE],
                                         [self.gathered, (sizes, displacements), MPI.BYTE], root=0))
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
            spans = self.model.element_spans(index)
            sizes = [sum(b - a for a, b in rank_spans) for rank_spans in spans]
            displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
            mine = self.model.pack_widened(index, store.read(client, index) if store is not None else None)
            if not self.leader:
                wait(self.group.Igatherv([mine.numpy(), MPI.FLOAT], None, root=0))
                if store is not None:
                    kept = self.mine[:sizes[self.group.Get_rank()]]
                    wait(self.group.Iscatterv(None, [kept.numpy(), MPI.FLOAT], root=0))
                    store.write(client, index, kept)
                continue
            assert self.compressor is not None and self.plan.codec is not None  # the leader's, under compression
            wait(self.group.Igatherv([mine.numpy(), MPI.FLOAT], [self.rows, (sizes, displacements), MPI.FLOAT],
                                     root=0))
            x = self.wide[:chunk.nbytes // chunk.itemsize].zero_()  # alignment padding: zero, as in a flat buffer
            at = 0
            for rank_spans in spans:
                for a, b in rank_spans:
                    x[a:b] = torch.from_numpy(self.rows[at:at + b - a])
                    at += b - a
            out = self.wire_ring[index % self.slots][:self.plan.wire[index].nbytes]
            self.compressor.encode_chunk(index, x, stream, out)
            if store is not None:
                assert isinstance(self.plan.codec, TopK)  # the only codec with error feedback (config checks)
                self.plan.codec.subtract(out, x.numel(), x)
                at = 0
                for rank_spans in spans:
                    for a, b in rank_spans:
                        self.rows[at:at + b - a] = x[a:b].numpy()
                        at += b - a
                kept = self.mine[:sizes[0]]
                wait(self.group.Iscatterv([self.rows, (sizes, displacements), MPI.FLOAT], [kept.numpy(), MPI.FLOAT],
                                          root=0))
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


class ShardedLeader:
    """The group's first rank: serves the server's rounds as a client rank does, for the whole group."""

    def __init__(self, comm: MPI.Comm, group: ShardedGroup, trainer: Trainer,
                 local_data: Mapping[int, tuple[ClientData | None, ClientData | None]], *, seed: int,
                 accept_failures: bool, parallel: ShardedParallel, state: ShardedState | None):
        self.comm, self.group, self.trainer, self.local_data = comm, group, trainer, local_data
        self.seed, self.accept_failures, self.parallel, self.state = seed, accept_failures, parallel, state
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.progress = ProgressReporter(comm)
        self.progress.attach(group.model.module)
        self.meter = CostMeter()
        self.first = True

    def order(self, step: GroupStep) -> None:
        """Tell the other ranks of the group what to do now."""
        for member in range(1, self.group.group.Get_size()):
            send_object(self.group.group, step, member, protocol.GROUP)

    def upload_initial(self) -> None:
        """The out-of-core server's round 0: the freshly built model, gathered chunk by chunk."""
        self.order(GroupStep(INIT))
        send_chunks(self.comm, [protocol.SERVER], protocol.INIT, self.group.gathered_chunks(values=True),
                    self.group.plan.inflight)

    def run(self) -> None:
        """Serve rounds until the server says stop; then release the group."""
        while True:
            header = recv_object(self.comm, protocol.SERVER, protocol.HEADER)
            if not isinstance(header, protocol.Header):
                raise RuntimeError(f"rank {self.rank}: the server sent {header!r} where a header belongs")
            if self.state is not None and self.state.journal is not None:  # before anything reads or publishes it
                self.order(GroupStep(SETTLE, dropped=tuple(header.dropped)))
                self.state.settle(header.dropped, self.rank)
            if isinstance(header, protocol.Stop):
                break
            if isinstance(header, protocol.PersistOrder):
                self.persist(header)
                continue
            if type(header) is not protocol.RoundOrder:  # config checks refuse what would send anything else
                raise RuntimeError(f"rank {self.rank}: the server sent {header!r}, which a sharded client group "
                                   "cannot serve")
            self.progress.start_round(header.round)
            if header.clients:
                self.serve_round(header)
        self.order(GroupStep(STOP))
        self.progress.close()

    def persist(self, header: protocol.PersistOrder) -> None:
        """Every rank of the group publishes its rows of its clients' vectors for the checkpoint; the leader
        acknowledges with all their files."""
        assert self.state is not None  # the server asks only with per-client state, which the group then keeps
        self.order(GroupStep(PERSIST, round=header.round, folder=header.folder))
        mine = self.state.persist(Path(header.folder), self.rank, header.round)
        names = self.group.group.gather(mine, root=0)
        send_object(self.comm, names, protocol.SERVER, protocol.RESIDUALS)

    def serve_round(self, header: protocol.RoundOrder) -> None:
        """Take the global model with the group, then train and send each logical client in id order."""
        self.order(GroupStep(MODEL))
        self.group.take_model(receive_ring(self.comm, protocol.round_tag(protocol.MODEL, header.round), self.group))
        steps = dict(zip(header.clients, header.steps))
        own = self.trainer.cfg.local_steps if isinstance(self.trainer, ConfiguredTrainer) else None
        meta_tag, update_tag = (protocol.round_tag(kind, header.round) for kind in (protocol.META, protocol.UPDATE))
        for client in header.clients:
            began = time.perf_counter()
            step = GroupStep(TRAIN, client, client_seed(self.seed, header.round, client), steps.get(client, own),
                             personal=personal_seed(self.seed, header.round, client))
            self.order(step)
            dispatched = time.perf_counter()
            result = train_client(self.group, self.trainer, self.local_data, step, round_=header.round,
                                  rank=self.rank, state=self.state)
            trained = time.perf_counter()
            error = checked_update(self.group, step, self.accept_failures, self.rank)
            metrics = {**result.metrics, **self.group.costs(self.meter),
                       "group_setup_seconds": self.parallel.setup_seconds if self.first else 0.0,
                       "group_dispatch_seconds": dispatched - began, "group_train_seconds": trained - dispatched}
            self.first = False
            meta = protocol.UpdateMeta(client, result.num_samples, time.perf_counter() - began, metrics, error,
                                       result.local_steps)
            send_object(self.comm, meta, protocol.SERVER, meta_tag)
            residuals = self.state.residuals if self.state is not None else None
            send_chunks(self.comm, [protocol.SERVER], update_tag,
                        self.group.update_chunks(client, header.round, residuals, usable=error is None),
                        self.group.plan.inflight)


class ShardedMember:
    """A sharded group's other rank: do what the leader orders, with the group."""

    def __init__(self, group: ShardedGroup, trainer: Trainer,
                 local_data: Mapping[int, tuple[ClientData | None, ClientData | None]], *, accept_failures: bool,
                 state: ShardedState | None):
        self.group, self.trainer, self.local_data = group, trainer, local_data
        self.accept_failures, self.state = accept_failures, state
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.meter = CostMeter()

    def run(self) -> None:
        """Follow the leader's steps until it says stop."""
        while True:
            step = recv_object(self.group.group, 0, protocol.GROUP)
            if not isinstance(step, GroupStep):
                raise RuntimeError(f"rank {self.rank}: the group's leader sent {step!r} where a GroupStep belongs")
            if step.kind == STOP:
                return
            if step.kind in (SETTLE, PERSIST):
                self.keep_state(step)
            elif step.kind == INIT:
                drain(self.group.gathered_chunks(values=True))
            elif step.kind == MODEL:
                self.group.take_model(None)
            else:
                train_client(self.group, self.trainer, self.local_data, step, round_=-1, rank=self.rank,
                             state=self.state)
                error = checked_update(self.group, step, self.accept_failures, self.rank)
                self.group.costs(self.meter)
                residuals = self.state.residuals if self.state is not None else None
                drain(self.group.update_chunks(step.client, -1, residuals, usable=error is None))

    def keep_state(self, step: GroupStep) -> None:
        """SETTLE: put back the dropped clients' vectors; PERSIST: publish this rank's rows of its clients' vectors
        and hand the file's name to the leader."""
        assert self.state is not None  # the leader orders these only of a group that keeps per-client state
        if step.kind == SETTLE:
            self.state.settle(step.dropped, self.rank)
        else:
            self.group.group.gather(self.state.persist(Path(step.folder), self.rank, step.round), root=0)


def drain(chunks: Iterator[np.ndarray]) -> None:
    """Take part in a gathered stream whose chunks this rank does not send (a member's side)."""
    for _ in chunks:
        pass


def train_client(group: ShardedGroup, trainer: Trainer,
                 local_data: Mapping[int, tuple[ClientData | None, ClientData | None]], step: GroupStep, *,
                 round_: int, rank: int, state: ShardedState | None) -> TrainResult:
    """Every rank: train ``step.client`` with the group from the round's global model, inside its client half
    where the run keeps per-client state, which then keeps the client's new vector over this rank's rows."""
    group.start_client()
    train, _ = local_data.get(step.client, (None, None))
    half = state.half if state is not None else None
    try:
        if state is not None and state.personal is not None:  # Ditto: v_i first, then w from the global model
            state.personal.train(step.client, group.model.module, train, step.personal)
        with local_steps(trainer, step.steps), half.training(step.client) if half else contextlib.nullcontext():
            result = trainer.train(group.model.module, train, step.seed)
        if state is not None and state.half is not None:
            state.half.update(step.client, result.local_steps or 0, state.weight(protocol.UpdateMeta(
                step.client, result.num_samples, 0.0, dict(result.metrics), local_steps=result.local_steps)))
        return result
    except Exception as err:
        when = f" in round {round_}" if round_ >= 0 else ""
        raise ClientFailure(f"logical client {step.client} failed{when} on rank {rank}, a rank of its sharded group "
                            f"(clients.sharding: fsdp): {type(err).__name__}: {err} (a group cannot go on "
                            "mid-collective, so the job ends)") from err


def checked_update(group: ShardedGroup, step: GroupStep, accept_failures: bool, rank: int) -> str | None:
    """Every rank: the update's NaN/Inf values over the group; the client's error under accept_failures, else the
    job ends on every rank of the group."""
    bad = group.nonfinite()
    if not bad:
        return None
    error = f"update contains {bad} NaN/Inf values"
    if not accept_failures:
        raise FloatingPointError(f"logical client {step.client}, trained by the sharded group of rank {rank}: {error} "
                                 "(clients.accept_failures=false); if its training diverged, lower train.lr or set "
                                 "train.max_grad_norm, or drop such clients with clients.accept_failures=true")
    return error


def serve_sharded(federation: MPI.Comm | None, group_comm: MPI.Comm, cfg: Config, spec: ModelSpec,  # noqa: PLR0913 - keyword-only, each from the runner
                  plan: ExchangeLayout, local: Mapping[int, tuple[ClientData | None, ClientData | None]], *,
                  upload_initial: bool, run_dir: Path | None, resume: ResumePoint | None) -> None:
    """Every rank of a sharded group (the leader with the ``federation``): join the group's process group, build
    this rank's shard of the model and its rows of the clients' state, then serve the rounds (the leader) or follow
    the leader (the others)."""
    rank, size = group_comm.Get_rank(), group_comm.Get_size()
    return_freed_memory()  # memory before speed: what sharding is for (mpifl.wire.memory says why)
    timeout = startup_limit([], spec.total_bytes)
    parallel = ShardedParallel(rank, size)
    device = resolve_device(cfg.train.device)
    if device.type == "cuda" and cfg.train.deterministic:
        use_deterministic_kernels()
    store, address = rendezvous_store(None, size, timeout) if rank == 0 else (None, None)
    address = group_comm.bcast(address, root=0)
    if rank != 0:
        store, _ = rendezvous_store(address, size, timeout)
    assert store is not None
    parallel.start(store, device, timeout)
    began = time.perf_counter()
    module = build_model(cfg.model, cfg.seed, streams=model_streams(cfg.client_rule))
    exchanged, _ = split_tensors(module, cfg.model.exchange == "trainable", cfg.model.local)
    if build_spec(exchanged).hash != spec.hash:
        raise RuntimeError(f"rank {MPI.COMM_WORLD.Get_rank()}: the model built for sharding differs from the "
                           "exchanged layout")
    streams = shard_buffers(module, CONTROL, size, rank) if hasattr(module, CONTROL) else []
    build_sharded(module, cfg.seed, parallel, device)
    if cfg.model.transformers.pretrained:
        assert cfg.model.transformers.path is not None  # config checks refuse pretrained without a path
        load_pretrained_rows(module, cfg.model.transformers.path, size, rank)
    parallel.setup_seconds += time.perf_counter() - began
    trainer = make_trainer(cfg.train)
    assert isinstance(trainer, (TorchTrainer, CausalLMTrainer))  # the config checks allow only these
    trainer.parallel = parallel
    model = ShardedModel(module, spec, plan, rank, size, cfg.strategy.update == "delta", cfg.statistics_as_values,
                         row_buffers=streams)
    tensors = tensors_by_name(module)
    rows = rows_of(module, spec, model.global_rows, [tensors[name] for name in streams], every_rank(group_comm))
    pieces = [sum(b - a for a, b in model.element_spans(index)[rank]) for index in range(len(plan.chunks))]
    state = open_sharded_state(
        cfg, rows, pieces, (rank, size), MPI.COMM_WORLD.Get_rank(), sorted(local), run_dir, resume,
        make_strategy(cfg.strategy).weight_of,
        lambda store: ShardPersonalModels(rows, store, trainer, cfg.train.ditto_lambda, model.reset,
                                          cfg.train.grad_accum_steps))
    compressor = UpdateCompressor(plan, cfg.seed, whole=False) if plan.codec is not None and rank == 0 else None
    group = ShardedGroup(group_comm, model, plan, compressor)
    if federation is None:
        ShardedMember(group, trainer, local, accept_failures=cfg.clients.accept_failures, state=state).run()
    else:
        if federation.Get_rank() == 1:
            log(f"client groups of {size} ranks shard each client's model with FSDP over "
                f"{parallel.backend}: this rank holds {format_bytes(model.held_bytes)} of the "
                f"{format_bytes(spec.total_bytes)} exchanged (built in {parallel.setup_seconds:.1f} s)", rank=1)
        leader = ShardedLeader(federation, group, trainer, local, seed=cfg.seed,
                               accept_failures=cfg.clients.accept_failures, parallel=parallel, state=state)
        if federation.Get_rank() == 1 and upload_initial and cfg.server.state == "disk":
            leader.upload_initial()
        leader.run()
    parallel.close()
