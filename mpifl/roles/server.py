"""Rank 0: sample, stream the global model out, reduce updates as they stream back."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Callable

from mpi4py import MPI
from tqdm import tqdm

from mpifl.wire import protocol
from mpifl.aggregation.strategies import Strategy
from mpifl.config import Config
from mpifl.roles.federation import group_by_rank, sample_clients
from mpifl.roles.launch import StopRequest, log
from mpifl.metrics import JsonLines, current_rss_bytes, peak_rss_bytes
from mpifl.wire.flat import wire_chunks
from mpifl.aggregation.reduction import PoolPlan, ReceivePool, RoundAborted, StreamedReduction
from mpifl.storage.stores import InMemoryState, OnDiskState
from mpifl.wire.transport import send_chunks, wait_all


@dataclass
class RoundTimes:
    """Wall-clock marks of one round (perf_counter seconds)."""

    start: float
    dispatched: float
    first_update: float
    reduced: float
    evaluated: float
    checkpointed: float
    end: float
    aggregate: float  # seconds spent folding/finishing, inside [first_update, reduced]

    def split(self) -> dict[str, float]:
        """Disjoint parts that add up to the round (no double counting, cf. seed 004)."""
        receive = self.reduced - self.first_update
        return {
            "dispatch": self.dispatched - self.start,
            "client_train": self.first_update - self.dispatched,
            "return": receive - self.aggregate,
            "aggregate": self.aggregate,
            "eval": self.evaluated - self.reduced,
            "checkpoint": self.checkpointed - self.evaluated,
            "other": self.end - self.checkpointed,
            "round": self.end - self.start,
        }


class Server:
    """Runs the rounds over a global-model state (in memory or on disk) and a receive pool."""

    def __init__(self, comm: MPI.Comm, cfg: Config, state: InMemoryState | OnDiskState, sink: JsonLines,
                 evaluate: Callable[[], dict] | None, attrs: dict, stop: StopRequest, strategy: Strategy):
        self.comm, self.cfg, self.state, self.sink, self.evaluate = comm, cfg, state, sink, evaluate
        self.attrs, self.stop = attrs, stop
        self.client_ranks = comm.Get_size() - 1
        self.chunks = state.chunks
        self.wire = wire_chunks(self.chunks, cfg.strategy.wire_dtype)
        self.strategy = strategy
        self.pool = ReceivePool(self.wire, cfg.clients_per_round() if strategy.stacked else 1)
        self.history: list[dict] = []

    def run(self, start_round: int = 0, history: list[dict] = ()) -> list[dict]:
        """Rounds start_round+1.. until the last or a SIGTERM, then tell the clients to stop."""
        self.history = list(history)
        bar = tqdm(total=self.cfg.rounds, initial=start_round, desc="[rank 0] rounds", leave=False,
                   disable=not (self.cfg.output.progress and sys.stderr.isatty()), dynamic_ncols=True)
        try:
            for rnd in range(start_round + 1, self.cfg.rounds + 1):
                record, stopping = self.round(rnd)
                self.sink.write(record)
                bar.update(1)
                if "eval" in record or "federated_eval" in record:
                    bar.write(f"[rank 0] round {rnd}/{self.cfg.rounds}: " + _summary(record))
                if stopping and rnd < self.cfg.rounds:
                    log(f"SIGTERM: stopped after round {rnd} with a checkpoint; continue with --resume", rank=0)
                    break
        finally:
            bar.close()
        self._broadcast_headers({}, self.cfg.rounds + 1, stop=True)
        return self.history

    def round(self, rnd: int) -> tuple[dict, bool]:
        """One round, top to bottom; also says whether a SIGTERM made it the last (it then checkpointed)."""
        start = time.perf_counter()
        participants = sample_clients(self.cfg.seed, rnd, self.cfg.clients.num_clients, self.cfg.clients_per_round())
        by_rank = group_by_rank(participants, self.client_ranks)
        self._broadcast_headers(by_rank, rnd)
        for window in self.state.outgoing():
            send_chunks(self.comm, sorted(by_rank), protocol.MODEL, window, self.cfg.transport.inflight)
        dispatched = time.perf_counter()
        self.state.begin_round(rnd)
        reduction = StreamedReduction(self.comm, self.state, self.chunks, self.strategy, by_rank, self.pool,
                                      self._plan(by_rank), self.wire, self.cfg.clients.min_participants, rnd)
        try:
            stats = reduction.run()
        except RoundAborted:
            self._save_before_abort(rnd, reduction.stats.metas)
            raise
        self._log_drops(rnd, stats.metas)
        reduced = time.perf_counter()
        evaluation = self._evaluate(rnd)
        evaluated = time.perf_counter()
        record = self._record(rnd, participants, by_rank, stats.metas, evaluation)
        times = RoundTimes(start, dispatched, stats.first_arrival or dispatched, reduced, evaluated, evaluated,
                           evaluated, stats.aggregate_seconds)
        record["time"] = times.split()
        self.history.append(record)
        every = self.cfg.checkpoint.every
        stopping = self.stop.requested  # read once: a later SIGTERM is handled after the next round
        save = rnd == self.cfg.rounds or stopping or bool(every and rnd % every == 0)
        self.state.end_round(rnd, {**self.attrs, "round": rnd}, self.history, save)
        times.checkpointed = time.perf_counter()
        times.end = time.perf_counter()
        record["time"] = times.split()
        return record, stopping

    def _log_drops(self, rnd: int, metas: dict) -> None:
        for client, meta in sorted(metas.items()):
            if meta.error is not None:
                log(f"round {rnd}: dropped logical client {client} (rank {self._rank_of(client)}): {meta.error}",
                    rank=0)

    def _rank_of(self, client: int) -> int:
        return protocol.rank_of_client(client, self.client_ranks)

    def _save_before_abort(self, rnd: int, metas: dict) -> None:
        """The round is not applied: keep the model as it was after the previous round, on disk."""
        self._log_drops(rnd, metas)
        self.state.abandon_round()
        if rnd > 1 and isinstance(self.state, InMemoryState):
            path = self.state.end_round(rnd - 1, {**self.attrs, "round": rnd - 1}, self.history, save=True)
            log(f"round {rnd} aborted; the global model after round {rnd - 1} is saved in {path}", rank=0)

    def _plan(self, by_rank: dict[int, list[int]]) -> PoolPlan:
        t = self.cfg.transport
        budget = int(t.pool_mb * 2**20)
        if isinstance(self.state, InMemoryState):
            # At most a quarter of the model: the in-memory server's bound is ~1.25 x model.
            budget = min(budget, self.state.spec.total_bytes // 4)
        if self.strategy.stacked:  # at least two chunks' stacks, whatever the budget
            budget = max(budget, 2 * self.pool.acc_numel * 4 * 2)
        return PoolPlan.from_budget(
            budget_bytes=budget, chunk_bytes=self.pool.chunk_bytes,
            acc_chunk_bytes=self.pool.acc_numel * 4, ranks=len(by_rank), inflight=t.inflight,
            num_chunks=len(self.chunks), sequential=any(len(c) > 1 for c in by_rank.values()))

    def _broadcast_headers(self, by_rank: dict[int, list[int]], rnd: int, stop: bool = False) -> None:
        requests = [self.comm.isend(protocol.RoundHeader(rnd, tuple(by_rank.get(r, ())), stop), dest=r,
                                    tag=protocol.HEADER) for r in range(1, self.client_ranks + 1)]
        wait_all(requests)

    def _evaluate(self, rnd: int) -> dict | None:
        every = self.cfg.eval.every
        if self.evaluate is None or every == 0 or (rnd % every and rnd != self.cfg.rounds):
            return None
        return self.evaluate()

    def _record(self, rnd: int, participants: list[int], by_rank: dict, metas: dict, evaluation: dict | None) -> dict:
        usable = [m for m in metas.values() if m.error is None]
        samples = sum(m.num_samples for m in usable)
        losses = [(m.metrics["loss"], m.num_samples) for m in usable if "loss" in m.metrics]
        model_bytes = sum(c.nbytes for c in self.chunks)
        record = {
            "round": rnd,
            "participants": participants,
            "dropped": [{"client": c, "rank": self._rank_of(c), "reason": m.error}
                        for c, m in sorted(metas.items()) if m.error is not None],
            "train_loss": sum(l * n for l, n in losses) / max(1, sum(n for _, n in losses)) if losses else None,
            "num_samples": samples,
            "bytes_sent": model_bytes * len(by_rank),
            "bytes_received": sum(w.nbytes for w in self.wire) * len(participants),
            "server_rss_bytes": current_rss_bytes(),
            "server_peak_rss_bytes": peak_rss_bytes(),
            "client_train_seconds": max(m.train_seconds for m in metas.values()),
            "client_peak_rss_bytes": max(m.metrics.get("rank_peak_rss_bytes", 0) for m in metas.values()),
        }
        if evaluation is not None:
            record["eval"] = evaluation
        federated = federated_evaluation(usable)
        if federated is not None:
            record["federated_eval"] = federated
        return record


def federated_evaluation(metas) -> dict | None:
    """Clients' validation metrics of the global model they received, weighted by validation samples."""
    reports = [m.metrics for m in metas if "val_samples" in m.metrics]
    if not reports:
        return None
    n = sum(r["val_samples"] for r in reports)
    keys = [k for k in reports[0] if k.startswith("val_") and k != "val_samples"]
    out = {k[4:]: sum(r[k] * r["val_samples"] for r in reports) / n for k in keys}
    if "perplexity" in out:  # of the pooled loss, not a mean of perplexities
        out["perplexity"] = math.exp(min(out["loss"], 50.0))
    return {**out, "clients": len(reports), "samples": n}


def _summary(record: dict) -> str:
    parts = []
    if record.get("train_loss") is not None:
        parts.append(f"train_loss {record['train_loss']:.4f}")
    parts += [f"{k} {v:.4f}" for k, v in record.get("eval", {}).items()]
    if "federated_eval" in record:
        parts += [f"federated_{k} {v:.4f}" for k, v in record["federated_eval"].items() if k not in ("clients", "samples")]
    return ", ".join(parts)


def log_final(history: list[dict], where: str) -> None:
    """One closing line with the last evaluation."""
    last = next((r for r in reversed(history) if "eval" in r), None)
    detail = f"round {last['round']}: " + _summary(last) if last else "no evaluation"
    log(f"finished {len(history)} rounds; final {detail}; outputs in {where}", rank=0)
