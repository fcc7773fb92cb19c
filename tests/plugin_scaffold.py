"""The shipped client-half example (examples/client_half/scaffold.py) beside a builder the suite needs that no user
should copy: one that declares SCAFFOLD's client half but builds a plain mean, which is refused before MPI starts."""
from __future__ import annotations

from examples.client_half.scaffold import CAPABILITIES
from mpifl.api import Replace, Strategy, WeightedMean


def mismatched(cfg):
    """Declares SCAFFOLD's client half on the builder, but builds a plain mean: refused before MPI starts."""
    return Strategy(cfg, WeightedMean(cfg), Replace(cfg))


mismatched.capabilities = CAPABILITIES
