"""``mpifl export --client``: the model one logical client uses, out of a checkpoint and its per-rank files.

With ``model.local`` (FedBN, FedPer) a client uses the global exchanged tensors with its own local ones; with Ditto
(``train.ditto_lambda``) its personal model v_i. Either is a part of the client's one vector
(mpifl.config.client_state), published by the rank that hosted it beside each checkpoint
(``ckpt-r<round>.residuals/rank<rank>.h5``, ``/clients/<id>``). It is decoded as a client rank loads it: into the
model built as the run built it, through the run's exchange chunks (as ``PersonalModels`` reads v_i) and its local
tensors (as ``PersonalTensors`` reads them), so that no layout arithmetic is written twice.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import h5py
import torch
import yaml

from mpifl.config import ConfigError, load_config
from mpifl.errors import CheckpointError
from mpifl.storage.checkpointer import kept_per_client, residual_files, residuals_dir, withheld_ranks
from mpifl.storage.hdf5 import Checkpoint

if TYPE_CHECKING:
    from mpifl.config import Config
    from mpifl.config.client_state import ClientState, ClientStateLayout

OWN_MODELS = "model.local (FedBN, FedPer) or train.ditto_lambda (Ditto)"


def client_tensors(ckpt: Checkpoint, client: int) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of the model logical client ``client`` uses at the checkpoint's round, and which it is ('personal'
    or 'local'); CheckpointError saying why where the checkpoint holds none of its own."""
    from mpifl.algorithms import model_streams
    from mpifl.learning.datasets import data_shape, needs_dataset
    from mpifl.learning.models import meta_flat_model, state_sizes
    from mpifl.learning.steps import scatter, trainable
    from mpifl.wire.layout import ExchangeLayout

    cfg = _run_config(ckpt)
    state = _own_models(ckpt, cfg, client)
    shape = data_shape(cfg.data) if needs_dataset(cfg) else {}  # as the run's ranks size the model
    flat = meta_flat_model(cfg.model, cfg.seed, model_streams(cfg.client_rule), **shape)
    ckpt.check_spec(flat.spec)
    if cfg.clients.sharding == "fsdp":  # Ditto's v_i over each rank's rows of the trained parameters
        ckpt.read_into(flat.tensors())
        personal = _joined_personal_rows(ckpt, client, state, trainable(flat.module))
        for (_, tensor), rows in zip(trainable(flat.module), personal):
            tensor.data.copy_(rows.view(tensor.shape))
        return {name: t.clone() for name, t in flat.tensors()}, "personal"
    plan = ExchangeLayout.build(flat.spec, cfg.transport, cfg.compression, cfg.strategy.wire_dtype,
                                cfg.clients.groups > 0)
    layout = state.layout(state_sizes(plan, flat))
    which = "personal" if state.personal else "local"
    part = layout.part(which)
    assert part is not None  # _own_models refused a run without either
    vector = _client_vector(ckpt, client, layout)
    mark = layout.mark(part)
    if mark is not None and float(vector[mark]) != 1.0:
        raise CheckpointError(f"export --client {client}: {ckpt.path}: client {client} has no {_named(which)} of its "
                              f"own at round {ckpt.round} (it never kept one: not yet trained, or its every training "
                              "diverged), so the global model is what it would use: export it without --client")
    firsts = layout.firsts

    def chunk(index: int) -> torch.Tensor:
        return vector[firsts[index]:firsts[index + 1]]

    ckpt.read_into(flat.tensors())
    local = [t for _, t in flat.local_tensors()]
    if which == "personal":  # v_i: the exchange's chunks, then its own local tensors with model.local
        for i, c in enumerate(plan.chunks):
            flat.chunk_view(c).copy_(chunk(part.first + i))
        if state.local:
            scatter(chunk(part.first + len(plan.chunks)), local)
    else:
        scatter(chunk(part.first), local)
    return {name: t.clone() for name, t in [*flat.tensors(), *flat.local_tensors()]}, which


def _named(which: str) -> str:
    """A part of the vector as a message names it."""
    return {"personal": "Ditto personal model", "local": "model.local tensors"}[which]


def _run_config(ckpt: Checkpoint) -> Config:
    """The config of the run that wrote the checkpoint (its model is built from it)."""
    try:
        return load_config(None, data=yaml.safe_load(ckpt.config) or {})
    except (ConfigError, yaml.YAMLError) as err:
        raise CheckpointError(f"export --client: {ckpt.path}: its run's config cannot be read here, and the "
                              f"client's vector is laid out by it: {err}") from None


def _own_models(ckpt: Checkpoint, cfg: Config, client: int) -> ClientState:
    """The run's per-client state, once it is known to hold a model of a client's own that can be read here."""
    state = cfg.client_state()
    if state is None or not (state.local or state.personal):
        kept = f"kept {kept_per_client(ckpt)} per client" if state is not None else "kept nothing per client"
        vectors = [name for name, _ in state.vectors] if state is not None else []
        theirs = (f" (its trainer's declared vectors, {', '.join(map(repr, vectors))}, are the trainer's own to "
                  "turn into the model a client uses, as APFL mixes its personal model with the global one: export "
                  "cannot do that for it)") if vectors else ""
        raise CheckpointError(f"export --client: {ckpt.path}: its run {kept}, no model of a client's own: only runs "
                              f"with {OWN_MODELS} keep one; export the global model without --client{theirs}")
    if not 0 <= client < cfg.clients.num_clients:
        raise CheckpointError(f"export --client: {ckpt.path}: no client {client}: its run had clients 0 to "
                              f"{cfg.clients.num_clients - 1} (clients.num_clients: {cfg.clients.num_clients})")
    return state


def shard_rows(rows: int, shards: int) -> list[tuple[int, int]]:
    """The rows ``[start, stop)`` of a parameter's first dimension each rank of a sharded group holds, by its index
    in the group: FSDP's even split (torch.chunk's: ceil(rows / shards) a rank, the last ranks fewer or none)."""
    per = -(-rows // shards)
    return [(min(rows, s * per), min(rows, (s + 1) * per)) for s in range(shards)]


def _joined_personal_rows(ckpt: Checkpoint, client: int, state: ClientState,
                          trained: list[tuple[str, torch.nn.Parameter]]) -> list[torch.Tensor]:
    """``client``'s Ditto v_i over each trained parameter (flat, fp32), joined from the rows each rank of its
    group kept (``mpifl.roles.sharded_state``: each rank's vector is its rows of every trained parameter, in the
    model's order, laid out as one chunk of the run's layout)."""
    from mpifl.config.client_state import StateSizes

    by_shard: dict[int, torch.Tensor] = {}
    shards = 0
    for path in _rank_files(ckpt, client):
        with h5py.File(path, "r") as f:
            index, shards = int(f.attrs.get("shard", 0)), int(f.attrs.get("shards", 1))
            if str(client) in f["clients"]:
                by_shard[index] = torch.from_numpy(f["clients"][str(client)][()])
    if not by_shard:
        _never_kept(ckpt, client)
    if sorted(by_shard) != list(range(shards)):
        raise CheckpointError(f"export --client {client}: {residuals_dir(ckpt.path)} holds client {client}'s rows "
                              f"from rank(s) {sorted(by_shard)} of its group of {shards}: some are missing")
    splits = [shard_rows(p.shape[0] if p.dim() else 1, shards) for _, p in trained]
    per_row = [p[0].numel() if p.dim() else 1 for _, p in trained]
    pieces: list[list[torch.Tensor]] = [[] for _ in trained]
    for index, vector in sorted(by_shard.items()):
        elements = sum((split[index][1] - split[index][0]) * row for split, row in zip(splits, per_row))
        layout = state.layout(StateSizes(trainable=elements, chunks=(elements,), local=0, tensors=elements))
        part = layout.part("personal")
        assert part is not None  # _own_models refused a run without Ditto
        if int(vector.numel()) != layout.elements:
            raise CheckpointError(f"export --client {client}: rank file of shard {index}: a vector of "
                                  f"{int(vector.numel())} elements, where the run's layout has {layout.elements}")
        mark = layout.mark(part)
        if mark is not None and float(vector[mark]) != 1.0:
            raise CheckpointError(f"export --client {client}: {ckpt.path}: client {client} has no Ditto personal "
                                  f"model of its own at round {ckpt.round}, so the global model is what it would "
                                  "use: export it without --client")
        start = layout.firsts[part.first]
        for k, (split, row) in enumerate(zip(splits, per_row)):
            size = (split[index][1] - split[index][0]) * row
            pieces[k].append(vector[start:start + size])
            start += size
    return [torch.cat(rows) for rows in pieces]


def _rank_files(ckpt: Checkpoint, client: int) -> list[Path]:
    """The checkpoint's per-rank files, each there; CheckpointError naming what is missing."""
    files = residual_files(ckpt)
    if files is None:
        raise CheckpointError(f"export --client {client}: {ckpt.path}: saved with no per-client state (round "
                              f"{ckpt.round}): no client has a model of its own yet")
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise CheckpointError(f"export --client {client}: {ckpt.path}: its per-client files {missing} are missing")
    return files


def _never_kept(ckpt: Checkpoint, client: int) -> NoReturn:
    """Refuse a client whose vector no rank file holds: it has no model of its own."""
    files = residual_files(ckpt) or []
    silent = withheld_ranks(ckpt)
    lacks = f", or it was hosted by rank(s) {silent}, silent when it was saved" if silent else ""
    raise CheckpointError(f"export --client {client}: client {client}'s vector is in none of the {len(files)} rank "
                          f"file(s) of {residuals_dir(ckpt.path)}: it kept no state by round {ckpt.round}{lacks}; "
                          "with no model of its own yet, the global model is what it would use: export it without "
                          "--client")


def _client_vector(ckpt: Checkpoint, client: int, layout: ClientStateLayout) -> torch.Tensor:
    """``client``'s whole vector from whichever of the checkpoint's rank files holds it."""
    files = _rank_files(ckpt, client)
    for path in files:
        try:
            opened = h5py.File(path, "r")
        except OSError as err:
            raise CheckpointError(f"export --client {client}: {path}: cannot read this file of clients' vectors: "
                                  f"{err}; nothing written") from None
        with opened as f:
            if int(f.attrs.get("shards", 1)) > 1:
                raise CheckpointError(f"export --client {client}: {path} holds one shard of each client's rows "
                                      "(clients.sharding: fsdp), but its run's config keeps whole vectors: the files "
                                      "are not this checkpoint's run's")
            if int(f.attrs["elements"]) != layout.elements:
                raise CheckpointError(f"export --client {client}: {path}: vectors of {int(f.attrs['elements'])} "
                                      f"elements, where the run's layout has {layout.elements}")
            if str(client) in f["clients"]:
                return torch.from_numpy(f["clients"][str(client)][()])
    _never_kept(ckpt, client)
