"""Flat buffers: a model's exchanged tensors as views into one contiguous byte buffer, laid out as
``mpifl.wire.spec`` describes.

Parameters and floating-point buffers are exchanged; integer and bool buffers (BatchNorm's
``num_batches_tracked``) are *local*: they never travel, are never averaged, and every
logical client starts from the value the model was built with.

With ``trainable_only``, frozen parameters (``requires_grad=False``: frozen layers, the base
model under LoRA) go to a second flat buffer that never travels: only the trainable tensors
are in the spec, on the wire, in the reduction and in checkpoints.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from mpifl.wire.memory import host_bytes
from mpifl.wire.spec import CONTROL, ITEMSIZES, Chunk, ModelSpec, TensorEntry, is_local, layout, padding_ranges

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ITEMSIZES}  # the spec's dtype names


def dtype_name(dtype: torch.dtype) -> str:
    """Return the short name ('float32', 'bfloat16', ...) of a floating torch dtype."""
    return str(dtype).replace("torch.", "")


def floating_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and floating buffers, in ``state_dict`` order, tied weights once."""
    seen: set[int] = set()
    out = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point() or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor))
    return out


def is_frozen(tensor: torch.Tensor) -> bool:
    """A parameter that does not train (floating buffers always count as state that changes)."""
    return isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad


Named = list[tuple[str, torch.Tensor]]


def split_tensors(module: torch.nn.Module, trainable_only: bool = False,
                  local: Sequence[str] = ()) -> tuple[Named, Named]:
    """(exchanged, kept): the tensors that travel, and those that stay on each rank: with ``trainable_only`` the
    frozen parameters, and the tensors named by ``local`` patterns (FedBN, FedPer: kept per client)."""
    named = floating_tensors(module)

    def stays(name: str, tensor: torch.Tensor) -> bool:
        return (trainable_only and is_frozen(tensor)) or is_local(name, local)

    return [(n, t) for n, t in named if not stays(n, t)], [(n, t) for n, t in named if stays(n, t)]


def build_spec(named: list[tuple[str, torch.Tensor]]) -> ModelSpec:
    """Lay tensors out by dtype segments, each segment aligned to 64 bytes; buffers are marked as statistics,
    except SCAFFOLD's control variates, which its strategy treats as a section of their own."""
    statistics = {name for name, t in named
                  if not isinstance(t, torch.nn.Parameter) and not name.startswith(CONTROL + ".")}
    return layout([(name, tuple(t.shape), dtype_name(t.dtype)) for name, t in named], statistics)


class FlatModel:
    """A module whose exchanged tensors are views into one contiguous ``uint8`` buffer
    (and whose frozen parameters, with ``trainable_only``, are views into a second one)."""

    def __init__(self, module: torch.nn.Module, trainable_only: bool = False, device: str | torch.device = "cpu",
                 pin: bool = False, local: Sequence[str] = ()):
        exchanged, frozen = split_tensors(module, trainable_only, local)
        self.local = tuple(local)
        named = exchanged + frozen
        self.module = module
        self.spec = build_spec(exchanged)
        self.frozen_spec = build_spec(frozen)
        self.device = torch.device(device)
        if self.device.type == "cpu" and not pin:  # numpy memory: huge pages, 2x faster MPI copies (host_bytes)
            self.buffer = torch.from_numpy(host_bytes(self.spec.total_bytes, touch=False))
        else:
            self.buffer = torch.empty(self.spec.total_bytes, dtype=torch.uint8, device=self.device, pin_memory=pin)
        self.frozen = torch.empty(self.frozen_spec.total_bytes, dtype=torch.uint8, device=self.device)
        for spec, buffer in ((self.spec, self.buffer), (self.frozen_spec, self.frozen)):
            for start, end in padding_ranges(spec):  # no tensor writes there: zero, never what memory held before
                buffer[start:end].zero_()
        # same memory, for MPI buffer slices (a device-side replica never touches MPI)
        self.bytes = self.buffer.numpy() if self.device.type == "cpu" else None
        # by name: the layout groups tensors by dtype, so interleaved dtypes come out in another order
        entries = {e.name: e for e in self.spec.entries}
        frozen_entries = {e.name: e for e in self.frozen_spec.entries}
        views = {id(t): self.view(entries[n]) for n, t in exchanged}
        views.update({id(t): self.view(frozen_entries[n], self.frozen) for n, t in frozen})
        if any(t.is_meta for _, t in named):
            self._bind_meta(views)
        else:
            for _, tensor in named:
                view = views[id(tensor)]
                with torch.no_grad():
                    view.copy_(tensor.detach())
                # Rebinding .data on the Parameter object keeps tied weights tied and
                # frees the original storage at once: peak is buffer + one tensor.
                tensor.data = view
        self._local_init = {n: t.detach().clone() for n, t in module.state_dict().items()
                            if not t.is_floating_point()}

    def _bind_meta(self, views: dict[int, torch.Tensor]) -> None:
        """A module built on the meta device: its tensors become views of the (uninitialised)
        buffers, so the weights are allocated once. Buffers that were built for real keep
        their values; meta integer buffers start at zero."""
        bound: dict[int, torch.nn.Parameter] = {}
        for mod in self.module.modules():
            for name, p in list(mod._parameters.items()):
                if p is None or id(p) not in views:
                    continue
                if id(p) not in bound:
                    view = views[id(p)]
                    if not p.is_meta:
                        view.copy_(p.detach())
                    bound[id(p)] = torch.nn.Parameter(view, requires_grad=p.requires_grad)
                mod._parameters[name] = bound[id(p)]
            for name, b in list(mod._buffers.items()):
                if b is None:
                    continue
                if id(b) in views:
                    if not b.is_meta:
                        views[id(b)].copy_(b)
                    mod._buffers[name] = views[id(b)]
                elif b.is_meta:
                    mod._buffers[name] = torch.zeros_like(b, device="cpu")

    def view(self, entry: TensorEntry, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The typed view of one tensor inside the buffer (or inside ``buffer``)."""
        raw = (self.buffer if buffer is None else buffer)[entry.offset:entry.offset + entry.nbytes]
        return raw.view(DTYPES[entry.dtype]).view(entry.shape)

    def views_in(self, tensors: Sequence[torch.Tensor], copy: torch.Tensor) -> list[torch.Tensor]:
        """Each of ``tensors`` (views of this model's flat buffer) as the same view of ``copy``, a byte copy of
        the buffer: the global model a client rank keeps while it trains."""
        base, out = self.buffer.data_ptr(), []
        for t in tensors:
            start = t.data_ptr() - base
            out.append(copy[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
        return out

    def chunk_view(self, chunk: Chunk) -> torch.Tensor:
        """The typed 1-D view of one chunk inside the buffer."""
        return self.buffer[chunk.offset:chunk.offset + chunk.nbytes].view(DTYPES[chunk.dtype])

    def chunk_bytes(self, chunk: Chunk) -> np.ndarray:
        """The chunk as a numpy ``uint8`` slice, ready to be an MPI buffer."""
        assert self.bytes is not None, "a device-side replica has no host bytes: it never touches MPI"
        return self.bytes[chunk.offset:chunk.offset + chunk.nbytes]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, typed view) for every exchanged tensor."""
        for entry in self.spec.entries:
            yield entry.name, self.view(entry)

    def frozen_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, typed view) for every tensor that never travels (frozen, or local)."""
        for entry in self.frozen_spec.entries:
            yield entry.name, self.view(entry, self.frozen)

    def local_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, typed view) of the ``model.local`` tensors, each logical client's own (FedBN, FedPer)."""
        return [(n, t) for n, t in self.frozen_tensors() if is_local(n, self.local)]

    def reset_local_state(self) -> None:
        """Give integer buffers back the values the model was built with (nothing to do, and no state dict built,
        for a model without any: this runs before every logical client)."""
        if not self._local_init:
            return
        state = self.module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in self._local_init.items():
                state[name].copy_(value)
