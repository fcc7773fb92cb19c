"""What a strategy is, as the run-mode checks need it: ``Capabilities``, and the built-in strategies' own.

A run mode is allowed by what a strategy can do, never by its name. This vocabulary sits in
``mpifl.config`` (torch-free, below aggregation) so that ``load_config`` already refuses a built-in
strategy a run mode cannot take; ``mpifl.aggregation`` re-exports it, its combiners declare the
same values (tests/test_capabilities.py checks they agree), and a plug-in strategy's come from its
own stages, checked by ``mpifl.aggregation.compatibility`` on every rank before MPI starts.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a strategy's combination is. The defaults are what mpifl assumes of a combiner that declares
    nothing: not summable, needing every participant's own update, keeping no state (the safe side)."""

    # The combination reads the participants' updates only through their weighted sum: fold is
    # ``acc = w * x`` (first) then ``acc += w * x``, and combine a function of (acc, total weight). Then
    # partial sums may be added on the way (clients.groups, transport.reduce: chain), under secure
    # aggregation (secagg) and noised as a sum (privacy).
    summable: bool = False
    # Robust: needs each participant's own update at once (median, trimmed mean): a stack of rows.
    needs_every_row: bool = True
    # Keeps state across rounds (server momentum, Adam moments): a run mode that replaces the server
    # update (clock.mode: fedasync's mixing) would silently drop it.
    server_state: bool = False
    # Divides the weighted sum by a total of its own, computed from the round's update headers (FedNova's
    # effective local steps), of deltas: it needs strategy.update='delta', and neither DP's fixed divisor
    # nor asynchronous FL's staleness weights may stand in for that total.
    own_total: bool = False
    # Keeps state per logical client on the ranks that host it, which the update depends on (SCAFFOLD's client
    # control variates c_i): the update must be a delta that nothing rewrites on the way (no DP clipping or
    # noise, no secure-aggregation masking, no compression), trained by the built-in torch trainer on the host,
    # in synchronous rounds.
    client_state: bool = False
    # Averages the participants equally, and keeps state that assumes it (FedDyn's h): strategy.weighting must be
    # 'equal'.
    equal_weights: bool = False
    # Reads the local steps as plain SGD steps of size lr (SCAFFOLD's option II control variates (x - y) / (K lr),
    # FedNova's normaliser): with an adaptive local optimizer (Adam) that rule is scaled wrongly, which is warned of.
    sgd_steps: bool = False
    # The strategy's client half (with client_state): a built-in rule of mpifl.algorithms ('control_variates':
    # SCAFFOLD's corrected steps and c_i; 'dynamic_regularizer': FedDyn's g_i and its regulariser), or a plug-in's
    # import path 'package.module:attr' to a ClientAlgorithm; '' for none (a plug-in trainer's declared
    # client_state vectors need no rule).
    client_rule: str = ""
    # The client half acts after every optimizer step (SCAFFOLD's correction, outside the optimizer's momentum):
    # the optimizer must step once over the whole model, never parameter by parameter inside backward.
    corrects_steps: bool = False
    # The client half appends summed streams to the model (SCAFFOLD's c and the clients' control deltas), which
    # every update carries: nothing may rewrite them on the way (secure aggregation's masks among others).
    summed_streams: bool = False
    # Needs every participant's whole update before any chunk is finished (distances between whole updates: Krum,
    # the geometric median): the server keeps the round's updates (RAM, or a temporary file) and finishes every
    # chunk once the last has landed. Unlike a coordinate-wise rule it takes sparse (top-k) updates.
    whole_update: bool = False
    # A whole-update rule that ends in a coordinate-wise order statistic (Bulyan's values nearest each coordinate's
    # median): sparse (top-k) updates would make it mostly zeros, as they would the median's.
    coordinate_wise: bool = False


UNDECLARED = Capabilities()
MEAN = Capabilities(summable=True, needs_every_row=False)
SERVER_OPTIMIZER = Capabilities(summable=True, needs_every_row=False, server_state=True)
ORDER_STATISTIC = Capabilities(summable=False, needs_every_row=True)
WHOLE_UPDATE = Capabilities(summable=False, needs_every_row=True, whole_update=True)
WHOLE_UPDATE_COORDINATE_WISE = Capabilities(summable=False, needs_every_row=True, whole_update=True,
                                            coordinate_wise=True)
NORMALIZED_MEAN = Capabilities(summable=True, needs_every_row=False, own_total=True, sgd_steps=True)
CONTROLLED_MEAN = Capabilities(summable=True, needs_every_row=False, server_state=True, client_state=True,
                                sgd_steps=True, client_rule="control_variates", corrects_steps=True,
                                summed_streams=True)
DYNAMIC_MEAN = Capabilities(summable=True, needs_every_row=False, server_state=True, client_state=True,
                            equal_weights=True, client_rule="dynamic_regularizer")
CLIENT_RULES = ("control_variates", "dynamic_regularizer")

# Each built-in strategy (sections.STRATEGIES) -> what it is; mpifl.aggregation declares the same on its stages.
BUILTIN_CAPABILITIES: dict[str, Capabilities] = {
    "fedavg": MEAN,
    "fedavgm": SERVER_OPTIMIZER,
    "fedadam": SERVER_OPTIMIZER,
    "fedyogi": SERVER_OPTIMIZER,
    "fedadagrad": SERVER_OPTIMIZER,
    "median": ORDER_STATISTIC,
    "trimmed_mean": ORDER_STATISTIC,
    "krum": WHOLE_UPDATE,
    "multi_krum": WHOLE_UPDATE,
    "bulyan": WHOLE_UPDATE_COORDINATE_WISE,
    "geometric_median": WHOLE_UPDATE,
    "fednova": NORMALIZED_MEAN,
    "scaffold": CONTROLLED_MEAN,
    "feddyn": DYNAMIC_MEAN,
}

# The built-in rules that select updates by Krum's scores: the name a message gives each and the Byzantine guarantee
# it needs, n >= factor * f + 3 updates per server step (Krum and Multi-Krum: Blanchard et al. 2017; Bulyan: El
# Mhamdi et al. 2018); and what each takes of a step's updates, as `mpifl validate` says it ({updates}, {weights},
# {f}, {m} filled in).
KRUM_SELECTIONS: dict[str, tuple[str, int]] = {"krum": ("Krum", 2), "multi_krum": ("Multi-Krum", 2),
                                                "bulyan": ("Bulyan", 4)}
WHOLE_UPDATE_RULES: dict[str, str] = {
    "krum": "the one of {updates} updates with the lowest of the Krum scores (f={f}: squared distances to the n - f "
            "- 2 nearest others)",
    "multi_krum": "the mean weighted by {weights} of the {m} of {updates} updates with the lowest Krum scores (f={f}: "
                  "squared distances to the n - f - 2 nearest others)",
    "bulyan": "coordinate by coordinate, the mean of the n - 4f values closest to the median among the n - 2f of "
              "{updates} updates that Krum selects one at a time (f={f}), unweighted",
    "geometric_median": "the geometric median of {updates} updates weighted by {weights} (at most {iterations} "
                        "smoothed Weiszfeld iterations)",
}

# The keys of the strategy section that only some built-in strategies read (beyond name, kwargs, weighting, update
# and wire_dtype), and which: set beside a built-in strategy that does not read one, a config warning says it is
# ignored (a plug-in may read any key of its StrategyConfig, so it is not warned of).
ADAPTIVE = ("fedadam", "fedyogi", "fedadagrad")
STRATEGY_KEYS: dict[str, tuple[str, ...]] = {
    "server_lr": ("fedavgm", *ADAPTIVE, "scaffold"),
    "momentum": ("fedavgm",),
    "beta1": ADAPTIVE,
    "beta2": ("fedadam", "fedyogi"),
    "tau": ADAPTIVE,
    "trim_fraction": ("trimmed_mean",),
    "byzantine_clients": ("krum", "multi_krum", "bulyan"),
    "krum_keep": ("multi_krum",),
    "geomed_iterations": ("geometric_median",),
    "geomed_tolerance": ("geometric_median",),
    "geomed_smoothing": ("geometric_median",),
    "control_ram_mb": ("scaffold", "feddyn"),
    "alpha": ("feddyn",),
}


def reads_key(strategy: str, key: str) -> bool:
    """Whether built-in ``strategy`` reads ``strategy.<key>`` (keys not in ``STRATEGY_KEYS`` every strategy reads)."""
    return strategy in STRATEGY_KEYS.get(key, (strategy,))
