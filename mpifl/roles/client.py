"""Ranks 1..N: host logical clients, receive the global model, train, stream updates back."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from mpi4py import MPI

from mpifl.learning.datasets import ClientData
from mpifl.learning.device import DeviceReplica, deterministic_hint
from mpifl.learning.trainers import (
    ConfiguredTrainer,
    Evaluator,
    TrainContext,
    Trainer,
    TrainResult,
    accepts_context,
    local_steps,
)
from mpifl.logs import log
from mpifl.metrics import peak_rss_bytes
from mpifl.planning.federation import group_of
from mpifl.planning.seeds import GROUP_COMPRESSION, client_seed, personal_seed
from mpifl.privacy.dp import ClientPrivacy
from mpifl.privacy.secagg import SecureAggregation
from mpifl.roles.client_state import DeclaredVectors
from mpifl.roles.control import ClientControls, ClientDynamics
from mpifl.roles.encoding import GroupSum, UpdateCompressor, UpdateEncoder, count_nonfinite
from mpifl.roles.lending import StateLending
from mpifl.roles.personal import PersonalModels, PersonalTensors
from mpifl.storage.residuals import ResidualStore, UndoJournal, save_snapshot
from mpifl.units import range_list
from mpifl.wire import protocol
from mpifl.wire.flat import DTYPES, FlatModel
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import host_bytes
from mpifl.wire.spec import element_offsets
from mpifl.wire.transport import ProgressReporter, pass_on, recv_object, relay_chunks, send_chunks, send_object

if TYPE_CHECKING:  # roles.group imports roles.client's neighbours only: the type alone, no import at run time
    from mpifl.roles.group import GroupLeader


class ClientFailure(RuntimeError):
    """A logical client's training raised: the message names the client, its rank and the round."""


@dataclass(kw_only=True)
class ClientParts:
    """What a client rank works with, each part built from its own config section."""

    plan: ExchangeLayout
    trainer: Trainer
    seed: int  # the root seed: each logical client's seed derives from it, the round and its id
    num_clients: int = 0  # clients.num_clients: a plug-in trainer's TrainContext
    delta: bool  # strategy.update: send trained - global instead of the trained weights
    statistics_as_values: bool = False  # Config.statistics_as_values: statistics travel as values in a delta
    accept_failures: bool  # clients.accept_failures: a failing client is reported, not fatal
    groups: int = 0  # clients.groups: sum each reduction group's updates here before sending
    # a participant's weight (groups: in its group's sum; secure aggregation: in its masked update), from its header
    weight: Callable[[protocol.UpdateMeta], float] = lambda meta: float(meta.num_samples)
    replica: DeviceReplica | None = None  # train.device: the model on the device, beside the host buffer
    evaluate: Evaluator | None = None  # federated evaluation of the received model, when due
    evaluate_every: int = 0
    rounds: int = 0
    privacy: ClientPrivacy | None = None  # DP: clip each update to the round's bound (local DP: noise it too)
    secagg: SecureAggregation | None = None  # send updates in fixed point, masked (simulated secure aggregation)
    residuals: ResidualStore | None = None  # top-k with error feedback: what each hosted client has not sent yet
    state: ResidualStore | None = None  # the rank's one store of per-client state, any kind: what checkpoints publish
    controls: ClientControls | ClientDynamics | None = None  # scaffold's c_i, feddyn's g_i: one vector per client
    personal: PersonalTensors | None = None  # model.local (FedBN, FedPer): each hosted client's local tensors
    personal_models: PersonalModels | None = None  # train.ditto_lambda (Ditto): each hosted client's own model
    declared: DeclaredVectors | None = None  # a plug-in trainer's per-client vectors (its client_state)
    note: Callable[..., None] = lambda state, round_=None, **detail: None  # the rank's notes in the run dir
    group: GroupLeader | None = None  # clients.ranks_per_client > 1: this rank leads a group that trains together
    lending: StateLending | None = None  # per_round placement with per-client state: each round's loans of it
    # clients.accept_failures with SCAFFOLD or FedDyn: the round's writes of c_i or g_i, undone for dropped clients
    journal: UndoJournal | None = None


def group_members(clients: tuple[int, ...], groups: int, assigned: tuple[int, ...] = ()) -> list[tuple[int, list[int]]]:
    """A rank's participants by reduction group: (group, members), both ascending. A client's group is c mod
    ``groups``, or its entry in ``assigned`` (the header's groups under clients.group_by 'cost')."""
    group = dict(zip(clients, assigned)) if assigned else {c: group_of(c, groups) for c in clients}
    out: dict[int, list[int]] = {}
    for c in sorted(clients):
        out.setdefault(group[c], []).append(c)
    return sorted(out.items())


class ClientRank:
    """One model in memory; its logical clients train one after another in it."""

    def __init__(self, comm: MPI.Comm, flat: FlatModel,
                 local_data: Mapping[int, tuple[ClientData | None, ClientData | None]], parts: ClientParts):
        self.comm, self.flat, self.local_data, self.parts = comm, flat, local_data, parts
        self.rank = comm.Get_rank()
        self.trainer = parts.trainer
        assert flat.bytes is not None  # the rank's model lives in host memory (a device copy is the replica)
        self.chunk_buffers = parts.plan.chunk_slices(flat.bytes)
        self.encoder = UpdateEncoder(flat, parts.plan, parts.delta, parts.statistics_as_values)
        self.replica = parts.replica
        self.work = parts.replica.flat if parts.replica else flat  # the model that trains
        self.group_sum = GroupSum(self.work, parts.plan, separate=self.replica is not None) if parts.groups else None
        self.snapshot: torch.Tensor | None = None
        self.chain_slots: list[np.ndarray] | None = None  # transport.reduce=chain: the running sum's receive ring
        self.chain_free: list[np.ndarray] = []  # chain: host bytes for a group sum, free until the next round's
        self.held: dict[int, tuple[protocol.UpdateMeta, list[np.ndarray]]] = {}  # asynchronous FL: trained, not sent
        self.clip: float | None = None  # DP: this round's L2 bound
        self.participants = 0  # this round's logical clients on every rank together (a trainer's TrainContext)
        self.context = accepts_context(self.trainer)  # whether the trainer takes a TrainContext
        self.cohort: tuple[int, ...] = ()  # secure aggregation: the round's participants
        self.first_element = element_offsets(parts.plan.chunks)
        self.compressor = UpdateCompressor(parts.plan, parts.seed, parts.residuals) \
            if parts.plan.codec is not None else None
        # a group's members may be trained again to find a non-finite update (_sum_clients): training on the host
        # with nothing kept per client, no update protected on its own (DP, secure aggregation), no group of ranks
        self.group_check_deferred = all(k is None for k in (
            parts.controls, parts.personal, parts.personal_models, parts.residuals, parts.privacy, parts.secagg,
            parts.group, parts.replica, parts.declared))
        self.vectors: dict[str, torch.Tensor] = {}  # the training client's declared vectors, kept once it is usable
        self.progress = ProgressReporter(comm)  # the server's watchdog hears this rank's forward passes
        self.progress.attach(self.work.module)

    def run(self) -> None:
        """Serve rounds until the server says stop."""
        self._serve_until_stop()
        self.progress.close()

    def _serve_until_stop(self) -> None:
        """The round loop: each header says train, hold, publish residuals, or stop."""
        while True:
            header = recv_object(self.comm, protocol.SERVER, protocol.HEADER)
            if not isinstance(header, protocol.RoundHeader):
                raise RuntimeError(f"rank {self.rank}: the server sent {header!r} where a RoundHeader belongs")
            if self.parts.lending is not None:
                self.parts.lending.settle()  # every vector home before it is put back, lent again or published
            if self.parts.journal is not None:  # before anything reads, lends or publishes the state
                self._undo_dropped(header)
            if header.stop:
                self.parts.note("finished")
                return
            if header.persist is not None:
                self.persist(header)
                continue
            self.parts.note("round", header.round)
            self.progress.start_round(header.round)
            self.clip, self.cohort, self.participants = header.clip, header.cohort, header.participants
            if self.parts.lending is not None:
                self.parts.lending.borrow(header)
            if header.hold:
                self.serve_step(header)
            elif header.clients:
                self.serve_round(header)
            if self.parts.lending is not None:
                self.parts.lending.give_back(header)

    def _undo_dropped(self, header: protocol.RoundHeader) -> None:
        """Put back the state of this rank's clients that the server dropped since the last header; keep the
        rest."""
        assert self.parts.journal is not None  # called only with one
        undone = self.parts.journal.settle(header.dropped)
        if undone:
            kept = ["c_i" if isinstance(self.parts.controls, ClientControls) else "g_i"] if self.parts.controls else []
            state = " and ".join(kept + (["trainer state"] if self.parts.declared is not None else []))
            log(f"logical clients {range_list(undone)} were dropped past their deadline: each one's {state} is put "
                "back as it was before it trained", rank=self.rank)

    def persist(self, header: protocol.RoundHeader) -> None:
        """Publish this rank's per-client state of the round just ended (error-feedback residuals, control variates,
        local tensors, personal models: the one store that holds them) for the server's checkpoint, then
        acknowledge."""
        assert header.persist is not None  # run() calls this only for a persist header
        store = self.parts.state
        assert store is not None  # the server asks only with per-client state (Config.client_state), which makes one
        name = save_snapshot(store, store.firsts, Path(header.persist), self.rank, header.round)
        send_object(self.comm, name, protocol.SERVER, protocol.RESIDUALS)

    def serve_round(self, header: protocol.RoundHeader) -> None:
        """Receive the global model once, then train and send each logical client in id order."""
        inflight = self.parts.plan.inflight
        meta_tag, update_tag = (protocol.round_tag(kind, header.round) for kind in (protocol.META, protocol.UPDATE))
        keep = self._receive_global(header)
        if self.group_sum is None:
            for i, client in enumerate(header.clients):
                meta, buffers = self._train(header.round, client, keep, first=i == 0)
                assert buffers is not None  # only a group's sum keeps updates on the device
                send_object(self.comm, meta, protocol.SERVER, meta_tag)
                send_chunks(self.comm, [protocol.SERVER], update_tag, buffers, inflight)
            return
        if header.reduce_stream is not None:
            self._serve_chain(header, keep)
            return
        trained = 0
        for group, members in group_members(header.clients, self.parts.groups, header.groups):
            metas = self._sum_clients(header.round, members, keep, first=trained == 0)
            trained += len(members)
            send_object(self.comm, protocol.GroupMeta(group, metas), protocol.SERVER, meta_tag)
            send_chunks(self.comm, [protocol.SERVER], update_tag, self._group_wire(header.round, group), inflight)

    def _sum_clients(self, round_: int, clients: list[int], keep: torch.Tensor | None,
                     first: bool) -> tuple[protocol.UpdateMeta, ...]:
        """Train ``clients`` (ascending id) and fold their usable updates into a fresh partial sum; their headers.
        ``first``: the first of them is the first this rank trains this round (the model is the global one).

        Where retraining is free of side effects (``group_check_deferred``), the members' NaN/Inf check is one
        check of the group's sum: a finite sum has finite terms, since a NaN or an Inf in any member makes it
        NaN or Inf. Only a sum that is not finite has its members trained again (the same seeds, data and
        starting model: the same updates), each checked on its own as without deferral. On the 93 MB MLP of the
        cross-device task the check was 5 ms of a client's 80 (``profiling/client_slowdown.py``)."""
        deferred = keep is not None and self.group_check_deferred
        metas = self._fold_members(round_, clients, keep, first, check=not deferred)
        assert self.group_sum is not None  # called only with clients.groups (serve_round, _serve_chain)
        if deferred and count_nonfinite(self.group_sum.sums):
            metas = self._fold_members(round_, clients, keep, first=False, check=True)
        return metas

    def _fold_members(self, round_: int, clients: list[int], keep: torch.Tensor | None, first: bool,
                      check: bool) -> tuple[protocol.UpdateMeta, ...]:
        """Train each of ``clients`` and fold its usable update into a fresh partial sum (``check``: each update's
        NaN/Inf first); their headers."""
        assert self.group_sum is not None  # called only with clients.groups (_sum_clients)
        self.group_sum.reset()
        metas = []
        for i, client in enumerate(clients):
            meta, _ = self._train(round_, client, keep, first=first and i == 0, check=check)
            if meta.error is None:
                self.group_sum.add(self.parts.weight(meta))
            metas.append(meta)
        return tuple(metas)

    def _group_wire(self, round_: int, group: int) -> list[np.ndarray]:
        """A group's partial sum as it travels: fp32, or quantized (compression.method) with noise keyed by
        (seed, round, group): the same on any number of ranks."""
        assert self.group_sum is not None  # called only with clients.groups (serve_round)
        sums = self.group_sum.to_host()
        if self.compressor is None:
            return sums
        chunks = [torch.from_numpy(b).view(torch.float32) for b in sums]
        return self.compressor.compress(chunks, round_, group, None, key=GROUP_COMPRESSION)

    def _serve_chain(self, header: protocol.RoundHeader, keep: torch.Tensor | None) -> None:
        """transport.reduce=chain: sum each of this rank's groups (ascending id) into a partial sum of its own,
        then play this rank's hops of the chain (``protocol.chain_hops``): each adds its groups' sums, one after
        another, to the running sum from the hop before and passes that on; the last hop sends it to the server.

        Each addition is ``running += own``, the fold the server would do with the groups' sums arriving point
        to point in group order, so the chain gives the bits of point-to-point groups on any number of ranks.
        A group without a usable update is left out. A rank with k groups keeps k sums until the chain has
        passed: each earlier group's sum is handed over in place, the next forming in spare host bytes (k - 1
        buffers beside the group sum's own, reused round to round)."""
        assert self.group_sum is not None  # serve_round chains only with clients.groups
        assert header.reduce_stream is not None  # serve_round chains only for a header with a stream id
        members = group_members(header.clients, self.parts.groups, header.groups)
        metas: dict[int, tuple[protocol.UpdateMeta, ...]] = {}
        sums: dict[int, list[np.ndarray]] = {}
        handed: list[np.ndarray] = []  # the bytes of the sums kept aside, free again once the chain has passed
        trained = 0
        for i, (group, clients) in enumerate(members):
            metas[group] = self._sum_clients(header.round, clients, keep, first=trained == 0)
            trained += len(clients)
            if i + 1 < len(members):  # keep this sum as it is; the next group's forms in spare bytes
                spare = self.chain_free.pop() if self.chain_free else host_bytes(len(self.group_sum.buffer))
                kept, sums[group] = self.group_sum.hand_over(spare)
                handed.append(kept)
            else:
                sums[group] = self.group_sum.to_host()
        hops = header.chain
        missing = sorted({g for hop in hops for g in hop.groups} ^ set(metas))
        if missing:
            raise RuntimeError(f"rank {self.rank}: round {header.round}'s chain lists groups that this rank does not "
                               f"train, or leaves out groups it does: {missing}")
        running_usable = self._chain_metas(header, metas)
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
        if self.chain_slots is None:
            self.chain_slots = [host_bytes(max(sizes)) for _ in range(self.parts.plan.inflight)]
        pass_on(self.comm, hops, (reduce, update), self.chain_slots, sizes, combine)
        self.chain_free.extend(handed)

    def _chain_metas(self, header: protocol.RoundHeader,
                     metas: dict[int, tuple[protocol.UpdateMeta, ...]]) -> list[bool]:
        """Each hop's GroupMeta, in the chain's order: every member so far (received from the hop before) and
        this hop's groups' members, sent on to the next hop (REDUCE_META) or the server (META). Whether each
        hop's running sum, as it arrives, holds a usable update."""
        assert header.reduce_stream is not None  # _serve_chain runs only for a header with a stream id
        meta_tag, reduce_meta = (protocol.round_tag(k, header.round) for k in (protocol.META, protocol.REDUCE_META))
        running_usable = []
        for hop in header.chain:
            before: tuple[protocol.UpdateMeta, ...] = ()
            if hop.source is not None:
                received = recv_object(self.comm, hop.source, reduce_meta)
                if not isinstance(received, protocol.GroupMeta):
                    raise RuntimeError(f"rank {self.rank}: rank {hop.source} sent {received!r} where the chain's "
                                       "GroupMeta belongs")
                before = received.members
            running_usable.append(any(m.error is None for m in before))
            own = tuple(m for group in hop.groups for m in metas[group])
            send_object(self.comm, protocol.GroupMeta(header.reduce_stream, before + own), hop.dest,
                        meta_tag if hop.dest == protocol.SERVER else reduce_meta)
        return running_usable

    def serve_step(self, header: protocol.RoundHeader) -> None:
        """Asynchronous FL: train the listed clients from the model sent now and keep their updates here;
        then send the held updates the server asks for, in its (virtual-arrival) order."""
        if header.clients:
            keep = self._receive_global(header)
            steps = dict(zip(header.clients, header.steps))
            for i, client in enumerate(header.clients):
                with local_steps(self.trainer, steps.get(client)):
                    meta, buffers = self._train(header.round, client, keep, first=i == 0)
                assert buffers is not None  # asynchronous FL runs without clients.groups (config checks)
                self.held[client] = meta, [np.array(b, copy=True) for b in buffers]
        for client in header.send:
            if client not in self.held:
                raise RuntimeError(f"rank {self.rank}: the server asked for logical client {client}'s update, "
                                   f"which this rank does not hold (it holds {sorted(self.held)})")
            meta, buffers = self.held.pop(client)
            send_object(self.comm, meta, protocol.SERVER, protocol.round_tag(protocol.META, header.round))
            send_chunks(self.comm, [protocol.SERVER], protocol.round_tag(protocol.UPDATE, header.round), buffers,
                        self.parts.plan.inflight)

    def _receive_global(self, header: protocol.RoundHeader) -> torch.Tensor | None:
        """Receive the global model (from the server, or from the parent rank of a broadcast tree, passing it on
        to the header's children); keep a host copy when the header's logical clients will need it."""
        relay_chunks(self.comm, header.parent, header.children, protocol.round_tag(protocol.MODEL, header.round),
                     self.chunk_buffers, self.parts.plan.inflight)
        clients = len(header.clients)
        if self.replica is not None:
            self.replica.load_global()
        # Training (and forming a delta) overwrites the model: keep the global for what follows.
        if not self._needs_host_global(clients):
            return None
        if self.snapshot is None:
            self.snapshot = torch.from_numpy(host_bytes(self.flat.buffer.numel(), touch=False))
        return self.snapshot.copy_(self.flat.buffer)

    def _needs_host_global(self, clients: int) -> bool:
        """Whether the host must keep a copy of the global model: for deltas formed on the host, or to reset
        the host model between logical clients (a device replica resets from its own device copy, and per-client
        state reads the global model there too: ``_anchor``)."""
        if self.replica is not None:
            return self.parts.delta and self.group_sum is None
        return self.parts.delta or self.parts.personal_models is not None or (
            clients > 1 and self.trainer.modifies_weights)

    def _anchor(self, keep: torch.Tensor | None) -> torch.Tensor | None:
        """The round's global model beside the model that trains, for the per-client state's rules (SCAFFOLD's and
        FedDyn's vectors, Ditto's regulariser): the device replica's own copy, or the host copy ``keep``."""
        return self.replica.global_copy if self.replica is not None else keep

    def _train(self, round_: int, client: int, keep: torch.Tensor | None, first: bool,
               check: bool = True) -> tuple[protocol.UpdateMeta, list[np.ndarray] | None]:
        """Reset the model to the global one (after the first client), train ``client``, encode its update
        (``check``: count its NaN/Inf values; a group whose sum is checked instead passes False)."""
        if self.replica is not None:
            self.replica.reset()
        else:
            if not first and keep is not None:
                self.flat.buffer.copy_(keep)
            self.flat.reset_local_state()
        if self.parts.personal is not None:
            self.parts.personal.load(client)
        return self._serve_client(round_, client, keep, check)

    def _serve_client(self, round_: int, client: int, keep: torch.Tensor | None,
                      check_update: bool = True) -> tuple[protocol.UpdateMeta, list[np.ndarray] | None]:
        """Train one logical client and turn its model into the update it sends, with its header (no buffers:
        the update stays on the device for the group's sum)."""
        train, val = self.local_data.get(client, (None, None))
        metrics = self._federated_eval(round_, val)
        start = time.perf_counter()
        anchor = self._anchor(keep)
        if self.parts.personal_models is not None:
            assert anchor is not None  # Ditto's ranks keep the global model (_needs_host_global, _anchor)
            metrics.update(self._personal(round_, client, train, val, anchor))
        result, error = self._train_one(round_, client, train, anchor)
        if error is None and self.parts.personal is not None:
            self.parts.personal.keep(client)
        if error is None and self.parts.controls is not None:
            assert anchor is not None  # scaffold and feddyn send deltas, so the rank keeps the global model
            self.parts.controls.update(client, anchor, result.local_steps or 0, self.parts.weight(
                protocol.UpdateMeta(client, result.num_samples, 0.0, dict(result.metrics),
                                    local_steps=result.local_steps)))
        check = check_update and error is None and (self.trainer.modifies_weights or self.encoder.narrowed)
        if self.replica is not None and self.group_sum is not None:  # the update stays on the device
            buffers, bad = None, self._device_update(check)
        else:
            buffers, bad = self._host_update(round_, client, keep, result, usable=error is None, check=check)
        if self.parts.declared is not None and error is None and not bad:  # else as if it had not trained
            self.parts.declared.keep(client, self.vectors)
        if bad:
            error = f"update contains {bad} NaN/Inf values"
            if not self.parts.accept_failures:
                raise FloatingPointError(f"logical client {client} on rank {self.rank}: {error} "
                                         "(clients.accept_failures=false); if its training diverged, lower "
                                         "train.lr or set train.max_grad_norm, or drop such clients from their "
                                         "rounds with clients.accept_failures=true")
        metrics.update(result.metrics, rank_peak_rss_bytes=peak_rss_bytes())
        if self.replica is not None and self.replica.on_gpu:
            metrics["rank_peak_device_bytes"] = self.replica.peak_bytes()
        meta = protocol.UpdateMeta(client, result.num_samples, time.perf_counter() - start, metrics, error,
                                   result.local_steps)
        return meta, buffers

    def _train_one(self, round_: int, client: int, train: ClientData | None,
                   anchor: torch.Tensor | None = None) -> tuple[TrainResult, str | None]:
        """Local training of one logical client (``anchor``: the global model beside the one that trains, for
        SCAFFOLD's and FedDyn's rules); a raise ends the job, or is its error under accept_failures."""
        controls, seed = self.parts.controls, client_seed(self.parts.seed, round_, client)
        try:
            assert anchor is not None or controls is None  # scaffold and feddyn send deltas: the rank keeps the global
            with controls.training(client, anchor) if controls and anchor is not None else contextlib.nullcontext():
                if self.parts.group is not None:
                    return self._train_in_group(client, train, seed), None
                if self.context:
                    return self.trainer.train(self.work.module, train, seed,  # type: ignore[call-arg]
                                              context=self._context(round_, client)), None
                return self.trainer.train(self.work.module, train, seed), None
        except Exception as err:  # noqa: BLE001 - a failing client is data when accept_failures is on
            if not self.parts.accept_failures or self.parts.group is not None:
                why = ("its group of ranks (clients.ranks_per_client) cannot go on mid-collective"
                       if self.parts.group is not None else "clients.accept_failures=false")
                raise ClientFailure(f"logical client {client} on rank {self.rank} failed in round {round_}: "
                                    f"{type(err).__name__}: {err} ({why}{deterministic_hint(err)})") from err
            return TrainResult(0, {}), f"{type(err).__name__}: {err}{deterministic_hint(err)}"

    def _context(self, round_: int, client: int) -> TrainContext:
        """What a plug-in trainer learns of the client it trains, with the client's declared vectors loaded."""
        declared = self.parts.declared
        if declared is None:
            return TrainContext(client, round_, self.participants, self.parts.num_clients)
        self.vectors, fresh = declared.load(client)
        return TrainContext(client, round_, self.participants, self.parts.num_clients, self.vectors, fresh,
                            declared.covered)

    def _train_in_group(self, client: int, train: ClientData | None, seed: int) -> TrainResult:
        """Train ``client`` with this rank's group (clients.ranks_per_client); its metrics add the group's setup
        (round 1 only), the weights' dispatch to the group, and the training itself, in seconds."""
        assert self.parts.group is not None  # _train_one calls this only for a group's leader
        own_steps = self.trainer.cfg.local_steps if isinstance(self.trainer, ConfiguredTrainer) else None
        controls = self.parts.controls  # SCAFFOLD's c - c_i or FedDyn's g_i, set as the training began: the members'
        costs = self.parts.group.dispatch(client, seed, own_steps, controls.shared if controls else None)
        began = time.perf_counter()
        result = self.trainer.train(self.work.module, train, seed)
        result.metrics.update(costs, group_train_seconds=time.perf_counter() - began)
        return result

    def _device_update(self, check: bool) -> int:
        """The update stays on the device for the group's sum: make it a delta there; its NaN/Inf count."""
        if self.parts.delta:
            assert self.replica is not None  # _serve_client keeps updates on the device only with a replica
            for c in self.parts.plan.chunks:
                self.work.chunk_view(c).sub_(self.replica.global_view(c))
        return count_nonfinite(self.work.chunk_view(c) for c in self.parts.plan.chunks) if check else 0

    def _host_update(self, round_: int, client: int, keep: torch.Tensor | None, result: TrainResult, *,
                     usable: bool, check: bool) -> tuple[list, int]:
        """The update's pipeline on the host: encode (delta, narrowed dtype), check (NaN/Inf), protect (DP clip
        and noise, secure-aggregation mask), compress. Returns the wire buffers and the NaN/Inf count."""
        if self.replica is not None:
            self.replica.to_host()
        buffers = self.encoder.encode(keep)
        bad = self.encoder.count_nonfinite() if check else 0
        if usable and not bad:
            self._protect(buffers, round_, client, result)
        if self.compressor is not None and self.group_sum is None:  # a group's sum is compressed, not its members
            began = time.perf_counter()
            chunks = [torch.from_numpy(b).view(DTYPES[c.dtype]) for c, b in zip(self.parts.plan.chunks, buffers)]
            buffers = self.compressor.compress(chunks, round_, client, self.clip if self.parts.privacy else None,
                                               usable=usable and not bad)
            result.metrics["compress_seconds"] = time.perf_counter() - began
        return buffers, bad

    def _protect(self, buffers: list[np.ndarray], round_: int, client: int, result: TrainResult) -> None:
        """DP: clip (and, local DP, noise) the update; secure aggregation: mask it in fixed point. In place."""
        if self.parts.privacy is None and self.parts.secagg is None:
            return
        chunks = [torch.from_numpy(b).view(DTYPES[w.dtype]) for w, b in zip(self.encoder.wire, buffers)]
        if self.parts.privacy is not None:
            assert self.clip is not None  # with DP every header carries the round's clip bound (roles.server)
            result.metrics.update(self.parts.privacy.apply(chunks, self.first_element, self.clip, round_, client))
        if self.parts.secagg is not None:
            # the header is not complete yet: the weight sees what the server's will (samples, steps, metrics)
            weight = self.parts.weight(protocol.UpdateMeta(client, result.num_samples, 0.0, dict(result.metrics),
                                                           local_steps=result.local_steps))
            result.metrics.update(self.parts.secagg.mask(chunks, self.first_element, weight, self.cohort, round_,
                                                         client))

    def _personal(self, round_: int, client: int, train: ClientData | None, val: ClientData | None,
                  anchor: torch.Tensor) -> dict:
        """Ditto: update and keep ``client``'s personal model (evaluated when federated evaluation is due); a
        raise ends the job, or, under accept_failures, leaves the personal model as it was."""
        assert self.parts.personal_models is not None  # _serve_client calls this only for Ditto
        due = self._evaluation_due(round_, val)
        evaluate = self.parts.evaluate

        def personal_eval() -> dict:
            assert evaluate is not None and val is not None  # due only with an evaluator and a validation split
            return {f"val_personal_{k}": v for k, v in evaluate(self.work.module, val.x, val.y).items()}

        try:
            return self.parts.personal_models.train(client, train, anchor,
                                                    personal_seed(self.parts.seed, round_, client),
                                                    personal_eval if due else None)
        except Exception as err:  # noqa: BLE001 - a failing client is data when accept_failures is on
            if not self.parts.accept_failures or self.parts.group is not None:
                why = ("its group of ranks (clients.ranks_per_client) cannot go on mid-collective"
                       if self.parts.group is not None else "clients.accept_failures=false")
                raise ClientFailure(f"logical client {client} on rank {self.rank} failed in round {round_} while "
                                    f"training its personal model: {type(err).__name__}: {err} ({why})") from err
            return {}

    def _evaluation_due(self, round_: int, val: ClientData | None) -> bool:
        """Whether federated evaluation runs this round on this client's validation split."""
        every = self.parts.evaluate_every
        return bool(every) and val is not None and len(val) > 0 and not (round_ % every and round_ != self.parts.rounds)

    def _federated_eval(self, round_: int, val: ClientData | None) -> dict:
        """The received global model on this client's validation split (before training)."""
        if not self._evaluation_due(round_, val):
            return {}
        assert self.parts.evaluate is not None and val is not None  # due: an evaluator and a validation split
        result = self.parts.evaluate(self.work.module, val.x, val.y)
        return {**{f"val_{k}": v for k, v in result.items()}, "val_samples": len(val)}
