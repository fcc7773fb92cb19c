"""Hugging Face transformers causal LMs, offline and allocated once.

The model is built with its parameters on the ``meta`` device (buffers such as rotary
frequencies are computed for real: they are small), then ``mpifl.wire.flat.FlatModel``
allocates the flat buffer and binds every parameter into it, and only then are the weights
written: a seeded ``initialize_weights`` or the safetensors shards of a local folder, one
tensor at a time. Peak memory is the buffer plus one tensor.

Nothing is ever downloaded: configs come from ``model.transformers`` (inline values over an
architecture's defaults) or from a local folder.
"""
from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpifl.config import ConfigError, LoraConfig, ModelConfig
from mpifl.errors import MissingExtra
from mpifl.wire.flat import DTYPES, FlatModel

if TYPE_CHECKING:  # the 'hf' extra: transformers is imported only where a model is built
    from transformers import PretrainedConfig


def stay_offline() -> None:
    """Keep hub access off (before transformers is imported): nothing is ever downloaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _transformers() -> ModuleType:
    stay_offline()
    try:
        import transformers
    except ImportError:
        raise MissingExtra("model.name='transformers' needs the 'hf' extra: pip install 'mpifl[hf]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def transformers_config(cfg: ModelConfig) -> PretrainedConfig:
    """The transformers config: a local folder's config.json or an architecture's defaults, with
    ``model.transformers.config`` values on top; an unknown key is an error, not silently kept."""
    transformers = _transformers()
    hf = cfg.transformers
    if hf.path is not None:
        base = transformers.AutoConfig.from_pretrained(hf.path, local_files_only=True)
        if hf.architecture is not None and hf.architecture != base.model_type:
            raise ConfigError(f"model.transformers.architecture: {hf.architecture!r}, but {hf.path}/config.json "
                              f"says {base.model_type!r}")
    else:
        try:
            base = transformers.AutoConfig.for_model(hf.architecture)
        except ValueError:
            close = difflib.get_close_matches(hf.architecture, list(transformers.CONFIG_MAPPING.keys()), n=3)
            raise ConfigError(f"model.transformers.architecture: {hf.architecture!r} is not a transformers "
                              f"model_type{'; did you mean ' + ', '.join(close) + '?' if close else ''}") from None
    known = set(base.to_dict()) | set(inspect.signature(type(base).__init__).parameters)
    for key in hf.config:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"model.transformers.config.{key}: not a {base.model_type} config key{hint}")
    with refused_shape("model.transformers.config"):
        if hf.path is not None:
            return transformers.AutoConfig.from_pretrained(hf.path, local_files_only=True, **hf.config)
        return transformers.AutoConfig.for_model(hf.architecture, **hf.config)


@contextlib.contextmanager
def refused_shape(key: str) -> Iterator[None]:
    """Inside the block, what transformers raises on an impossible shape (hidden size not a multiple of the heads:
    a ValueError, or huggingface_hub's StrictDataclassClassValidationError around one) is a ConfigError naming
    ``key`` with the library's own first line: it is the config's mistake, not a traceback to read on every rank."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - the library validates with whatever it likes; the cause is the config
        root: BaseException = err
        while root.__cause__ is not None:  # the wrapped ValueError says what is wrong; its wrapper only where
            root = root.__cause__
        lines = [line.strip() for line in str(root).splitlines() if line.strip()]
        raise ConfigError(f"{key}: transformers refuses the model: {lines[0] if lines else type(root).__name__}") \
            from None


def position_key(config: PretrainedConfig) -> str | None:
    """The config key that bounds a sequence's positions as the architecture names it (gpt2's n_positions,
    llama's max_position_embeddings), or None where it has none."""
    key = config.attribute_map.get("max_position_embeddings", "max_position_embeddings")
    return key if isinstance(getattr(config, key, None), int) else None


def positions_problem(config: PretrainedConfig, seq_len: int) -> str | None:
    """Token blocks longer than the model has positions fail in round 1 on every client (gpt2's position embedding
    raises IndexError): what is wrong, naming both keys, or None."""
    key = position_key(config)
    if key is None or seq_len <= getattr(config, key):
        return None
    return (f"data.kwargs.seq_len: blocks of {seq_len} tokens are longer than the model's {getattr(config, key)} "
            f"positions; lower data.kwargs.seq_len or raise model.transformers.config's {key}")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (no memory, no init work);
    buffers are built for real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    # torch has no hook for parameter creation: patch the method for this block only
    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build(cfg: ModelConfig) -> nn.Module:
    """The causal LM with parameters on the meta device (inside ``torch.device('meta')``,
    buffers too), LoRA adapters added when configured."""
    transformers = _transformers()
    config = transformers_config(cfg)
    dtype = DTYPES[cfg.dtype]
    with parameters_on_meta():
        with refused_shape("model.transformers.config"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        if cfg.lora.r:
            model = apply_lora(model, cfg.lora)
    return model


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap with peft LoRA adapters; peft freezes the base model."""
    problem = unmatched_target_problem([name for name, _ in model.named_modules()], cfg.target_modules)
    if problem:
        raise ConfigError(problem)
    lora = lora_config(cfg)
    import peft

    try:
        with warnings.catch_warnings():  # peft's notes on Conv1D (GPT-2) layout and deprecated names
            warnings.simplefilter("ignore", category=UserWarning)
            warnings.simplefilter("ignore", category=FutureWarning)
            return peft.get_peft_model(model, lora)
    except ValueError as err:
        raise ConfigError(f"model.lora.target_modules: {err}") from None


def lora_config(cfg: LoraConfig) -> Any:
    """The peft LoraConfig that ``model.lora`` wraps the model with (an empty target list lets peft choose the
    architecture's targets, as it does again when the adapters are loaded)."""
    try:
        stay_offline()
        import peft
    except ImportError:
        raise MissingExtra("model.lora needs peft: pip install 'mpifl[lora]'") from None
    # peft annotates lora_alpha as int but only divides it (by r or sqrt r): a float alpha is fine
    return peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,  # type: ignore[arg-type]
                           target_modules=list(cfg.target_modules) or None, task_type="CAUSAL_LM")


def targets_module(name: str, target: str) -> bool:
    """Whether peft adapts the module ``name`` for this entry of a target_modules list: its name is the entry or
    ends with ``.`` + the entry."""
    return name == target or name.endswith("." + target)


def unmatched_target_problem(module_names: Sequence[str], targets: Sequence[str]) -> str | None:
    """The first entry of ``model.lora.target_modules`` that adapts no module, with the closest module names, or
    None. peft only refuses a list none of whose entries matches: a misspelt entry beside a good one would be
    dropped without a word, training fewer adapters than asked for."""
    for target in targets:
        if not any(targets_module(name, target) for name in module_names):
            suffixes = {".".join(parts[i:]) for parts in (n.split(".") for n in module_names if n)
                        for i in range(len(parts))}
            close = difflib.get_close_matches(target, sorted(suffixes), n=3)
            hint = f"; closest module names: {', '.join(close)}" if close else ""
            return f"model.lora.target_modules: {target!r} matches no module of the model{hint}"
    return None


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    wrapper: Any = model  # a peft PeftModel when it has get_base_model (peft is optional, so not typed as one)
    return wrapper.get_base_model() if hasattr(wrapper, "get_base_model") else model


def initialize(model: nn.Module, seed: int,
               around: Callable[[Sequence[nn.Module]], AbstractContextManager[None]] | None = None) -> None:
    """Seeded transformers initialisation, in place (into the flat buffer once bound); LoRA
    adapters as peft initialises them (A Kaiming-uniform, B zero). ``around(modules)``, where given, wraps the
    initialisation of each module's own tensors (a sharded build makes them real only then:
    ``mpifl.learning.sharding.seeded_rows``)."""
    base: Any = base_model(model)  # a transformers PreTrainedModel: its methods are not nn.Module's
    for name, module in model.named_modules():  # transformers marks what post_init initialised (on meta)
        module.__dict__.pop("_is_hf_initialized", None)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor.__dict__.pop("_is_hf_initialized", None)
        if ".lora_" in name:  # adapters are peft's to initialise: the base model's draws stay as without LoRA
            module._is_hf_initialized = True
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _each_module(around):
        torch.manual_seed(seed)
        base.initialize_weights()
        for module in model.modules():
            if hasattr(module, "reset_lora_parameters"):
                layer: Any = module  # a peft LoRA layer (peft is optional, so not typed as one)
                adapters = [m for n, m in module.named_modules() if n.startswith("lora_")]  # not the base layer
                with around(adapters) if around else contextlib.nullcontext():
                    for adapter in layer.lora_A:
                        layer.reset_lora_parameters(adapter, init_lora_weights=True)


@contextlib.contextmanager
def _each_module(around: Callable[[Sequence[nn.Module]], AbstractContextManager[None]] | None) -> Iterator[None]:
    """Inside the block, transformers' initialisation of each module runs within ``around([module])``."""
    if around is None:
        yield
        return
    transformers = _transformers()
    cls = transformers.PreTrainedModel
    original = cls._initialize_weights

    def wrapped(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        with around([module]):
            original(self, module, *args, **kwargs)

    cls._initialize_weights = wrapped  # the one method transformers calls per module (smart_apply)
    try:
        yield
    finally:
        cls._initialize_weights = original


def saved_name(name: str) -> str:
    """A parameter's name as ``save_pretrained`` writes it: peft's wrapper prefixes removed."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def load_pretrained(flat: FlatModel, path: str | Path) -> None:
    """Read a local folder's safetensors shards tensor by tensor into the flat buffers; every
    tensor of the model must be found (LoRA adapters excepted)."""
    targets = {saved_name(n): t for n, t in [*flat.tensors(), *flat.frozen_tensors()]}
    read_safetensors(flat.module, targets, path, lambda f, key, target: target.copy_(f.get_tensor(key)))


def read_safetensors(module: nn.Module, targets: dict[str, torch.Tensor], path: str | Path,
                     read: Callable[[Any, str, torch.Tensor], object]) -> None:
    """Match a local folder's safetensors tensors to ``targets`` (by their saved names, with or without the model's
    prefix), check each one's shape, and have ``read(file, key, target)`` copy it (or the target's rows of it) in;
    every target must be found (LoRA adapters excepted)."""
    from safetensors import safe_open

    prefix = getattr(base_model(module), "base_model_prefix", "")
    found: set[str] = set()
    shards = sorted(Path(path).glob("*.safetensors"))
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                name = key if key in targets else f"{prefix}.{key}"
                if name not in targets:
                    continue
                target, shape = targets[name], tuple(f.get_slice(key).get_shape())
                if shape != tuple(target.shape):
                    raise ValueError(f"{shard}: tensor {key!r} has shape {list(shape)}, the model "
                                     f"expects {list(target.shape)}")
                with torch.no_grad():
                    read(f, key, target)
                found.add(name)
    missing = [n for n in targets if n not in found and ".lora_" not in n]
    if missing:
        raise ValueError(f"{path}: {len(missing)} of the model's tensors are in none of its {len(shards)} "
                         f"safetensors shards, first {missing[0]!r}")


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in the backward pass (non-reentrant, so frozen inputs are fine)."""
    base: Any = base_model(model)  # a transformers PreTrainedModel: its methods are not nn.Module's
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
