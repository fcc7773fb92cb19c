"""The keys whose default is ``auto`` (or unset), resolved from the rest of the config before any check runs.

What a client sends (``strategy.update``) and how clients are weighted (``strategy.weighting``) follow from the
strategy and the run modes: SCAFFOLD, FedNova and FedDyn work on deltas, DP clips deltas and needs equal weights,
top-k sparsifies a change, FedBuff and FedCompass average deltas against the version each trained on. Left at
``auto``, each key takes the value those need, so ``strategy.name: scaffold`` runs as written; set explicitly, it
is kept, and a value that cannot work is refused by ``mpifl.config.checks`` naming the key. The resolved values
are what the run directory's ``config.yaml`` and every checkpoint record, so a resume compares concrete values.

Where nothing needs them, the keys resolve to 'weights' and 'samples', the defaults they had before ``auto``
existed, so every config that ran before runs bitwise as it did. A plug-in strategy resolves the same way from the
capabilities it declares: while a key is ``auto`` it is built once here (``build(cfg, **strategy.kwargs)``, the keys
resolved by the run modes) and its ``capabilities`` read, so a plug-in declaring ``own_total`` or ``client_state``
gets deltas and one declaring ``equal_weights`` equal weights, as the built-ins with those capabilities do. A plug-in
that cannot be built here resolves by the run modes alone; ``mpifl.cli.preflight.check_plugins`` builds it again on
every rank and reports why it fails, naming the key.
"""
from __future__ import annotations

import dataclasses

from mpifl.config.capabilities import BUILTIN_CAPABILITIES, Capabilities
from mpifl.config.sections import Config, StrategyConfig
from mpifl.plugins import is_import_path, resolve

AUTO = "auto"
# The keys this module fills in from the rest of the config: a recorded config holds them resolved, so two runs
# that differ in one chosen key (clock.mode) may differ in these too, as a consequence (mpifl compare's labels)
AUTOMATIC_KEYS = ("strategy.update", "strategy.weighting", "clock.concurrency")


def needs_delta(caps: Capabilities | None) -> bool:
    """A strategy that divides by its own total of deltas or keeps per-client state from them."""
    return caps is not None and (caps.own_total or caps.client_state)


def needs_equal_weights(caps: Capabilities | None) -> bool:
    """A strategy whose server state assumes equal weights (FedDyn)."""
    return caps is not None and caps.equal_weights


def modes_need_delta(cfg: Config) -> bool:
    """A run mode that works on the change a client made: DP clips it, top-k sparsifies it, FedBuff and FedCompass
    average it against the version each client trained on."""
    return cfg.privacy.mode != "off" or cfg.compression.method == "topk" or cfg.clock.mode in ("fedbuff", "fedcompass")


def modes_need_equal_weights(cfg: Config) -> bool:
    """DP's sensitivity: one client moves the model by at most the clip bound only with equal weights."""
    return cfg.privacy.mode != "off"


def plugin_capabilities(strategy: StrategyConfig) -> Capabilities | None:
    """What a plug-in strategy declares, from building it once with ``strategy`` (its keys concrete); None for a
    built-in name, or a plug-in that cannot be built here (check_plugins builds it again and says why)."""
    if not is_import_path(strategy.name):
        return None
    try:
        built = resolve(strategy.name)(strategy, **strategy.kwargs)
    except Exception:  # noqa: BLE001 -- a probe: the real build in check_plugins reports the error with its key
        return None
    caps = getattr(built, "capabilities", None)
    return caps if isinstance(caps, Capabilities) else None


def resolve_strategy(strategy: StrategyConfig, update: str, weighting: str) -> StrategyConfig:
    """``strategy`` with an ``auto`` update or weighting replaced by the value given (explicit values kept)."""
    if AUTO not in (strategy.update, strategy.weighting):
        return strategy
    return dataclasses.replace(strategy, update=update if strategy.update == AUTO else strategy.update,
                               weighting=weighting if strategy.weighting == AUTO else strategy.weighting)


def resolve_by_capabilities(strategy: StrategyConfig, modes_delta: bool, modes_equal: bool) -> StrategyConfig:
    """``strategy``'s ``auto`` keys resolved from what the run modes need and what the strategy declares: the
    built-in table, or the plug-in built once with the keys the run modes alone would give."""
    if AUTO not in (strategy.update, strategy.weighting):
        return strategy
    by_modes = resolve_strategy(strategy, "delta" if modes_delta else "weights",
                                "equal" if modes_equal else "samples")
    caps = BUILTIN_CAPABILITIES.get(strategy.name) or plugin_capabilities(by_modes)
    return resolve_strategy(strategy, "delta" if modes_delta or needs_delta(caps) else "weights",
                            "equal" if modes_equal or needs_equal_weights(caps) else "samples")


def resolve_lone_strategy(strategy: StrategyConfig) -> StrategyConfig:
    """A StrategyConfig built on its own (in code, without a Config): resolved by the strategy alone."""
    return resolve_by_capabilities(strategy, modes_delta=False, modes_equal=False)


# clock.concurrency left unset: this many clients train at once, or every client where there are fewer (a
# config of 8 clients with clock.mode fedbuff runs as written instead of being refused for 10 > 8)
DEFAULT_CONCURRENCY = 10


def automatic_concurrency(cfg: Config) -> int:
    """The asynchronous clocks' clients in flight when ``clock.concurrency`` is unset."""
    return min(DEFAULT_CONCURRENCY, cfg.clients.num_clients)


def resolve_automatic(cfg: Config) -> Config:
    """``cfg`` with every ``auto`` (or unset) key replaced by its value for this config (other keys untouched)."""
    strategy = resolve_by_capabilities(cfg.strategy, modes_need_delta(cfg), modes_need_equal_weights(cfg))
    if strategy is not cfg.strategy:
        cfg = dataclasses.replace(cfg, strategy=strategy)
    if cfg.clock.concurrency is None:
        cfg = dataclasses.replace(cfg, clock=dataclasses.replace(cfg.clock, concurrency=automatic_concurrency(cfg)))
    return cfg
