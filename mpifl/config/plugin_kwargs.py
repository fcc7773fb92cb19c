"""Plug-ins' own settings (``strategy.kwargs``, ``train.kwargs``, ``model.kwargs``, ``data.kwargs``), typed by the
plug-in's annotations as the built-in keys are typed by their sections, when the config is loaded.

Why here: every rank, ``mpifl validate`` and ``mpifl plan`` load the config, and the ``auto`` keys already build a
plug-in strategy from its kwargs (``mpifl.config.automatic``), so a value converted later would be seen raw once.
Only import paths are converted: the built-in functions take no ``kwargs`` of the plug-in kind (strategies,
trainers) or check their own (models, datasets).
"""
from __future__ import annotations

import dataclasses

from mpifl.config.schema import ConfigError
from mpifl.config.sections import Config
from mpifl.plugins import is_import_path, resolve, typed_kwargs

# (section, the key naming the plug-in): each section's ``kwargs`` go to that plug-in
PLUGIN_KEYS = (("strategy", "name"), ("train", "trainer"), ("model", "name"), ("data", "dataset"))


def typed_plugin_kwargs(cfg: Config) -> Config:
    """``cfg`` with each plug-in's kwargs converted to its parameters' annotated types (ConfigError naming the key
    of a value that cannot be)."""
    for section, name_key in PLUGIN_KEYS:
        part = getattr(cfg, section)
        name = getattr(part, name_key)
        if not part.kwargs or not is_import_path(name):
            continue
        try:
            fn = resolve(name)
        except ImportError as err:
            raise ConfigError(f"{section}.{name_key}: {err}") from None
        converted, problem = typed_kwargs(fn, part.kwargs, f"{section}.kwargs")
        if problem:
            raise ConfigError(problem)
        setattr(cfg, section, dataclasses.replace(part, kwargs=converted))
    return cfg
