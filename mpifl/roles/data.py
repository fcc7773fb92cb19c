"""Where a run's data goes: read once and shared (the server keeps only labels and the held-out set), split into
logical clients, placed on client ranks, and each rank's clients' slices."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from mpi4py import MPI

from mpifl.config import Config, DataConfig
from mpifl.errors import InputRefused
from mpifl.learning.datasets import (
    ClientData,
    Dataset,
    client_data,
    client_source,
    load_dataset,
    surveyed_dataset,
)
from mpifl.learning.noise import client_noise_std, validation_inputs
from mpifl.learning.partitions import (
    counts_of,
    partition,
    partition_csv,
    partition_table,
    split_validation,
)
from mpifl.learning.sources import HeldRows
from mpifl.learning.text import fewer_ids
from mpifl.logs import log
from mpifl.planning.federation import Placement, placement_for
from mpifl.roles.launch import SetupError, agree
from mpifl.storage.rundir import TOKENIZER
from mpifl.wire import protocol
from mpifl.wire.flat import FlatModel
from mpifl.wire.shared import node_communicator, recv_tensors, send_tensors, share_on_node
from mpifl.wire.transport import arrive_together, recv_object, send_object


def vocabulary_problem(flat: FlatModel, dataset: Dataset, data: DataConfig) -> str | None:
    """Token ids must fit the transformers model's embedding: what is wrong, or None. The advice follows where the
    ids came from: a named tokenizer, one trained to data.kwargs.vocab_size, or a plug-in dataset."""
    language_model: Any = flat.module  # a transformers model (the caller checks): its methods are not nn.Module's
    rows = language_model.get_input_embeddings().num_embeddings
    largest = max(_largest_id(dataset.x_train), _largest_id(dataset.x_test))
    if largest >= rows:
        fewer = f" or {fewer_ids(data.kwargs)}" if data.dataset == "text" else ""
        return (f"data: token id {largest} does not fit the model's {rows}-row embedding; raise "
                f"model.transformers.config's vocab_size{fewer}")
    return None


def _largest_id(rows: torch.Tensor | HeldRows) -> int:
    """The largest token id in ``rows``; from a client source, in the rows this rank holds (every rank checks
    its own and agree_on_spec shares any problem)."""
    if isinstance(rows, torch.Tensor):
        return int(rows.max()) if rows.numel() else -1
    return max((int(t.max()) for t in rows.held.values() if t.numel()), default=-1)


def shared_dataset(comm: MPI.Comm, cfg: DataConfig) -> Dataset:
    """The data every rank starts from: read once on rank 1 and shared (``_read_on_a_client_rank``); or, from a
    client source, only its index shared (labels, shapes), each client rank reading its own clients' inputs later."""
    source = client_source(cfg)
    if source is None:
        return _read_on_a_client_rank(comm, lambda: load_dataset(cfg))
    surveyed: dict = {}
    index = agree(comm, lambda: surveyed.setdefault("survey", source.survey())[0])
    return surveyed_dataset(source, index, surveyed["survey"][1] if comm.Get_rank() == 0 else None)


def _read_on_a_client_rank(comm: MPI.Comm, load: Callable[[], Dataset]) -> Dataset:
    """The dataset read once, on rank 1, and shared with every client rank; the server gets its labels and the
    held-out set only (``server_view``), so it never holds the training inputs it does not train on, not even
    while they are read. A reading error is a SetupError on every rank, as ``agree`` makes it."""
    rank = comm.Get_rank()
    clients = comm.Split(MPI.UNDEFINED if rank == 0 else 0, rank)
    try:
        if rank == 0:
            dataset, error = _receive_server_view(comm)
        else:
            dataset, error = None, None
            if rank == 1:
                try:
                    dataset = load()
                except (OSError, ValueError, SetupError) as err:
                    error = str(err)
                _send_server_view(comm, dataset, error)
            dataset, error = _share_with_client_ranks(cast(MPI.Intracomm, clients), dataset, error)
    finally:
        if clients != MPI.COMM_NULL:
            clients.Free()
    if error:
        raise SetupError(error)
    assert dataset is not None  # without an error, rank 1 read it
    return dataset


def _send_server_view(comm: MPI.Comm, dataset: Dataset | None, error: str | None) -> None:
    """Rank 1 sends the server its view of the dataset (or the error reading it): the skeleton as an object, its
    tensors as raw bytes (wire.shared.send_tensors), so that neither side holds them pickled."""
    if dataset is None:
        send_object(comm, (None, error), protocol.SERVER, protocol.DATASET)
        return
    view, none = server_view(dataset), torch.empty(0)
    skeleton = replace(view, y_train=none, x_test=none, y_test=none)  # x_train: empty, its shape the inputs'
    send_object(comm, (skeleton, None), protocol.SERVER, protocol.DATASET)
    send_tensors(comm, [view.y_train, view.x_test, view.y_test], protocol.SERVER, protocol.DATASET)


def _receive_server_view(comm: MPI.Comm) -> tuple[Dataset | None, str | None]:
    """The server's view of the dataset rank 1 read (``_send_server_view``), or the error reading it."""
    got = recv_object(comm, 1, protocol.DATASET)
    assert isinstance(got, tuple)  # rank 1 sends (skeleton or None, error or None)
    skeleton, error = got
    if skeleton is None:
        return None, error
    y_train, x_test, y_test = recv_tensors(comm, 1, protocol.DATASET)
    return replace(skeleton, y_train=y_train, x_test=x_test, y_test=y_test), error


def _share_with_client_ranks(clients: MPI.Intracomm, dataset: Dataset | None,
                             error: str | None) -> tuple[Dataset | None, str | None]:
    """Rank 1's dataset (``clients``' first rank) on every client rank, held once per node: its tensors go into
    shared-memory windows that the node's client ranks map (wire.shared), their bytes sent over the nodes' first
    ranks straight into each node's windows; only the rest (a small skeleton) travels as an object. Every rank gets
    tensors with the same bytes, so results do not change. Rank 1 holds the data twice while it fills the windows,
    its read tensors and the windows (planning.memory.reading_rank_bytes); a pickled broadcast would hold it four
    times."""
    arrive_together(clients)  # the others sleep while rank 1 reads
    node = node_communicator(clients)
    leaders = clients.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, clients.Get_rank())
    across = cast(MPI.Intracomm, leaders) if leaders != MPI.COMM_NULL else None
    try:
        none = torch.empty(0)  # the tensors travel in windows, the rest as an object
        skeleton = replace(dataset, x_train=none, y_train=none, x_test=none, y_test=none) if dataset else None
        if across is not None:
            skeleton, error = across.bcast((skeleton, error), root=0)
        skeleton, error = node.bcast((skeleton, error), root=0)
        if error:
            return None, error
        assert skeleton is not None  # without an error, rank 1 read it
        x_train, y_train, x_test, y_test = (share_on_node(node, getattr(dataset, n) if dataset else None, across)
                                            for n in ("x_train", "y_train", "x_test", "y_test"))
        return replace(skeleton, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test), None
    finally:
        if leaders != MPI.COMM_NULL:
            leaders.Free()
        node.Free()


def server_view(dataset: Dataset) -> Dataset:
    """What the server keeps of a dataset: labels (partition, sizes), the held-out set and the inputs' shape."""
    x = dataset.x_train
    return replace(dataset, x_train=torch.empty((0, *x.shape[1:]), dtype=x.dtype))


def report_partition(cfg: Config, dataset: Dataset, parts: list, run_dir: Path | None) -> None:
    """Print the clients x labels table of what each client trains on (``parts``, as ``client_partition`` made
    it; its validation samples apart); keep it as partition.csv in the run directory."""
    with _partition_errors():
        histogram, validation = counts_of(parts, cfg.data, dataset, cfg.seed)
    held_out = (f" ({int(validation.sum())} of them held out for validation, data.val_fraction "
                f"{cfg.data.val_fraction:g})" if validation.any() else "")
    log(f"partition '{cfg.data.partition}' of {partition_scope(cfg, dataset, histogram, validation)}{held_out}:\n"
        + partition_table(histogram, validation=validation), rank=0)
    if cfg.data.feature_noise:
        n, scale = cfg.clients.num_clients, cfg.data.feature_noise
        log(f"data.feature_noise {scale:g}: client k reads its inputs through Gaussian noise of std {scale:g} * k / "
            f"{n - 1} (from 0 for client 0 to {scale:g} for client {n - 1}), drawn afresh for every minibatch; the "
            f"held-out set is scored at each of the {n} levels", rank=0)
    if run_dir is not None:
        (run_dir / "partition.csv").write_text(partition_csv(histogram, validation))


def partition_scope(cfg: Config, dataset: Dataset, histogram: np.ndarray,
                    validation: np.ndarray) -> str:
    """How many training samples the clients hold ("19 training samples"), and, when that is not all of them, of
    how many: a natural split takes the data's first clients.num_clients clients, a label split may leave classes
    out."""
    taken, total = int(histogram.sum() + validation.sum()), len(dataset.y_train)
    scope = f"{taken} training samples"
    if cfg.data.partition == "natural" and dataset.clients is not None \
            and len(dataset.clients) > cfg.clients.num_clients:
        kind = f" ({dataset.source[1].id_kind}s)" if dataset.source is not None else ""
        return (f"{scope}: those of the first {cfg.clients.num_clients} of the data's {len(dataset.clients)} "
                f"clients{kind}, {total} samples in all")
    return scope if taken == total else f"{scope} (of {total} in the data)"


def keep_tokenizer(dataset: Dataset, run_dir: Path | None) -> None:
    """Keep the tokenizer that made a text dataset's token ids in the run directory: the model means nothing on
    text without it, and it is trained at start-up (or read from a path that may not outlive the run)."""
    if dataset.tokenizer is not None and run_dir is not None:
        (run_dir / TOKENIZER).write_text(dataset.tokenizer)


@contextlib.contextmanager
def _partition_errors() -> Iterator[None]:
    """A partition that cannot be made (too few samples, a bad partition file) ends the job in one line."""
    try:
        yield
    except (ValueError, OSError) as err:
        raise InputRefused(f"cannot partition the data: {err}") from None


def client_partition(cfg: Config, dataset: Dataset | None) -> list | None:
    """Every client's training indices (the same on every rank), or None without data."""
    if dataset is None:
        return None
    with _partition_errors():
        return partition(cfg.data, dataset.y_train, cfg.clients.num_clients, cfg.seed, dataset.clients,
                         dataset.natural_name)


def placement_of(cfg: Config, parts: list | None, client_ranks: int) -> Placement:
    """``clients.placement``: by work, samples x epochs (fixed local_steps make every client's work equal)."""
    work = None
    if parts is not None and cfg.clients.placement != "round_robin" and not cfg.train.local_steps:
        work = [float(len(p) * cfg.train.local_epochs) for p in parts]
    return placement_for(cfg.clients, client_ranks, work)


def local_data(cfg: Config, dataset: Dataset | None, rank: int, client_ranks: int) -> Mapping:
    """Each logical client ``rank`` hosts, by id: its (training, validation) slices."""
    parts = client_partition(cfg, dataset)
    mine = placement_of(cfg, parts, client_ranks).clients_of(rank, cfg.clients.num_clients)
    if dataset is None:
        return {c: (None, None) for c in mine}
    assert parts is not None  # client_partition returns None only without a dataset
    if cfg.clients.placement == "per_round":  # any client may train here: slice its data when it does
        assert dataset.source is None  # cli.preflight.check_plugins refuses per_round with a client source
        return ClientSlices(dataset, parts, cfg.data.val_fraction, cfg.seed, cfg.data.feature_noise)
    if dataset.source is not None:  # from a client source: read only now, and only these clients
        try:
            dataset = dataset.holding(mine)
        except (ValueError, OSError) as err:  # what the survey did not read: the inputs (a LEAF row, a table's cell)
            raise InputRefused(f"cannot read its clients' data: {err}") from None
        held = sum(len(parts[c]) for c in mine)
        whose = "its client's" if len(mine) == 1 else f"its {len(mine)} clients'"
        log(f"read {held} of {len(dataset.y_train)} training samples: {whose} "
            f"({cfg.data.dataset} files under {cfg.data.kwargs.get('path')})", rank=rank)
    slices = ClientSlices(dataset, parts, cfg.data.val_fraction, cfg.seed, cfg.data.feature_noise)
    return {c: slices[c] for c in mine}


class ClientSlices(Mapping):
    """Every client's (training, validation) data, sliced from the rank's copy of the training set when asked:
    ``clients.placement: per_round`` may hand a rank any client, and copying all of them up front would hold the
    training set twice. With ``feature_noise`` (``data.feature_noise``) client c's data carries its noise level,
    and its validation split is noised once (mpifl.learning.noise)."""

    def __init__(self, dataset: Dataset, parts: list, val_fraction: float, seed: int, feature_noise: float = 0.0):
        self.dataset, self.parts, self.val_fraction, self.seed = dataset, parts, val_fraction, seed
        self.feature_noise = feature_noise

    def __getitem__(self, client: int) -> tuple[ClientData, ClientData | None]:
        """Client ``client``'s training data and (when it has one) validation data."""
        if not 0 <= client < len(self.parts):
            raise KeyError(client)
        train, val = split_validation(self.parts[client], self.val_fraction, self.seed, client)
        std = client_noise_std(self.feature_noise, client, len(self.parts))
        val_data = client_data(self.dataset, val) if len(val) else None
        if val_data is not None and std:
            val_data = ClientData(validation_inputs(val_data.x, std, self.seed, client), val_data.y)
        return client_data(self.dataset, train, std), val_data

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.parts)))

    def __len__(self) -> int:
        return len(self.parts)
