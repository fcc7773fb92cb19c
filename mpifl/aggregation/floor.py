"""The raw-MPI floor of the exchange: what plain mpi4py, done well, takes to move and fold the same bytes.

Two users:

- ``mpifl bench exchange`` runs ``FloorExchange`` at the model's size beside the real exchange
  (``ratio_to_floor`` in its output);
- ``mpifl run`` times it once before round 1 on a probe of ``transport.floor_probe_mb``
  (``measure_floor``), between the server and all its client ranks at once, and gives every
  round's record the floor of that round's bytes at the measured rates (``FloorRate.exchange``).
  A run's trackers then show, round by round, how far its exchange is from what the machine allows.

The floor is chunked ``Isend``/``Irecv`` of raw bytes with the same chunk size and the same number in
flight per peer as mpifl, the same sleep-polled waits, buffers from the same (huge-page) memory, and the
same fastest fold (narrow chunks widened into an fp32 scratch, then a fused multiply-add) in arrival order,
with no ordering and no bookkeeping.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from mpi4py import MPI

from mpifl.aggregation.kernels import fold
from mpifl.errors import JobFailure
from mpifl.planning.pools import FloorProbe
from mpifl.wire import protocol
from mpifl.wire.memory import host_bytes, host_tensor
from mpifl.wire.transport import Backoff, recv_chunks, send_chunks

PROBE_REPEATS = 3  # timed probe rounds after one warm-up; the rates are their medians


@dataclass(frozen=True)
class FloorRate:
    """Seconds per byte of the raw-MPI floor between the server and its client ranks, all of them at once:
    ``down`` per byte the server sends, ``up`` per byte it receives and folds."""

    down: float
    up: float
    probe_bytes: int  # what each client rank moved each way per probe round
    client_ranks: int

    def exchange(self, split: dict[str, float], sent: int, received: int) -> dict[str, float]:
        """A round's exchange against the floor of its bytes: the seconds the server spent sending, receiving
        and folding (dispatch + return + aggregate of the time split), the floor's seconds for the same bytes,
        and their ratios. With training, ``return`` also holds the wait for clients that finish later, so the
        whole ratio is an upper bound; the dispatch, which no training overlaps, is exact."""
        floor_down, floor_up = sent * self.down, received * self.up
        seconds = split["dispatch"] + split["return"] + split["aggregate"]
        out = {"seconds": seconds, "floor_seconds": floor_down + floor_up}
        if floor_down + floor_up > 0:
            out["ratio_to_floor"] = seconds / (floor_down + floor_up)
        if floor_down > 0:
            out["dispatch_ratio_to_floor"] = split["dispatch"] / floor_down
        return out


def measure_floor(comm: MPI.Comm, probe: FloorProbe, dtype: torch.dtype, limit_seconds: float,
                  repeats: int = PROBE_REPEATS) -> FloorRate | None:
    """Every rank of ``comm`` calls this at the same point; rank 0 gets the floor's rates, the others None.

    One warm-up round, then ``repeats`` timed rounds of ``FloorExchange`` on the probe's bytes; the rates
    are the medians. A client rank that makes no progress for ``limit_seconds`` (it may still be finishing an
    earlier start-up stage, reading ``model.init_from`` say, when the server gets here) ends the job, named,
    instead of hanging it."""
    nbytes = probe.nbytes
    if nbytes <= 0 or comm.Get_size() < 2:
        return None
    exchange = FloorExchange(comm, nbytes, dtype, probe.chunk_bytes, probe.inflight,
                             tags=(protocol.FLOOR_DOWN, protocol.FLOOR_UP), limit_seconds=limit_seconds)
    for _ in range(repeats + 1):
        exchange.round()
    if comm.Get_rank() != 0:
        return None
    moved = nbytes * exchange.clients
    timed = exchange.split[1:]
    return FloorRate(down=statistics.median(s["dispatch"] for s in timed) / moved,
                     up=statistics.median(s["return"] for s in timed) / moved,
                     probe_bytes=nbytes, client_ranks=exchange.clients)


class ProbeDeadline:
    """The probe's deadline (a ``transport.SendWatch``): a client rank that makes no progress for ``limit`` seconds
    ends the job, named, instead of hanging it."""

    def __init__(self, ranks: Iterable[int], limit: float):
        now = time.monotonic()
        self.limit, self.last = limit, {rank: now for rank in ranks}

    def progress(self, rank: int) -> None:
        """A message to or from ``rank`` completed."""
        self.last[rank] = time.monotonic()

    def check(self, waiting: Callable[[], dict[int, tuple[str, str | None]]]) -> None:
        """Raise naming the ranks in ``waiting()`` silent for longer than the limit."""
        now = time.monotonic()
        silent = sorted(rank for rank in waiting() if now - self.last[rank] > self.limit)
        if silent:
            raise JobFailure(f"the exchange's floor probe before round 1: rank(s) {silent} made no progress for "
                             f"{self.limit:.0f} s (transport.floor_probe_mb: 0 skips the probe)")


class FloorExchange:
    """Raw chunked exchange + fused reduction in arrival order (no ordering, no bookkeeping).

    Buffers are preallocated and touched once, as careful hand-written code would do. Rank 0 is the server;
    every other rank of ``comm`` receives the buffer and sends it back. With ``limit_seconds``, the server
    ends the job (``JobFailure``) when a client rank makes no progress for that long.
    """

    def __init__(self, comm: MPI.Comm, model_bytes: int, dtype: torch.dtype, chunk_bytes: int, inflight: int,
                 tags: tuple[int, int], limit_seconds: float | None = None):
        self.comm, self.dtype, self.slots_per_client = comm, dtype, inflight
        self.tag_down, self.tag_up, self.limit = tags[0], tags[1], limit_seconds
        self.split: list[dict[str, float]] = []  # rank 0: each round's dispatch and return seconds
        self.rank, self.clients = comm.Get_rank(), comm.Get_size() - 1
        self.itemsize = dtype.itemsize
        step = max(1, min(chunk_bytes, model_bytes) // self.itemsize) * self.itemsize  # no slot beyond the buffer
        self.spans = [(o, min(step, model_bytes - o)) for o in range(0, model_bytes, step)]
        self.model = host_bytes(model_bytes)
        self.chunks = [self.model[o:o + n] for o, n in self.spans]
        if self.rank == 0:
            self.slots = [[host_bytes(step) for _ in range(self.slots_per_client)] for _ in range(self.clients)]
            self.acc = host_tensor(model_bytes // self.itemsize, torch.float32)  # huge pages, as mpifl's
            self.scratch = host_tensor(step // self.itemsize, torch.float32)  # the fastest fold, as mpifl's

    def round(self) -> None:
        """One round: model out to every client, every client's model back and folded."""
        if self.rank != 0:
            recv_chunks(self.comm, 0, self.tag_down, self.chunks, self.slots_per_client)
            send_chunks(self.comm, [0], self.tag_up, self.chunks, self.slots_per_client)
            return
        deadline = ProbeDeadline(range(1, self.clients + 1), self.limit) if self.limit is not None else None
        start = time.perf_counter()
        send_chunks(self.comm, list(range(1, self.clients + 1)), self.tag_down, self.chunks, self.slots_per_client,
                    deadline)
        dispatched = time.perf_counter()
        self._receive_and_fold(deadline)
        self.split.append({"dispatch": dispatched - start, "return": time.perf_counter() - dispatched})

    def _receive_and_fold(self, deadline: ProbeDeadline | None) -> None:
        self.acc.zero_()
        requests, tickets, nxt = [], [], [0] * self.clients
        for c in range(self.clients):
            for s in range(min(self.slots_per_client, len(self.spans))):
                requests.append(self._post(c, s, nxt[c]))
                tickets.append((c, s, nxt[c]))
                nxt[c] += 1
        remaining, backoff = self.clients * len(self.spans), Backoff()
        def owed() -> dict[int, tuple[str, str | None]]:
            return {c + 1: ("floor probe", None) for (c, _, _), r in zip(tickets, requests) if r}

        while remaining:
            done = MPI.Request.Testsome(requests)
            if not done:
                if deadline is not None:
                    deadline.check(owed)
                backoff.pause()
                continue
            backoff.reset()
            for i in done:
                c, s, j = tickets[i]
                if deadline is not None:
                    deadline.progress(c + 1)
                o, n = self.spans[j]
                x = torch.from_numpy(self.slots[c][s][:n]).view(self.dtype)
                fold(self.acc[o // self.itemsize:(o + n) // self.itemsize], x, 1.0 / self.clients, False, self.scratch)
                remaining -= 1
                if nxt[c] < len(self.spans):
                    requests[i] = self._post(c, s, nxt[c])
                    tickets[i] = (c, s, nxt[c])
                    nxt[c] += 1

    def _post(self, client: int, slot: int, j: int) -> MPI.Request:
        n = self.spans[j][1]
        return self.comm.Irecv([self.slots[client][slot][:n], MPI.BYTE], source=client + 1, tag=self.tag_up)
