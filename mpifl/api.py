"""The public surface for plug-in authors: import what user code needs from here, nothing deeper.

User code is named by import path ``package.module:attr`` in the config and imported on every rank
(so the module must be importable there: installed, or on ``PYTHONPATH``). The contracts:

**Strategy** (``strategy.name``): ``attr(cfg, **strategy.kwargs) -> Strategy``, ``cfg`` the
``StrategyConfig``; ``strategy.kwargs`` are checked against the signature before MPI starts
(built-in strategies take none). A strategy is ``Strategy(cfg, combiner, update)`` (an optional
``capabilities=`` states what it is outright, over its combiner's declaration). A ``Strategy`` subclass may
override the server-side hooks the built-ins use: ``bind(spec, num_clients)`` once before the first
round (the exchanged model's layout, ``clients.num_clients``; call ``super().bind``),
``begin_round(round, participants)`` before each round is reduced (how many clients were sampled),
``finish(acc, count, total_weight, target, state, chunk)`` per chunk (``count`` and ``total_weight``:
the usable updates folded) and ``round_metrics()`` after the round.

**Combiner** (first stage, per chunk): ``fold(acc, x, weight, index)`` takes the ``index``-th
included participant's chunk ``x`` into the fp32 accumulator (index 0 overwrites, never reads);
``combine(acc, count, total_weight)`` returns the combined fp32 chunk (or ``combine_into`` the
model's dtype). ``stacked = True`` gives one accumulator row per participant. A participant's
weight is ``weight_of(meta)`` from its ``UpdateMeta`` (``num_samples``, ``local_steps``, the
trainer's ``metrics``; by default ``weight(meta.num_samples)``); clients compute it too, so it may
read only those fields. The module-level ``fold(acc, x, weight, first, scratch=None)`` is the fused fp32
``acc (+)= w * x`` a weighted sum uses: ``first=True`` overwrites ``acc`` (pass ``index == 0`` from the
method), ``first=False`` adds to it.

**Capabilities** (what run modes a strategy can take, never judged by its name): a combiner
declares ``capabilities = Capabilities(summable=..., needs_every_row=...)``. ``summable`` (fold is
``acc (+)= w * x``, combine a function of the sum and the total weight) allows ``clients.groups``,
``transport.reduce: chain``, ``secagg``, ``privacy`` (which also needs equal weights: a combiner
that overrides ``weight``/``weight_of`` is refused there) and ``clock.mode: fedasync``;
``needs_every_row`` says it needs each participant's own update (median); ``server_state`` follows
from the server update's ``state_init`` (FedAsync's mixing would drop it). A subclass that only
changes ``weight``/``weight_of`` keeps its base's; one that overrides ``fold``/``combine`` declares
its own, or is assumed neither summable nor free of the others' rows, and refused where that
would be wrong, before MPI starts.

**A rule over whole updates** (Krum, the geometric median; the exported ``Krum`` is Multi-Krum, the rule behind
``strategy.name: multi_krum``, and Krum's single choice is its ``m = 1``): subclass ``DistanceRule`` and write
``coefficients(gram, weights)``, what each of the round's n usable updates counts in the result (n floats
summing to 1), from their n x n float64 Gram matrix (centred on the first: squared distances are
``G_ii + G_jj - 2 G_ij``) and their weights. mpifl keeps the updates (RAM, or a temporary file) and finishes
every chunk with sum_i c_i x_i once the last has landed; ``self.clients[i]`` is update i's logical client,
``self.metrics`` what ``round_metrics()`` records and ``self.rejected`` the clients left out (the record's
``rejected``). Its capabilities are ``whole_update``: every participant's own update, like the median.

**ServerUpdate** (second stage): ``step(delta, state)`` turns the fp32 pseudo-gradient into the
step added to the old global chunk, in place; per-element state lives in fp32 vectors named in
``state_init`` (checkpointed); ``reads_previous = True`` when the update needs the old global chunk;
``combines = True`` when the step is part of the combination and so applies to BatchNorm's statistics too
(FedAsync's mixing), else they skip it and take the combined value.

**Model** (``model.name``): ``attr(**model.kwargs) -> torch.nn.Module``; mpifl adds
``input_shape`` and ``num_classes`` (from the data) when the signature names them. ``mpifl
validate`` builds it on the meta device.

**Dataset** (``data.dataset``): ``attr(**data.kwargs) -> (x_train, y_train, x_test, y_test[,
clients])``, tensors or arrays; ``clients`` (one index array per client) is the data's own split,
used with ``data.partition: natural``. **Partition** (``data.partition``): ``attr(labels,
num_clients, seed)`` returns one index array per client. **Loss** (``train.loss``):
``attr(output, target, reduction="mean")`` (evaluation asks for ``reduction="sum"``).

**Trainer** (``train.trainer``): ``attr(cfg, **train.kwargs)`` with ``cfg`` the ``TrainConfig``, an object
with ``modifies_weights`` (False: the model goes back as received) and ``train(model, data, seed) ->
TrainResult(num_samples, metrics, local_steps)``: train ``model`` in place on ``data`` (a
``ClientData``, ``x`` and ``y`` tensors; None without local data), seeded by ``seed``. A ``train`` that
also names a keyword parameter ``context`` gets a ``TrainContext``: the logical client's id, the round,
the round's participants and ``clients.num_clients``. A trainer class with ``client_state = {name:
StateVector(covers, size, start)}`` keeps those vectors per logical client: ``context.state[name]``
is the training client's (fp32, changed in place), kept once its update is usable, stored in RAM or
on disk, checkpointed, resumed, lent under per-round placement and put back when the client is
dropped past its deadline, like the built-in per-client state.

**Per-step hooks**: ``corrected_steps(params, corrections)`` acts after every optimizer step (SCAFFOLD's
correction, outside the momentum); ``regularized_gradients(params, anchors, states, alpha)`` adds
``alpha (y - anchor) - state`` to every gradient (FedDyn's regulariser, Ditto's). The built-in client halves
(``ClientAlgorithm``, mpifl.algorithms: SCAFFOLD, FedDyn, Ditto, FedBN/FedPer) are built on them. On a client
sharded over its group's ranks (``clients.sharding: fsdp``) a client half runs on every rank over the rows it
holds (``ClientAlgorithm.shard``: a ``ShardHalf`` over ``ShardRows``); there ``corrected_steps`` takes
corrections shaped like ``own_rows(param)``, and ``regularized_shard_gradients`` stands for
``regularized_gradients``.

**Settings**: ``strategy.kwargs``, ``train.kwargs``, ``model.kwargs`` and ``data.kwargs`` are checked
against the plug-in's signature before MPI starts (a typo is named with the closest parameter) and
converted to its annotated types as the config loads (``clip: float`` set to ``1e6`` is 1000000.0).

**Metrics**: every number in a trainer's ``TrainResult.metrics`` besides ``loss`` (which is
``train_loss``; names starting with ``rank_``, ``group_``, ``secagg_`` or ``ditto_`` are mpifl's own and refused) is
recorded each round as ``client_metrics.<name>``: its mean over the round's usable
clients weighted by their samples, its ``min``, ``max`` and ``clients``. A strategy's
``round_metrics()`` is recorded as ``strategy_metrics``. Both reach metrics.jsonl and every tracker
(``client_metrics/<name>/mean`` in TensorBoard).
"""
from __future__ import annotations

from mpifl.aggregation.combiners import Combiner, Median, SortedStack, TrimmedMean, WeightedMean
from mpifl.aggregation.distances import DistanceRule, GeometricMedian, Krum, squared_distances
from mpifl.aggregation.kernels import ACCUMULATOR_DTYPE, fold, weighted_mean_into
from mpifl.aggregation.strategies import Strategy, section_span
from mpifl.aggregation.updates import FedAdagrad, FedAdam, FedYogi, Momentum, Replace, ServerOptimizer, ServerUpdate
from mpifl.algorithms.contract import ClientAlgorithm, ClientHalf, GroupHalf, LaneCorrections, ShardHalf, ShardRows
from mpifl.config import ConfigError, DataConfig, ModelConfig, StrategyConfig, TrainConfig
from mpifl.config.capabilities import Capabilities
from mpifl.config.client_state import StateVector
from mpifl.learning.datasets import ClientData
from mpifl.learning.steps import (
    corrected_steps,
    gather,
    own_rows,
    regularized_gradients,
    regularized_shard_gradients,
    scatter,
    split,
    trainable,
)
from mpifl.learning.trainers import TrainContext, Trainer, TrainResult, make_loss, make_optimizer, minibatches
from mpifl.wire.protocol import UpdateMeta
from mpifl.wire.spec import CONTROL as SUMMED_STREAMS  # the submodule a client half's summed streams go in

__all__ = [
    "ACCUMULATOR_DTYPE",
    "SUMMED_STREAMS",
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
