"""Per-client state on a sharded client group (``clients.sharding: fsdp``): every rank of the group keeps its
clients' vectors (SCAFFOLD's c_i, FedDyn's g_i, Ditto's personal models) over the rows of the model it holds, and
only those.

Why on every rank rather than on the leader: a client's vector is one fp32 value per trained element, twice a
bf16 model's size, so a leader holding whole vectors would hold more than the model the group shards. Each rank's
store is a store like an unsharded rank's (in RAM or on disk within the state's budget), of 1/R of the elements;
its client half (``ClientAlgorithm.shard``) acts on its rows elementwise as the unsharded half acts on whole
tensors, so the group's result is what one rank would compute, up to the training's own rounding.

A checkpoint holds one file per rank of each group, each marked with its rows (``storage.residuals.save_snapshot``);
a resume on another number of groups reads each rank's rows from the files of its index in the group. Clients the
server drops past their deadline have their vectors put back on every rank of the group, as the leader relays the
server's note of them (``GroupStep.dropped``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from mpi4py import MPI

from mpifl.algorithms import client_algorithm
from mpifl.algorithms.contract import ShardHalf, ShardRows
from mpifl.algorithms.ditto import ShardPersonalModels
from mpifl.config import Config, ConfigError
from mpifl.config.client_state import StateSizes
from mpifl.errors import noted
from mpifl.learning.steps import own_rows, trainable
from mpifl.logs import log
from mpifl.roles.client_state import open_client_state, put_back_line, state_views
from mpifl.roles.sharded_chunks import ShardedModel
from mpifl.storage.residuals import DiskResiduals, RamResiduals, ResidualStore, UndoJournal, save_snapshot
from mpifl.storage.rundir import ResumePoint
from mpifl.wire.protocol import UpdateMeta


def rows_of(model: ShardedModel, streams: Sequence[torch.Tensor], all_ranks: Callable[[bool], bool]) -> ShardRows:
    """What this rank holds of a sharded model, for a client half (``ShardRows``): its trained parameters, its rows of
    each, the round's global values of those rows (views of ``model.global_rows``, the bytes the group keeps of
    them) and its rows of the summed streams."""
    named = trainable(model.module)
    params = [p for _, p in named]
    dtypes, global_rows = model.dtypes, model.global_rows
    rows = [own_rows(p.data) for p in params]
    anchors = []
    for (name, _), mine in zip(named, rows):
        if name not in dtypes:
            raise RuntimeError(f"the trained parameter {name!r} does not travel, so a client half has no global value "
                               "of it to act on")
        held = global_rows.get(name)  # none where this rank holds no rows of it
        anchors.append(held.view(dtypes[name]).view(mine.shape) if held is not None else torch.empty_like(mine))
    device = rows[0].device if rows else torch.device("cpu")
    return ShardRows(params, rows, anchors, list(streams), device, all_ranks)


@dataclass
class ShardedState:
    """One rank's per-client state in a sharded group: its store over its rows, what reads it (a strategy's client
    half, Ditto's personal models), and the put-back of dropped clients' vectors where the run journals them."""

    kept: RamResiduals | DiskResiduals  # the store itself: what a checkpoint publishes
    journal: UndoJournal | None
    shard: tuple[int, int]  # (this rank's index in its group, the group's size)
    weight: Callable[[UpdateMeta], float]  # a client's weight in the server's fold (its strategy's), from its header
    half: ShardHalf | None = None  # the strategy's client half (SCAFFOLD, FedDyn)
    personal: ShardPersonalModels | None = None  # train.ditto_lambda
    residuals: ResidualStore | None = None  # top-k's error feedback: this rank's pieces of each chunk, by chunk

    def settle(self, dropped: Sequence[int], rank: int) -> None:
        """Put back the vectors of this rank's clients the server dropped since its last header."""
        if self.journal is None:
            return
        undone = self.journal.settle(tuple(dropped))
        if undone and self.shard[0] == 0:
            log(put_back_line(undone, "per-client state", " on every rank of its group"), rank=rank)

    def checked(self, client: int, usable: bool) -> None:
        """``client``'s update was checked on every rank: Ditto's v_i, held since it trained, stands only with a
        ``usable`` update, as on an unsharded rank (a refused client ends the round as if never sampled)."""
        if self.personal is not None:
            self.personal.keep(client, usable)

    def persist(self, folder: Path, rank: int, round_: int) -> str:
        """Publish this rank's rows of its clients' vectors for round ``round_``'s checkpoint; the file's name."""
        return save_snapshot(self.kept, self.kept.firsts, folder, rank, round_, self.shard)


def open_sharded_state(cfg: Config, rows: ShardRows, pieces: Sequence[int], shard: tuple[int, int], rank: int,  # noqa: PLR0913 - each from its own source
                       hosted: list[int], run_dir: Path | None, resume: ResumePoint | None,
                       weight: Callable[[UpdateMeta], float],
                       personal: Callable[[ResidualStore], ShardPersonalModels]) -> ShardedState | None:
    """The per-client state of a sharded group's rank (``rank`` its world rank), over its rows of the trained
    parameters (``pieces``: the elements this rank sends of each exchange chunk, which error feedback keeps);
    None for a run without. What the sharded path keeps: a client half's vector, Ditto's personal model
    (``personal`` builds its part over the store) and top-k's residuals; the config checks refuse the other
    kinds, and Ditto beside error feedback. A client half without a sharded form is refused here, naming it."""
    kinds = cfg.client_state()
    if kinds is None:
        return None
    algorithm = client_algorithm(cfg.client_rule) if cfg.client_rule else None
    if cfg.client_rule and (algorithm is None or algorithm.shard is None):
        raise ConfigError(f"strategy.name: clients.sharding: 'fsdp' keeps per-client state only through a client "
                          f"half's sharded form (ClientAlgorithm.shard); {cfg.client_rule!r} has none: set "
                          "clients.sharding='replicate'")
    # error feedback: its pieces of each chunk; else Ditto's v_i: one chunk, this rank's rows
    chunks = tuple(pieces) if kinds.residuals else (rows.elements,)
    layout = kinds.layout(StateSizes(trainable=rows.elements, chunks=chunks, local=0, tensors=rows.elements))
    kept = open_client_state(cfg, layout, rank, hosted, run_dir, resume, shard)
    views = state_views(cfg, layout, kept)
    state = ShardedState(kept, views.journal, shard, weight)
    if algorithm is not None and algorithm.shard is not None and views.rule is not None:
        with noted(f"the client half {cfg.client_rule!r}, building it: shard(rows, store, cfg)"):
            state.half = algorithm.shard(rows, views.rule, cfg)
    if views.personal is not None:
        state.personal = personal(views.personal)
    state.residuals = views.residuals
    return state


def every_rank(comm: MPI.Comm) -> Callable[[bool], bool]:
    """``ShardRows.all_ranks`` over a group's communicator: True where every rank's answer is."""
    return lambda mine: bool(comm.allreduce(int(mine), op=MPI.MIN))
