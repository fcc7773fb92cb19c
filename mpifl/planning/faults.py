"""Which injected faults (the config's ``faults:``) strike which logical client, rank and stage in a round.

A pure function of the config, the round, the client and the rank that trains it, computed alike by the client
rank that injects a fault and by the server that records it: nothing about faults travels. A ``fraction`` is drawn
for each client on its own from the run's seed, the round, the client and the fault's place in the list, so the
same clients are hit on any number of ranks and in every run.

Under a virtual clock (``clock.mode`` other than ``off``) a ``stall`` or a ``slowdown`` acts on time, and time there
is the cost model's, so the clock adds the delay to the struck task's virtual duration (``virtual_delay``) and no
rank sleeps: a delay the machine sleeps would only meet wall-clock deadlines, which a virtual-time run must never
depend on. ``delay_seconds`` is the one rule for both clocks.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mpifl.config import Config
from mpifl.config.sections import FaultConfig
from mpifl.logs import world_rank
from mpifl.planning.seeds import BITS, FAULTS, NOISE, derive_seed
from mpifl.units import range_list


@dataclass(frozen=True)
class Strike:
    """One fault striking one logical client (or, at stage 'receive', the rank that trains it) in one round."""

    index: int  # the fault's place in the config's list: faults[index]
    fault: FaultConfig
    round: int
    client: int
    rank: int

    def describe(self) -> dict:
        """The record's entry (metrics.jsonl: a round's ``faults``), before the outcome is known."""
        entry: dict = {"fault": self.index, "kind": self.fault.kind, "stage": self.fault.stage,
                       "client": self.client, "rank": world_rank(self.rank)}
        entry.update({name: getattr(self.fault, name) for name in PARAMETERS.get(self.fault.kind, ())})
        return entry


PARAMETERS = {"stall": ("seconds",), "slowdown": ("factor",), "scale": ("factor",), "corrupt": ("bits",),
              "noise": ("std",), "exit": ("code", "via")}


# kinds that delay the struck rank itself, so also the logical clients it trains after the struck one this round;
# under a virtual clock they delay the struck task's virtual duration instead, and only that (``delays_virtually``)
DELAYS_THE_RANK = frozenset({"stall", "slowdown"})
FAILS_THE_UPDATE = frozenset({"raise", "nan", "inf", "lose"})  # kinds whose strike makes the client's update unusable
# kinds that change an update after its client's NaN/Inf check: a NaN/Inf they make shows first in the global model
CHANGES_PAST_THE_CHECK = frozenset({"corrupt"})
# kinds that change a usable update's values (an attack): they can drive the global model to diverge, after which
# every client's update is NaN/Inf, in later rounds than the strikes themselves
ALTERS_THE_UPDATE = frozenset({"scale", "corrupt", "noise", "label_flip"})
ENDS_THE_JOB = frozenset({"kill", "exit"})  # kinds whose every strike ends the job (ends_the_job adds a stall for ever)


def fault_summary(fault: FaultConfig) -> str:
    """One fault in a few words, for ``mpifl validate``: its kind with the parameters it reads, whom and when it
    strikes, and its stage where that is not the default ('scale (factor -5) on clients 0-1, rounds 1-end')."""
    parameters = ", ".join(f"{name} {getattr(fault, name):g}" if isinstance(getattr(fault, name), float)
                           else f"{name} {getattr(fault, name)}" for name in PARAMETERS.get(fault.kind, ()))
    what = fault.kind + (f" ({parameters})" if parameters else "")
    if fault.clients:
        whom = f"client{'s' if len(fault.clients) > 1 else ''} {range_list(sorted(fault.clients))}"
    elif fault.ranks:
        whom = f"rank{'s' if len(fault.ranks) > 1 else ''} {range_list(sorted(fault.ranks))}"
    else:
        whom = f"{fault.fraction:.0%} of trained clients"
    if fault.rounds:
        when = f"round{'s' if len(fault.rounds) > 1 else ''} {range_list(sorted(fault.rounds))}"
    else:
        when = f"rounds {fault.from_round}-{fault.to_round or 'end'}"
    return f"{what} on {whom}, {when}" + ("" if fault.stage == "train" else f", at stage {fault.stage}")


def ends_the_job(fault: FaultConfig) -> bool:
    """Whether a strike of ``fault`` ends the job whatever the config allows: a kill, an exit, or a stall for ever
    (``seconds: 0``: past its deadline the job ends, and under accept_failures the rank never comes back). Each is
    recorded before it acts, so a resume goes past it (``FaultPlan``'s ``spent``)."""
    return fault.kind in ENDS_THE_JOB or (fault.kind == "stall" and fault.seconds == 0)


class FaultPlan:
    """The run's faults, asked round by round. ``spent``: (fault index, round) of each strike that ended an earlier
    attempt of this run (the run directory's ``faults-struck``: a kill, an exit, or a corruption that made the
    global model non-finite): a resume that redid the round would be ended again, for ever, so each strikes once,
    as a node fails once."""

    def __init__(self, cfg: Config, spent: Mapping[tuple[int, int], tuple[int, int] | None] | None = None):
        """``spent``: each with the (logical client, rank) it struck then, None where its record does not say."""
        self.faults, self.seed, self.rounds = cfg.faults, cfg.seed, cfg.rounds
        self.spent = dict(spent or {})
        self.virtual = cfg.clock.mode != "off"  # stalls and slowdowns then delay the virtual clock, not the rank

    def __bool__(self) -> bool:
        return bool(self.faults)

    def strikes(self, round_: int, client: int, rank: int, spent: bool = False) -> list[Strike]:
        """The faults that strike ``client``, trained on ``rank`` in ``round_``, in the list's order (``spent``:
        instead those that would, but ended an earlier attempt of the run)."""
        return [Strike(i, fault, round_, client, rank) for i, fault in enumerate(self.faults)
                if fault.strikes_in(round_, self.rounds) and self._targets(i, fault, round_, client, rank)
                and ((i, round_) in self.spent) == spent]

    def spent_in(self, round_: int) -> dict[int, tuple[int, int] | None]:
        """The faults whose strike in ``round_`` ended an earlier attempt of the run, by index, each with the
        (logical client, rank) it struck then (None: its record does not say)."""
        return {i: where for (i, r), where in sorted(self.spent.items()) if r == round_ and i < len(self.faults)}

    def spent_strikes(self, round_: int) -> list[Strike]:
        """The strikes in ``round_`` that ended an earlier attempt of the run, on the logical client and rank they
        struck then, where their records say (``spent_in``)."""
        return [Strike(i, self.faults[i], round_, *where) for i, where in self.spent_in(round_).items()
                if where is not None]

    def delays_virtually(self, strike: Strike) -> bool:
        """Whether ``strike`` acts on the virtual clock alone: a stall or a slowdown under ``clock.mode`` other than
        off, which lengthens the struck task's virtual duration and leaves the rank running at full speed."""
        return self.virtual and strike.fault.kind in DELAYS_THE_RANK

    def virtual_delay(self, round_: int, client: int, rank: int, compute_seconds: float) -> float:
        """The virtual seconds the stalls and slowdowns on ``client`` in ``round_`` add to its task, whose training
        takes ``compute_seconds`` on its device (math.inf: a stall for ever, so the task never arrives)."""
        return sum((delay_seconds(s, compute_seconds) for s in self.strikes(round_, client, rank)
                    if s.fault.kind in DELAYS_THE_RANK), 0.0)

    def _targets(self, index: int, fault: FaultConfig, round_: int, client: int, rank: int) -> bool:
        if fault.clients:
            return client in fault.clients
        if fault.ranks:
            return rank in fault.ranks
        return fault.fraction is not None and drawn(self.seed, index, round_, client) < fault.fraction

    def bad_ranks(self, client_ranks: int) -> str | None:
        """A fault that names a rank the job does not have as a client rank, said with its key; else None."""
        for i, fault in enumerate(self.faults):
            missing = [r for r in fault.ranks if r > client_ranks]
            if missing:
                return (f"faults[{i}].ranks: {missing} {'is' if len(missing) == 1 else 'are'} not client ranks of this "
                        f"job (ranks 1..{client_ranks})")
        return None


def delay_seconds(strike: Strike, trained_seconds: float) -> float:
    """The seconds a stall or a slowdown adds to a task whose training takes ``trained_seconds``: a slowdown makes
    the training ``factor`` times as long, so adds ``(factor - 1)`` times it; a stall waits its ``seconds``, and
    ``seconds: 0`` for ever (math.inf). A client rank sleeps it in real time; a virtual clock adds it to the task."""
    fault = strike.fault
    if fault.kind == "slowdown":
        return trained_seconds * (fault.factor - 1)
    if fault.kind == "stall":
        return fault.seconds if fault.seconds > 0 else math.inf
    return 0.0


def drawn(seed: int, index: int, round_: int, client: int) -> float:
    """The uniform draw in [0, 1) that decides whether fault ``index``'s fraction hits ``client`` in ``round_``."""
    return float(np.random.default_rng(derive_seed(seed, FAULTS, index, round_, client)).random())


def flipped_bits(seed: int, strike: Strike, total_bits: int) -> np.ndarray:
    """Which of an update's ``total_bits`` bits a corruption flips: ``strike.fault.bits`` distinct positions, drawn
    from the seed, the fault, the round and the client."""
    rng = np.random.default_rng(derive_seed(seed, FAULTS, BITS, strike.index, strike.round, strike.client))
    return np.sort(rng.choice(total_bits, size=min(strike.fault.bits, total_bits), replace=False))


def noise_seed(seed: int, strike: Strike, entry: int) -> int:
    """The seed of a ``noise`` strike's Gaussian values for the ``entry``-th exchanged tensor: from the run's seed, the
    fault, the round, the client and the tensor, so the same values on any rank count and chunk size."""
    return derive_seed(seed, FAULTS, NOISE, strike.index, strike.round, strike.client, entry)


def flipped_labels(labels: np.ndarray, classes: int) -> np.ndarray:
    """All-to-all label flipping (Fang et al. 2020, "Local Model Poisoning Attacks to Byzantine-Robust Federated
    Learning", USENIX Security): class y becomes C - 1 - y."""
    return classes - 1 - labels
