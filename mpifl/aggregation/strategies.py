"""A strategy: a combiner and a server update, composed into what the reduction and server call.

A strategy decides, it never communicates. For every chunk of the model the server

1. *combines* the participants' chunks (weights or deltas, as the clients send them) with the
   strategy's combiner (combiners.py): a weighted mean folded into an fp32 accumulator, or a
   coordinate-wise median / trimmed mean over a stack of every participant's chunk
   (participants x chunk, never participants x model);
2. *updates* the global chunk with its server update (updates.py): plain replacement
   (FedAvg), or a server optimizer step on the pseudo-gradient ``delta = combined - global``
   (FedAvgM, FedAdam, FedYogi, FedAdagrad; Reddi et al. 2021), whose moments live in
   chunk-addressable fp32 server-state vectors (RAM or HDF5, saved in checkpoints).

Everything is computed in fp32 and rounded once into the model's dtype. ``make_strategy``
builds a registered name (registry.py) or calls an import path ``package.module:attr`` as
``attr(cfg, **cfg.kwargs)``, cfg the StrategyConfig; attr returns a Strategy (or is a Strategy
subclass). A strategy's ``capabilities`` (what run modes it can take) come from its combiner's
declaration (or the safe assumption when it declares none) and its server update's state.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import torch

from mpifl.aggregation.combiners import Combiner, checked_combined, declared_capabilities
from mpifl.aggregation.kernels import ACCUMULATOR_DTYPE, Rows
from mpifl.aggregation.registry import BUILTIN, STRATEGIES, STRATEGY_CLASSES, stages
from mpifl.aggregation.updates import ServerUpdate
from mpifl.config import ConfigError, StrategyConfig
from mpifl.config.automatic import resolve_lone_strategy
from mpifl.config.capabilities import UNDECLARED, Capabilities
from mpifl.errors import JobFailure
from mpifl.plugins import is_import_path, resolve
from mpifl.wire.protocol import UpdateMeta
from mpifl.wire.spec import Chunk, ModelSpec

__all__ = ["ACCUMULATOR_DTYPE", "Strategy", "make_strategy"]


class Strategy:
    """What the streamed reduction calls for each chunk (weight, fold, finish) and planning asks (bytes)."""

    def __init__(self, cfg: StrategyConfig, combiner: Combiner, update: ServerUpdate,
                 capabilities: Capabilities | None = None) -> None:
        self.cfg, self.combiner, self.update = cfg, combiner, update
        self.name = cfg.name
        self.delta = cfg.update == "delta"  # clients send trained - global, not their weights
        self.stacked = combiner.stacked
        self.whole_update = combiner.whole_update  # keeps whole updates, finishing every chunk after the last lands
        self.state_init = dict(update.state_init)
        self.weigher = combiner  # whose weight_of weighs the participants (kept when a run mode swaps the combiner)
        declared = capabilities or declared_capabilities(combiner)
        self.declared = declared is not None  # False: the checks assume the safe side and say how to declare
        base = declared or UNDECLARED
        self.capabilities = dataclasses.replace(base, server_state=base.server_state or bool(self.state_init))
        self.statistics: tuple[tuple[int, int], ...] = ()  # byte ranges of the model's statistics (bind)
        self.round_statistics_total: float | None = None  # this round's divisor of the statistics (the reduction's)
        # Clients send their statistics as values, not changes, even with deltas: the asynchronous modes, where a
        # change is measured from an older version than the one it is applied to (set by the runner)
        self.statistics_absolute = False

    @property
    def needs_previous_global(self) -> bool:
        """Whether finishing a chunk reads the old global chunk (deltas and server optimizers do)."""
        return self.delta or self.update.reads_previous

    def weight(self, num_samples: int) -> float:
        """A participant's weight in the combination, from its sample count."""
        return self.combiner.weight(num_samples)

    def weight_of(self, meta: UpdateMeta) -> float:
        """A participant's weight from its whole update header (the combiner's ``weight_of``)."""
        return self.weigher.weight_of(meta)

    def total_weight(self, metas: Sequence[UpdateMeta]) -> float:
        """What the round's weighted sum is divided by, from its usable participants' headers."""
        return self.weigher.total_weight(metas)

    def statistics_total(self, metas: Sequence[UpdateMeta]) -> float | None:
        """What the round's statistics are divided by where that differs from ``total_weight`` (FedNova's), else
        None; the reduction keeps it as ``round_statistics_total`` for ``finish``."""
        return self.weigher.statistics_total(metas)

    def substituted(self, combiner: Combiner | None = None, update: ServerUpdate | None = None) -> Strategy:
        """A twin with the stage a run mode substitutes (secure aggregation's ring sum, FedAsync's mixing); the
        participants keep this strategy's weights and the twin keeps its capabilities."""
        twin = copy.copy(self)
        Strategy.__init__(twin, self.cfg, combiner or self.combiner, update or self.update, self.capabilities)
        twin.weigher = self.weigher
        return twin

    def begin_round(self, round_: int, participants: int) -> None:
        """Learn the round about to be reduced: its number and how many logical clients were sampled for it (of the
        ``num_clients`` that ``bind`` gave). The server calls it before any chunk of the round is folded; how many
        of them sent a usable update reaches ``finish`` as its ``count`` and ``total_weight``. Nothing by default:
        a strategy whose rule scales by the round's participation (SCAFFOLD's P / N) overrides it."""

    def round_metrics(self) -> Mapping[str, float]:
        """What the strategy measured in the round just finished, recorded as ``strategy_metrics`` in
        metrics.jsonl and every tracker (numbers by name); none by default. A rule that measures per chunk
        accumulates in ``finish`` and resets in ``begin_round``. Here the combiner's (Krum's kept and rejected
        counts, the geometric median's iterations)."""
        return self.combiner.round_metrics()

    def round_rejected(self) -> tuple[int, ...] | None:
        """The logical clients whose usable updates the round just reduced left out by the strategy's own choice
        (Krum's rejected: the record's ``rejected``), or None where the strategy never leaves one out."""
        return self.combiner.round_rejected()

    def fold(self, acc: torch.Tensor, x: torch.Tensor, weight: float, index: int) -> None:
        """Take in the ``index``-th included participant's chunk (acc is a stack row per participant when stacked)."""
        self.combiner.fold(acc, x, weight, index)

    def bind(self, spec: ModelSpec, num_clients: int) -> None:
        """Learn the exchanged model's layout and the federation's size before the first round (the server
        calls it once): here, where the model's statistics lie (a strategy with sections of its own, or that
        needs the federation's size, extends it)."""
        self.statistics = statistic_ranges(spec)

    def finish(self, acc: Rows, count: int, total_weight: float, target: torch.Tensor,
               state: dict[str, torch.Tensor], chunk: Chunk | None = None) -> None:
        """Write the new global chunk into ``target`` (which holds the old one where needed).

        ``acc`` is one fp32 accumulator, or, for a stacking combiner whose stack is held in the receive
        slots, its rows: only stacking combiners ever get rows, and they take ``kernels.Rows``. ``chunk``
        says which part of the model this is (a strategy with sections of its own reads it).

        A server optimizer steps the parameters only. The model's statistics (BatchNorm's running mean and
        variance) take the combined value as FedAvg would: they are estimates the clients measured, not
        weights that descend a loss, and a momentum or adaptive step on them overshoots (FedAvgM drove a
        running variance below zero, and every evaluation to NaN, within two rounds on Fashion-MNIST)."""
        stack: torch.Tensor = acc  # type: ignore[assignment]  # rows reach stacking combiners only (see above)
        if not self.needs_previous_global:  # FedAvg: one fp32 division (or copy) into target, one rounding
            self.combiner.combine_into(target, stack, count, total_weight)
            return
        statistics = self.statistic_spans(chunk)
        own = self.round_statistics_total
        means = [stack[lo:hi] / own for lo, hi in statistics] if own is not None else []  # before acc is spent
        combined = checked_combined(self.combiner.combine(stack, count, total_weight), self.combiner, target.numel(),
                                    self.name)
        for (lo, hi), mean in zip(statistics, means):
            combined[lo:hi] = mean
        values = not self.delta or self.statistics_absolute  # the statistics' combination is a value, not a change
        stepped = [] if self.update.combines else statistics  # FedAsync's mixing steps them with the rest
        averaged = [combined[lo:hi].clone() for lo, hi in stepped] if values else []
        if not self.delta:
            combined.sub_(target)  # pseudo-gradient: combined weights - old global
        elif self.statistics_absolute:
            for lo, hi in statistics:
                combined[lo:hi].sub_(target[lo:hi])
        for lo, hi in parameter_spans(stepped, combined.numel()):
            self._step(combined[lo:hi], {k: v[lo:hi] for k, v in state.items()} if stepped else state)
        combined.add_(target)
        for (lo, hi), mean in zip(stepped, averaged):  # values: the mean itself, not (mean - x) + x
            combined[lo:hi] = mean
        target.copy_(combined)

    def _step(self, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """The server update's step on ``delta`` and ``state``, checked to have worked in place (cheaply: the
        objects and their memory, nothing per element), since a new tensor returned or bound in ``state`` would
        be dropped without a word."""
        before = {name: (tensor, tensor.data_ptr()) for name, tensor in state.items()}
        # a plug-in's step may return what its base declares it never does
        returned = self.update.step(delta, state)  # type: ignore[func-returns-value]
        problem = step_problem(delta, returned, before, state)
        if problem is not None:
            raise JobFailure(f"strategy.name {self.name!r}: {type(self.update).__qualname__}.step {problem}, which "
                             "mpifl would drop; write the step into delta and change each state tensor in place "
                             "(delta.mul_(lr), state['m'].mul_(beta).add_(delta)), and return None")

    def statistic_spans(self, chunk: Chunk | None) -> list[tuple[int, int]]:
        """The element ranges of ``chunk`` that hold statistics (none without a chunk, or before ``bind``)."""
        if chunk is None:
            return []
        spans = (section_span(chunk, start, end) for start, end in self.statistics)
        return [(lo, hi) for lo, hi in spans if lo < hi]

    def start_finish(self, acc: Rows, count: int, total_weight: float, target: torch.Tensor,
                     state: dict[str, torch.Tensor]) -> list[Future] | None:
        """Begin ``finish`` on the combiner's worker threads, so the caller can go on receiving; the
        jobs' results say when ``target`` is written. None: this strategy finishes only in the caller."""
        if self.needs_previous_global:
            return None
        return self.combiner.start_combine_into(target, acc, count, total_weight)

    def state_bytes(self, elements: int) -> int:
        """Bytes of server state (fp32 vectors) for a model of ``elements`` exchanged elements."""
        return elements * self.update.state_bytes_per_element

    def accumulator_rows(self, participants: int) -> int:
        """fp32 accumulator rows per chunk for ``participants`` participants (1, or one per participant)."""
        return self.combiner.accumulator_rows(participants)


def step_problem(delta: torch.Tensor, returned: object, before: Mapping[str, tuple[torch.Tensor, int]],
                 state: Mapping[str, torch.Tensor]) -> str | None:
    """What a server update's step did that mpifl cannot see, or None: returned a tensor other than ``delta`` (in
    place it writes into delta), or left in ``state`` another tensor, or other memory, than it was handed
    (``before``: each name's tensor and its address)."""
    if isinstance(returned, torch.Tensor) and not (returned.data_ptr() == delta.data_ptr()
                                                   and returned.shape == delta.shape):
        return "returned a new tensor instead of writing into delta"
    if state.keys() != before.keys():
        return f"changed state's names from {sorted(before)} to {sorted(state)}"
    for name, (tensor, address) in before.items():
        if state[name] is not tensor or tensor.data_ptr() != address:
            return f"bound state[{name!r}] to a new tensor instead of changing it in place"
    return None


def statistic_ranges(spec: ModelSpec) -> tuple[tuple[int, int], ...]:
    """The byte ranges [start, end) of the spec's statistics (``TensorEntry.statistic``), adjacent ones merged."""
    ranges: list[tuple[int, int]] = []
    for e in spec.entries:
        if not e.statistic:
            continue
        if ranges and ranges[-1][1] == e.offset:
            ranges[-1] = (ranges[-1][0], e.offset + e.nbytes)
        else:
            ranges.append((e.offset, e.offset + e.nbytes))
    return tuple(ranges)


def parameter_spans(statistics: Sequence[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The element ranges of a chunk of ``numel`` elements between its ``statistics`` spans (sorted, disjoint)."""
    spans, at = [], 0
    for lo, hi in statistics:
        if at < lo:
            spans.append((at, lo))
        at = hi
    if at < numel:
        spans.append((at, numel))
    return spans


def section_span(chunk: Chunk, start: int, end: int) -> tuple[int, int]:
    """The elements of ``chunk`` that fall in the byte range [start, end) of the flat buffer, as (lo, hi)
    element indices within the chunk (lo == hi: none)."""
    lo = min(max(start, chunk.offset), chunk.offset + chunk.nbytes)
    hi = max(min(end, chunk.offset + chunk.nbytes), lo)
    return (lo - chunk.offset) // chunk.itemsize, (hi - chunk.offset) // chunk.itemsize


def make_strategy(cfg: StrategyConfig) -> Strategy:
    """The strategy named in the config: a registered name, or an import path called as ``fn(cfg, **cfg.kwargs)``.

    ``load_config`` resolves ``auto`` keys from the whole config; one still ``auto`` here (a StrategyConfig built in
    code) is resolved by the strategy alone."""
    cfg = resolve_lone_strategy(cfg)
    if cfg.name in BUILTIN:
        combiner, update = stages(cfg.name)
        cls = resolve(STRATEGY_CLASSES[cfg.name]) if cfg.name in STRATEGY_CLASSES else Strategy
        return cls(cfg, combiner(cfg), update(cfg))
    if not is_import_path(cfg.name):
        raise ConfigError(f"strategy.name: {cfg.name!r} is not allowed; choose one of "
                          f"{', '.join(map(repr, STRATEGIES))} or an import path 'package.module:name' (a class "
                          "or a function)")
    try:
        build = resolve(cfg.name)
    except ImportError as err:
        raise ConfigError(f"strategy.name: {err}") from None
    try:
        inspect.signature(build).bind(cfg, **cfg.kwargs)
    except TypeError as err:
        raise ConfigError(f"strategy.kwargs: {cfg.name!r} is called as fn(cfg, **strategy.kwargs): {err}") from None
    except ValueError:  # no signature to check against
        pass
    try:
        strategy = build(cfg, **cfg.kwargs)
    except ConfigError:
        raise
    except Exception as err:  # whatever a plug-in builder raises, said once, naming the key
        raise ConfigError(f"strategy.name: building {cfg.name!r} failed: {type(err).__name__}: {err}") from err
    if not isinstance(strategy, Strategy):
        raise ConfigError(f"strategy.name: {cfg.name!r} returned {type(strategy).__name__}, not a "
                          "mpifl.aggregation.strategies.Strategy")
    return strategy
