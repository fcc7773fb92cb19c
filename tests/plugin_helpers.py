"""Plug-ins for the contract tests, loaded by import path (``plugin_helpers:...``) in-process and on every rank."""
from __future__ import annotations

import math
import os

import torch
from torch import nn

from mpifl.api import Capabilities, Combiner, Median, Replace, Strategy, StrategyConfig, UpdateMeta, WeightedMean


def median(cfg: StrategyConfig) -> Strategy:
    """The tester's plug-in median: a built-in combiner wrapped as a plug-in strategy."""
    return Strategy(cfg, Median(cfg), Replace(cfg))


class RunningMax(Combiner):
    """A combiner that declares nothing (coordinate-wise max, unweighted)."""

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, index: int) -> None:
        acc.copy_(x) if index == 0 else torch.maximum(acc, x.to(acc.dtype), out=acc)

    def combine(self, acc: torch.Tensor, count: int, total_weight: float) -> torch.Tensor:
        return acc


def undeclared(cfg: StrategyConfig) -> Strategy:
    return Strategy(cfg, RunningMax(cfg), Replace(cfg))


class DeclaredMax(RunningMax):
    """The same combiner, declaring what it is: not a sum, but it needs no stack either."""

    capabilities = Capabilities(summable=False, needs_every_row=False)


def declared_max(cfg: StrategyConfig) -> Strategy:
    return Strategy(cfg, DeclaredMax(cfg), Replace(cfg))


class PerStep(WeightedMean):
    """FedNova-style: a participant weighs its samples per local step (fails loudly without local steps)."""

    def weight_of(self, meta: UpdateMeta) -> float:
        if not meta.local_steps:
            raise ValueError(f"client {meta.client}'s header carries no local steps: {meta!r}")
        return meta.num_samples / meta.local_steps


def per_step(cfg: StrategyConfig) -> Strategy:
    return Strategy(cfg, PerStep(cfg), Replace(cfg))


class OwnTotalMean(WeightedMean):
    """A FedNova-like plug-in: it divides the sum of deltas by a total of its own, so it needs deltas."""

    capabilities = Capabilities(summable=True, needs_every_row=False, own_total=True)


def own_total(cfg: StrategyConfig) -> Strategy:
    return Strategy(cfg, OwnTotalMean(cfg), Replace(cfg))


class EqualStateMean(WeightedMean):
    """A FedDyn-like plug-in whose server state assumes equal client weights."""

    capabilities = Capabilities(summable=True, needs_every_row=False, equal_weights=True)


def equal_state(cfg: StrategyConfig) -> Strategy:
    return Strategy(cfg, EqualStateMean(cfg), Replace(cfg))


class CountedMean(WeightedMean):
    """An equal-weight mean that divides by ``count``, as the docs' P/N rules read P: right only where ``count`` is
    the round's usable participants, not the streams that carried them (a reduction group's partial sum)."""

    capabilities = Capabilities(summable=True, needs_every_row=False)

    def weight(self, num_samples: int) -> float:
        return 1.0

    def combine(self, acc: torch.Tensor, count: int, total_weight: float) -> torch.Tensor:
        return acc.div_(float(count))

    def combine_into(self, out: torch.Tensor, acc: torch.Tensor, count: int, total_weight: float) -> None:
        out.copy_(acc / float(count))


def counted_mean(cfg: StrategyConfig) -> Strategy:
    return Strategy(cfg, CountedMean(cfg), Replace(cfg))


def scaled(cfg: StrategyConfig, scale: float, offset: float = 0.0) -> Strategy:
    """A plug-in with settings of its own (strategy.kwargs), one of them required."""
    strategy = Strategy(cfg, WeightedMean(cfg), Replace(cfg))
    strategy.settings = {"scale": scale, "offset": offset}
    return strategy


def sized(input_shape, num_classes, hidden):
    """A plug-in model written like the built-ins: mpifl passes the data's shape."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))


def pooling_cnn(channels: int = 8) -> nn.Module:
    """A LEAF-shaped CNN for 1 x 28 x 28 inputs: convolutions, ReLU, max pooling (model.nhwc_pooling)."""
    return nn.Sequential(nn.Conv2d(1, channels, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(channels, 2 * channels, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(2 * channels * 7 * 7, 10))


def unsized(width: int = 5) -> nn.Module:
    """A plug-in model that takes no shape: mpifl passes none."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))


def open_ended(**kwargs) -> nn.Module:
    """A plug-in model with **kwargs only: mpifl passes it nothing of its own."""
    assert "input_shape" not in kwargs, kwargs
    return unsized(**kwargs)


def classes_only(num_classes, hidden: int = 4):
    """Asks for num_classes only."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.Linear(hidden, num_classes))


def broken(input_shape, num_classes):
    """Builds a layer with a wrong size: caught by mpifl validate's build, not by the signature check."""
    return nn.Linear(math.prod(input_shape), -num_classes)


class ContextRecorder:
    """A plug-in trainer with a setting of its own (``train.kwargs.out``): trains as the built-in torch trainer does,
    and writes each ``TrainContext`` it gets as one JSON line of ``<out>/rank<rank>.jsonl``; reports the client's
    id as a metric, so its mean, min and max land in the round's record."""

    modifies_weights = True

    def __init__(self, cfg, out: str, scale: float = 1.0) -> None:
        from mpifl.learning.trainers import TorchTrainer

        if scale <= 0:  # a check only the plug-in itself can make
            raise ValueError(f"scale must be > 0, got {scale}")
        self.inner, self.out, self.scale = TorchTrainer(cfg), out, scale

    def train(self, model, data, seed, context=None):
        import json
        import os

        result = self.inner.train(model, data, seed)
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        with open(os.path.join(self.out, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"client": context.client, "round": context.round,
                                "participants": context.participants, "num_clients": context.num_clients,
                                "scale": self.scale}) + "\n")
        result.metrics.update(client_id=context.client * self.scale, trained=True)
        return result


class CountingMean(WeightedMean):
    capabilities = Capabilities(summable=True, needs_every_row=False)


class Counting(Strategy):
    """A plug-in strategy that measures its rounds through the server-side hooks: the participants sampled
    (begin_round), the usable ones folded into the first chunk (finish), and a setting (``clip: float``)."""

    def bind(self, spec, num_clients):
        super().bind(spec, num_clients)
        self.num_clients = num_clients

    def begin_round(self, round_, participants):
        self.seen = {"round": round_, "sampled": participants, "of": self.num_clients, "folded": -1,
                     "clip": self.clip}

    def finish(self, acc, count, total_weight, target, state, chunk=None):
        if self.seen["folded"] < 0:
            self.seen["folded"] = count
        super().finish(acc, count, total_weight, target, state, chunk)

    def round_metrics(self):
        return self.seen


def counting(cfg: StrategyConfig, clip: float) -> Strategy:
    strategy = Counting(cfg, CountingMean(cfg), Replace(cfg))
    strategy.clip = clip
    return strategy


def slowed(path: str) -> type:
    """The example trainer at ``path``, sleeping ``FL_HELPERS_SLEEP`` seconds before each client (0 without it): a
    job slow enough to be killed mid-run. Declares what the example declares."""
    from mpifl.plugins import resolve

    example = resolve(path)

    class Slowed:
        modifies_weights = True
        client_state = example.client_state

        def __init__(self, cfg, **kwargs) -> None:
            self.inner = example(cfg, **kwargs)

        def train(self, model, data, seed, context):
            import os
            import time

            time.sleep(float(os.environ.get("FL_HELPERS_SLEEP", "0")))
            return self.inner.train(model, data, seed, context)

    Slowed.__name__ = f"Slow{example.__name__}"
    return Slowed


SlowMoonTrainer = slowed("examples.moon.moon:MoonTrainer")
SlowAPFLTrainer = slowed("examples.apfl.apfl:APFLTrainer")


class BadDeclaration:
    """A trainer whose client_state is not a mapping of StateVectors."""

    modifies_weights = True
    client_state = {"previous": "trainable"}

    def __init__(self, cfg) -> None:
        pass

    def train(self, model, data, seed, context):
        raise AssertionError("never built")


class NoContext:
    """A trainer that declares a vector but takes no context, so could never see it."""

    modifies_weights = True

    def __init__(self, cfg) -> None:
        pass

    def train(self, model, data, seed):
        raise AssertionError("never built")


def _declare_for_no_context():
    from mpifl.api import StateVector

    NoContext.client_state = {"v": StateVector()}


_declare_for_no_context()


class LocalHeadState(NoContext):
    """Declares a vector over the model.local tensors: a run without model.local would keep it empty."""

    def train(self, model, data, seed, context=None):
        raise AssertionError("never built")


def _declare_local_head_state():
    from mpifl.api import StateVector

    LocalHeadState.client_state = {"head": StateVector(covers="local")}


_declare_local_head_state()


class TrainingCounter:
    """The built-in torch trainer, counting in a declared one-element vector how many times each client trained:
    after a run, a client's count is the rounds it took part in, less those it was dropped from."""

    modifies_weights = True

    def __init__(self, cfg) -> None:
        from mpifl.learning.trainers import TorchTrainer

        self.inner = TorchTrainer(cfg)

    def train(self, model, data, seed, context):
        result = self.inner.train(model, data, seed)
        context.state["count"].add_(1.0)
        return result


def _declare_counter():
    from mpifl.api import StateVector

    TrainingCounter.client_state = {"count": StateVector(covers="custom", size=1)}


_declare_counter()


class VectorBreaker(TrainingCounter):
    """The training counter, except that logical client ``client`` from round ``from_round`` on leaves its count as
    a new tensor of ``size`` elements of ``dtype``, all -1: a trainer that breaks the shape or dtype it declared;
    with ``nan``, all NaN (as declared otherwise): a trainer whose vector diverged."""

    def __init__(self, cfg, client: int = 3, from_round: int = 2, size: int = 1, dtype: str = "float32",
                 nan: bool = False, returns: str = "") -> None:
        super().__init__(cfg)
        self.client, self.from_round, self.size, self.dtype = client, from_round, size, getattr(torch, dtype)
        self.fill = float("nan") if nan else -1.0
        self.returns = returns  # 'tuple' or 'dict': what train returns instead of its TrainResult (vectors as declared)

    def train(self, model, data, seed, context):
        result = super().train(model, data, seed, context)
        if context.client == self.client and context.round >= self.from_round:
            if self.returns == "tuple":
                return result.num_samples, result.metrics
            if self.returns == "dict":
                return {"num_samples": result.num_samples, **result.metrics}
            context.state["count"] = torch.full((self.size,), self.fill, dtype=self.dtype)
        return result


def crashing_on_rank_2(cfg: StrategyConfig) -> Strategy:
    """The counting strategy, except on the rank the launcher numbers 2, where building it raises: a failure before
    MPI starts on one rank only (a module or a file missing on one node), which mpifl's checks do not catch."""
    if os.environ.get("PMI_RANK") == "2":
        raise RuntimeError("deliberate failure on rank 2 before MPI starts")
    return counting(cfg, clip=1.0)


class ReportsValidation:
    """A plug-in trainer that trains as the built-in torch trainer does and, with ``claim``, reports validation
    numbers of its own under the names mpifl once used for its federated evaluation (``val_accuracy``, ``val_loss``,
    ``val_samples``), as a personalised trainer scoring its personal model would."""

    modifies_weights = True

    def __init__(self, cfg, claim: bool = True) -> None:
        from mpifl.learning.trainers import TorchTrainer

        self.inner, self.claim = TorchTrainer(cfg), claim

    def train(self, model, data, seed, context=None):
        result = self.inner.train(model, data, seed)
        if self.claim:
            result.metrics.update(val_accuracy=0.99, val_loss=0.01, val_samples=7)
        return result


class PersonalizedWithoutContext:
    """A trainer with a personalised model to score (``personalized``) whose ``train`` takes no context, where the
    client's state it would read lives."""

    modifies_weights = True

    def __init__(self, cfg) -> None:
        pass

    def train(self, model, data, seed):
        raise AssertionError("refused before it trains")

    def personalized(self, model, context):
        raise AssertionError("refused before it scores")


class TrainWithoutSeed:
    """A trainer class whose ``train`` forgot the seed mpifl passes it."""

    modifies_weights = True

    def __init__(self, cfg) -> None:
        pass

    def train(self, model, data):
        raise AssertionError("never called: refused before MPI")


class WithoutTrain:
    """A trainer class that forgot its ``train``."""

    modifies_weights = True

    def __init__(self, cfg) -> None:
        pass


class WithoutModifiesWeights:
    """A trainer class that forgot to say whether training changes the model."""

    def __init__(self, cfg) -> None:
        pass

    def train(self, model, data, seed):
        raise AssertionError("never built")


class ModifiesWeightsInInit:
    """A trainer whose ``__init__`` sets ``modifies_weights`` (an instance attribute): as valid as a class one."""

    def __init__(self, cfg) -> None:
        self.modifies_weights = True

    def train(self, model, data, seed):
        raise AssertionError("never trained in the test")


def without_modifies_weights(cfg):
    """A builder function whose trainer lacks ``modifies_weights``: seen only once it is built."""
    return WithoutModifiesWeights(cfg)


class ShortCombine(WeightedMean):
    """The weighted mean, one element short: a combine that returns the wrong shape."""

    capabilities = Capabilities(summable=True, needs_every_row=False)

    def combine(self, acc, count, total_weight):
        return super().combine(acc, count, total_weight)[:-1]


class WideCombine(ShortCombine):
    """The weighted mean in float64: a combine that returns the wrong dtype."""

    def combine(self, acc, count, total_weight):
        return acc.div(total_weight).double()


class SqueezedStack(Median):
    """A stacked combiner whose combine (reached through the default combine_into) returns one value per chunk."""

    def combine_into(self, out, acc, count, total_weight):
        Combiner.combine_into(self, out, acc, count, total_weight)

    def combine(self, acc, count, total_weight):
        return acc[0][:1].clone()


class HalvedMean(WeightedMean):
    """The weighted mean halved: a WeightedMean subclass that overrides combine alone (its combine_into is the
    built-in's fused division, which must not skip it)."""

    capabilities = Capabilities(summable=True, needs_every_row=False)

    def combine(self, acc, count, total_weight):
        return super().combine(acc, count, total_weight).mul_(0.5)


def halved_mean(cfg: StrategyConfig) -> Strategy:
    return Strategy(cfg, HalvedMean(cfg), Replace(cfg))


def short_combine(cfg: StrategyConfig) -> Strategy:
    from mpifl.api import ServerOptimizer

    return Strategy(cfg, ShortCombine(cfg), ServerOptimizer(cfg))


def wide_combine(cfg: StrategyConfig) -> Strategy:
    from mpifl.api import ServerOptimizer

    return Strategy(cfg, WideCombine(cfg), ServerOptimizer(cfg))


def squeezed_stack(cfg: StrategyConfig) -> Strategy:
    return Strategy(cfg, SqueezedStack(cfg), Replace(cfg))


def _server_step(kind: str):
    """A server optimizer with momentum state ``m`` whose step works in place (``kind`` 'in_place'), returns a new
    tensor instead of writing into delta ('returns'), binds a new tensor to state['m'] ('rebinds'), or raises
    ('raises')."""
    from mpifl.api import ServerOptimizer

    class Step(ServerOptimizer):
        def __init__(self, cfg: StrategyConfig) -> None:
            super().__init__(cfg)
            self.state_init = {"m": 0.0}

        def step(self, delta, state):
            if kind == "raises":
                raise RuntimeError("a bug in the server half")
            if kind == "returns":
                return delta * 2.0
            if kind == "rebinds":
                state["m"] = state["m"] * 0.5 + delta
                return None
            state["m"].mul_(0.5).add_(delta)
            return delta.add_(state["m"])  # returning delta itself is fine

    Step.__qualname__ = f"Step_{kind}"
    return lambda cfg: Strategy(cfg, WeightedMean(cfg), Step(cfg))


step_in_place, step_returns, step_rebinds, step_raises = (_server_step(k)
                                                         for k in ("in_place", "returns", "rebinds", "raises"))


class _MetricsRaise(WeightedMean):
    """A combiner whose round_metrics has a bug."""

    def round_metrics(self):
        raise KeyError("spread")


def metrics_raises(cfg: StrategyConfig) -> Strategy:
    """A plug-in whose per-round metrics raise after its reduction is done."""
    return Strategy(cfg, _MetricsRaise(cfg), Replace(cfg))


class _BindRaises(Strategy):
    """A strategy whose bind has a bug (it reads a key the federation does not have)."""

    def bind(self, spec, num_clients):
        super().bind(spec, num_clients)
        raise ValueError(f"{num_clients} clients: expected a multiple of 7")


def bind_raises(cfg: StrategyConfig) -> Strategy:
    """A plug-in whose bind raises before the first round."""
    return _BindRaises(cfg, WeightedMean(cfg), Replace(cfg))
