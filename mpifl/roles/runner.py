"""What every rank does for ``mpifl run``: build, agree on the model, then serve or train."""
from __future__ import annotations

import importlib.metadata
import os
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from mpi4py import MPI

from mpifl.wire import protocol
from mpifl.roles.client import ClientRank
from mpifl.config import Config, dump_config
from mpifl.aggregation.strategies import make_strategy
from mpifl.learning.datasets import Dataset, client_data, load_dataset, partition, partition_histogram, partition_table, split_validation
from mpifl.roles.federation import clients_of_rank
from mpifl.wire.flat import FlatModel, ModelSpec
from mpifl.roles.launch import SetupError, StopRequest, agree, log
from mpifl.metrics import JsonLines
from mpifl.learning.models import build_flat_model, model_spec
from mpifl.roles.server import Server, log_final
from mpifl.storage.stores import InMemoryState, OnDiskState
from mpifl.storage.hdf5 import Checkpoint, checkpoint_name
from mpifl.learning.trainers import make_evaluator
from mpifl.wire.transport import recv_chunks, send_chunks


def check_world(size: int, cfg: Config) -> None:
    """Refuse rank counts that cannot run this config."""
    if size < 2:
        raise SetupError("mpifl needs at least 2 ranks (rank 0 is the server, ranks 1.. are clients): "
                         "launch with e.g. `mpiexec -n 3 mpifl run CONFIG`")
    if size - 1 > cfg.clients.num_clients:
        raise SetupError(f"{size - 1} client ranks but clients.num_clients={cfg.clients.num_clients}: "
                         f"use at most {cfg.clients.num_clients + 1} ranks or raise clients.num_clients")
    if cfg.server.state == "disk" and cfg.clients_per_round() > size - 1:
        raise SetupError(f"server.state='disk' streams one participant per client rank, but "
                         f"{cfg.clients_per_round()} clients per round > {size - 1} client ranks: launch "
                         f"{cfg.clients_per_round() + 1} ranks or lower clients.per_round")


def needs_dataset(cfg: Config) -> bool:
    """Whether the run reads data: to size the model, to train or to evaluate (the benchmark blob never does)."""
    if cfg.model.name == "blob":
        return False
    return (cfg.model.name in ("mlp", "cnn") or cfg.train.trainer != "none" or cfg.eval.every > 0
            or cfg.eval.federated_every > 0)


def check_vocabulary(flat: FlatModel, dataset: Dataset) -> None:
    """Token ids must fit the transformers model's embedding."""
    rows = flat.module.get_input_embeddings().num_embeddings
    largest = int(max(dataset.x_train.max(), dataset.x_test.max()))
    if largest >= rows:
        raise SetupError(f"data: token id {largest} does not fit the model's {rows}-row embedding; raise "
                         "model.transformers.config's vocab_size or lower data.kwargs.vocab_size")


def agree_on_spec(comm: MPI.Comm, spec: ModelSpec) -> None:
    """Compare every client's model with the server's; all ranks fail if any differs."""
    server_spec = comm.bcast(spec if comm.Get_rank() == 0 else None, root=0)
    problem = None if spec.hash == server_spec.hash else spec.first_difference(server_spec)
    problems = comm.allgather(problem)
    bad = [(rank, p) for rank, p in enumerate(problems) if p]
    if bad:
        rank, what = bad[0]
        raise SetupError(f"rank {rank}'s model differs from the server's: {what} "
                         f"(client spec hash != server {server_spec.hash})")


def versions() -> dict[str, str]:
    """Library versions recorded with every checkpoint."""
    out = {"torch": str(torch.__version__), "h5py": h5py.__version__,
           "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split())}
    try:
        out["mpifl"] = importlib.metadata.version("mpifl")
    except importlib.metadata.PackageNotFoundError:
        out["mpifl"] = "unknown"
    return out


def run_rank(comm: MPI.Comm, cfg: Config, run_dir: Path | None, resume: Path | None = None) -> list[dict] | None:
    """Run one rank's part of the experiment; rank 0 returns the metrics history."""
    rank = comm.Get_rank()
    stop = StopRequest().install()
    torch.set_num_threads(1)  # one compute thread per rank: ranks share the node's cores
    dataset = agree(comm, lambda: load_dataset(cfg.data)) if needs_dataset(cfg) else None  # read once, shared
    shape = dict(input_shape=dataset.input_shape, num_classes=dataset.num_classes) if dataset else {}
    if rank == 0 and cfg.server.state == "disk":  # shapes only: the out-of-core server never allocates the model
        spec, flat = model_spec(cfg.model, cfg.seed, **shape)[0], None
    else:
        flat = build_flat_model(cfg.model, cfg.seed, **shape)
        spec = flat.spec
        if dataset is not None and cfg.model.name == "transformers":
            check_vocabulary(flat, dataset)
    agree_on_spec(comm, spec)
    if rank == 1 and flat.frozen_spec.entries:
        log(f"exchanging {len(spec.entries)} trainable tensors ({spec.total_bytes / 2**20:.1f} MiB); "
            f"{len(flat.frozen_spec.entries)} frozen tensors ({flat.frozen_spec.total_bytes / 2**20:.1f} MiB) "
            "stay on every rank", rank=1)
    opened: dict[str, Checkpoint] = {}
    if resume is not None:  # rank 0 checks; every rank learns whether it fits
        agree(comm, lambda: opened.setdefault("ckpt", _open_checkpoint(resume, spec)) and None)
    upload_initial = cfg.server.state == "disk" and resume is None and not cfg.model.init_from
    if rank != 0:
        if upload_initial and rank == 1:
            send_chunks(comm, [0], protocol.INIT, [flat.chunk_bytes(c) for c in _chunks(cfg, spec)],
                        cfg.transport.inflight)
        ClientRank(comm, cfg, flat, _local_data(cfg, dataset, rank, comm.Get_size() - 1)).run()
        return None
    return _serve(comm, cfg, run_dir, opened.get("ckpt"), spec, flat, dataset, stop)


def _serve(comm, cfg: Config, run_dir: Path | None, ckpt: Checkpoint | None, spec: ModelSpec,
           flat: FlatModel | None, dataset: Dataset | None, stop: StopRequest) -> list[dict]:
    chunks = _chunks(cfg, spec)
    ckpt_dir = run_dir / "checkpoints" if run_dir else None
    if ckpt_dir:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    attrs = {"config": dump_config(cfg), "seed": cfg.seed, "strategy": cfg.strategy.name,
             "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **{f"version_{k}": v for k, v in versions().items()}}
    strategy = make_strategy(cfg.strategy)
    if strategy.stacked and cfg.clients_per_round() > comm.Get_size() - 1:
        log(f"strategy {cfg.strategy.name}: {cfg.clients_per_round()} participants per round on "
            f"{comm.Get_size() - 1} client ranks: a rank's participants arrive one after another, so the server "
            "stacks every participant's whole model (participants x model x 4 bytes); one client rank per "
            "participant keeps it at participants x chunk", rank=0)
    if flat is not None:
        state = InMemoryState(flat, chunks, ckpt_dir, cfg.checkpoint.keep, strategy.state_init)
    else:
        if ckpt_dir is None:
            raise SetupError("server.state='disk' needs a run directory for its HDF5 state")
        state = OnDiskState(spec, chunks, ckpt_dir, cfg.checkpoint.keep, int(cfg.server.window_mb * 2**20),
                            strategy.state_init, read_previous=strategy.needs_previous_global)
    if dataset is not None and ckpt is None:
        _report_partition(cfg, dataset, run_dir)
    start, history = 0, []
    if ckpt is not None:
        start, history = ckpt.round, ckpt.metrics()
        state.load(ckpt)
    elif isinstance(state, OnDiskState) and cfg.model.init_from:
        init = Checkpoint(cfg.model.init_from)
        init.check_spec(spec)
        state.load(init)
    elif isinstance(state, OnDiskState):
        state.write_initial({**attrs, "round": 0},
                            lambda bufs: recv_chunks(comm, 1, protocol.INIT, bufs, cfg.transport.inflight))
    evaluator = None
    if dataset is not None and flat is not None:
        score = make_evaluator(cfg)
        evaluator = lambda: score(flat.module, dataset.x_test, dataset.y_test)  # noqa: E731
    sink = JsonLines(run_dir / "metrics.jsonl" if run_dir else None)
    try:
        history = Server(comm, cfg, state, sink, evaluator, attrs, stop, strategy).run(start, history)
    finally:
        sink.close()
    if run_dir and cfg.output.save_model and history and history[-1]["round"] == cfg.rounds:
        _link_final(ckpt_dir / checkpoint_name(cfg.rounds), run_dir / "model.h5")
    log_final(history, str(run_dir) if run_dir else "(no run directory)")
    return history


def _report_partition(cfg: Config, dataset: Dataset, run_dir: Path | None) -> None:
    """Print the clients x labels table; keep it as partition.csv in the run directory."""
    histogram = partition_histogram(cfg.data, dataset, cfg.clients.num_clients, cfg.seed)
    log(f"partition '{cfg.data.partition}' of {len(dataset.y_train)} training samples:\n"
        + partition_table(histogram), rank=0)
    if run_dir is not None:
        header = "samples," + ",".join(f"class{k}" for k in range(histogram.shape[1]))
        np.savetxt(run_dir / "partition.csv", np.column_stack([histogram.sum(axis=1), histogram]), fmt="%d",
                   delimiter=",", header=header, comments="")


def _open_checkpoint(path: Path, spec: ModelSpec) -> Checkpoint:
    ckpt = Checkpoint(path)
    ckpt.check_spec(spec)
    return ckpt


def _link_final(final: Path, model_file: Path) -> None:
    """model.h5 is the final checkpoint (a hard link where possible: no second copy on disk)."""
    tmp = model_file.with_name(model_file.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(final, tmp)
    except OSError:
        import shutil
        shutil.copyfile(final, tmp)
    os.replace(tmp, model_file)


def _chunks(cfg: Config, spec: ModelSpec):
    return spec.chunks(cfg.transport.chunk_bytes)


def _local_data(cfg: Config, dataset: Dataset | None, rank: int, client_ranks: int) -> dict:
    mine = clients_of_rank(rank, cfg.clients.num_clients, client_ranks)
    if dataset is None:
        return {c: (None, None) for c in mine}
    parts = partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed)
    out = {}
    for c in mine:
        train, val = split_validation(parts[c], cfg.data.val_fraction, cfg.seed, c)
        out[c] = (client_data(dataset, train), client_data(dataset, val) if len(val) else None)
    return out
