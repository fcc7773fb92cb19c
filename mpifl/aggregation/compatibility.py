"""Whether a strategy, built-in or plug-in, can take the configured run modes, by its capabilities.

``load_config`` already refuses a built-in strategy from the torch-free table
(``mpifl.config.capabilities``); a plug-in is known only once imported, so ``strategy_problem``
runs in ``mpifl.cli.preflight.check_plugins``: on every rank before MPI starts, and in ``mpifl
validate``. A plug-in that declares nothing is taken to be neither summable nor free of the
others' rows, and is refused where that would be wrong, with a message that says how to declare.
"""
from __future__ import annotations

import inspect
from typing import Any

from mpifl.aggregation.combiners import Combiner, WeightedMean
from mpifl.aggregation.strategies import Strategy, make_strategy
from mpifl.config import Config, ConfigError
from mpifl.config.capabilities import Capabilities
from mpifl.config.checks import capability_problem
from mpifl.plugins import is_import_path, kwargs_problem, resolve

__all__ = ["Capabilities", "checked_strategy", "strategy_kwargs_problem", "strategy_problem"]


def strategy_problem(strategy: Strategy, cfg: Config) -> str | None:
    """The first configured run mode ``strategy`` cannot take, naming the key and the capability, or None."""
    return _client_half_problem(strategy, cfg) or capability_problem(cfg, strategy.capabilities,
                                                                     declared=strategy.declared) \
        or _weights_problem(strategy, cfg)


def _client_half_problem(strategy: Strategy, cfg: Config) -> str | None:
    """A plug-in's client half is read from its builder before the strategy is built (``Config.capabilities``): the
    built strategy must declare the same one, or the client ranks and the server would run different algorithms."""
    before, built = cfg.capabilities, strategy.capabilities
    fields = ("client_rule", "corrects_steps", "summed_streams")
    differ = [f for f in fields if getattr(before, f) != getattr(built, f)]
    if not differ:
        return None
    return (f"strategy.name: {cfg.strategy.name!r} declares {', '.join(f'{f}={getattr(before, f)!r}' for f in differ)} "
            f"on its builder (its capabilities attribute) but the strategy it builds declares "
            f"{', '.join(f'{f}={getattr(built, f)!r}' for f in differ)}; pass the builder's Capabilities to "
            "Strategy(..., capabilities=...)")


def _weights_problem(strategy: Strategy, cfg: Config) -> str | None:
    """Differential privacy bounds each client's influence by the clip only with equal weights, which the config
    asks of the built-in weights (strategy.weighting); a combiner that weighs its own way cannot promise them."""
    weigher = type(strategy.weigher)
    own = weigher.weight_of is not Combiner.weight_of or weigher.weight not in (Combiner.weight, WeightedMean.weight)
    if cfg.privacy.mode == "off" or not own:
        return None
    return (f"strategy.name: privacy.mode {cfg.privacy.mode!r} needs equal client weights (strategy.weighting="
            f"'equal'), but strategy {cfg.strategy.name!r} weighs participants its own way ({weigher.__name__} "
            "overrides weight or weight_of): one client could move the model by more than the clip bound")


def strategy_kwargs_problem(cfg: Config) -> str | None:
    """What is wrong with ``strategy.kwargs`` for a plug-in's signature ``fn(cfg, **kwargs)``, or None."""
    if not is_import_path(cfg.strategy.name):
        return None
    try:
        build = resolve(cfg.strategy.name)
    except ImportError as err:
        return f"strategy.name: {err}"
    first = next(iter(_parameters(build)), None)  # the StrategyConfig, which mpifl passes itself
    return kwargs_problem(build, cfg.strategy.kwargs, "strategy.kwargs", supplied=(first,) if first else ())


def checked_strategy(cfg: Config) -> Strategy:
    """The configured strategy, built, once its kwargs and run modes are checked (ConfigError naming the key)."""
    problem = strategy_kwargs_problem(cfg)
    if problem:
        raise ConfigError(problem)
    try:
        strategy = make_strategy(cfg.strategy)
    except ConfigError:  # names its key already
        raise
    except ValueError as err:  # a plug-in refusing its settings
        raise ConfigError(f"strategy.name {cfg.strategy.name!r}: {err}") from None
    problem = strategy_problem(strategy, cfg)
    if problem:
        raise ConfigError(problem)
    return strategy


def _parameters(fn: Any) -> list[str]:
    """The names of ``fn``'s positional parameters (none when it has no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
