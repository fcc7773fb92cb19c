"""The strategy registry: each built-in name -> (combiner, server update), torch-free.

``mpifl.config`` lists these names as ``strategy.name``'s choices (``STRATEGIES``); this
table must name the same, in the same order. Torch-free: the stages are named here and
imported on first use. A new
algorithm is a small class in ``combiners.py`` or ``updates.py`` plus one line below, and one in
``mpifl.config.capabilities.BUILTIN_CAPABILITIES`` (what it is, for load_config's checks). User
strategies need no registration: ``strategy.name: package.module:attr`` (see strategies.py).
"""
from __future__ import annotations

from typing import Any

from mpifl.config.sections import STRATEGIES
from mpifl.plugins import resolve

COMBINERS = "mpifl.aggregation.combiners"
UPDATES = "mpifl.aggregation.updates"

# name: (combiner class in combiners.py, server update class in updates.py)
BUILTIN: dict[str, tuple[str, str]] = {
    "fedavg": ("WeightedMean", "Replace"),
    "fedavgm": ("WeightedMean", "Momentum"),
    "fedadam": ("WeightedMean", "FedAdam"),
    "fedyogi": ("WeightedMean", "FedYogi"),
    "fedadagrad": ("WeightedMean", "FedAdagrad"),
    "median": ("Median", "Replace"),
    "trimmed_mean": ("TrimmedMean", "Replace"),
    "fednova": ("NormalizedAverage", "Replace"),
    "scaffold": ("ControlledMean", "GlobalStep"),
    "feddyn": ("DynamicMean", "DynamicState"),
}
# built-in strategies whose Strategy class (in strategies.py) is not the plain one: they finish a chunk their own way
STRATEGY_CLASSES: dict[str, str] = {"scaffold": "ControlledAverage", "feddyn": "DynamicRegularized"}

if tuple(BUILTIN) != STRATEGIES:  # the config's vocabulary and this table are one list, checked on import
    raise ImportError(f"mpifl.aggregation.registry names {tuple(BUILTIN)}, the config {STRATEGIES}")


def stages(name: str) -> tuple[Any, Any]:
    """The (combiner class, server update class) registered as ``name`` (KeyError if none)."""
    combiner, update = BUILTIN[name]
    return resolve(f"{COMBINERS}:{combiner}"), resolve(f"{UPDATES}:{update}")
