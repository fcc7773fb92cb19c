"""What a round leaves behind: its time split, its derived metrics and the run's closing line."""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpifl.errors import IN_A_NEW_RUN, RESUME_FAILS_THE_SAME_WAY, strikes_again
from mpifl.logs import log, world_rank
from mpifl.metrics import OWN_METRIC_PREFIXES, PERSONAL_DIVERGED
from mpifl.planning.faults import ALTERS_THE_UPDATE, DELAYS_THE_RANK, FAILS_THE_UPDATE, ends_the_job
from mpifl.privacy.ring import advisable_fraction_bits, value_range
from mpifl.units import MIB, range_list

if TYPE_CHECKING:
    from mpifl.config import SecAggConfig
    from mpifl.planning.faults import FaultPlan, Strike
    from mpifl.planning.federation import RoundAssignment
    from mpifl.wire.protocol import UpdateMeta


@dataclass
class RoundTimes:
    """Wall-clock marks of one round (perf_counter seconds)."""

    start: float
    dispatched: float
    first_update: float
    reduced: float
    evaluated: float
    checkpointed: float
    end: float
    aggregate: float  # seconds spent folding/finishing, inside [first_update, reduced]
    training: float = 0.0  # the longest any rank trained this round (its clients one after another)
    last_drop: float | None = None  # when the last rank was dropped past a deadline (None: nobody was)

    def split(self) -> dict[str, float]:
        """Disjoint parts that add up to the round: no part is counted twice. ``client_train`` is the longest any
        rank that delivered trained (at least until the first update landed), not only until the first update: a
        rank's later clients train while its earlier ones' updates stream back, and that is training, not the
        wire. ``dropped_wait`` is the wait beyond that for ranks then dropped past a deadline (still training,
        stalled or silent): neither training that counted nor the wire."""
        waited = self.reduced - self.dispatched - self.aggregate  # for updates: training, then the wire
        train = min(waited, max(self.first_update - self.dispatched, self.training))
        dropped = 0.0 if self.last_drop is None else min(waited - train,
                                                          max(0.0, self.last_drop - self.dispatched - train))
        return {
            "dispatch": self.dispatched - self.start,
            "client_train": train,
            "dropped_wait": dropped,
            "return": waited - train - dropped,
            "aggregate": self.aggregate,
            "eval": self.evaluated - self.reduced,
            "checkpoint": self.checkpointed - self.evaluated,
            "other": self.end - self.checkpointed,
            "round": self.end - self.start,
        }


def dropped_entries(plan: RoundAssignment, metas: dict[int, UpdateMeta],
                    rank_of: Callable[[RoundAssignment, int], int]) -> list[dict]:
    """The round's dropped clients, by id, each with its rank and why: past a deadline or failed (its update's
    error), or left out because its rank was still training a round it had been dropped from."""
    reasons = {c: (rank_of(plan, c), m.error) for c, m in metas.items() if m.error is not None}
    for client, rank in plan.busy_clients.items():
        reasons[client] = (rank, f"rank {world_rank(rank)} was still training round {plan.busy_ranks[rank]}, from "
                                 "which it was "
                                 "dropped past its deadline: left out of this round as if not sampled, not waited for")
    return [{"client": c, "rank": world_rank(rank), "reason": why} for c, (rank, why) in sorted(reasons.items())]


def resume_advice(strikes: Sequence[Strike], metas: dict[int, UpdateMeta]) -> str:
    """What an aborted round's message advises: ``--resume`` once the cause is fixed, unless the config's own
    faults made the updates unusable, which strike the same clients again on a resume."""
    failed: dict[tuple[int, str], list[int]] = {}
    for s in strikes:
        if s.fault.kind in FAILS_THE_UPDATE and s.client in metas and metas[s.client].error is not None:
            failed.setdefault((s.index, s.fault.kind), []).append(s.client)
    if failed:
        named = "; ".join(f"faults[{index}] ({kind!r}) strikes logical client{'s' if len(clients) > 1 else ''} "
                          f"{range_list(sorted(clients))}" for (index, kind), clients in sorted(failed.items()))
        return strikes_again(named)
    altering: dict[tuple[int, str], list[int]] = {}
    for s in strikes:
        if s.fault.kind in ALTERS_THE_UPDATE:
            altering.setdefault((s.index, s.fault.kind), []).append(s.client)
    if altering and all(m.error is not None for m in metas.values()):
        named = "; ".join(f"faults[{index}] ({kind!r}) strikes logical client{'s' if len(clients) > 1 else ''} "
                          f"{range_list(sorted(clients))}" for (index, kind), clients in sorted(altering.items()))
        return (f"{named} this round, and the updates it alters can drive the model to diverge (every update here "
                f"is unusable); it strikes again on a resume, so {RESUME_FAILS_THE_SAME_WAY}: change the faults "
                f"section {IN_A_NEW_RUN}, or set clients.below_quorum='keep' (a resume may) to let such a run go on "
                "to its last round, as a result")
    return "continue with --resume once the cause is fixed"


def stalled_by(strikes: Sequence[Strike], rank: int) -> tuple[str, str]:
    """What a deadline's message adds of the config's stalls on ``rank`` among the round's ``strikes``, and what it
    advises: a stall of some seconds strikes again on a resume; one for ever is recorded as struck, and does not."""
    stalls = [s for s in strikes if s.rank == rank and s.fault.kind == "stall"]
    if not stalls:
        return "", "continue with --resume once the cause is fixed"
    named = {f"faults[{s.index}] ({s.fault.kind!r} at stage {s.fault.stage!r}"
             + (f", {s.fault.seconds:g} s)" if s.fault.seconds > 0 else ", for ever)"): s for s in stalls}
    why = f": {' and '.join(named)} stall{'s' if len(named) == 1 else ''} it this round"
    again = sorted({s.index for s in stalls if s.fault.seconds > 0})
    if not again:
        return why + ", recorded as struck, so a resume goes past it", "continue with --resume"
    which = ", ".join(f"faults[{i}]" for i in again)
    return why, strikes_again(f"{which} stall{'s' if len(again) == 1 else ''} rank {rank}")


def round_strikes(faults: FaultPlan, plan: RoundAssignment, home: Callable[[int], int],
                  spent: bool = False) -> list[Strike]:
    """The faults that strike this round's training clients (config ``faults:``), by client, then list order; and,
    under the virtual clock, the stalls and slowdowns on its stragglers (on their ``home`` rank), which made them
    late: those acted, though the client never trained. ``spent``: instead the strikes that ended an earlier attempt
    of the run in this round, and strike no more: each once, on the client and rank it struck then where its record
    says (a resume on another number of ranks places the clients anew), else on each client it would strike now."""
    if spent:
        then = faults.spent_in(plan.round)
        unrecorded = [s for rank, clients in plan.train.items() for client in clients
                      for s in faults.strikes(plan.round, client, rank, True) if then.get(s.index) is None]
        return sorted(faults.spent_strikes(plan.round) + unrecorded, key=lambda s: (s.client, s.index))
    trained = [s for rank, clients in plan.train.items() for client in clients
               for s in faults.strikes(plan.round, client, rank)]
    late = [s for client in plan.clock.get("stragglers", ())
            for s in faults.strikes(plan.round, client, home(client)) if faults.delays_virtually(s)]
    return sorted(trained + late, key=lambda s: (s.client, s.index))


def strike_lines(strikes: Sequence[Strike], spent: bool = False, recorded: bool = True) -> list[str]:
    """The server's log lines for a round's strikes: one for each, but one for a fault's strikes on one rank where it
    strikes the rank once (a kill, an exit or a stall for ever ends it at the first; at stage 'receive' it acts once
    before the rank takes up the model). ``spent``, ``recorded``: as ``strike_line``'s."""
    groups: dict[tuple[int, int], list[Strike]] = {}
    for strike in strikes:
        once = not spent and (ends_the_job(strike.fault) or strike.fault.stage == "receive")
        groups.setdefault((strike.index, strike.rank) if once else (id(strike), -1), []).append(strike)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(strike_line(group[0], spent, recorded))
            continue
        first, clients = group[0], range_list(sorted(s.client for s in group))
        when = "once, before it takes up the model" if first.fault.stage == "receive" else \
            "once, at the first it trains, which ends the job"
        out.append(f"round {first.round}: faults[{first.index}] ({first.fault.kind!r} at stage {first.fault.stage!r})"
                   f" strikes rank {world_rank(first.rank)} (its logical clients {clients} this round) {when}")
    return out


def strike_line(strike: Strike, spent: bool = False, recorded: bool = True) -> str:
    """The server's log line for one strike, at the start of its round (``spent``: it ended an earlier attempt, on
    the client and rank its record names, or, not ``recorded``, on the one it would strike now)."""
    what = f"round {strike.round}: faults[{strike.index}] ({strike.fault.kind!r} at stage {strike.fault.stage!r})"
    if spent:
        from mpifl.storage.notes import FAULTS_STRUCK  # light: the report imports this module

        where = f"{FAULTS_STRUCK}/{strike.index}-r{strike.round}"
        if recorded:
            return (f"{what} ended an earlier attempt of this run in this round ({where}), striking logical client "
                    f"{strike.client} (rank {world_rank(strike.rank)}) then: it strikes once, so nobody now")
        return (f"{what} ended an earlier attempt of this run in this round ({where}): it strikes once, so not "
                f"logical client {strike.client} (rank {world_rank(strike.rank)}) now")
    return f"{what} strikes logical client {strike.client} (rank {world_rank(strike.rank)})"


def fault_entries(strikes: list[Strike], plan: RoundAssignment, metas: dict[int, UpdateMeta],
                  spent: Sequence[Strike] = (), unapplied: str | None = None,
                  rejected: Collection[int] = ()) -> list[dict]:
    """Each strike of the round with what came of it: ``dropped`` (with the client's error), ``folded`` (its
    update was used: mpifl checks updates for NaN/Inf, not for a scaled or corrupted value), ``unapplied`` (its
    update was usable, but the round was not applied: a virtual clock's round with too few, ``unapplied`` saying
    why), or, asynchronously, ``held`` (trained now, sent in a later step), or, under the virtual clock,
    ``straggler`` (its task arrived
    after the round closed, so the clock left it out: the round's ``stragglers`` lists it). In real time a stall or
    a slowdown delays its whole rank: the rank's other logical clients dropped this round are listed with it
    (``rank_clients_dropped``), since their own drop reason can only say what the server saw, a rank past its
    deadline. Under the virtual clock (``plan.clock`` set) it delays only the struck task's virtual time.
    ``spent``: the strikes that ended an earlier attempt of the run in this round, recorded as such (they strike
    once). ``rejected``: the clients whose usable updates the strategy left out (Krum's), whose strikes are
    ``rejected``, not folded."""
    out = [{**strike.describe(), "outcome": "ended an earlier attempt"} for strike in spent]
    stragglers = set(plan.clock.get("stragglers", ()))
    for strike in strikes:
        meta = metas.get(strike.client)
        if meta is not None:
            outcome = {"outcome": "dropped", "reason": meta.error} if meta.error is not None else \
                {"outcome": "unapplied", "reason": unapplied} if unapplied is not None else \
                {"outcome": "rejected", "reason": "the strategy left its update out"} if strike.client in rejected \
                else {"outcome": "folded"}
        elif strike.client in stragglers:
            outcome = {"outcome": "straggler",
                       "reason": "the virtual clock left it out: its task did not arrive by the round's close"}
        else:
            outcome = {"outcome": "held" if plan.hold else "not received"}
        entry = {**strike.describe(), **outcome}
        if strike.fault.kind in DELAYS_THE_RANK and not plan.clock:
            others = [c for c in sorted(plan.train.get(strike.rank, ()))
                      if c != strike.client and c in metas and metas[c].error is not None]
            if others:
                entry["rank_clients_dropped"] = others
        out.append(entry)
    return out


def fault_line(entry: dict) -> str:
    """One recorded strike (``fault_entries``) as a tracker's note."""
    why = f" ({entry['reason']})" if entry.get("reason") else ""
    others = entry.get("rank_clients_dropped")
    also = (f"; the rank's logical client{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} then "
            "dropped past the deadline" if others else "")
    return (f"faults[{entry['fault']}] {entry['kind']!r} on logical client {entry['client']} (rank {entry['rank']}): "
            f"{entry['outcome']}{why}{also}")


# What a client rank reports of its cost with each update (roles.costs.UpdateCosts), summed per rank.
RANK_COSTS = ("cpu_seconds", "bytes_written", "gpu_seconds", "gpu_energy_joules")


def rank_costs(metas: Iterable[UpdateMeta]) -> dict[str, float]:
    """One rank's cost this round: the sums of what its updates' headers report (``RANK_COSTS``), each only where
    some header reported it."""
    out: dict[str, float] = {}
    for meta in metas:
        for key in RANK_COSTS:
            if f"rank_{key}" in meta.metrics:
                out[key] = out.get(key, 0) + meta.metrics[f"rank_{key}"]
    return out


def round_cost(server: dict[str, float], ranks: dict[str, dict], bytes_moved: int) -> dict[str, float]:
    """What the round cost: CPU-seconds of the server and of the client ranks, bytes written by both (where every
    rank could count them), bytes moved over MPI, and, where client ranks train on GPUs, GPU-seconds and the
    energy NVML counted. A client rank counts from its previous update's header, so its figure holds the previous
    round's last send, and a run's totals leave out only the run's very last send. The server's share ends once the
    round's checkpoint is written (``plus_server``)."""
    clients = list(ranks.values())
    cost = {"cpu_seconds": server["cpu_seconds"] + sum(r.get("cpu_seconds", 0.0) for r in clients),
            "server_cpu_seconds": server["cpu_seconds"],
            "client_cpu_seconds": sum(r.get("cpu_seconds", 0.0) for r in clients),
            "bytes_moved": float(bytes_moved)}
    # a rank whose headers this round carried no reading (it spent nothing since its last one) leaves no gap;
    # a reading without bytes written does: no total that leaves that rank's out
    readings = [r for r in clients if "cpu_seconds" in r]
    if "bytes_written" in server and all("bytes_written" in r for r in readings):
        cost["bytes_written"] = server["bytes_written"] + sum(r["bytes_written"] for r in readings)
    on_gpus = [r for r in clients if "gpu_seconds" in r]
    if on_gpus:
        cost["gpu_seconds"] = sum(r["gpu_seconds"] for r in on_gpus)
        uncounted = sum("gpu_energy_joules" not in r for r in on_gpus)  # no NVML energy counter on that GPU
        if uncounted:  # no total that leaves a GPU's energy out: the count of those left out, said by cost_line
            cost["gpu_energy_uncounted_ranks"] = float(uncounted)
        else:
            cost["gpu_energy_joules"] = sum(r["gpu_energy_joules"] for r in on_gpus)
    return cost


def plus_server(cost: dict[str, float], server: dict[str, float]) -> dict[str, float]:
    """``cost`` (a round's, or the run's to date) with more of the server's spending added: what its checkpoint took,
    read once the checkpoint is written."""
    out = {**cost, "cpu_seconds": cost["cpu_seconds"] + server["cpu_seconds"],
           "server_cpu_seconds": cost["server_cpu_seconds"] + server["cpu_seconds"]}
    if "bytes_written" in cost and "bytes_written" in server:
        out["bytes_written"] = cost["bytes_written"] + server["bytes_written"]
    return out


def plus_late(cost: dict[str, float], late: dict[str, float]) -> dict[str, float]:
    """``cost`` with what dropped ranks spent on the rounds they were dropped from, as reported by the late headers
    that landed this round (``rank_costs`` of them): without it a run's totals would leave that work out, since a
    rank's next header counts only from its last one. ``late_cpu_seconds`` says how much of the CPU it is."""
    out = {**cost, "cpu_seconds": cost["cpu_seconds"] + late.get("cpu_seconds", 0.0),
           "client_cpu_seconds": cost["client_cpu_seconds"] + late.get("cpu_seconds", 0.0),
           "late_cpu_seconds": cost.get("late_cpu_seconds", 0.0) + late.get("cpu_seconds", 0.0)}
    for key in ("bytes_written", "gpu_seconds", "gpu_energy_joules"):
        if key in late and key in cost:
            out[key] = cost[key] + late[key]
    if "gpu_seconds" in late and "gpu_seconds" in cost and "gpu_energy_joules" not in late:  # no energy counter
        out["gpu_energy_uncounted_ranks"] = cost.get("gpu_energy_uncounted_ranks", 0.0) + 1.0
    return out


def cost_to_date(previous: dict[str, float] | None, cost: dict[str, float]) -> dict[str, float]:
    """The run's cost so far: ``previous`` (the last record's, resumes included) plus this round's ``cost``."""
    previous = previous or {}
    return {key: previous.get(key, 0.0) + cost.get(key, 0.0) for key in {**previous, **cost}}


def cost_line(total: dict[str, float]) -> str:
    """The run's cost on one line: CPU-seconds, bytes moved and written, and GPU time and energy where measured."""
    parts = [f"{total.get('cpu_seconds', 0.0):.3g} CPU-s ({total.get('server_cpu_seconds', 0.0):.3g} on the server)",
             f"{total.get('bytes_moved', 0.0) / MIB:.3g} MiB moved"]
    if "bytes_written" in total:
        parts.append(f"{total['bytes_written'] / MIB:.3g} MiB written")
    if "gpu_seconds" in total:
        parts += [f"{total['gpu_seconds']:.3g} GPU-s", energy_said(total)]
    return "cost: " + ", ".join(parts)


def energy_said(total: dict[str, float]) -> str:
    """The GPU energy of a cost with GPU-seconds: the kWh NVML counted, or that some GPU rank had no energy counter
    (``gpu_energy_uncounted_ranks``: its rounds, summed), never a total that leaves a GPU out."""
    uncounted = int(total.get("gpu_energy_uncounted_ranks", 0))
    if uncounted or "gpu_energy_joules" not in total:
        where = f" in {uncounted} rank-round{'s' if uncounted != 1 else ''}" if uncounted else ""
        return f"GPU energy not counted (no NVML energy counter{where}; each rank's log says why)"
    return f"{total['gpu_energy_joules'] / 3.6e6:.3g} kWh of GPU energy"


def secagg_record(metas: dict[int, UpdateMeta], cohort: int, fraction_bits: int,
                  weight_of: Callable[[UpdateMeta], float], withheld: Sequence[int] = ()) -> dict:
    """Secure aggregation's round: clients dropped (their masks removed), the slowest client's masking time, values
    clamped into the ring's range; that range for the ``cohort`` and its heaviest client (``ring.value_range``: a
    lighter client's is wider in proportion), the largest share of its own client's range a value took (above 1:
    clamped), and the most fraction bits that would have held every value; and the clients ``withheld``, too few
    for secagg.min_cohort."""
    usable = [m for m in metas.values() if m.error is None]
    record: dict = {"dropped": len(metas) - len(usable),
                    "mask_seconds": max((m.metrics.get("secagg_seconds", 0.0) for m in usable), default=0.0),
                    "clamped": sum(m.metrics.get("secagg_clamped", 0) for m in usable), "cohort": cohort}
    sent = [(weight_of(m), m.metrics.get("secagg_peak", 0.0)) for m in usable]
    sent = [(weight, peak) for weight, peak in sent if weight > 0]  # a weight of 0 sends zeros: nothing to clamp
    if sent:
        heaviest = max(weight for weight, _ in sent)
        record.update(largest_weight=heaviest, range=value_range(fraction_bits, cohort, heaviest),
                      range_used=max(peak / value_range(fraction_bits, cohort, weight) for weight, peak in sent))
        fits = [advisable_fraction_bits(cohort, weight, peak) for weight, peak in sent if peak > 0]
        if fits:
            record["max_fraction_bits"] = min(fits)
    if withheld:
        record["withheld"] = list(withheld)
    return record


def note_secagg(history: list[dict], cfg: SecAggConfig) -> None:
    """Say on rank 0 what secure aggregation did to the latest round that changes the results: values clamped (the
    first such round, then only one that needs fewer fraction bits than any before, so a long run does not repeat
    it), a cohort withheld (the first time); ``secagg_summary`` gives the run's totals at its end."""
    entry, earlier = history[-1]["secagg"], [r["secagg"] for r in history[:-1] if "secagg" in r]
    round_ = history[-1]["round"]
    if entry["clamped"]:
        needed = [e.get("max_fraction_bits", cfg.fraction_bits) for e in earlier if e.get("clamped")]
        if not needed or entry.get("max_fraction_bits", cfg.fraction_bits) < min(needed):
            log(clamping_line(round_, entry, cfg.fraction_bits), rank=0)
    if entry.get("withheld") and not any(e.get("withheld") for e in earlier):
        drawn = entry["withheld"]
        clients = f"{len(drawn)} client{'s' if len(drawn) != 1 else ''} ({range_list(drawn)})"
        why = f"only {clients} finished in time (clock.mode sync)" if _timed(history[-1]) else \
            f"Poisson sampling drew {clients}"
        how = "" if _timed(history[-1]) else " (as one that draws nobody: DP noise alone moves the model)"
        log(f"round {round_}: {why}, fewer than secagg.min_cohort={cfg.min_cohort}: left out, the round runs without "
            f"updates{how}, so that no sum of so few is revealed; said once, metrics.jsonl's secagg.withheld names "
            "them in every such round", rank=0)


def _timed(record: dict) -> bool:
    """Whether ``record`` is a synchronous round in virtual time, which keeps the clients on time (``stragglers``)."""
    return "stragglers" in record


def clamping_line(round_: int, entry: dict, fraction_bits: int) -> str:
    """The warning for a round whose values secure aggregation clamped (its ``secagg_record`` entry): how many, the
    range and where it comes from, and the fraction bits that would have held them."""
    n, cohort, weight, fit = entry["clamped"], entry["cohort"], entry["largest_weight"], entry["max_fraction_bits"]
    advice = (f"secagg.fraction_bits={fit} would have held every value of this round" if fit >= 1 else
              "no secagg.fraction_bits (1 or more) holds them: send smaller values (strategy.update=delta sends "
              "changes, not weights), weigh clients equally (strategy.weighting=equal) or sample fewer per round")
    return (f"warning: round {round_}: secure aggregation clamped {n:,} value{'s' if n != 1 else ''} into the ring's "
            f"range, so the model is not the plain sum's: secagg.fraction_bits={fraction_bits} holds "
            f"±{entry['range']:.4g} = (2^31 - 1) / ({cohort} x {weight:g} x 2^{fraction_bits}) for the heaviest "
            f"client of this cohort of {cohort}, of weight {weight:g} (a lighter client's range is wider in "
            f"proportion), and a value reached {entry['range_used']:.3g} times its client's range; {advice}. Said "
            "again only for a round that needs fewer bits; metrics.jsonl's secagg.clamped counts every round's")


def secagg_summary(history: Sequence[dict], cfg: SecAggConfig) -> list[str]:
    """The run's closing word on secure aggregation, when it clamped values or withheld a cohort in some round."""
    entries = [(r["round"], r["secagg"]) for r in history if "secagg" in r]
    clamped = [(round_, e) for round_, e in entries if e.get("clamped")]
    lines = []
    if clamped:
        most_round, most = max(clamped, key=lambda item: item[1]["clamped"])
        fit = min(e.get("max_fraction_bits", cfg.fraction_bits) for _, e in clamped)
        advice = (f"secagg.fraction_bits={fit} would have held every round's values" if fit >= 1 else
                  "no secagg.fraction_bits holds them")
        lines.append(f"warning: secure aggregation clamped values in {len(clamped)} of {len(history)} rounds, "
                     f"{sum(e['clamped'] for _, e in clamped):,} in all (most: {most['clamped']:,} in round "
                     f"{most_round}); {advice} (docs/how-to/secure-aggregation.md)")
    withheld = [round_ for round_, e in entries if e.get("withheld")]
    if withheld:
        how = "kept fewer than {} clients in time" if _timed(history[-1]) else "drew fewer than {} clients"
        lines.append(f"secagg.min_cohort: {len(withheld)} of {len(history)} rounds (round {range_list(withheld)}) "
                     f"{how.format(cfg.min_cohort)} and ran without updates")
    return lines


def federated_evaluation(metas: Iterable[UpdateMeta]) -> dict | None:
    """The round's clients' scores of their own validation splits (``UpdateMeta.evaluation``, mpifl's alone: never a
    trainer's metrics): each score's mean weighted by validation samples, and for each accuracy (the received
    model's, Ditto's ``personal_accuracy``) how it spreads across the clients (``client_spread``); None when no
    client was evaluated. Summed in ascending client id, so the record is the same bits on any number of ranks.

    Ditto's ``personal_*`` scores are over the clients whose personal model stayed finite (``personal_clients`` of
    them): a client whose personal training diverged has no personal model to score (``PERSONAL_DIVERGED``)."""
    scored = sorted((m for m in metas if "samples" in m.evaluation), key=lambda m: m.client)
    if not scored:
        return None
    reports = [m.evaluation for m in scored]
    n = sum(r["samples"] for r in reports)
    keys = [k for k in dict.fromkeys(k for r in reports for k in r) if k != "samples"]
    out = {k: sum(r[k] * r["samples"] for r in reports if k in r) / sum(r["samples"] for r in reports if k in r)
           for k in keys}
    if any(k.startswith("personal_") for k in keys) or any(m.metrics.get(PERSONAL_DIVERGED) for m in scored):
        out["personal_clients"] = sum(any(k.startswith("personal_") for k in r) for r in reports)
    if "perplexity" in out:  # of the pooled loss, not a mean of perplexities
        out["perplexity"] = math.exp(min(out["loss"], 50.0))
    spreads: dict = {}
    for key in (k for k in keys if k.endswith("accuracy")):
        per_client = {m.client: float(m.evaluation[key]) for m in scored if key in m.evaluation}
        spreads.update({f"{key}_{stat}": value for stat, value in client_spread(per_client).items()})
    return {**out, "clients": len(reports), "samples": n, **spreads}


def personal_diverged(metas: Iterable[UpdateMeta]) -> list[int]:
    """Ditto: the round's clients whose personal training went non-finite (their v_i not kept), by id."""
    return sorted(m.client for m in metas if m.metrics.get(PERSONAL_DIVERGED))


def divergence_line(round_: int, clients: Sequence[int]) -> str:
    """The warning for a round whose clients' personal models diverged (``personal_diverged``)."""
    return (f"round {round_}: Ditto: the personal training of logical client{'s' if len(clients) != 1 else ''} "
            f"{range_list(clients)} went non-finite (NaN/Inf); their personal models were not kept (each starts "
            "again from its last kept one, or from the global model) and are left out of the federated personal "
            "scores. Lower train.lr or train.ditto_lambda: the regulariser's step is stable only while "
            "lr * ditto_lambda < 2 (2 * (1 + momentum) with momentum)")


WORST_SHARE = 10  # the worst tenth of the clients: Ditto's fairness measure (Li et al. 2021, "worst 10%")


def client_spread(per_client: dict[int, float]) -> dict:
    """How one score spreads across the clients that reported it, each client counting once: the unweighted mean,
    the standard deviation across clients (population, ddof=0: these clients are the whole set described), the mean
    of the worst tenth (the lowest ceil(n/10) values, at least one client) and every client's own value, by id."""
    ids = sorted(per_client)
    values = [per_client[c] for c in ids]
    mean = sum(values) / len(values)
    worst = sorted(values)[:max(1, -(-len(values) // WORST_SHARE))]
    return {"unweighted": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)),
            "worst10": sum(worst) / len(worst), "per_client": {str(c): per_client[c] for c in ids}}


# What an update's header's metrics carry that a round's record reports under its own keys: the training loss
# (train_loss), the ranks' peaks and costs (client_peak_*, ranks, cost), a client group's costs (client_group) and
# secure aggregation's (secagg). Everything else a client reports is a client metric, a trainer's val_* included:
# mpifl's own evaluation travels apart (UpdateMeta.evaluation, federated_eval).
REPORTED_ELSEWHERE = ("loss",)


def client_metrics(metas: Sequence[UpdateMeta]) -> dict | None:
    """What the round's usable participants reported beyond the keys reported elsewhere (a plug-in trainer's
    ``TrainResult.metrics``, DP's ``update_norm``, top-k's ``compress_seconds``): for each numeric value, its mean
    weighted by the clients' samples and its least and greatest, by name; None when nothing was reported.

    Summed in ascending client id, never in arrival order, so two runs that train the same clients record the same
    bits on any number of ranks. A true/false value counts as 1/0, so its mean is the share of clients it held for."""
    ordered = sorted(metas, key=lambda m: m.client)
    names = sorted({k for m in ordered for k, v in m.metrics.items() if _numeric(v) and _client_metric(k)})
    out = {}
    for name in names:
        values = [(float(m.metrics[name]), m.num_samples) for m in ordered if _numeric(m.metrics.get(name))]
        samples = sum(n for _, n in values)
        mean = sum(v * n for v, n in values) / samples if samples else sum(v for v, _ in values) / len(values)
        out[name] = {"mean": mean, "min": min(v for v, _ in values), "max": max(v for v, _ in values),
                     "clients": len(values)}
    return out or None


def _numeric(value: object) -> bool:
    return isinstance(value, (bool, int, float)) and math.isfinite(float(value))


def _client_metric(name: str) -> bool:
    return name not in REPORTED_ELSEWHERE and not name.startswith(OWN_METRIC_PREFIXES)


GROUP_COSTS = ("group_setup_seconds", "group_dispatch_seconds", "group_train_seconds")


def group_split(metas: Iterable[UpdateMeta]) -> dict | None:
    """clients.ranks_per_client: the round's client time, summed over its participants and split as the group
    spent it: setup (building the process group and DDP: round 1 only), dispatch (the order and the weights to
    the group), train, and the rest (evaluation, encoding the update); None without groups."""
    reports = [m for m in metas if GROUP_COSTS[0] in m.metrics]
    if not reports:
        return None
    split = {key.split("_")[1]: sum(m.metrics[key] for m in reports) for key in GROUP_COSTS}
    split["other"] = max(0.0, sum(m.train_seconds for m in reports) - sum(split.values()))
    return split


SPREAD_NOT_LOGGED = ("_unweighted", "_std", "_per_client")  # the log line keeps the weighted means and worst 10%


def summary(record: dict) -> str:
    """The round's losses and evaluation scores, on one line."""
    parts = []
    if record.get("train_loss") is not None:
        parts.append(f"train_loss {record['train_loss']:.4f}")
    parts += [f"{k} {v:.4f}" for k, v in record.get("eval", {}).items()]
    if "federated_eval" in record:
        parts += [f"federated_{k} {v:.4f}" for k, v in record["federated_eval"].items()
                  if k not in ("clients", "samples", "personal_clients") and not k.endswith(SPREAD_NOT_LOGGED)]
    return ", ".join(parts)


def log_final(history: list[dict], rounds: int, where: str, epsilon_budget: float | None = None) -> None:
    """One closing line: how far the run got, and its last evaluation; ``epsilon_budget``: the privacy budget that
    is spent, which ended the run complete before round ``rounds``."""
    last = next((r for r in reversed(history) if "eval" in r), None)
    reached = history[-1]["round"] if history else 0
    spent = epsilon_budget is not None and reached < rounds and bool(history)
    if reached == rounds or spent:
        detail = f"final round {last['round']}: " + summary(last) if last else "no evaluation"
        if "cost_to_date" in history[-1]:
            log(cost_line(history[-1]["cost_to_date"]), rank=0)
        ended = f"finished {len(history)} rounds"
        if spent:
            epsilon = history[-1].get("privacy", {}).get("epsilon")
            after = f"epsilon {epsilon:.3f} after round {reached}" if epsilon is not None else f"round {reached}"
            ended = (f"finished after round {reached} of {rounds}: the privacy budget is spent "
                     f"(privacy.epsilon_budget {epsilon_budget:g}: {after}; round {reached + 1} would pass it)")
        log(f"{ended}; {detail}; outputs in {where}", rank=0)
        return
    detail = f"last evaluation after round {last['round']}: " + summary(last) if last else "no evaluation"
    log(f"stopped after round {reached} of {rounds} (continue with --resume); {detail}; outputs in {where}", rank=0)


# What each memory field can show: (rank kind, record key, how the warning names it, what the plot's note says grew).
MEMORY_SIGNALS = (("server", "server_rss_bytes", "the server's RSS", "server memory"),
                  ("client", "client_peak_rss_bytes", "the largest client rank's peak RSS", "client memory"),
                  ("client", "client_peak_device_bytes", "the largest client rank's peak GPU memory",
                   "client GPU memory"))


def memory_growth(history: Sequence[dict], window: int = 5, min_rises: int = 4, min_fraction: float = 0.10,
                  min_bytes: int = 64 * MIB) -> list[dict]:
    """Ranks whose memory creeps up round over round: a warning while the run still lives, not an OOM kill.

    A rank warns when its reading rose in at least ``min_rises`` of the last ``window`` rounds and by more
    than ``min_fraction`` and ``min_bytes`` over them (so from round ``window + 1`` on). The server's
    ``server_rss_bytes`` is its RSS now: it falls when memory is freed, so a steady rise is memory kept.
    The clients report only a peak (``client_peak_rss_bytes``, the largest among the round's participants):
    a peak never falls, so it cannot show memory being freed, and growth stays hidden under an earlier
    spike until it passes it; a peak that sets a new high in most rounds still means a client rank holds
    more each round, so it is the secondary signal. Records without a reading (or 0: nobody trained)
    in the window are not judged.
    """
    recent = list(history[-window - 1:])
    if window < 1 or len(recent) <= window:
        return []
    found = []
    for kind, key, _, _ in MEMORY_SIGNALS:
        values = [r.get(key) or 0 for r in recent]
        if not all(values):
            continue
        rises = sum(later > earlier for earlier, later in zip(values, values[1:]))
        growth = values[-1] - values[0]
        if rises >= min_rises and growth > min_bytes and growth > min_fraction * values[0]:
            found.append({"rank": kind, "signal": key, "from_round": recent[0]["round"],
                          "to_round": recent[-1]["round"], "rises": rises, "growth_bytes": growth,
                          "growth_fraction": growth / values[0], "per_round_bytes": growth // window})
    return found


def memory_warning_line(warning: dict) -> str:
    """One warning from ``memory_growth`` as the log line a user reads before the OOM kill."""
    what = next(name for _, key, name, _ in MEMORY_SIGNALS if key == warning["signal"])
    return (f"warning: {warning['rank']} memory grows round over round: {what} rose in {warning['rises']} of "
            f"rounds {warning['from_round'] + 1}-{warning['to_round']}, by {warning['growth_bytes'] / MIB:.0f} MiB "
            f"({warning['growth_fraction']:.0%}), about {warning['per_round_bytes'] / MIB:.1f} MiB per round; "
            f"if it keeps on, the run ends out of memory")


def note_memory_growth(history: list[dict]) -> None:
    """Put any memory creep on the latest record, and log it once per signal rather than every round."""
    found = memory_growth(history)
    if not found:
        return
    history[-1]["memory_warning"] = found
    warned = {w["signal"] for record in history[:-1] for w in record.get("memory_warning", ())}
    for warning in found:
        if warning["signal"] not in warned:
            log(memory_warning_line(warning), rank=0)
