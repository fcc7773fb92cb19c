"""mpifl.api is the plug-in authors' surface: its names change only by a deliberate diff here."""
from __future__ import annotations

import mpifl.api as api

PUBLIC = [
    "ACCUMULATOR_DTYPE",
    "Capabilities",
    "ClientAlgorithm",
    "ClientData",
    "ClientHalf",
    "Combiner",
    "ConfigError",
    "DataConfig",
    "DistanceRule",
    "FedAdagrad",
    "FedAdam",
    "FedYogi",
    "GeometricMedian",
    "GroupHalf",
    "Krum",
    "LaneCorrections",
    "Median",
    "ModelConfig",
    "Momentum",
    "Replace",
    "SUMMED_STREAMS",
    "ServerOptimizer",
    "ServerUpdate",
    "ShardHalf",
    "ShardRows",
    "SortedStack",
    "StateVector",
    "Strategy",
    "StrategyConfig",
    "TrainConfig",
    "TrainContext",
    "TrainResult",
    "Trainer",
    "TrimmedMean",
    "UpdateMeta",
    "WeightedMean",
    "corrected_steps",
    "fold",
    "gather",
    "make_loss",
    "make_optimizer",
    "minibatches",
    "own_rows",
    "regularized_gradients",
    "regularized_shard_gradients",
    "scatter",
    "section_span",
    "split",
    "squared_distances",
    "trainable",
    "weighted_mean_into",
]


def test_the_public_names_are_frozen():
    assert PUBLIC == sorted(PUBLIC)
    assert sorted(api.__all__) == PUBLIC


def test_every_public_name_exists():
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert not missing, missing


def test_the_module_docstring_states_each_contract():
    for contract in ("**Strategy**", "**Combiner**", "**Capabilities**", "**ServerUpdate**", "**Model**",
                     "**Dataset**", "**Trainer**", "strategy.kwargs", "weight_of", "input_shape"):
        assert contract in api.__doc__, contract
