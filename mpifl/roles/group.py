"""``clients.ranks_per_client``: a logical client trained by a group of R ranks.

Client ranks 1.. form groups of R consecutive ranks. The first rank of each group, its leader, is the
only one the server knows: rank 0 and the leaders talk over a communicator of their own (the
federation), with the protocol and code of R = 1 unchanged, so the server's reduction, its memory bound
and the results' independence of the number of groups stay what they are. The other ranks of a group
(its members) wait for the leader's orders (``protocol.TrainOrder``) in the group's communicator:
before each logical client trains, the leader sends the order, broadcasts its weights over the group's
``torch.distributed`` process group, and the group trains the client together in DDP
(``mpifl.learning.parallel``). The process group is built at the first order and kept for the run, so
its cost shows once, in round 1's ``group_setup_seconds``, and never again.

Per-client state stays with the leader, as with R = 1, in its store and checkpoints. With each order the
leader broadcasts what the members train with: the client's local tensors (``model.local``), SCAFFOLD's
correction c - c_i or FedDyn's g_i (the strategy's client half, ``mpifl.algorithms``); for Ditto, a personal
order first, with the global w and the client's personal v_i (``mpifl.algorithms.ditto``).
"""
from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from datetime import timedelta

import torch
from mpi4py import MPI
from torch import distributed as dist

from mpifl.algorithms.contract import GroupHalf
from mpifl.algorithms.ditto import GroupPersonalModels
from mpifl.errors import entered, plugin_name
from mpifl.learning.datasets import ClientData
from mpifl.learning.parallel import DataParallel
from mpifl.learning.trainers import Trainer, local_steps
from mpifl.logs import log
from mpifl.metrics import CostMeter, peak_rss_bytes
from mpifl.planning.world import GroupLayout
from mpifl.wire import protocol
from mpifl.wire.flat import FlatModel
from mpifl.wire.transport import recv_object, send_object


def split_world(comm: MPI.Comm, layout: GroupLayout) -> tuple[MPI.Comm | None, MPI.Comm | None]:
    """(the federation: rank 0 and the leaders, None on other members; this rank's group, None on rank 0)."""
    rank = comm.Get_rank()
    leader_or_server = layout.position(rank) == 0
    federation = comm.Split(0 if leader_or_server else MPI.UNDEFINED, layout.federation_rank(rank))
    group_id = layout.group_of(rank)
    group = comm.Split(MPI.UNDEFINED if group_id is None else group_id, layout.position(rank))
    return (federation if federation != MPI.COMM_NULL else None), (group if group != MPI.COMM_NULL else None)


def rendezvous_store(address: tuple[str, int] | None, size: int, timeout_s: float) -> tuple[dist.Store, tuple]:
    """The group's rendezvous: the leader (``address`` None) listens on a free port of its host; the members
    connect to ``address``. Returns the store and the address to send the members."""
    if address is None:
        host = socket.gethostname()
        store = dist.TCPStore(host, 0, size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return store, (host, store.port)
    host, port = address
    return dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=timeout_s)), address


def summed_costs(readings: list[dict]) -> dict[str, float]:
    """The members' readings as one: CPU-seconds summed, bytes written summed where every reading has them (no
    total that leaves a rank out), the largest peak RSS; {} for none."""
    if not readings:
        return {}
    out = {"cpu_seconds": sum(r.get("cpu_seconds", 0.0) for r in readings),
           "peak_rss_bytes": max(r.get("peak_rss_bytes", 0.0) for r in readings)}
    if all("bytes_written" in r for r in readings):
        out["bytes_written"] = sum(r["bytes_written"] for r in readings)
    return out


def client_model(work: FlatModel) -> list[torch.Tensor]:
    """What the leader sends its group before a logical client trains: the global model (the flat buffer) and
    the client's own local tensors (``model.local``: FedBN, FedPer), which the leader has just loaded into its
    module and which never travel to the server. The same list, in the same order, on every rank."""
    return [work.buffer, *(tensor for _, tensor in work.local_tensors())]


class GroupLeader:
    """A group leader's side: each logical client's order, the weights to the group, and the cost of both."""

    def __init__(self, comm: MPI.Comm, parallel: DataParallel, work: FlatModel, timeout_s: float):
        self.comm, self.parallel, self.work, self.timeout_s = comm, parallel, work, timeout_s
        self.round = 0  # the round the leader serves (set by its client rank), named in each order
        self.owed = 0  # orders each member has trained (or is training) whose cost the leader has not taken

    def members_spent(self) -> dict[str, float]:
        """What the group's other ranks spent on the orders since the last call, summed (``cpu_seconds``,
        ``bytes_written`` where every member counted it) and their largest ``peak_rss_bytes``, for the leader's
        reading (``UpdateCosts``): without it a replicated group's cost would be its leader's alone. Each member
        sends its meter's reading once it has trained an order, in step with the leader, so this waits little."""
        readings = [recv_object(self.comm, member, protocol.GROUP_COST) for _ in range(self.owed)
                    for member in range(1, self.comm.Get_size())]
        self.owed = 0
        return summed_costs([r for r in readings if isinstance(r, dict)])

    def dispatch(self, client: int, seed: int, steps: int | None,
                 shared: torch.Tensor | None = None) -> dict[str, float]:
        """Start ``client``'s training on every rank of the group; the seconds spent setting the group up (the
        process group and DDP: in the run's first order only) and sending it the weights (and ``shared``: the
        client's state that the members train with, SCAFFOLD's c - c_i or FedDyn's g_i)."""
        began, setup_before = time.perf_counter(), self.parallel.setup_seconds
        self._order(protocol.TrainOrder(client, seed, steps))
        self.parallel.broadcast([*client_model(self.work), *([shared] if shared is not None else [])])
        setup = self.parallel.setup_seconds - setup_before
        return {"group_setup_seconds": setup, "group_dispatch_seconds": time.perf_counter() - began - setup}

    def dispatch_personal(self, client: int, seed: int, global_bytes: torch.Tensor) -> None:
        """Ditto: start the training of ``client``'s personal model v_i, now in the leader's model, on every rank
        of the group, with the global w (``global_bytes``) it is regularised towards. A client trains its
        personal model before the global one, so this may be the run's first order."""
        self._order(protocol.TrainOrder(client, seed, personal=True))
        self.parallel.broadcast([global_bytes, *client_model(self.work)])

    def _order(self, order: protocol.TrainOrder) -> None:
        """Send every member ``order`` (with the rendezvous address the first time), join the process group the
        first time, and wrap the model (once)."""
        address = None
        if not self.parallel.ready:
            store, address = rendezvous_store(None, self.parallel.size, self.timeout_s)
        order = dataclasses.replace(order, address=address, round=self.round)
        for member in range(1, self.comm.Get_size()):
            send_object(self.comm, order, member, protocol.GROUP)
        self.owed += 1
        if address is not None:
            self.parallel.start(store, self.work.device, self.timeout_s)
            why = " (its ranks share a GPU, which NCCL refuses)" if (
                self.parallel.backend == "gloo" and self.work.device.type == "cuda") else ""
            log(f"client group of {self.parallel.size} ranks: torch.distributed over {self.parallel.backend}{why}")
        self.parallel.wrap(self.work.module)

    def release(self, interrupted: bool = False) -> None:
        """The run is over (``interrupted``: stopped on request before its last round): let the members leave, then
        leave the process group."""
        self.members_spent()  # what the last orders cost, taken so that no member's message is left unreceived
        for member in range(1, self.comm.Get_size()):
            send_object(self.comm, protocol.TrainOrder(stop=True, interrupted=interrupted), member, protocol.GROUP)
        self.parallel.close()


class GroupMemberFailure(RuntimeError):
    """A group member's share of a logical client's training raised: the message names the client and the rank."""


class GroupMember:
    """A group's other rank: train each logical client the leader orders, on this rank's share of its batches."""

    def __init__(self, comm: MPI.Comm, parallel: DataParallel, work: FlatModel, trainer: Trainer,  # noqa: PLR0913 - each from serve_as_member
                 local_data: Mapping[int, tuple[ClientData | None, ClientData | None]], timeout_s: float,
                 state: GroupHalf | None = None, personal: GroupPersonalModels | None = None,
                 note: Callable[[str, int], None] = lambda state, round_: None):
        self.comm, self.parallel, self.work, self.trainer = comm, parallel, work, trainer
        self.local_data, self.timeout_s, self.state, self.personal = local_data, timeout_s, state, personal
        self.note, self.noted = note, 0  # this rank's notes in the run directory: the round it last trained in
        self.meter = CostMeter()  # what this rank spent, sent to the leader after each order (members_spent)

    def run(self) -> bool:
        """Follow the leader's orders until it says stop; whether the run stopped on request before its last
        round."""
        while True:
            order = recv_object(self.comm, 0, protocol.GROUP)
            if not isinstance(order, protocol.TrainOrder):
                raise RuntimeError(f"the group leader sent {order!r} where a TrainOrder belongs")
            if order.stop:
                self.parallel.close()
                return order.interrupted
            if order.round != self.noted:
                self.note("round", order.round)
                self.noted = order.round
            try:
                if order.personal:
                    self.train_personal(order)
                else:
                    self.train(order)
                send_object(self.comm, {**self.meter.since_last(), "peak_rss_bytes": float(peak_rss_bytes())}, 0,
                            protocol.GROUP_COST)
            except Exception as err:
                what = "personal model" if order.personal else "training"
                raise GroupMemberFailure(
                    f"logical client {order.client}'s {what} failed on rank {MPI.COMM_WORLD.Get_rank()}, a member of "
                    f"its client group (clients.ranks_per_client): {type(err).__name__}: {err} (a group cannot go on "
                    "mid-collective, so the job ends)") from err

    def _join(self, order: protocol.TrainOrder) -> None:
        """Join the process group at the first order; wrap the model (once)."""
        if not self.parallel.ready:
            store, _ = rendezvous_store(order.address, self.parallel.size, self.timeout_s)
            self.parallel.start(store, self.work.device, self.timeout_s)
        self.work.reset_local_state()
        self.parallel.wrap(self.work.module)

    def train(self, order: protocol.TrainOrder) -> None:
        """Take the leader's weights, then train ``order.client`` with the group."""
        self._join(order)
        state = self.state  # SCAFFOLD's correction or FedDyn's g_i, from the leader (the client half's GroupHalf)
        self.parallel.broadcast([*client_model(self.work), *([state.vector] if state else [])])
        train, _ = self.local_data.get(order.client, (None, None))
        with local_steps(self.trainer, order.steps), entered(state.training, f"the client half {plugin_name(state)}, "
                                                             "in training") if state else nullcontext():
            self.trainer.train(self.work.module, train, order.seed)

    def train_personal(self, order: protocol.TrainOrder) -> None:
        """Ditto: take the global w and the client's personal v_i, and update v_i with the group."""
        if self.personal is None:
            raise RuntimeError("the group leader ordered a personal model's training, but this run has no Ditto")
        self._join(order)
        self.parallel.broadcast([self.personal.global_copy, *client_model(self.work)])
        train, _ = self.local_data.get(order.client, (None, None))
        self.personal.train(self.trainer, train, order.seed)
