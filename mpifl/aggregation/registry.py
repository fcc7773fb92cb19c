"""The strategy registry: each built-in name -> (combiner, server update), torch-free.

``mpifl.config`` lists these names as ``strategy.name``'s choices (``STRATEGIES``); this
table must name the same, in the same order. Torch-free: the stages are named here and
imported on first use. A new server-side
algorithm is a small class in ``combiners.py`` or ``updates.py`` plus one line below, and one in
``mpifl.config.capabilities.BUILTIN_CAPABILITIES`` (what it is, for load_config's checks); one with a
client half is a file of its own in ``mpifl.algorithms``, named here by import path. User
strategies need no registration: ``strategy.name: package.module:attr`` (see strategies.py).
"""
from __future__ import annotations

from typing import Any

from mpifl.config.sections import STRATEGIES
from mpifl.plugins import resolve

COMBINERS = "mpifl.aggregation.combiners"
UPDATES = "mpifl.aggregation.updates"
DISTANCES = "mpifl.aggregation.distances"  # the rules over whole updates (Krum, Bulyan, the geometric median)
# Algorithms with a client half live in one file each, both halves together (mpifl.algorithms), above this
# package: named by import path, as a plug-in is, and imported on first use.
SCAFFOLD = "mpifl.algorithms.scaffold"
FEDDYN = "mpifl.algorithms.feddyn"

# name: (combiner class in combiners.py, server update class in updates.py)
BUILTIN: dict[str, tuple[str, str]] = {
    "fedavg": ("WeightedMean", "Replace"),
    "fedavgm": ("WeightedMean", "Momentum"),
    "fedadam": ("WeightedMean", "FedAdam"),
    "fedyogi": ("WeightedMean", "FedYogi"),
    "fedadagrad": ("WeightedMean", "FedAdagrad"),
    "median": ("Median", "Replace"),
    "trimmed_mean": ("TrimmedMean", "Replace"),
    "krum": (f"{DISTANCES}:SingleKrum", "Replace"),
    "multi_krum": (f"{DISTANCES}:Krum", "Replace"),
    "bulyan": (f"{DISTANCES}:Bulyan", "Replace"),
    "geometric_median": (f"{DISTANCES}:GeometricMedian", "Replace"),
    "fednova": ("NormalizedAverage", "Replace"),
    "scaffold": (f"{SCAFFOLD}:ControlledMean", "GlobalStep"),
    "feddyn": (f"{FEDDYN}:DynamicMean", f"{FEDDYN}:DynamicState"),
}
# built-in strategies whose Strategy class is not the plain one: they finish a chunk their own way
STRATEGY_CLASSES: dict[str, str] = {"scaffold": f"{SCAFFOLD}:ControlledAverage",
                                    "feddyn": f"{FEDDYN}:DynamicRegularized"}

if tuple(BUILTIN) != STRATEGIES:  # the config's vocabulary and this table are one list, checked on import
    raise ImportError(f"mpifl.aggregation.registry names {tuple(BUILTIN)}, the config {STRATEGIES}")


def stages(name: str) -> tuple[Any, Any]:
    """The (combiner class, server update class) registered as ``name`` (KeyError if none)."""
    combiner, update = BUILTIN[name]
    return resolve(combiner if ":" in combiner else f"{COMBINERS}:{combiner}"), \
        resolve(update if ":" in update else f"{UPDATES}:{update}")
