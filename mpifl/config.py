"""Experiment configuration: typed sections, YAML + ``key=value`` overrides, strict validation.

Each component reads only its own section. Validation happens before any MPI work: an
unknown key names itself and the closest valid key; a bad value names the key and what
is allowed; an import path (``pkg.module:attr``) must resolve.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from mpifl.aggregation.registry import STRATEGIES  # torch-free: the registered strategy names
from mpifl.plugins import is_import_path, resolve
from mpifl.units import MIB


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


def _f(default: Any, doc: str, **rules: Any) -> Any:
    factory = dict(default_factory=default) if callable(default) else dict(default=default)
    return field(metadata={"doc": doc, **rules}, **factory)


@dataclass
class ClientsConfig:
    """Who takes part."""

    num_clients: int = _f(8, "logical clients in the federation (may exceed client ranks)", min=1)
    per_round: Optional[int] = _f(None, "clients sampled per round (overrides fraction)", min=1)
    fraction: float = _f(1.0, "fraction of clients sampled per round", min=0.0, max=1.0, exclusive_min=True)
    accept_failures: bool = _f(False, "drop a logical client that raises or sends NaN/Inf from the round (logged "
                               "with client, rank and reason) instead of aborting the job")
    min_participants: int = _f(1, "abort the round, and the job, when fewer updates than this remain", min=1)

    def per_round_count(self) -> int:
        """How many logical clients take part in each round."""
        if self.per_round is not None:
            return min(self.per_round, self.num_clients)
        return max(1, round(self.fraction * self.num_clients))


@dataclass
class DataConfig:
    """The dataset and how it is split across logical clients."""

    dataset: str = _f("digits", "built-in dataset ('digits', 'synthetic', or 'text': token blocks for causal-LM "
                      "training, see mpifl.learning.text) or import path returning (x_train, y_train, x_test, y_test)",
                      choices=("digits", "synthetic", "text"), import_ok=True)
    kwargs: dict = _f(dict, "keyword arguments for the dataset function")
    partition: str = _f("iid", "how training samples are split: iid, dirichlet (label skew), shards (k classes "
                        "per client) or unbalanced (lognormal sizes, iid labels)",
                        choices=("iid", "dirichlet", "shards", "unbalanced"))
    alpha: float = _f(0.5, "Dirichlet concentration (smaller = more label skew)", min=0.0, exclusive_min=True)
    classes_per_client: int = _f(2, "shards: classes each client holds", min=1)
    size_sigma: float = _f(1.0, "unbalanced: sigma of the lognormal client sizes (0 = equal)", min=0.0)
    val_fraction: float = _f(0.0, "share of each client's samples kept as its local validation split "
                             "(federated evaluation)", min=0.0, max=0.9)


@dataclass
class TransformersConfig:
    """A Hugging Face transformers causal LM (model.name='transformers'), built offline."""

    architecture: Optional[str] = _f(None, "model_type as transformers names it (gpt2, llama, mistral, ...); "
                                     "optional when path has a config.json")
    config: dict = _f(dict, "config values (n_layer, hidden_size, num_hidden_layers, ...) over the architecture's "
                      "defaults or over path's config.json")
    path: Optional[str] = _f(None, "local folder with config.json (and, with pretrained, *.safetensors shards); "
                             "never a hub name: nothing is downloaded")
    pretrained: bool = _f(False, "load the weights from path's safetensors shards, shard by shard into the flat "
                          "buffer (else: random init from the seed)")


@dataclass
class LoraConfig:
    """LoRA adapters through peft (the 'lora' extra); only the adapters train and travel."""

    r: int = _f(0, "adapter rank (0 = no LoRA)", min=0)
    alpha: float = _f(16.0, "LoRA scaling alpha", min=0.0, exclusive_min=True)
    dropout: float = _f(0.0, "dropout on the adapter input", min=0.0, max=1.0)
    target_modules: list = _f(list, "module names to adapt, e.g. [c_attn] (gpt2) or [q_proj, v_proj] (llama); "
                              "default: peft's choice for the architecture")


@dataclass
class ModelConfig:
    """The model every rank builds."""

    name: str = _f("mlp", "built-in model ('mlp', 'cnn', 'blob', 'transformers') or import path to a function "
                   "returning an nn.Module", choices=("mlp", "cnn", "blob", "transformers"), import_ok=True)
    kwargs: dict = _f(dict, "keyword arguments for the model function")
    dtype: str = _f("float32", "parameter dtype", choices=("float32", "bfloat16", "float16"))
    init_from: Optional[str] = _f(None, "an mpifl checkpoint to start from: every rank builds the model on the "
                                  "meta device and reads the weights straight into its flat buffer")
    transformers: TransformersConfig = _f(TransformersConfig, "model.name='transformers': architecture and config")
    trainable: list = _f(list, "glob patterns of parameter names that train (e.g. ['*.h.11.*', 'lm_head.*']); "
                         "the others are frozen; default: all")
    exchange: str = _f("trainable", "what travels and is reduced: only the trainable tensors (frozen ones stay "
                       "where they are) or all", choices=("trainable", "all"))
    lora: LoraConfig = _f(LoraConfig, "LoRA adapters (model.name='transformers')")


@dataclass
class TrainConfig:
    """Local training on each logical client."""

    trainer: str = _f("torch", "'torch' (plain loop), 'causal_lm' (transformers fine-tuning on data.dataset='text'), "
                      "'none' (model-only exchange) or an import path", choices=("torch", "causal_lm", "none"),
                      import_ok=True)
    optimizer: str = _f("sgd", "local optimizer", choices=("sgd", "adam", "adamw"))
    lr: float = _f(0.05, "local learning rate", min=0.0, exclusive_min=True)
    momentum: float = _f(0.0, "SGD momentum", min=0.0, max=1.0)
    weight_decay: float = _f(0.0, "weight decay", min=0.0)
    local_epochs: int = _f(1, "passes over the local data per round", min=1)
    local_steps: Optional[int] = _f(None, "if set, a fixed number of minibatch steps instead of epochs", min=1)
    batch_size: int = _f(32, "local minibatch size", min=1)
    grad_accum_steps: int = _f(1, "micro-batches of batch_size accumulated per optimizer step", min=1)
    gradient_checkpointing: bool = _f(False, "causal_lm: recompute activations in the backward pass (less memory, "
                                      "~30% more compute)")
    max_grad_norm: Optional[float] = _f(None, "clip the gradient norm to this before each step", min=0.0,
                                        exclusive_min=True)
    prox_mu: float = _f(0.0, "FedProx proximal term mu/2 * ||w - w_global||^2 (0 = off)", min=0.0)
    loss: str = _f("cross_entropy", "loss: 'cross_entropy', 'mse' or an import path (fn(output, target))",
                   choices=("cross_entropy", "mse"), import_ok=True)


@dataclass
class StrategyConfig:
    """How the server combines updates."""

    name: str = _f("fedavg", "fedavg, fedavgm (server momentum), fedadam/fedyogi/fedadagrad (Reddi et al. 2021), "
                   "median or trimmed_mean (coordinate-wise, unweighted), or an import path to a function "
                   "StrategyConfig -> Strategy (mpifl.aggregation.strategies)", choices=STRATEGIES, import_ok=True)
    weighting: str = _f("samples", "client weight in means: by sample count or equal", choices=("samples", "equal"))
    update: str = _f("weights", "what a client sends: its trained weights or its delta (trained - global)",
                     choices=("weights", "delta"))
    wire_dtype: Optional[str] = _f(None, "dtype of float32/float64 tensors in client updates (e.g. bfloat16 halves "
                                   "the bytes; the server still accumulates in float32); default: the model's",
                                   choices=("float32", "bfloat16", "float16"))
    server_lr: Optional[float] = _f(None, "server learning rate eta (default 1.0 for fedavgm, 0.01 for the "
                                    "adaptive ones)", min=0.0, exclusive_min=True)
    momentum: float = _f(0.9, "fedavgm: server momentum beta", min=0.0, max=1.0)
    beta1: float = _f(0.9, "fedadam/fedyogi: first-moment decay", min=0.0, max=1.0)
    beta2: float = _f(0.99, "fedadam/fedyogi: second-moment decay", min=0.0, max=1.0)
    tau: float = _f(1e-3, "adaptive strategies: adaptivity tau (also v's initial value tau^2)", min=0.0,
                    exclusive_min=True)
    trim_fraction: float = _f(0.1, "trimmed_mean: fraction beta trimmed from each end (< 0.5)", min=0.0, max=0.49)


@dataclass
class TransportConfig:
    """Chunked exchange."""

    chunk_mb: float = _f(16.0, "largest message in MiB (16 was best on shared-memory MPICH)", min=0.0,
                         exclusive_min=True)
    inflight: int = _f(4, "chunks in flight per peer", min=1)
    pool_mb: float = _f(256.0, "server memory budget for receive slots and chunk accumulators, MiB", min=0.0,
                        exclusive_min=True)

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * MIB))


@dataclass
class EvalConfig:
    """Held-out evaluation of the global model on the server."""

    every: int = _f(1, "evaluate every K rounds (0 = never); the last round is always evaluated", min=0)
    federated_every: int = _f(0, "every K rounds, clients evaluate the global model they received on their local "
                              "validation split (data.val_fraction); 0 = never", min=0)
    batch_size: int = _f(512, "evaluation batch size", min=1)


@dataclass
class CheckpointConfig:
    """HDF5 checkpoints in <run dir>/checkpoints (always one after the last round)."""

    every: int = _f(0, "save every K rounds (0 = only at the end and on SIGTERM)", min=0)
    keep: int = _f(3, "keep the newest K checkpoints (the final one is always the newest)", min=1)


@dataclass
class ServerConfig:
    """Where the server keeps the global model."""

    state: str = _f("memory", "'memory', or 'disk': out-of-core, window by window from HDF5",
                    choices=("memory", "disk"))
    window_mb: float = _f(64.0, "out-of-core read window for streaming the model out, MiB", min=0.0,
                          exclusive_min=True)


@dataclass
class OutputConfig:
    """What a run writes."""

    dir: Optional[str] = _f(None, "run directory (default runs/<config name>-<time>)")
    save_model: bool = _f(True, "write the final global model to <run dir>/model.h5")
    progress: bool = _f(True, "progress bar on rank 0")


@dataclass
class Config:
    """One experiment."""

    name: str = _f("experiment", "experiment name (used in the default run directory)")
    seed: int = _f(0, "root seed: sampling, partitioning and client randomness derive from it", min=0)
    rounds: int = _f(10, "federated rounds", min=1)
    clients: ClientsConfig = _f(ClientsConfig, "participation")
    data: DataConfig = _f(DataConfig, "dataset and partitioning")
    model: ModelConfig = _f(ModelConfig, "model")
    train: TrainConfig = _f(TrainConfig, "local training")
    strategy: StrategyConfig = _f(StrategyConfig, "aggregation")
    transport: TransportConfig = _f(TransportConfig, "chunked exchange")
    eval: EvalConfig = _f(EvalConfig, "evaluation")
    checkpoint: CheckpointConfig = _f(CheckpointConfig, "checkpoints")
    server: ServerConfig = _f(ServerConfig, "server state")
    output: OutputConfig = _f(OutputConfig, "outputs")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def clients_per_round(self) -> int:
        """How many logical clients take part in each round."""
        return self.clients.per_round_count()


def load_config(path: str | Path | None, overrides: list[str] = (), data: dict | None = None) -> Config:
    """Read a YAML file (or a dict), apply ``key=value`` overrides, validate everything."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        raw.setdefault("name", path.stem)
    if data:
        raw = _merge(raw, data)
    for item in overrides:
        _apply_override(raw, item)
    cfg = _build(Config, raw, "")
    _check_combinations(cfg)
    return cfg


def _check_combinations(cfg: Config) -> None:
    if cfg.model.name == "blob" and (cfg.train.trainer == "torch" or cfg.eval.every):
        raise ConfigError("model.name: 'blob' is a benchmark payload with no data: it needs eval.every=0 and a "
                          "trainer other than 'torch' (e.g. train.trainer='none')")
    _check_transformers(cfg)
    if cfg.model.init_from is not None and not Path(cfg.model.init_from).is_file():
        raise ConfigError(f"model.init_from: checkpoint file {cfg.model.init_from!r} does not exist")
    if cfg.eval.federated_every and cfg.data.val_fraction == 0:
        raise ConfigError("eval.federated_every: federated evaluation needs local validation splits; "
                          "set data.val_fraction (e.g. 0.1)")
    if cfg.clients.min_participants > cfg.clients_per_round():
        raise ConfigError(f"clients.min_participants: {cfg.clients.min_participants} is more than the "
                          f"{cfg.clients_per_round()} clients sampled per round")
    if cfg.server.state == "disk" and cfg.eval.every:
        raise ConfigError("eval.every: the out-of-core server (server.state='disk') never holds the whole model, "
                          "so it cannot evaluate it; set eval.every=0")


def _check_transformers(cfg: Config) -> None:
    model, hf = cfg.model, cfg.model.transformers
    if model.name != "transformers":
        if model.lora.r:
            raise ConfigError("model.lora.r: LoRA adapters need model.name='transformers'")
        if cfg.train.trainer == "causal_lm":
            raise ConfigError("train.trainer: 'causal_lm' needs model.name='transformers'")
        return
    if model.kwargs:
        raise ConfigError("model.kwargs: a transformers model takes its settings from model.transformers.config")
    if hf.architecture is None and hf.path is None:
        raise ConfigError("model.transformers: name an architecture (e.g. gpt2, llama) or a local path with a "
                          "config.json")
    if hf.path is not None and not Path(hf.path).is_dir():
        raise ConfigError(f"model.transformers.path: {hf.path!r} is not a local folder (nothing is downloaded: "
                          "hub names are not accepted)")
    if hf.path is not None and hf.architecture is None and not (Path(hf.path) / "config.json").is_file():
        raise ConfigError(f"model.transformers.path: {hf.path!r} has no config.json; set model.transformers.architecture")
    if hf.pretrained and (hf.path is None or not any(Path(hf.path).glob("*.safetensors"))):
        raise ConfigError(f"model.transformers.pretrained: no *.safetensors files in model.transformers.path "
                          f"({hf.path!r})")
    if hf.pretrained and model.init_from:
        raise ConfigError("model.init_from: choose one source of weights: a pretrained folder or an mpifl checkpoint")
    if cfg.train.trainer == "torch":
        raise ConfigError("train.trainer: a transformers model trains with 'causal_lm' (or 'none' for model-only "
                          "exchange), not 'torch'")
    reads_text = cfg.train.trainer == "causal_lm" or cfg.eval.every or cfg.eval.federated_every
    if reads_text and cfg.data.dataset != "text" and not is_import_path(cfg.data.dataset):
        raise ConfigError(f"data.dataset: causal-LM training and perplexity read token blocks; use 'text', not "
                          f"{cfg.data.dataset!r} (or set eval.every=0 with train.trainer='none')")
    if cfg.data.dataset == "text" and cfg.data.partition in ("dirichlet", "shards"):
        raise ConfigError(f"data.partition: {cfg.data.partition!r} splits by label; text blocks have none "
                          "(use iid or unbalanced)")


# Keys that may differ between a checkpoint's config and the config that resumes it.
RESUMABLE = ("name", "rounds", "checkpoint", "output", "eval", "transport", "server")


def resume_conflict(saved: dict, current: dict) -> str | None:
    """The first key whose change would make a resumed run differ from an uninterrupted one."""
    for key in sorted(set(saved) | set(current)):
        if key in RESUMABLE:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = resume_conflict({f"{key}.{k}": v for k, v in a.items()}, {f"{key}.{k}": v for k, v in b.items()})
            if inner:
                return inner
        elif a != b:
            return f"{key}: {a!r} in the checkpoint, {b!r} now"
    return None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. rounds=5)")
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(text) if text else None


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown key '{prefix}{key}'" + hint)
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name] or {}, f"{prefix}{name}.")
        else:
            values[name] = _check_value(f"{prefix}{name}", raw[name], hint, f.metadata)
    return cls(**values)


def _check_value(key: str, value: Any, hint: Any, rules: typing.Mapping) -> Any:
    optional = typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: a value is required ({rules.get('doc', '')})")
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    value = _coerce(key, value, base)
    _check_rules(key, value, rules)
    return value


def _coerce(key: str, value: Any, base: Any) -> Any:
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if base in (float, str, dict, list) and not isinstance(value, base):
        raise ConfigError(f"{key}: expected {base.__name__}, got {type(value).__name__} {value!r}")
    if base is list and not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
    return value


def _check_rules(key: str, value: Any, rules: typing.Mapping) -> None:
    if "min" in rules and (value < rules["min"] or (rules.get("exclusive_min") and value == rules["min"])):
        op = ">" if rules.get("exclusive_min") else ">="
        raise ConfigError(f"{key}: must be {op} {rules['min']}, got {value!r}")
    if "max" in rules and value > rules["max"]:
        raise ConfigError(f"{key}: must be <= {rules['max']}, got {value!r}")
    choices = rules.get("choices")
    if choices and value not in choices:
        if rules.get("import_ok") and is_import_path(value):
            try:
                resolve(value)
            except ImportError as err:
                raise ConfigError(f"{key}: {err}") from None
            return
        extra = " or an import path 'package.module:function'" if rules.get("import_ok") else ""
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, choices))}{extra}")


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
