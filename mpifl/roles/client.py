"""Ranks 1..N: host logical clients, receive the global model, train, stream updates back."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from mpi4py import MPI

from mpifl.learning.datasets import ClientData
from mpifl.learning.device import DeviceReplica, GpuEnergy, deterministic_hint
from mpifl.learning.trainers import (
    ConfiguredTrainer,
    TrainContext,
    Trainer,
    TrainResult,
    accepts_context,
    local_steps,
)
from mpifl.logs import log
from mpifl.metrics import CostMeter, peak_rss_bytes
from mpifl.planning.faults import FaultPlan
from mpifl.planning.seeds import client_seed, personal_seed
from mpifl.privacy.dp import ClientPrivacy
from mpifl.privacy.secagg import SecureAggregation
from mpifl.roles.batched import BatchedClients
from mpifl.roles.client_state import ClientStateParts
from mpifl.roles.encoding import GroupSum, UpdateCompressor, UpdateEncoder
from mpifl.roles.evaluation import FederatedEvaluation
from mpifl.roles.faults import FaultInjector
from mpifl.roles.grouped import GroupedClients
from mpifl.roles.pipeline import UpdatePipeline
from mpifl.storage.residuals import save_snapshot
from mpifl.units import range_list
from mpifl.wire import protocol
from mpifl.wire.flat import FlatModel
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import host_bytes
from mpifl.wire.transport import ProgressReporter, recv_object, relay_chunks, send_chunks, send_object

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
    evaluation: FederatedEvaluation = FederatedEvaluation()  # eval.federated_every: scores on clients' own splits
    privacy: ClientPrivacy | None = None  # DP: clip each update to the round's bound (local DP: noise it too)
    secagg: SecureAggregation | None = None  # send updates in fixed point, masked (simulated secure aggregation)
    # per-client state (mpifl.config.client_state): the rank's one store and each rule that reads a part of it
    state: ClientStateParts = field(default_factory=ClientStateParts)
    note: Callable[..., None] = lambda state, round_=None, **detail: None  # the rank's notes in the run dir
    group: GroupLeader | None = None  # clients.ranks_per_client > 1: this rank leads a group that trains together
    faults: FaultPlan | None = None  # the config's faults: what strikes this rank's clients, and when
    batched: BatchedClients | None = None  # train.batched_clients: clients trained K at a time, served one by one


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
        self.held: dict[int, tuple[protocol.UpdateMeta, list[np.ndarray]]] = {}  # asynchronous FL: trained, not sent
        self.participants = 0  # this round's logical clients on every rank together (a trainer's TrainContext)
        self.context = accepts_context(self.trainer)  # whether the trainer takes a TrainContext
        compressor = None if parts.plan.codec is None else \
            UpdateCompressor(parts.plan, parts.seed, parts.state.residuals)
        self.updates = UpdatePipeline(self.encoder, parts.plan, self.work, replica=self.replica, delta=parts.delta,
                                      privacy=parts.privacy, secagg=parts.secagg, compressor=compressor,
                                      grouped=self.group_sum is not None, weight=parts.weight)
        # a group's members may be trained again to find a non-finite update (_sum_clients): training on the host
        # with nothing kept per client, no update protected on its own (DP, secure aggregation), no group of ranks
        self.group_check_deferred = all(k is None for k in (
            parts.state.store, parts.privacy, parts.secagg, parts.group, parts.replica))
        # clients.groups: each reduction group's members folded here, their sum sent
        self.grouped = None if self.group_sum is None else GroupedClients(
            comm, self.group_sum, parts.plan, parts.groups, parts.weight, compressor, self.group_check_deferred,
            self._train)
        self.vectors: dict[str, torch.Tensor] = {}  # the training client's declared vectors, kept once it is usable
        self.progress = ProgressReporter(comm)  # the server's watchdog hears this rank's forward passes
        self.progress.attach(self.work.module)
        self.faults = FaultInjector(parts.faults, self.rank, self.progress.tick) if parts.faults else None
        self.cost = CostMeter()  # CPU-seconds and bytes written, reported with each update's header
        self.energy = GpuEnergy(self.work.buffer.device) if self.replica is not None and self.replica.on_gpu else None
        self.joules = self.energy.joules() if self.energy is not None else None
        self.updates_left = 0  # this round's headers still to send: the last one reads the energy counter
        if self.energy is not None and self.joules is None:
            log(f"GPU energy is not recorded: {self.energy.why}", rank=self.rank)

    def run(self) -> None:
        """Serve rounds until the server says stop."""
        self._serve_until_stop()
        self.progress.close()

    def _serve_until_stop(self) -> None:
        """The round loop: each header says train, hold, publish residuals, or stop."""
        while True:
            header = recv_object(self.comm, protocol.SERVER, protocol.HEADER)
            if not isinstance(header, protocol.Header):
                raise RuntimeError(f"rank {self.rank}: the server sent {header!r} where a header belongs")
            if self.parts.state.lending is not None:
                self.parts.state.lending.settle()  # every vector home before it is put back, lent again or published
            if self.parts.state.journal is not None:  # before anything reads, lends or publishes the state
                self._undo_dropped(header)
            if isinstance(header, protocol.Stop):
                self.parts.note("finished")
                return
            if isinstance(header, protocol.PersistOrder):
                self.persist(header)
                continue
            if not isinstance(header, protocol.RoundOrder):
                raise RuntimeError(f"rank {self.rank}: the server sent {header!r}, a header this rank cannot serve")
            self.parts.note("round", header.round)
            self.progress.start_round(header.round)
            self.updates.begin_round(header.clip, header.cohort)
            self.participants = header.participants
            self.updates_left = len(header.clients)
            if self.parts.state.lending is not None:
                self.parts.state.lending.borrow(header)
            if isinstance(header, protocol.HoldOrder):
                self.serve_step(header)
            elif header.clients:
                self.serve_round(header)
            if self.parts.state.lending is not None:
                self.parts.state.lending.give_back(header)

    def _undo_dropped(self, header: protocol.Header) -> None:
        """Put back the state of this rank's clients that the server dropped since the last header; keep the
        rest."""
        assert self.parts.state.journal is not None  # called only with one
        undone = self.parts.state.journal.settle(header.dropped)
        if undone:
            log(f"logical clients {range_list(undone)} were dropped past their deadline: each one's "
                f"{self.parts.state.put_back()} is put "
                "back as it was before it trained", rank=self.rank)

    def persist(self, header: protocol.PersistOrder) -> None:
        """Publish this rank's per-client state of the round just ended (error-feedback residuals, control variates,
        local tensors, personal models: the one store that holds them) for the server's checkpoint, then
        acknowledge."""
        store = self.parts.state.store
        assert store is not None  # the server asks only with per-client state (Config.client_state), which makes one
        name = save_snapshot(store, store.firsts, Path(header.folder), self.rank, header.round)
        send_object(self.comm, name, protocol.SERVER, protocol.RESIDUALS)

    def serve_round(self, header: protocol.RoundOrder) -> None:
        """Receive the global model once, then train and send each logical client in id order."""
        keep = self._receive_global(header)
        if self.parts.batched is not None:
            self.parts.batched.begin_round(header.round, header.clients)
        if self.grouped is not None:
            self.grouped.serve(header, keep)
            return
        meta_tag, update_tag = (protocol.round_tag(kind, header.round) for kind in (protocol.META, protocol.UPDATE))
        for i, client in enumerate(header.clients):
            meta, buffers = self._train(header.round, client, keep, first=i == 0)
            assert buffers is not None  # only a group's sum keeps updates on the device
            send_object(self.comm, meta, protocol.SERVER, meta_tag)
            self._send_update(header.round, client, update_tag, buffers)

    def serve_step(self, header: protocol.HoldOrder) -> None:
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
            self._send_update(header.round, client, protocol.round_tag(protocol.UPDATE, header.round), buffers)

    def _send_update(self, round_: int, client: int, tag: int, buffers: list[np.ndarray]) -> None:
        """Stream ``client``'s update to the server; a fault at stage 'send' strikes after its first chunk."""
        strikes = self.faults.send_strikes(round_, client) if self.faults else []
        if strikes:
            assert self.faults is not None
            send_chunks(self.comm, [protocol.SERVER], tag, buffers[:1], self.parts.plan.inflight)
            self.faults.act(strikes)
            buffers = buffers[1:]
        send_chunks(self.comm, [protocol.SERVER], tag, buffers, self.parts.plan.inflight)

    def _receive_global(self, header: protocol.RoundOrder) -> torch.Tensor | None:
        """Receive the global model (from the server, or from the parent rank of a broadcast tree, passing it on
        to the header's children); keep a host copy when the header's logical clients will need it. A fault at stage
        'receive' strikes first."""
        if self.faults:
            self.faults.before_receive(header.round, header.clients)
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
        return self.parts.delta or self.parts.state.models is not None or (
            clients > 1 and self.trainer.modifies_weights) or (self.faults is not None and self.faults.scales)

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
        if self.parts.state.personal is not None:
            self.parts.state.personal.load(client)
        return self._serve_client(round_, client, keep, check)

    def _serve_client(self, round_: int, client: int, keep: torch.Tensor | None,
                      check_update: bool = True) -> tuple[protocol.UpdateMeta, list[np.ndarray] | None]:
        """Train one logical client and turn its model into the update it sends, with its header (no buffers:
        the update stays on the device for the group's sum)."""
        train, val = self.local_data.get(client, (None, None))
        metrics = self.parts.evaluation.received(self.work.module, round_, val)
        start = time.perf_counter()
        anchor = self._anchor(keep)
        if self.parts.state.models is not None:
            assert anchor is not None  # Ditto's ranks keep the global model (_needs_host_global, _anchor)
            metrics.update(self._personal(round_, client, train, val, anchor))
        result, error = self._train_one(round_, client, train, anchor)
        if error is None and self.faults and (lost := self.faults.lost(round_, client)) is not None:
            error = self._failed(lost, round_, client, "")  # as if it had not been sampled
        if error is None and self.parts.state.personal is not None:
            self.parts.state.personal.keep(client)
        if error is None and self.parts.state.controls is not None:
            assert anchor is not None  # scaffold and feddyn send deltas, so the rank keeps the global model
            self.parts.state.controls.update(client, anchor, result.local_steps or 0, self.parts.weight(
                protocol.UpdateMeta(client, result.num_samples, 0.0, dict(result.metrics),
                                    local_steps=result.local_steps)))
        check = check_update and error is None and (self.trainer.modifies_weights or self.encoder.narrowed)
        if self.replica is not None and self.group_sum is not None:  # the update stays on the device
            buffers, bad = None, self.updates.on_device(check)
        else:
            buffers, bad = self.updates.on_host(round_, client, keep, result, usable=error is None, check=check)
        if self.parts.state.declared is not None and error is None and not bad:  # else as if it had not trained
            self.parts.state.declared.keep(client, self.vectors)
        if self.faults and error is None and not bad:  # a corruption strikes past every check
            self.faults.corrupt(round_, client, buffers, self.work, self.parts.plan, self.parts.seed)
        if bad:
            error = f"update contains {bad} NaN/Inf values"
            if not self.parts.accept_failures:
                raise FloatingPointError(f"logical client {client} on rank {self.rank}: {error} "
                                         "(clients.accept_failures=false); if its training diverged, lower "
                                         "train.lr or set train.max_grad_norm, or drop such clients from their "
                                         "rounds with clients.accept_failures=true")
        seconds = time.perf_counter() - start
        metrics.update(result.metrics, rank_peak_rss_bytes=peak_rss_bytes())
        metrics.update(self._cost(seconds))
        if self.replica is not None and self.replica.on_gpu:
            metrics["rank_peak_device_bytes"] = self.replica.peak_bytes()
        meta = protocol.UpdateMeta(client, result.num_samples, seconds, metrics, error, result.local_steps)
        return meta, buffers

    def _cost(self, seconds: float) -> dict[str, float]:
        """What this rank spent since its last update's header (CPU-seconds, bytes written: receiving the model and
        the previous update's send included), and, on a GPU, ``seconds`` of it and, with the round's last update,
        the energy the GPU's counter saw since the rank's last reading.

        Why the energy once a round: the records keep only each rank's sum over the round, which is the same, and
        an NVML query can cost milliseconds where the driver sits behind a virtualised device. On one H200 VM the
        LEAF CNN fell from 109 to 72 client updates/s (about 4.8 ms more per update) once every update read the
        counter; that cost was inferred from the two checks, not timed on its own."""
        cost = {f"rank_{key}": value for key, value in self.cost.since_last().items()}
        if self.replica is not None and self.replica.on_gpu:
            cost["rank_gpu_seconds"] = seconds
        self.updates_left -= 1
        if self.energy is not None and self.joules is not None and self.updates_left <= 0:
            joules = self.energy.joules()
            assert joules is not None  # a counter that answered once keeps answering
            cost["rank_gpu_energy_joules"], self.joules = joules - self.joules, joules
        return cost

    def _train_one(self, round_: int, client: int, train: ClientData | None,
                   anchor: torch.Tensor | None = None) -> tuple[TrainResult, str | None]:
        """Local training of one logical client (``anchor``: the global model beside the one that trains, for
        SCAFFOLD's and FedDyn's rules); a raise ends the job, or is its error under accept_failures."""
        controls, seed = self.parts.state.controls, client_seed(self.parts.seed, round_, client)
        try:
            assert anchor is not None or controls is None  # scaffold and feddyn send deltas: the rank keeps the global
            if self.faults:
                self.faults.before_training(round_, client)
            began = time.perf_counter()
            with controls.training(client, anchor) if controls and anchor is not None else contextlib.nullcontext():
                if self.parts.group is not None:
                    result = self._train_in_group(client, train, seed)
                elif self.parts.batched is not None:  # trained with its batch (the model holds the global one)
                    result = self.parts.batched.train(self.work.module, client)
                elif self.context:
                    result = self.trainer.train(self.work.module, train, seed,  # type: ignore[call-arg]
                                                context=self._context(round_, client))
                else:
                    result = self.trainer.train(self.work.module, train, seed)
            if self.faults:
                self.faults.after_training(round_, client, self.work, self.parts.plan, anchor,
                                           time.perf_counter() - began)
            return result, None
        except Exception as err:  # noqa: BLE001 - a failing client is data when accept_failures is on
            return TrainResult(0, {}), self._failed(err, round_, client, "")

    def _failed(self, err: Exception, round_: int, client: int, doing: str) -> str:
        """The failure rule: a raise in a client's training ends the job, naming the client, its rank and the round;
        under clients.accept_failures it is the client's error instead (not in a group of ranks, which cannot go on
        mid-collective)."""
        hint = deterministic_hint(err)
        if not self.parts.accept_failures or self.parts.group is not None:
            why = ("its group of ranks (clients.ranks_per_client) cannot go on mid-collective"
                   if self.parts.group is not None else "clients.accept_failures=false")
            raise ClientFailure(f"logical client {client} on rank {self.rank} failed in round {round_}{doing}: "
                                f"{type(err).__name__}: {err} ({why}{hint})") from err
        return f"{type(err).__name__}: {err}{hint}"

    def _context(self, round_: int, client: int) -> TrainContext:
        """What a plug-in trainer learns of the client it trains, with the client's declared vectors loaded."""
        declared = self.parts.state.declared
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
        # SCAFFOLD's c - c_i or FedDyn's g_i, set as the training began: the members'
        controls = self.parts.state.controls
        costs = self.parts.group.dispatch(client, seed, own_steps, controls.shared if controls else None)
        began = time.perf_counter()
        result = self.trainer.train(self.work.module, train, seed)
        result.metrics.update(costs, group_train_seconds=time.perf_counter() - began)
        return result

    def _personal(self, round_: int, client: int, train: ClientData | None, val: ClientData | None,
                  anchor: torch.Tensor) -> dict:
        """Ditto: update and keep ``client``'s personal model (evaluated when federated evaluation is due); a
        raise ends the job, or, under accept_failures, leaves the personal model as it was."""
        assert self.parts.state.models is not None  # _serve_client calls this only for Ditto
        try:
            return self.parts.state.models.train(client, train, anchor,
                                                    personal_seed(self.parts.seed, round_, client),
                                                    self.parts.evaluation.personal(self.work.module, round_, val))
        except Exception as err:  # noqa: BLE001 - a failing client is data when accept_failures is on
            self._failed(err, round_, client, " while training its personal model")
            return {}
