"""Ranks 1..N: host logical clients, receive the global model, train, stream updates back."""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from mpifl.errors import noted, plugin_name
from mpifl.learning.datasets import ClientData
from mpifl.learning.device import DeviceReplica
from mpifl.learning.trainers import local_steps
from mpifl.logs import log, world_rank
from mpifl.metrics import PERSONAL_DIVERGED
from mpifl.privacy.dp import ClientPrivacy
from mpifl.privacy.secagg import SecureAggregation
from mpifl.roles.client_state import ClientStateParts, put_back_line
from mpifl.roles.costs import UpdateCosts
from mpifl.roles.encoding import GroupSum, UpdateCompressor, UpdateEncoder
from mpifl.roles.evaluation import FederatedEvaluation
from mpifl.roles.faults import FaultInjector
from mpifl.roles.grouped import GroupedClients
from mpifl.roles.local_training import LocalTraining, TrainingParts
from mpifl.roles.pipeline import UpdatePipeline
from mpifl.storage.residuals import save_snapshot
from mpifl.wire import protocol
from mpifl.wire.flat import FlatModel
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.memory import host_bytes
from mpifl.wire.transport import ProgressReporter, recv_object, relay_chunks, send_chunks, send_object


@dataclass(kw_only=True)
class ClientParts:
    """What a client rank works with, each part built from its own config section."""

    plan: ExchangeLayout
    training: TrainingParts  # how its logical clients train: trainer, seeds, failure rule, groups of ranks, batches
    delta: bool  # strategy.update: send trained - global instead of the trained weights
    statistics_as_values: bool = False  # Config.statistics_as_values: statistics travel as values in a delta
    groups: int = 0  # clients.groups: sum each reduction group's updates here before sending
    # a participant's weight (groups: in its group's sum; secure aggregation: in its masked update), from its header
    weight: Callable[[protocol.UpdateMeta], float] = lambda meta: float(meta.num_samples)
    replica: DeviceReplica | None = None  # train.device: the model on the device, beside the host buffer
    # eval.federated_every: scores on clients' own splits
    evaluation: FederatedEvaluation = field(default_factory=FederatedEvaluation)
    privacy: ClientPrivacy | None = None  # DP: clip each update to the round's bound (local DP: noise it too)
    secagg: SecureAggregation | None = None  # send updates in fixed point, masked (simulated secure aggregation)
    # per-client state (mpifl.config.client_state): the rank's one store and each rule that reads a part of it
    state: ClientStateParts = field(default_factory=ClientStateParts)
    note: Callable[..., None] = lambda state, round_=None, **detail: None  # the rank's notes in the run dir


class ClientRank:
    """One model in memory; its logical clients train one after another in it."""

    def __init__(self, comm: MPI.Comm, flat: FlatModel,
                 local_data: Mapping[int, tuple[ClientData | None, ClientData | None]], parts: ClientParts):
        self.comm, self.flat, self.local_data, self.parts = comm, flat, local_data, parts
        self.rank = comm.Get_rank()
        self.trainer = parts.training.trainer
        assert flat.bytes is not None  # the rank's model lives in host memory (a device copy is the replica)
        self.chunk_buffers = parts.plan.chunk_slices(flat.bytes)
        self.encoder = UpdateEncoder(flat, parts.plan, parts.delta, parts.statistics_as_values)
        self.replica = parts.replica
        self.work = parts.replica.flat if parts.replica else flat  # the model that trains
        self.group_sum = GroupSum(self.work, parts.plan, separate=self.replica is not None) if parts.groups else None
        self.snapshot: torch.Tensor | None = None
        self.held: dict[int, tuple[protocol.UpdateMeta, list[np.ndarray]]] = {}  # asynchronous FL: trained, not sent
        compressor = None if parts.plan.codec is None else \
            UpdateCompressor(parts.plan, parts.training.seed, parts.state.residuals)
        self.updates = UpdatePipeline(self.encoder, parts.plan, self.work, replica=self.replica, delta=parts.delta,
                                      privacy=parts.privacy, secagg=parts.secagg, compressor=compressor,
                                      grouped=self.group_sum is not None, weight=parts.weight)
        # a group's members may be trained again to find a non-finite update (_sum_clients): training on the host
        # with nothing kept per client, no update protected on its own (DP, secure aggregation), no group of ranks
        group_check_deferred = all(k is None for k in (
            parts.state.store, parts.privacy, parts.secagg, parts.training.group, parts.replica))
        # clients.groups: each reduction group's members folded here, their sum sent
        self.grouped = None if self.group_sum is None else GroupedClients(
            comm, self.group_sum, parts.plan, parts.groups, parts.weight, compressor, group_check_deferred,
            self._train)
        self.progress = ProgressReporter(comm)  # the server's watchdog hears this rank's forward passes
        self.progress.attach(self.work.module)
        self.faults = None if not parts.training.faults else FaultInjector(
            parts.training.faults, self.rank, self.progress.tick, parts.training.spend_fault, parts.training.classes)
        self.training = LocalTraining(parts.training, self.work, parts.state, parts.plan, parts.evaluation,
                                      self.faults, self.rank)
        group = parts.training.group  # a replicated client group: its members' spending counts as this rank's
        self.costs = UpdateCosts(self.replica, self.rank, group.members_spent if group is not None else None)

    def run(self) -> bool:
        """Serve rounds until the server says stop; whether it stopped on request before the last round."""
        interrupted = self._serve_until_stop()
        self.progress.close()
        return interrupted

    def _note_round(self, round_: int) -> None:
        """Note the round in the run directory (mpifl status); a group's members note it from each order."""
        self.parts.note("round", round_)
        if self.parts.training.group is not None:
            self.parts.training.group.round = round_

    def _serve_until_stop(self) -> bool:
        """The round loop: each header says train, hold, publish residuals, or stop (on request, or at the end)."""
        while True:
            header = recv_object(self.comm, protocol.SERVER, protocol.HEADER)
            if not isinstance(header, protocol.Header):
                raise RuntimeError(f"rank {world_rank(self.rank)}: the server sent {header!r} where a header belongs")
            if self.parts.state.lending is not None:
                self.parts.state.lending.settle()  # every vector home before it is put back, lent again or published
            if self.parts.state.journal is not None:  # before anything reads, lends or publishes the state
                self._undo_dropped(header)
            if isinstance(header, protocol.Stop):
                self.parts.note("interrupted" if header.interrupted else "finished")
                return header.interrupted
            if isinstance(header, protocol.PersistOrder):
                self.persist(header)
                continue
            if not isinstance(header, protocol.RoundOrder):
                raise RuntimeError(f"rank {world_rank(self.rank)}: the server sent {header!r}, a header this rank "
                                   "cannot serve")
            self._begin_round(header)
            if isinstance(header, protocol.HoldOrder):
                self.serve_step(header)
            elif header.clients:
                self.serve_round(header)
            if self.parts.state.lending is not None:
                self.parts.state.lending.give_back(header)

    def _begin_round(self, header: protocol.RoundOrder) -> None:
        """What every round's order sets before any client trains: its progress, clip bound and cohort, context,
        costs, borrowed per-client state, and whether it is the run's last."""
        self._note_round(header.round)
        self.progress.start_round(header.round)
        if header.last:  # privacy.epsilon_budget ends the run here: score it as the configured last round is
            self.parts.evaluation.ends_at(header.round)
        self.updates.begin_round(header.clip, header.cohort)
        self.training.participants = header.participants
        if isinstance(header, protocol.HoldOrder):
            self.costs.begin_step(len(header.send))
        else:
            self.costs.begin_round(len(header.clients))
        if self.parts.state.lending is not None:
            self.parts.state.lending.borrow(header)

    def _undo_dropped(self, header: protocol.Header) -> None:
        """Put back the state of this rank's clients that the server dropped since the last header; keep the
        rest."""
        assert self.parts.state.journal is not None  # called only with one
        undone = self.parts.state.journal.settle(header.dropped)
        if undone:
            log(put_back_line(undone, self.parts.state.put_back()), rank=world_rank(self.rank))

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
        if self.parts.training.batched is not None:
            self.parts.training.batched.begin_round(header.round, header.clients)
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
                raise RuntimeError(f"rank {world_rank(self.rank)}: the server asked for logical client {client}'s "
                                   "update, "
                                   f"which this rank does not hold (it holds {sorted(self.held)})")
            meta, buffers = self.held.pop(client)
            meta = replace(meta, metrics={**meta.metrics, **self.costs.at_send()})
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

    def _personal_flags(self, client: int) -> dict:
        """Ditto: the header's mark of a client whose personal model diverged (the server's record names it)."""
        models = self.parts.state.models
        return {PERSONAL_DIVERGED: True} if models is not None and models.diverged == client else {}

    def _data(self, round_: int, client: int) -> tuple[ClientData | None, ClientData | None]:
        """The client's training and validation data; a label_flip strike poisons what it trains on (its global and
        personal models), never its validation split."""
        train, val = self.local_data.get(client, (None, None))
        return (self.faults.poisoned(round_, client, train) if self.faults else train), val

    def _serve_client(self, round_: int, client: int, keep: torch.Tensor | None,
                      check_update: bool = True) -> tuple[protocol.UpdateMeta, list[np.ndarray] | None]:
        """Train one logical client and turn its model into the update it sends, with its header (no buffers:
        the update stays on the device for the group's sum)."""
        train, val = self._data(round_, client)
        scores = self.parts.evaluation.received(self.work.module, round_, val)
        start = time.perf_counter()
        anchor = self._anchor(keep)
        personal_error = None
        if self.parts.state.models is not None:
            assert anchor is not None  # Ditto's ranks keep the global model (_needs_host_global, _anchor)
            personal, personal_error = self.training.personal(round_, client, train, val, anchor)
            scores.update(personal)
        result, error = self.training.train(round_, client, train, anchor)
        # a plug-in trainer's own personalised model (its personalized), before the update is formed
        scores.update(self.training.personalized_scores(round_, client, val, trained=error is None))
        error = error or personal_error  # a client whose personal training failed is dropped, as for its global
        if error is None and self.faults and (lost := self.faults.lost(round_, client)) is not None:
            error = self.training.failed(lost, round_, client, "")  # as if it had not been sampled
        if error is None and self.parts.state.controls is not None:
            assert anchor is not None  # scaffold and feddyn send deltas, so the rank keeps the global model
            controls = self.parts.state.controls
            with noted(f"round {round_}, logical client {client}: the client half {plugin_name(controls)}, in update"):
                controls.update(client, anchor, result.local_steps or 0, self.parts.weight(
                    protocol.UpdateMeta(client, result.num_samples, 0.0, dict(result.metrics),
                                        local_steps=result.local_steps)))
        check = check_update and error is None and (self.trainer.modifies_weights or self.encoder.narrowed)
        if self.replica is not None and self.group_sum is not None:  # the update stays on the device
            buffers, bad = None, self.updates.on_device(check)
        else:
            buffers, bad = self.updates.on_host(round_, client, keep, result, usable=error is None, check=check)
        if self.parts.state.personal is not None and error is None and not bad:  # else as if it had not trained
            self.parts.state.personal.keep(client)
        if self.parts.state.declared is not None and error is None and not bad:
            self.parts.state.declared.keep(client, self.training.vectors)
        if self.faults and error is None and not bad:  # a corruption strikes past every check
            self.faults.corrupt(round_, client, buffers, self.work, self.parts.plan, self.parts.training.seed)
        if bad:
            injected = self.faults.injected_non_finite(round_, client) if self.faults else None
            error = self.training.non_finite(round_, client, bad, injected)
        models = self.parts.state.models
        if models is not None and error is None:  # Ditto's v_i stands or falls with the client's round, as c_i
            models.keep(client)
        elif models is not None:
            models.discard()
        seconds = time.perf_counter() - start
        metrics = {**result.metrics, **self.costs.of_update(seconds)}
        metrics.update(self._personal_flags(client))
        if self.replica is not None and self.replica.on_gpu:
            metrics["rank_peak_device_bytes"] = self.replica.peak_bytes()
        meta = protocol.UpdateMeta(client, result.num_samples, seconds, metrics, error, result.local_steps, scores)
        return meta, buffers
