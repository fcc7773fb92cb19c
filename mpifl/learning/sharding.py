"""One logical client's model sharded over the R ranks of its group (``clients.sharding: fsdp``), with PyTorch's FSDP.

Each rank holds ``1/R`` of every parameter (its rows, ``mpifl.wire.shards.shard_rows``), of its gradient and of the
optimizer's state; FSDP (``torch.distributed.fsdp.fully_shard``) gathers one unit's parameters for its forward and
backward and reduce-scatters its gradients. Units: each block transformers names as not to be split
(``_no_split_modules``: the decoder layers), the input and the output embeddings (the largest tensors of a language
model: gathered alone, not with the rest of the root), then the root.

No rank ever builds the whole model: it is built on the meta device and its seeded initialisation runs module by
module (``seeded_rows``), each module's tensors made real only while it is initialised, so a rank holds its own rows
plus one module's tensors at most. The draws are those of the unsharded build, in the same order, so a sharded
client starts from bitwise the weights an unsharded one would (the frozen base model under LoRA, which never travels,
included).

Each rank trains on its share of every batch as under DDP (``mpifl.learning.parallel.share_of``): FSDP's
reduce-scatter averages the shares' gradients, so a step is the whole batch's, up to floating-point rounding, and
bitwise the same for a fixed R on any number of groups. This module never touches MPI (``mpifl.roles.sharded``
moves the bytes).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import distributed as dist
from torch import nn

from mpifl.learning.parallel import DataParallel, use_group_batch_norm
from mpifl.learning.steps import own_rows
from mpifl.wire.shards import shard_rows


def sharded_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP gathers as one unit, innermost first (the root is sharded last, by ``shard_model``): every
    block of the classes transformers keeps whole (``_no_split_modules``), and the input and output embeddings
    where they are not tied; for any other model, each direct child that holds parameters."""
    from mpifl.learning.hf import base_model

    base: Any = base_model(model)
    keep_whole = set(getattr(base, "_no_split_modules", None) or ())
    if not keep_whole:
        return [child for child in model.children() if any(True for _ in child.parameters())]
    units = [m for m in model.modules() if type(m).__name__ in keep_whole]
    inputs = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    outputs = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    tied = inputs is not None and outputs is not None and outputs.weight is inputs.weight
    for embedding in (inputs, outputs):
        if embedding is not None and not tied and not any(embedding is u for u in units):
            units.append(embedding)
    if tied:  # one tensor in two modules: both in the same unit, the root's
        units = [u for u in units if u is not inputs and u is not outputs]
    return units


def shard_model(model: nn.Module, mesh: Any) -> None:
    """Apply FSDP over ``mesh`` to each unit (``sharded_units``), then to the root, in place."""
    from torch.distributed.fsdp import fully_shard

    for unit in sharded_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


class MaterializedInit:
    """Makes a sharded module's parameters whole and real while transformers initialises them, and copies this rank's
    rows of each into its shard once nothing will touch it again.

    A module's initialisation may reach into its children (GPT-2 rescales every ``c_proj.weight`` from the
    attention and MLP modules above them), so a parameter stays whole until the module that ``holder`` names for it
    is done: the FSDP unit it lies in (a decoder block, an embedding), else its module's parent. A rank therefore
    holds its shards plus one block's whole tensors at most. Tied weights stay whole until every module that holds
    them is done."""

    def __init__(self, model: nn.Module, parts: int, index: int):
        self.parts, self.index = parts, index
        self.names = {id(p): name for name, p in model.named_parameters()}
        units = {id(u) for u in sharded_units(model)}
        parents = {id(child): module for module in model.modules() for child in module.children()}
        self.release: dict[int, set[int]] = {}
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None:
                    self.release.setdefault(id(p), set()).add(id(holder(module, parents, units)))
        self.whole: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, nn.Parameter]]]] = {}
        self.done: set[int] = set()
        self.written: set[str] = set()

    @contextlib.contextmanager
    def around(self, modules: Sequence[nn.Module]) -> Iterator[None]:
        """The parameters of ``modules`` (their own: their children's are made whole in their own turn) whole inside
        the block; afterwards, each parameter whose holders are all done gets this rank's rows of it, and its shard
        back in its modules."""
        for module in modules:
            for key, p in list(module._parameters.items()):
                if p is None or id(p) not in self.release:
                    continue
                whole, holders = self.whole.setdefault(id(p), (
                    nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad), []))
                module._parameters[key] = whole
                holders.append((module, key, p))
        try:
            yield
        finally:
            self.done.update(id(m) for m in modules)
            for ident in [k for k in self.whole if self.release[k] <= self.done]:
                whole, holders = self.whole.pop(ident)
                for module, name, shard in holders:
                    module._parameters[name] = shard
                full, local = whole.detach(), own_rows(holders[0][2].data)
                first, last = shard_rows(full.shape[0], self.parts, self.index) if full.dim() else (0, 0)
                with torch.no_grad():
                    local.copy_(full[first:last] if full.dim() else full)
                self.written.add(self.names[ident])

    def untouched(self, model: nn.Module) -> list[str]:
        """Parameters no module's initialisation made whole (their shards would hold garbage)."""
        return [name for name, _ in model.named_parameters() if name not in self.written]


def holder(module: nn.Module, parents: dict[int, nn.Module], units: set[int]) -> nn.Module:
    """The module after whose initialisation ``module``'s own parameters are final: the nearest FSDP unit at or
    above it, else its parent (the root for itself)."""
    above: nn.Module | None = module
    while above is not None:
        if id(above) in units:
            return above
        above = parents.get(id(above))
    return parents.get(id(module), module)


def seeded_shards(model: nn.Module, seed: int, parts: int, index: int) -> None:
    """Write rank ``index``'s rows of every parameter of a sharded transformers model into its shards, as
    ``hf.initialize(model, seed)`` would draw them for the whole, unsharded model: the same draws in the same order,
    one block's tensors whole at a time."""
    from mpifl.learning.hf import initialize

    init = MaterializedInit(model, parts, index)
    initialize(model, seed, around=init.around)
    missing = init.untouched(model)
    if missing:
        raise RuntimeError(f"the sharded build's initialisation left {len(missing)} parameters uninitialised, first "
                           f"{missing[0]!r}: this model initialises a tensor from outside its own module")


def is_sharded(tensor: torch.Tensor) -> bool:
    """A parameter FSDP shards (a DTensor), not a buffer every rank holds whole."""
    return hasattr(tensor, "to_local")


class ShardedParallel(DataParallel):
    """The trainers' view of a sharded group (``TorchTrainer.parallel``, ``CausalLMTrainer.parallel``): a client
    group's process group, sums and batch shares as ``DataParallel`` has them, plus the device mesh FSDP shards over;
    the model is FSDP's already, so ``wrap`` returns it as it is."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self.mesh: Any = None

    def start(self, store: dist.Store, device: torch.device, timeout_s: float) -> None:
        """Join the group's process group, then its device mesh (every rank of the group, together, once)."""
        from torch.distributed.device_mesh import init_device_mesh

        super().start(store, device, timeout_s)
        began = time.perf_counter()
        self.mesh = init_device_mesh(self.device.type, (self.size,))
        self.setup_seconds += time.perf_counter() - began

    def wrap(self, module: nn.Module) -> nn.Module:
        """The module as FSDP already shards it; its BatchNorm layers normalize over the group's whole batch."""
        use_group_batch_norm(module)
        return module


def shard_buffers(model: nn.Module, prefix: str, parts: int, index: int) -> list[str]:
    """Keep only rank ``index``'s rows of each buffer of ``model``'s submodule ``prefix``, split as FSDP splits a
    parameter (``shard_rows``; a 0-d buffer stays whole), and return their names in ``model``.

    For a client half's summed streams (SCAFFOLD's server control variate c, ``mpifl.wire.spec.CONTROL``): fp32,
    one per trained element, so whole on every rank they would outweigh a bf16 model twice over. Call it on the
    model built on the meta device, before ``build_sharded``, which starts them at zero."""
    module = model.get_submodule(prefix)
    names = []
    for name, buffer in list(module._buffers.items()):
        if buffer is None or not buffer.dim():
            continue
        first, last = shard_rows(buffer.shape[0], parts, index)
        module._buffers[name] = torch.zeros((last - first, *buffer.shape[1:]), dtype=buffer.dtype,
                                            device=buffer.device)
        names.append(f"{prefix}.{name}")
    return names


def build_sharded(model: nn.Module, seed: int, parallel: ShardedParallel, device: torch.device) -> nn.Module:
    """Shard ``model``, built on the meta device (buffers real, but a client half's summed streams, which start at
    zero), over the group in place, on ``device``, with this rank's rows of the seeded initialisation
    (``seeded_shards``)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    shard_model(model, parallel.mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():  # to_empty leaves buffers uninitialised: the built values back
            if name in buffers:
                b.zero_() if buffers[name].is_meta else b.copy_(buffers[name])
    for name, p in model.named_parameters():
        expected = tuple(p.shape)
        first, last = shard_rows(expected[0], parallel.size, parallel.rank) if expected else (0, 0)
        local = tuple(own_rows(p.data).shape)
        if expected and local != (last - first, *expected[1:]):
            raise RuntimeError(f"FSDP gave rank {parallel.rank} rows of shape {local} of {name!r}, the layout "
                               f"expects {(last - first, *expected[1:])} (torch.chunk's split)")
    seeded_shards(model, seed, parallel.size, parallel.rank)
    return model


def load_pretrained_rows(model: nn.Module, path: str | Path, parts: int, index: int) -> None:
    """Read rank ``index``'s rows of every tensor from a local folder's safetensors shards straight into the sharded
    model (``get_slice``: only those rows are read), as ``hf.load_pretrained`` reads whole tensors for an unsharded
    model."""
    from mpifl.learning.hf import read_safetensors, saved_name

    def rows(f: Any, key: str, target: torch.Tensor) -> None:
        if is_sharded(target) and target.dim():
            first, last = shard_rows(target.shape[0], parts, index)
            own_rows(target.data).copy_(f.get_slice(key)[first:last])
        else:  # a buffer, whole on every rank
            target.copy_(f.get_tensor(key))

    targets = {saved_name(n): t for n, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()}
    read_safetensors(model, targets, path, rows)
