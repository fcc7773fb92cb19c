"""What every rank does for ``mpifl run``: build, agree on the model, then serve or train."""
from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path

import h5py
import torch
from mpi4py import MPI

from .client import ClientRank
from .config import Config, dump_config
from .data import Dataset, client_data, load_dataset, partition
from .federation import clients_of_rank
from .flat import FlatModel, ModelSpec
from .launch import SetupError
from .metrics import JsonLines
from .models import build_model
from .server import Server, log_final
from .storage import save_model


def check_world(size: int, cfg: Config) -> None:
    """Refuse rank counts that cannot run this config."""
    if size < 2:
        raise SetupError("mpifl needs at least 2 ranks (rank 0 is the server, ranks 1.. are clients): "
                         "launch with e.g. `mpiexec -n 3 mpifl run CONFIG`")
    if size - 1 > cfg.clients.num_clients:
        raise SetupError(f"{size - 1} client ranks but clients.num_clients={cfg.clients.num_clients}: "
                         f"use at most {cfg.clients.num_clients + 1} ranks or raise clients.num_clients")


def needs_dataset(cfg: Config) -> bool:
    """The benchmark blob with no training and no evaluation needs no data."""
    return not (cfg.model.name == "blob" and cfg.train.trainer == "none" and cfg.eval.every == 0)


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
    """Library versions recorded with every saved model."""
    out = {"torch": str(torch.__version__), "h5py": h5py.__version__, "mpi": MPI.Get_library_version().splitlines()[0]}
    try:
        out["mpifl"] = importlib.metadata.version("mpifl")
    except importlib.metadata.PackageNotFoundError:
        out["mpifl"] = "unknown"
    return out


def run_rank(comm: MPI.Comm, cfg: Config, run_dir: Path | None) -> list[dict] | None:
    """Run one rank's part of the experiment; rank 0 returns the metrics history."""
    rank = comm.Get_rank()
    torch.set_num_threads(1)  # one compute thread per rank: ranks share the node's cores
    dataset = load_dataset(cfg.data) if needs_dataset(cfg) else None
    shape = dict(input_shape=dataset.input_shape, num_classes=dataset.num_classes) if dataset else {}
    flat = FlatModel(build_model(cfg.model, cfg.seed, **shape))
    agree_on_spec(comm, flat.spec)
    if rank != 0:
        ClientRank(comm, cfg, flat, _local_data(cfg, dataset, rank, comm.Get_size() - 1)).run()
        return None
    sink = JsonLines(run_dir / "metrics.jsonl" if run_dir else None)
    try:
        history = Server(comm, cfg, flat, dataset, sink).run()
    finally:
        sink.close()
    if run_dir and cfg.output.save_model:
        save_model(run_dir / "model.h5", flat, {
            "round": cfg.rounds, "config": dump_config(cfg), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **{f"version_{k}": v for k, v in versions().items()}})
    log_final(history, str(run_dir) if run_dir else "(no run directory)")
    return history


def _local_data(cfg: Config, dataset: Dataset | None, rank: int, client_ranks: int) -> dict:
    mine = clients_of_rank(rank, cfg.clients.num_clients, client_ranks)
    if dataset is None:
        return {c: None for c in mine}
    parts = partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed)
    return {c: client_data(dataset, parts[c]) for c in mine}
