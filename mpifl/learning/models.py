"""Built-in models (MLP, small CNN, benchmark blob), the model factory, and the one place
where a rank allocates its model: ``build_flat_model``.

A plug-in model (``model.name: package.module:fn``) is called as ``fn(**model.kwargs)``, plus
``input_shape`` and ``num_classes`` (from the dataset) for those of the two its signature names,
when the run reads data; it returns a ``torch.nn.Module``.
"""
from __future__ import annotations

import fnmatch
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mpifl.config import ConfigError, ModelConfig
from mpifl.config.client_state import StateSizes
from mpifl.learning.steps import trainable_elements
from mpifl.plugins import is_import_path, kwargs_problem, resolve
from mpifl.units import MIB
from mpifl.wire.flat import DTYPES, FlatModel, build_spec, split_tensors
from mpifl.wire.layout import ExchangeLayout
from mpifl.wire.spec import CONTROL, ModelSpec


def mlp(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (128, 64)) -> nn.Module:
    """A multilayer perceptron over flattened inputs."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def cnn(input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (16, 32)) -> nn.Module:
    """A small CNN (conv-BN-ReLU blocks, global average pooling) for image-shaped inputs."""
    if len(input_shape) != 3:
        raise ValueError(f"model 'cnn' needs (channels, height, width) inputs, the dataset gives {tuple(input_shape)}")
    layers: list[nn.Module] = []
    in_ch = input_shape[0]
    for ch in channels:
        layers += [nn.Conv2d(in_ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU()]
        in_ch = ch
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)]
    return nn.Sequential(*layers)


class LeNet(nn.Module):
    """Two 5x5 convolutions, each followed by ReLU and 2x2 max pooling, then three dense layers (LeCun et al. 1998,
    "Gradient-Based Learning Applied to Document Recognition"). Its layers, their names and the order they are
    built in (so PyTorch's default initialisation draws the same numbers) are those of ``SimpleCNNMNIST`` in
    NIID-Bench's model.py (Li, Diao, Chen, He, ICDE 2022), the "simple CNN" that study trains on MNIST and
    Fashion-MNIST; no batch norm, so nothing in it is a statistic the server must treat apart."""

    def __init__(self, in_channels: int, flat_features: int, hidden: Sequence[int], num_classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(flat_features, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.fc3 = nn.Linear(hidden[1], num_classes)
        self.flat_features = flat_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a batch of images."""
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = x.reshape(-1, self.flat_features)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def lenet(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (120, 84)) -> nn.Module:
    """A LeNet-5-style CNN for small images such as MNIST's and Fashion-MNIST's 28x28 (44,426 parameters there):
    the model to start an image experiment from (``cnn`` has no pooling before its global average, so it learns
    far more slowly)."""
    if len(input_shape) != 3:
        raise ValueError(f"model 'lenet' needs (channels, height, width) inputs, the dataset gives "
                         f"{tuple(input_shape)}")
    if len(hidden) != 2:
        raise ValueError(f"model 'lenet' has two hidden dense layers: model.kwargs.hidden needs 2 widths, got {hidden}")
    channels, height, width = input_shape
    side_h, side_w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2  # conv 5x5, pool 2, conv 5x5, pool 2
    if side_h < 1 or side_w < 1:
        raise ValueError(f"model 'lenet': inputs of {height}x{width} are too small for two 5x5 convolutions, each "
                         "followed by 2x2 pooling (at least 16x16); use 'cnn' or 'mlp'")
    return LeNet(channels, 16 * side_h * side_w, hidden, num_classes)


class Blob(nn.Module):
    """Parameters only, of a given total size: the model-only exchange benchmark's payload."""

    def __init__(self, size_mb: float = 100.0, tensor_mb: float = 64.0, dtype: torch.dtype = torch.float32):
        super().__init__()
        itemsize = dtype.itemsize
        total = int(size_mb * MIB) // itemsize
        per = max(1, int(tensor_mb * MIB) // itemsize)
        sizes = [per] * (total // per) + ([total % per] if total % per else [])
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(n, dtype=dtype).uniform_(-1, 1)) for n in sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The input unchanged: the blob exists to be exchanged, not evaluated."""
        return x


SIZED_BY_DATA = {"mlp": mlp, "cnn": cnn, "lenet": lenet}  # built-ins whose input and output layers fit the data
LAYER_SIZES = {"mlp": "hidden", "cnn": "channels", "lenet": "hidden"}  # built-in kwargs that list layer widths
# a client algorithm's summed streams: (the model, model.local) -> the section appended to it (ClientAlgorithm.streams)
Streams = Callable[[nn.Module, Sequence[str]], nn.Module]
SHAPE = ("input_shape", "num_classes")  # what mpifl knows of the data and passes a model that asks


def model_function(cfg: ModelConfig) -> Any:
    """The function (or class) ``model.name`` builds the model with (not for transformers)."""
    return {**SIZED_BY_DATA, "blob": Blob}.get(cfg.name) or resolve(cfg.name)


def named_parameters(fn: Any) -> tuple[str, ...]:
    """The parameters ``fn`` takes by name (none when it has no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def supplied(cfg: ModelConfig, has_data: bool) -> tuple[str, ...]:
    """The parameters mpifl passes the model function itself: the data's shape to mlp and cnn, and to a plug-in
    whose signature names them when the run reads data; the dtype to blob."""
    if cfg.name == "blob":
        return ("dtype",)
    if not is_import_path(cfg.name):
        return SHAPE
    return tuple(n for n in SHAPE if has_data and n in named_parameters(resolve(cfg.name)))


def model_problem(cfg: ModelConfig, has_data: bool = True) -> str | None:
    """What is wrong with ``model.kwargs`` for the configured model (checked before MPI starts), or None;
    ``has_data``: whether the run reads a dataset (and so can pass its shape)."""
    if cfg.name == "transformers":
        return None
    fn = model_function(cfg)
    problem = kwargs_problem(fn, cfg.kwargs, "model.kwargs", supplied=supplied(cfg, has_data))
    if problem and is_import_path(cfg.name):
        problem = f"{problem} (model.name {cfg.name!r})"
    widths = cfg.kwargs.get(LAYER_SIZES.get(cfg.name, ""), [1])
    if problem is None and not (isinstance(widths, (list, tuple)) and all(
            isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths)):
        problem = (f"model.kwargs.{LAYER_SIZES[cfg.name]}: layer widths must be integers >= 1, got {widths!r} "
                   "(a zero-width layer trains at chance)")
    return problem


def build_model(cfg: ModelConfig, seed: int, input_shape: Sequence[int] | None = None,
                num_classes: int | None = None, streams: Streams | None = None) -> nn.Module:
    """Build the configured model with seeded initialisation, in the configured dtype; with ``streams`` (a client
    algorithm's summed streams, ``mpifl.algorithms.contract.ClientAlgorithm.streams``: SCAFFOLD's server control
    variate c), the section they make appended last, as the submodule ``CONTROL``."""
    model = use_memory_format(_build_model(cfg, seed, input_shape, num_classes), cfg.memory_format)
    if cfg.nhwc_pooling:
        use_nhwc_pooling(model)
    if streams is None:
        return model
    if hasattr(model, CONTROL):
        raise ValueError(f"the model already has a submodule named {CONTROL!r}, where a client algorithm's summed "
                         "streams go")
    model.add_module(CONTROL, streams(model, cfg.local))
    return model


class _NHWCMaxPool(torch.autograd.Function):
    """Max pooling of an NCHW tensor: forward by PyTorch's channels-last kernel, backward by its NCHW one.

    Max pooling only selects: the NHWC kernel finds the same maxima at the same (h, w) indices, the first in the
    window on ties as the NCHW one, so the values and indices are bit for bit those of ``F.max_pool2d``; the
    backward is PyTorch's own NCHW kernel given those indices, so the gradients are too. Only the time differs.
    Forward, PyTorch's CPU kernel for NCHW runs one plane at a time, scalar: 0.75 ms per call on the LEAF CNN's
    first pooling (batch 10, one thread) against 0.06 ms for the NHWC one, the two layout copies costing less than
    the difference (``profiling/nhwc_step.py``). Backward it is the other way round: the NCHW kernel only scatters
    the gradient to the saved indices, so no layout copy pays. In a LEAF CNN step (torch.profiler, 2026-11-27) the
    two poolings' backward took 0.41 ms this way against 0.93 ms through the NHWC kernel between two copies, and
    their forward 0.75 ms against 0.63 (the indices' copy to NCHW order): 0.4 ms, about 3%, off the step.
    The input is saved for backward rather than its NHWC copy: no more memory, and none at all where a ReLU before
    the pooling keeps it anyway."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int],
                dilation: list[int], ceil_mode: bool) -> torch.Tensor:
        nhwc = x.contiguous(memory_format=torch.channels_last)
        out, indices = torch.ops.aten.max_pool2d_with_indices(nhwc, kernel, stride, padding, dilation, ceil_mode)
        ctx.save_for_backward(x, indices.contiguous())
        ctx.pooling = (kernel, stride, padding, dilation, ceil_mode)
        return out.contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, indices = ctx.saved_tensors
        grad_in = torch.ops.aten.max_pool2d_with_indices_backward(grad.contiguous(), x, *ctx.pooling, indices)
        return grad_in, None, None, None, None, None


def _pair(value: int | Sequence[int]) -> list[int]:
    return [value, value] if isinstance(value, int) else list(value)


class NHWCMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` whose CPU pooling of an NCHW batch runs the channels-last kernel (``_NHWCMaxPool``); any
    other input (a GPU's, NHWC already, 3-D, one channel, asking for indices, or one of ``torch.func``'s batched
    lanes, which a custom autograd function cannot take) takes PyTorch's own path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pool ``x``: by the channels-last kernels where that is faster and the same, else as PyTorch does."""
        if (self.return_indices or x.device.type != "cpu" or x.dim() != 4 or x.shape[1] == 1
                or not x.is_contiguous() or torch._C._functorch.is_functorch_wrapped_tensor(x)):
            return super().forward(x)
        stride = self.stride if self.stride else self.kernel_size  # nn.MaxPool2d: stride None means the kernel
        return _NHWCMaxPool.apply(x, _pair(self.kernel_size), _pair(stride), _pair(self.padding),
                                  _pair(self.dilation), self.ceil_mode)


def use_nhwc_pooling(model: nn.Module) -> nn.Module:
    """``model.nhwc_pooling``: every ``nn.MaxPool2d`` of the model becomes an ``NHWCMaxPool2d`` (its class only: it
    holds no tensors, so state dicts, the flat buffer and pickling are unchanged)."""
    for module in model.modules():
        if type(module) is nn.MaxPool2d:
            module.__class__ = NHWCMaxPool2d
    return model


def _nhwc_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """A forward hook: the convolution's 4-D output in channels_last (NHWC) order, so the layers after it run on
    NHWC activations (a module-level function: models with hooks stay picklable)."""
    return output.contiguous(memory_format=torch.channels_last) if output.dim() == 4 else output


def use_memory_format(model: nn.Module, memory_format: str) -> nn.Module:
    """``model.memory_format``: with channels_last, every Conv2d hands on its output in NHWC order.

    Why the activations and not the weights: the parameters are views into the rank's flat buffer and keep its
    layout (what travels, what is reduced and checkpointed is unchanged); a convolution whose input is NHWC runs
    NHWC, and PyTorch's CPU max pooling is much faster on NHWC (LEAF CNN, batch 10, one thread: 0.75 ms per
    pooling call contiguous, 0.06 ms channels_last; ``profiling/nhwc_step.py``). The gradients are the same up to
    rounding."""
    if memory_format == "contiguous":
        return model
    convolutions = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    if not convolutions:
        raise ConfigError(f"model.memory_format: {memory_format!r} changes the layout of Conv2d outputs, and the "
                          f"model ({type(model).__name__}) has no Conv2d layer; remove the key")
    for conv in convolutions:
        conv.register_forward_hook(_nhwc_output)
    return model


def _build_model(cfg: ModelConfig, seed: int, input_shape: Sequence[int] | None,
                 num_classes: int | None) -> nn.Module:
    dtype = DTYPES[cfg.dtype]
    kwargs: dict[str, Any] = dict(cfg.kwargs)
    if cfg.name == "transformers":  # parameters on meta; weights come after binding
        from mpifl.learning import hf
        return freeze_except(hf.build(cfg), cfg.trainable)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.name == "blob":
            return Blob(dtype=dtype, **kwargs)
        if cfg.name in SIZED_BY_DATA:
            if input_shape is None or num_classes is None:
                raise ValueError(f"model {cfg.name!r} needs a dataset to size its input and output layers")
            model = SIZED_BY_DATA[cfg.name](input_shape, num_classes, **kwargs)
        else:
            fn = resolve(cfg.name)
            data = {"input_shape": input_shape, "num_classes": num_classes}
            shape = {k: v for k, v in data.items() if v is not None and k in named_parameters(fn) and k not in kwargs}
            model = fn(**shape, **kwargs)
            if not isinstance(model, nn.Module):
                raise TypeError(f"model.name {cfg.name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return freeze_except(model.to(dtype), cfg.trainable)


LISTED_TENSORS = 40  # an error message lists at most this many of a model's tensor names


def tensor_listing(model: nn.Module, parameters_only: bool = False) -> str:
    """The model's floating tensors by the module that holds them, for an error that says what a glob pattern
    could match: ``'0.weight', '0.bias' (Conv2d); '1.weight', ... (BatchNorm2d); ...``, at most
    LISTED_TENSORS names."""
    groups: list[str] = []
    listed = total = 0
    for module_name, module in model.named_modules():
        tensors = list(module.named_parameters(recurse=False))
        if not parameters_only:
            tensors += [(n, b) for n, b in module.named_buffers(recurse=False) if b is not None]
        names = [f"{module_name}.{n}" if module_name else n for n, t in tensors if t.is_floating_point()]
        total += len(names)
        shown = names[:max(0, LISTED_TENSORS - listed)]
        listed += len(shown)
        if shown:
            groups.append(", ".join(repr(n) for n in shown) + f" ({type(module).__name__})")
    more = f"; and {total - listed} more" if total > listed else ""
    return "; ".join(groups) + more


def batchnorm_patterns(model: nn.Module) -> list[str]:
    """One glob pattern per BatchNorm layer of the model (``'1.*'``, ``'encoder.bn1.*'``): what FedBN keeps local."""
    return [f"{name}.*" for name, module in model.named_modules()
            if name and isinstance(module, nn.modules.batchnorm._BatchNorm)]


def freeze_except(model: nn.Module, patterns: Sequence[str]) -> nn.Module:
    """Only parameters whose name matches one of the glob ``patterns`` train (no patterns: leave as is)."""
    if not patterns:
        return model
    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ConfigError(f"model.trainable: {pattern!r} matches no parameter; the model's parameters: "
                              f"{tensor_listing(model, parameters_only=True)}")
    for name, param in model.named_parameters():
        param.requires_grad_(any(fnmatch.fnmatchcase(name, p) for p in patterns))
    return model


def model_spec(cfg: ModelConfig, seed: int, streams: Streams | None = None,
               **shape: Any) -> tuple[ModelSpec, ModelSpec]:
    """The exchanged and the frozen tensors' layouts, from a meta-device build: nothing is allocated."""
    with torch.device("meta"):
        module = build_model(cfg, seed, streams=streams, **shape)
    exchanged, frozen = split_tensors(module, cfg.exchange == "trainable", local_patterns(cfg, module))
    return build_spec(exchanged), build_spec(frozen)


def local_patterns(cfg: ModelConfig, module: nn.Module) -> list[str]:
    """``model.local``, each pattern checked to name at least one floating tensor of the model."""
    names = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_floating_point()]
    for pattern in cfg.local:
        if not fnmatch.filter(names, pattern):
            batchnorm = batchnorm_patterns(module)
            fedbn = f". For FedBN, its BatchNorm layers are model.local={batchnorm!r}" if batchnorm else ""
            raise ConfigError(f"model.local: {pattern!r} matches no floating tensor of the model {cfg.name!r}; its "
                              f"tensors: {tensor_listing(module)}{fedbn}")
    def local(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in cfg.local)

    if cfg.local and all(local(n) for n in names):
        raise ConfigError(f"model.local: {cfg.local!r} names every tensor of the model: nothing would travel")
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    if cfg.local and trained and all(local(n) for n in trained):
        shared = [n for n in names if not local(n)]
        raise ConfigError(f"model.local: {cfg.local!r} names every trained parameter of the model, so only "
                          f"{', '.join(shared[:4])}{', ...' if len(shared) > 4 else ''} would travel and the clients "
                          "would learn nothing together; keep some trained layers out of model.local (FedPer makes "
                          "only the head local, FedBN only the BatchNorm layers)")
    return list(cfg.local)


def build_problem(cfg: ModelConfig, seed: int, judge: Callable[[nn.Module], str | None] | None = None,
                  **shape: Any) -> str | None:
    """Build the model once as every rank will, on the meta device (on the CPU when its construction reads
    values), so a plug-in's mistake shows before any MPI work: what went wrong, naming model.name, or None.
    ``judge``: what else the built model may be refused for (a setting of another section that it cannot serve)."""
    problem = None
    for device in ("meta", "cpu"):
        try:
            with torch.device(device):
                model = build_model(cfg, seed, **shape)
        except ConfigError as err:  # a key of the model section (model.trainable) names itself
            return str(err)
        except Exception as err:  # noqa: BLE001 - whatever user code raises is the config's problem here
            problem = f"model.name: building {cfg.name!r} failed: {type(err).__name__}: {err}"
            continue
        try:
            local_patterns(cfg, model)
        except ConfigError as err:
            return str(err)
        return output_width_problem(cfg, model, shape.get("input_shape"), shape.get("num_classes")) \
            or (judge(model) if judge is not None else None)
    return problem


def output_width_problem(cfg: ModelConfig, model: nn.Module, input_shape: Sequence[int] | None,
                         num_classes: int | None) -> str | None:
    """A classifier whose logits are not (batch, num_classes) trains into an IndexError on every rank: run one
    batch of two samples through it on the meta device (nothing computed) and say so before MPI starts. Models
    that meta cannot run, or that take other inputs (token ids), are not judged."""
    if cfg.name == "transformers" or input_shape is None or num_classes is None:
        return None
    param = next(model.parameters(), None)
    try:
        with torch.no_grad():
            meta = model.to("meta") if param is not None and param.device.type != "meta" else model
            dtype = param.dtype if param is not None else torch.float32
            out = meta(torch.empty((2, *input_shape), dtype=dtype, device="meta"))
    except Exception:  # noqa: BLE001 - a model meta cannot run is judged by the first real batch instead
        return None
    if isinstance(out, torch.Tensor) and tuple(out.shape) != (2, num_classes):
        return (f"model.name: {cfg.name!r} returns outputs of shape {tuple(out.shape)} for a batch of 2 samples of "
                f"shape {tuple(input_shape)}, but the data has {num_classes} classes: the last layer needs "
                f"{num_classes} outputs (name num_classes as a parameter and mpifl passes it)")
    return None


def state_sizes(plan: ExchangeLayout, flat: FlatModel) -> StateSizes:
    """The sizes a per-client layout needs (mpifl.config.client_state), read off a model and its exchange layout:
    a client rank's, and ``mpifl export --client``'s model built as the run built it."""
    return StateSizes(trainable=trainable_elements(flat.module, flat.local),
                      chunks=tuple(c.nbytes // c.itemsize for c in plan.chunks),
                      local=sum(t.numel() for _, t in flat.local_tensors()),
                      tensors=sum(t.numel() for _, t in flat.tensors()))


def meta_flat_model(cfg: ModelConfig, seed: int, streams: Streams | None = None, **shape: Any) -> FlatModel:
    """The model built on the meta device, then bound to flat buffers allocated but not written: the layout a
    run's ranks have, for a caller that fills every tensor it reads itself (from a checkpoint)."""
    with torch.device("meta"):
        module = build_model(cfg, seed, streams=streams, **shape)
    return FlatModel(module, cfg.exchange == "trainable", local=local_patterns(cfg, module))


def build_flat_model(cfg: ModelConfig, seed: int, read_init: bool = True, streams: Streams | None = None,
                     **shape: Any) -> FlatModel:
    """Build the model with its weights allocated once, in the flat buffer(s).

    Transformers models and ``init_from`` runs are built on the meta device and their
    weights written after binding (seeded init, pretrained shards, or the checkpoint);
    small built-in models are built normally and moved into the buffer tensor by tensor. With
    ``read_init=False`` the caller reads ``init_from`` itself (``read_init_from``), after checking it.
    """
    trainable_only = cfg.exchange == "trainable"
    if cfg.name == "transformers":
        from mpifl.learning import hf
        module = build_model(cfg, seed, streams=streams, **shape)
        flat = FlatModel(module, trainable_only, local=local_patterns(cfg, module))
        hf.initialize(flat.module, seed)
        if cfg.transformers.pretrained:
            assert cfg.transformers.path is not None  # config checks refuse pretrained without a path
            hf.load_pretrained(flat, cfg.transformers.path)
    elif cfg.init_from and not (trainable_only and cfg.trainable):  # the checkpoint holds every tensor
        flat = meta_flat_model(cfg, seed, streams, **shape)
    else:
        module = build_model(cfg, seed, streams=streams, **shape)
        flat = FlatModel(module, trainable_only, local=local_patterns(cfg, module))
    if streams is not None:  # summed streams start at 0 (SCAFFOLD's c), also where built on the meta device
        for buffer in getattr(flat.module, CONTROL).buffers():
            buffer.zero_()
    if cfg.init_from and read_init:
        read_init_from(flat, cfg.init_from)
    return flat


def read_init_from(flat: FlatModel, path: str) -> None:
    """Read a checkpoint of this model straight into the flat buffer (refusing another model's)."""
    from mpifl.storage.hdf5 import Checkpoint

    with Checkpoint(path) as init:
        init.check_spec(flat.spec)
        init.read_into(flat.tensors())
