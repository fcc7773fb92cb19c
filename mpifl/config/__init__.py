"""Experiment configuration: typed sections, YAML + ``key=value`` overrides, strict validation.

Each component reads only its own section. Validation happens before any MPI work: an
unknown key names itself and the closest valid key; a bad value names the key and what
is allowed; an import path (``pkg.module:attr``) must resolve.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from mpifl.config.automatic import resolve_automatic
from mpifl.config.checks import check_combinations, config_warnings
from mpifl.config.plugin_kwargs import typed_plugin_kwargs
from mpifl.config.schema import ConfigError, apply_override, build, merge, read_yaml
from mpifl.config.sections import (
    CheckpointConfig,
    ClientsConfig,
    ClockConfig,
    CompressionConfig,
    Config,
    DataConfig,
    EvalConfig,
    FaultConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
    PrivacyConfig,
    SecAggConfig,
    ServerConfig,
    StrategyConfig,
    TimeoutsConfig,
    TrainConfig,
    TransformersConfig,
    TransportConfig,
)

__all__ = ["CheckpointConfig", "ClientsConfig", "ClockConfig", "CompressionConfig", "Config", "ConfigError",
           "DataConfig", "EvalConfig", "FaultConfig", "LoraConfig", "ModelConfig", "OutputConfig", "PrivacyConfig",
           "SecAggConfig", "ServerConfig", "StrategyConfig", "TimeoutsConfig", "TrainConfig", "TransformersConfig",
           "TransportConfig",
           "config_warnings", "dump_config", "load_config", "resumable_keys", "resume_conflict"]


def closest_file(path: Path) -> str:
    """"; did you mean 'configs/llama3.1-70b-lora.yaml'?" for a mistyped config file: the closest name of a YAML
    file in its folder, else nothing (the folder missing too, or nothing close)."""
    import difflib

    folder = path.parent
    try:
        names = [p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml")]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return f"; did you mean {str(folder / close[0])!r}?" if close else ""


def load_config(path: str | Path | None, overrides: Sequence[str] = (), data: dict | None = None) -> Config:
    """Read a YAML file (or a dict), apply ``key=value`` overrides, resolve the ``auto`` keys, validate everything."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist{closest_file(path)}")
        try:
            raw = read_yaml(path.read_text(), str(path))
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if raw is None:
            raise ConfigError(f"{path}: the file is empty; write the sections you mean (rounds, clients, data, "
                              "model, ...) or '{}' to run every default on purpose")
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        raw.setdefault("name", path.stem)
    if data:
        raw = merge(raw, data)
    for item in overrides:
        apply_override(raw, item)
    cfg = resolve_automatic(typed_plugin_kwargs(build(Config, raw, "")))
    check_combinations(cfg)
    return cfg


# Keys that may differ between a checkpoint's config and the config that resumes it: sections that do not touch the
# numbers, and settings that change only how fast or in how much memory the same numbers come out (bitwise the
# same results, each with its test). The *_ram_mb budgets say whether a rank keeps its clients' state in RAM or in
# an HDF5 file: a checkpoint's snapshot of that state has one format either way, keyed by client.
# clients.placement says only which rank trains which client; that state is found by client id on resume, as it
# is on another number of ranks. clients.below_quorum acts only where a round would otherwise end the job, so a
# resume that keeps such a round ends where the same run with 'keep' throughout would.
RESUMABLE = ("name", "rounds", "checkpoint", "output", "eval", "transport", "server", "timeouts",
             "clients.placement", "clients.below_quorum", "model.nhwc_pooling", "train.reuse_freed_memory",
             "train.step_in_backward",
             "strategy.control_ram_mb", "model.local_ram_mb", "train.personal_ram_mb", "train.state_ram_mb",
             "compression.residual_ram_mb")


def resumable_keys() -> str:
    """RESUMABLE for a message: a whole section as ``section.*``."""
    defaults = Config().to_dict()
    return ", ".join(f"{k}.*" if isinstance(defaults.get(k), dict) else k for k in RESUMABLE)


def resume_conflict(saved: dict, current: dict, defaults: dict | None = None) -> str | None:
    """The first key whose change would make a resumed run differ from an uninterrupted one.

    ``defaults`` (the config's defaults, ``Config().to_dict()``) stand in for keys the checkpoint lacks: a
    checkpoint written before a key existed ran as that key's default does, so a resume may keep the default
    (a newer mpifl resuming an older run) but not change it."""
    defaults = defaults or {}
    for key in sorted(set(saved) | set(current)):
        if key in RESUMABLE:
            continue
        a, b = saved.get(key, defaults.get(key)), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            default = defaults.get(key)
            inner = resume_conflict(_prefixed(key, a), _prefixed(key, b),
                                    _prefixed(key, default) if isinstance(default, dict) else {})
            if inner:
                return inner
        elif a != b:
            if key not in saved and key in defaults:
                return (f"{key}: absent from the checkpoint (written before the key existed, so the run went as "
                        f"its default {a!r}), {b!r} now")
            if key not in current:  # a plug-in's kwargs key left out: its own default applies, not None
                return f"{key}: {a!r} in the checkpoint, not set now (so the plug-in's own default)"
            return f"{key}: {a!r} in the checkpoint, {b!r} now"
    return None


def _prefixed(section: str, values: dict) -> dict:
    """A section's keys as dotted keys: {"lr": 0.1} under "train" is {"train.lr": 0.1}."""
    return {f"{section}.{k}": v for k, v in values.items()}


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
