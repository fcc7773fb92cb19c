"""The keys whose default is ``auto`` (or unset), resolved from the rest of the config before any check runs.

What a client sends (``strategy.update``) and how clients are weighted (``strategy.weighting``) follow from the
strategy and the run modes: SCAFFOLD, FedNova and FedDyn work on deltas, DP clips deltas and needs equal weights,
top-k sparsifies a change, FedBuff and FedCompass average deltas against the version each trained on. Left at
``auto``, each key takes the value those need, so ``strategy.name: scaffold`` runs as written; set explicitly, it
is kept, and a value that cannot work is refused by ``mpifl.config.checks`` naming the key. The resolved values
are what the run directory's ``config.yaml`` and every checkpoint record, so a resume compares concrete values.

Where nothing needs them, the keys resolve to 'weights' and 'samples', the defaults they had before ``auto``
existed, so every config that ran before runs bitwise as it did. A plug-in strategy's capabilities are known
only once it is imported (``mpifl.aggregation.compatibility``, on every rank): here it is resolved by the run
modes alone, and a plug-in that needs deltas is refused there with the key to set.
"""
from __future__ import annotations

import dataclasses

from mpifl.config.capabilities import BUILTIN_CAPABILITIES
from mpifl.config.sections import Config, StrategyConfig

AUTO = "auto"


def strategy_needs_delta(name: str) -> bool:
    """A built-in strategy that divides by its own total of deltas or keeps per-client state from them."""
    caps = BUILTIN_CAPABILITIES.get(name)
    return caps is not None and (caps.own_total or caps.client_state)


def strategy_needs_equal_weights(name: str) -> bool:
    """A built-in strategy whose server state assumes equal weights (FedDyn)."""
    caps = BUILTIN_CAPABILITIES.get(name)
    return caps is not None and caps.equal_weights


def automatic_update(cfg: Config) -> str:
    """'delta' where the strategy or a run mode works on the change a client made, else 'weights'."""
    needs_delta = (strategy_needs_delta(cfg.strategy.name) or cfg.privacy.mode != "off"
                   or cfg.compression.method == "topk" or cfg.clock.mode in ("fedbuff", "fedcompass"))
    return "delta" if needs_delta else "weights"


def automatic_weighting(cfg: Config) -> str:
    """'equal' where the strategy's state or DP's sensitivity assumes equal weights, else 'samples'."""
    needs_equal = strategy_needs_equal_weights(cfg.strategy.name) or cfg.privacy.mode != "off"
    return "equal" if needs_equal else "samples"


def resolve_strategy(strategy: StrategyConfig, update: str, weighting: str) -> StrategyConfig:
    """``strategy`` with an ``auto`` update or weighting replaced by the value given (explicit values kept)."""
    if AUTO not in (strategy.update, strategy.weighting):
        return strategy
    return dataclasses.replace(strategy, update=update if strategy.update == AUTO else strategy.update,
                               weighting=weighting if strategy.weighting == AUTO else strategy.weighting)


def resolve_lone_strategy(strategy: StrategyConfig) -> StrategyConfig:
    """A StrategyConfig built on its own (in code, without a Config): resolved by the strategy alone."""
    return resolve_strategy(strategy, "delta" if strategy_needs_delta(strategy.name) else "weights",
                            "equal" if strategy_needs_equal_weights(strategy.name) else "samples")


# clock.concurrency left unset: this many clients train at once, or every client where there are fewer (a
# config of 8 clients with clock.mode fedbuff runs as written instead of being refused for 10 > 8)
DEFAULT_CONCURRENCY = 10


def automatic_concurrency(cfg: Config) -> int:
    """The asynchronous clocks' clients in flight when ``clock.concurrency`` is unset."""
    return min(DEFAULT_CONCURRENCY, cfg.clients.num_clients)


def resolve_automatic(cfg: Config) -> Config:
    """``cfg`` with every ``auto`` (or unset) key replaced by its value for this config (other keys untouched)."""
    strategy = resolve_strategy(cfg.strategy, automatic_update(cfg), automatic_weighting(cfg))
    if strategy is not cfg.strategy:
        cfg = dataclasses.replace(cfg, strategy=strategy)
    if cfg.clock.concurrency is None:
        cfg = dataclasses.replace(cfg, clock=dataclasses.replace(cfg.clock, concurrency=automatic_concurrency(cfg)))
    return cfg
