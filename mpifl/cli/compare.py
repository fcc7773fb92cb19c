"""``mpifl compare RUN_DIR ...``: runs side by side, and the runs that differ only in their seed as one row of
mean ± std, as a paper reports them; optionally one figure of every group's curve with its spread shaded.

Which way is better depends on the metric: a loss, a perplexity, an error, seconds and bytes are better lower;
accuracy is better higher. The direction is read from the metric's name (``better_direction``), and
``--better`` overrides it. Runs are grouped by their recorded config (``config.yaml``) with ``seed``, ``name`` and
``output`` left out, so a sweep's ``--grid seed=0,1,2`` falls into one group per other setting.
"""
from __future__ import annotations

import bisect
import json
import math
import re
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpifl.cli.report import load_metrics, metric_keys, metric_of, pyplot, saved_config
from mpifl.config.automatic import AUTOMATIC_KEYS
from mpifl.config.schema import dotted_values
from mpifl.config.sections import Config

if TYPE_CHECKING:  # the 'plot' extra: matplotlib is imported only when plotting
    from matplotlib.axes import Axes
    from matplotlib.lines import Line2D

# a privacy loss (epsilon), the exchange's ratio to its raw-MPI floor, values clamped and updates dropped count too
LOWER_WORDS = frozenset({"loss", "perplexity", "error", "seconds", "time", "bytes", "staleness", "std", "epsilon",
                         "floor", "clamped", "dropped"})
NOT_THE_SETTING = frozenset({"seed", "name", "output"})  # what a group's runs may differ in
DEFAULT_NAME = Config().name  # a run left with the default name has no name of its group's own
LIST_ENTRY = re.compile(r"^[a-z_]+\.\d+\.")  # a key of one entry of a list of sections: faults.0.kind
STRATEGY_KEY = "strategy.name"  # what a reader names a method by: the last key a group's label gives up


def better_direction(metric: str, asked: str = "auto") -> str:
    """'lower' or 'higher': ``asked`` unless 'auto', else 'lower' when any word of the dotted key is a loss, a
    perplexity, an error, a time, a size or a spread (``eval.loss``, ``train_loss``, ``time.round``, ``bytes_sent``,
    ``federated_eval.accuracy_std``)."""
    if asked != "auto":
        return asked
    words = metric.replace(".", "_").split("_")
    return "lower" if LOWER_WORDS.intersection(words) else "higher"


@dataclass(frozen=True)
class RunOutcome:
    """One run's metric: its best and final values, and when it first reached the target."""

    run_dir: Path
    config: dict
    curve: dict[int, float]  # round -> value, for the rounds that recorded the metric
    best: float
    final: float
    reached_round: int | None
    reached_virtual_seconds: float | None
    last_round: int = 0  # the last round the run recorded (a stopped or failed run's is short of config rounds)
    non_finite: int = 0  # rounds that recorded the metric as null: NaN or Inf (metrics.jsonl writes them so)
    virtual_at: dict[int, float] = field(default_factory=dict)  # round -> virtual_time, where the record has it

    @property
    def incomplete(self) -> bool:
        """Whether the run recorded fewer rounds than its config asks (stopped, failed, or still going)."""
        rounds = self.config.get("rounds")
        return isinstance(rounds, int) and self.last_round < rounds

    @property
    def has_virtual_time(self) -> bool:
        """Whether every round that recorded the metric has the virtual clock's time (``virtual_time``)."""
        return bool(self.curve) and all(r in self.virtual_at for r in self.curve)


def is_number(value: Any) -> bool:
    """Whether ``value`` is a number as a record holds it (an int or float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def value_of(record: dict, metric: str) -> float | None:
    """A round's value of ``metric``: the number, or the mean of a list of numbers (an asynchronous step's
    ``staleness``, one per arrival); None where absent, null or an empty list."""
    value = metric_of(record, metric)
    if isinstance(value, list):
        return statistics.fmean(value) if value and all(map(is_number, value)) else None
    return value


def list_keys(records: list[dict]) -> set[str]:
    """The dotted keys whose value is a non-empty list of numbers in some round (``staleness``, one per arrival),
    but for lists of client ids (``CLIENT_IDS``), whose mean measures nothing."""
    lists = metric_keys(records, lambda value: isinstance(value, list) and bool(value) and all(map(is_number, value)))
    return {key for key in lists if not names_clients(key)}


CLIENT_IDS = frozenset({"participants", "personal_diverged", "withheld"})  # a record's lists of client ids


def names_clients(metric: str) -> bool:
    """Whether the dotted key is a list of client ids (``participants``, ``secagg.withheld``), not a measure."""
    return metric.rsplit(".", 1)[-1] in CLIENT_IDS


def outcome(run_dir: Path, records: list[dict], metric: str, target: float | None, lower: bool) -> RunOutcome:
    """``records``' metric as one run's outcome (better = ``lower`` or higher)."""
    curve = {r["round"]: float(v) for r in records if (v := value_of(r, metric)) is not None}
    values = list(curve.values())
    pick = min if lower else max
    reached = None if target is None else next(
        (r for r in records if (v := value_of(r, metric)) is not None and (v <= target if lower else v >= target)),
        None)
    return RunOutcome(run_dir, saved_config(run_dir), curve, pick(values) if values else math.nan,
                      values[-1] if values else math.nan, reached["round"] if reached else None,
                      reached.get("virtual_time") if reached else None, records[-1]["round"] if records else 0,
                      sum(recorded_null(r, metric) for r in records),
                      {r["round"]: float(r["virtual_time"]) for r in records if is_number(r.get("virtual_time"))})


def recorded_null(record: dict, dotted: str) -> bool:
    """Whether a round's record has the dotted key as null: a value that was NaN or Inf when written."""
    *sections, leaf = dotted.split(".")
    section: Any = record
    for part in sections:
        section = section.get(part) if isinstance(section, dict) else None
    return isinstance(section, dict) and leaf in section and section[leaf] is None


def strategy_label(config: dict) -> str:
    """The strategy as it trained: its name, and FedProx's term, the personalisation or plug-in trainer beside it
    (``fedavg + prox(μ=0.01)``, ``fedavg + local [fc3.*]``, ``fedavg + ditto(λ=0.1)``), then DP, secure
    aggregation and compression (``fedavg + ditto(λ=0.1) + DP(central, z=1)``, ``fedavg + topk(0.1, error
    feedback)``)."""
    label = [str((config.get("strategy") or {}).get("name", "?"))]
    local = (config.get("model") or {}).get("local")
    if local:
        label.append(f"local [{', '.join(map(str, local))}]")
    train = config.get("train") or {}
    if train.get("prox_mu"):  # FedProx is FedAvg's aggregation with the proximal term on the clients
        label.append(f"prox(μ={float(train['prox_mu']):g})")
    if train.get("ditto_lambda"):
        label.append(f"ditto(λ={float(train['ditto_lambda']):g})")
    if ":" in str(train.get("trainer", "")):  # a plug-in trainer may personalise too (APFL)
        label.append(f"trainer {train['trainer']}")
    return " + ".join(label + protection_labels(config))


def protection_labels(config: dict) -> list[str]:
    """What changes the updates on their way beside the strategy, as a table row must say it (two runs that differ
    only in it would otherwise read alike): DP with its noise multiplier, secure aggregation, compression."""
    out = []
    privacy = config.get("privacy") or {}
    if privacy.get("mode", "off") != "off":
        out.append(f"DP({privacy['mode']}, z={float(privacy.get('noise_multiplier', 1.0)):g})")
    if (config.get("secagg") or {}).get("enabled"):
        out.append("secagg")
    compression = config.get("compression") or {}
    method = compression.get("method", "none")
    if method == "topk":
        feedback = ", error feedback" if compression.get("error_feedback", True) else ""
        out.append(f"topk({float(compression.get('fraction', 0.01)):g}{feedback})")
    elif method != "none":
        out.append(str(method))
    return out


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run directory's shortest path suffix that tells it from the others, as many parts for all
    (``sw_fedper/seed=0`` beside ``sw_ditto/seed=0``, where the last part alone is the same); with the parent folder
    whenever the runs are not all in one, so that a sweep's ``seed=1`` still says which sweep it is from."""
    parts = [Path(d).resolve().parts for d in run_dirs]
    start = 1 if len({p[:-1] for p in parts}) <= 1 else 2
    for k in range(start, max((len(p) for p in parts), default=1) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(Path(d)) for d in run_dirs]


def setting(o: RunOutcome) -> dict[str, Any]:
    """What a run's group is made of: its config as dotted keys, but the seed, name and output."""
    return {k: v for k, v in dotted_values(o.config).items() if k.split(".")[0] not in NOT_THE_SETTING}


def differing_keys(settings: Sequence[dict[str, Any]]) -> list[str]:
    """The dotted keys whose values are not the same in every one of ``settings``, sorted."""
    return sorted({k for s in settings for k in s if any(t.get(k) != s.get(k) for t in settings)})


def seed_groups(outcomes: Sequence[RunOutcome]) -> list[tuple[str, list[RunOutcome]]]:
    """The runs grouped by everything in their config but the seed (and name, output), in first-seen order, each
    labelled by the settings that tell the groups apart ('all runs' for a single group)."""
    keyed: dict[str, list[RunOutcome]] = {}
    for o in outcomes:
        keyed.setdefault(json.dumps(setting(o), sort_keys=True, default=str), []).append(o)
    settings = [setting(members[0]) for members in keyed.values()]
    named = names_of(list(keyed.values())) or variant_labels(list(keyed.values()))
    if named is not None:
        return list(zip(named, keyed.values()))
    differing = differing_keys(settings)
    keys = telling_keys(settings, differing)
    # a key a group leaves unset (another strategy's kwarg) says nothing of it: named only where set; a list of
    # sections the group leaves out altogether (faults: [], the clean baseline) is named as empty
    labels = [",".join([f"{k}={s[k]}" for k in keys if s.get(k) is not None] + left_out_sections(s, keys))
              or "defaults" for s in settings]
    if len(set(labels)) < len(labels):  # unset keys were what told two groups apart
        labels = [",".join(f"{k}={s.get(k)}" for k in keys) for s in settings]
    if len(settings) == 1:
        labels = [one_groups_name(next(iter(keyed.values())))]
    return list(zip(labels, keyed.values()))


def one_groups_name(members: Sequence[RunOutcome]) -> str:
    """The label of the only group: its runs' own name where they share one (``name=Ditto``), else 'all runs'."""
    names = {o.config.get("name") for o in members}
    name = next(iter(names))
    return name if len(names) == 1 and isinstance(name, str) and name and name != DEFAULT_NAME else "all runs"


def names_of(groups: Sequence[Sequence[RunOutcome]]) -> list[str] | None:
    """The groups' own names, where the runs were given them (``name=...`` when they were started): each group's runs
    share one, and no two groups do; None otherwise (the default name, a sweep's, or one name per seed)."""
    names = [{str(o.config.get("name")) for o in members} for members in groups]
    if len(groups) < 2 or any(len(n) != 1 for n in names):
        return None
    labels = [next(iter(n)) for n in names]
    return labels if len(set(labels)) == len(labels) and DEFAULT_NAME not in labels else None


def variant_labels(groups: Sequence[Sequence[RunOutcome]]) -> list[str] | None:
    """The groups' labels from their sweep's run directories (``attack=sign_flip,seed=0``) where the sweep had a
    variants axis (``--grid attack=@attacks.yaml``): a variant's name is in no config, only in the directory's name,
    and it names the settings the variant sets together better than any one of them. The label is the directory's
    ``KEY=VALUE`` parts but the seed; each group's runs must share it and no two groups may. None where no run
    directory names a variant."""
    labels, variants = [], False
    for members in groups:
        found = set()
        for o in members:
            pairs = [part.partition("=") for part in o.run_dir.name.split(",")]
            if any(not sep or not key or not value for key, sep, value in pairs):
                return None
            keys = dotted_values(o.config)
            variants |= any(key not in keys and key not in NOT_THE_SETTING for key, _, _ in pairs)
            found.add(",".join(f"{key}={value}" for key, _, value in pairs if key != "seed"))
        if len(found) != 1:
            return None
        labels.append(next(iter(found)))
    if not variants or len(groups) < 2 or len(set(labels)) < len(labels):
        return None
    parts = [label.split(",") for label in labels]  # an axis every group shares tells none apart: left out
    shared = set.intersection(*(set(p) for p in parts))
    labels = [",".join(part for part in p if part not in shared) for p in parts]
    return labels if "" not in labels and len(set(labels)) == len(labels) else None


def left_out_sections(setting: dict[str, Any], keys: Sequence[str]) -> list[str]:
    """``faults=[]`` for each list of sections (a key ``faults.0.kind``) among ``keys`` that ``setting`` holds no entry
    of: the run left the list empty, which is what tells it from the others."""
    sections = dict.fromkeys(k.split(".")[0] for k in keys if LIST_ENTRY.match(k))
    return [f"{section}=[]" for section in sections if not any(k.startswith(f"{section}.") for k in setting)]


def telling_keys(settings: Sequence[dict[str, Any]], differing: Sequence[str]) -> list[str]:
    """The fewest of ``differing`` that still tell every group from every other, in ``differing``'s order. Why: a
    recorded config holds every key the run filled in itself (a built-in strategy's ``strategy.update`` and
    ``strategy.weighting``, which a plug-in's leaves unset), so the groups differ in more keys than were chosen, and
    a label of all of them fills a legend. The keys mpifl fills in from the others (``AUTOMATIC_KEYS``: FedBuff's
    ``clock.mode`` makes ``strategy.update`` delta) go first, then keys some group leaves unset, then those with
    fewer distinct values, then a fault's ``kind``, and ``strategy.name`` last (what a reader names a method by); a
    key stays whenever dropping it would give two groups one label."""
    def told_apart(keys: Sequence[str]) -> bool:
        return len({tuple(str(s.get(k)) for k in keys) for s in settings}) == len(settings)

    kept = list(differing)
    for key in sorted(differing, key=lambda k: (k not in AUTOMATIC_KEYS, k == STRATEGY_KEY, is_entry_kind(k),
                                                all(s.get(k) is not None for s in settings),
                                                len({str(s.get(k)) for s in settings}))):
        fewer = [k for k in kept if k != key]
        if fewer and told_apart(fewer):
            kept = fewer
    return kept


def is_entry_kind(key: str) -> bool:
    """Whether ``key`` is the kind of one entry of a list of sections (``faults.0.kind``): what a reader names an
    attack by, so it is the last such key a label gives up."""
    return bool(LIST_ENTRY.match(key)) and key.endswith(".kind")


def unlabelled_differences(groups: Sequence[tuple[str, list[RunOutcome]]]) -> list[str]:
    """The settings the groups differ in beyond those their labels name (``telling_keys`` keeps the fewest that
    tell them apart), but the ones mpifl fills in from others (``AUTOMATIC_KEYS``): a difference a reader would
    otherwise not see (one set of runs under a virtual clock, another model)."""
    settings = [setting(members[0]) for _, members in groups]
    differing = differing_keys(settings)
    named = set(telling_keys(settings, differing))
    return [k for k in differing if k not in named and k not in AUTOMATIC_KEYS and not only_left_out(k, settings)]


def only_left_out(key: str, settings: Sequence[dict[str, Any]]) -> bool:
    """Whether ``key``, a field of one entry of a list of sections (``faults.0.bits``), differs only because some
    groups leave the list empty (``faults=[]``, which their labels say): every group that has the entry agrees."""
    matched = LIST_ENTRY.match(key)
    if matched is None:
        return False
    entry = key[:matched.end()]
    values = {str(s.get(key)) for s in settings if any(k.startswith(entry) for k in s)}
    return len(values) == 1


def seeds_cell(members: Sequence[RunOutcome]) -> str:
    """A group's seeds, each run that recorded fewer rounds than its config asks marked with how far it got."""
    return ",".join(f"{o.config.get('seed', '?')}" + (f" ({o.last_round} of {o.config.get('rounds')})"
                                                       if o.incomplete else "") for o in members)


def repeated_seed(members: Sequence[RunOutcome]) -> tuple[RunOutcome, RunOutcome] | None:
    """The first two runs of a seed group (``seed_groups``) with the same seed, or None."""
    seen: dict[Any, RunOutcome] = {}
    for o in members:
        seed = o.config.get("seed")
        if seed in seen:
            return seen[seed], o
        seen[seed] = o
    return None


def mean_std(values: Sequence[float], digits: int = 4) -> str:
    """'mean ± std' (the sample standard deviation), or the value alone for one run, as ``number`` writes them."""
    if not values:
        return "-"
    if len(values) == 1:
        return number(values[0], digits)
    mean = statistics.fmean(values)
    return f"{number(mean, digits)} ± {number(statistics.stdev(values), digits, like=mean)}"


def number(value: float, digits: int = 4, like: float | None = None) -> str:
    """A table's figure: ``digits`` decimals for a value under 1,000 (an accuracy, a loss, seconds), whole with
    thousands separated for a larger one (bytes, samples), where decimals would only be noise; ``like``: the
    value whose form it takes (a std beside its mean)."""
    if abs(value if like is None else like) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


# What a table cell's characters become in LaTeX: its special characters escaped, the symbols mpifl prints (±, the
# μ and λ of FedProx and Ditto, >= and <=) in math mode, so that pdflatex compiles the table without a package
LATEX = {"\\": "\\textbackslash{}", "{": "\\{", "}": "\\}", "&": "\\&", "%": "\\%", "$": "\\$", "#": "\\#",
         "_": "\\_", "~": "\\textasciitilde{}", "^": "\\textasciicircum{}", "±": "$\\pm$", "μ": "$\\mu$",
         "λ": "$\\lambda$", ">=": "$\\geq$", "<=": "$\\leq$"}
LATEX_SPECIAL = re.compile("|".join(re.escape(k) for k in sorted(LATEX, key=len, reverse=True)))


def latex_cell(text: str) -> str:
    """``text`` as a LaTeX table cell (``LATEX``), each character replaced once."""
    return LATEX_SPECIAL.sub(lambda m: LATEX[m.group(0)], text)


def render(header: Sequence[str], rows: Sequence[Sequence[str]], fmt: str) -> str:
    """A table as Markdown or as a LaTeX tabular."""
    if fmt == "latex":
        lines = ["\\begin{tabular}{" + "l" * len(header) + "}", "\\hline",
                 " & ".join(map(latex_cell, header)) + " \\\\", "\\hline"]
        lines += [" & ".join(map(latex_cell, row)) + " \\\\" for row in rows]
        return "\n".join([*lines, "\\hline", "\\end{tabular}"])
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(row) + " |" for row in rows)])


def compare_runs(run_dirs: Sequence[str], metric: str = "eval.accuracy", target: float | None = None,
                 better: str = "auto", fmt: str = "markdown", x: str = "round",
                 complete_only: bool = False) -> tuple[str, list[tuple[str, list[RunOutcome]]]]:
    """The per-run table and, where some runs differ only in their seed, the table of mean ± std per group; and
    the groups (for a figure against ``x``: 'round', or 'virtual', which every run drawn must have).
    ``complete_only``: a run that recorded fewer rounds than its config asks stays in the per-run table but out of
    the groups, so that no group pools a stopped seed's earlier round with the others' last."""
    _refuse_repeated_paths(run_dirs)
    runs = [(Path(d), run_records(Path(d))) for d in run_dirs]
    listed_in = set().union(*(list_keys(records) for _, records in runs))
    _refuse_unrecorded_metric(metric, runs, listed_in)
    direction = better_direction(metric, better)
    lower = direction == "lower"
    outcomes = [outcome(d, records, metric, target, lower) for d, records in runs]
    reach = f"rounds to {metric} {'<=' if lower else '>='} {target:g}" if target is not None else None
    names = dict(zip((o.run_dir for o in outcomes), run_labels([o.run_dir for o in outcomes])))
    text = _runs_table(outcomes, names, reach, direction, fmt)
    if metric in listed_in:
        text += (f"\n\n{metric}: the mean of each record's list (a round's value; the records list every arrival's, "
                 "a dropped update's too)")
    short = [f"{names[o.run_dir]} ({o.last_round} of {o.config.get('rounds')})" for o in outcomes
             if o.curve and o.incomplete]
    if short:
        text += (f"\n\n{', '.join(short)}: fewer rounds recorded than the config asks (stopped, failed or still "
                 "running: `mpifl status` says which); 'final' is the last round recorded")
    text += empty_notes(outcomes, names, metric)
    set_aside = [o for o in outcomes if o.curve and o.incomplete] if complete_only else []
    if set_aside:
        text += (f"\n\n{', '.join(names[o.run_dir] for o in set_aside)}: left out of the groups below and of the "
                 "figure (--complete-only)")
    groups = seed_groups([o for o in outcomes if o.curve and o not in set_aside])
    _refuse_ungroupable(groups, names, x)
    if any(len(members) > 1 for _, members in groups):
        text += "\n\n" + _seeds_table(groups, reach, direction, fmt)
        text += group_notes(groups)  # of that table: with one run a group, there is none to annotate
    return (latex_notes(text) if fmt == "latex" else text), groups


def run_records(run_dir: Path) -> list[dict]:
    """A run's per-round records; none for a run directory without ``metrics.jsonl`` (a run that failed or was
    stopped before its first round, a sweep's grid point refused at start-up), which the table then shows as a
    run no round recorded, while the other runs are compared. What is not a run directory ends the command."""
    if (run_dir / "config.yaml").is_file() and not (run_dir / "metrics.jsonl").exists():
        return []
    return load_metrics(run_dir, "compare")


def _refuse_repeated_paths(run_dirs: Sequence[str]) -> None:
    """A run directory named twice (as itself or by another path) ends the command: its seed would count twice."""
    given: dict[Path, str] = {}  # each run directory as the command line first named it
    for d in run_dirs:
        key = Path(d).resolve()
        if key in given:
            first = given[key]
            raise SystemExit(f"mpifl compare: {d} is given twice{f' (as {first})' if first != d else ''}: its seed "
                             "would count twice in the mean ± std")
        given[key] = d


def _refuse_unrecorded_metric(metric: str, runs: Sequence[tuple[Path, list[dict]]], listed_in: set[str]) -> None:
    """A metric no round of these runs recorded (not even as null) ends the command, with the closest key and
    the keys they have."""
    known = set().union(*(metric_keys(records) for _, records in runs))
    if metric in known | listed_in or any(recorded_null(r, metric) for _, records in runs for r in records):
        return
    if names_clients(metric):
        raise SystemExit(f"mpifl compare: --metric {metric!r} lists client ids, which measure nothing to compare; "
                         "num_samples counts the samples the round's clients trained on")
    inside = sorted(k for k in known | listed_in if k.startswith(metric + "."))
    if inside:
        raise SystemExit(f"mpifl compare: --metric {metric!r} is a section of the records: name one of its keys "
                         f"({first_few(inside)})")
    import difflib

    close = difflib.get_close_matches(metric, sorted(known | listed_in), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listed = sorted(k for k in known if not k.startswith("ranks.") and "_per_client." not in k)
    raise SystemExit(f"mpifl compare: --metric {metric!r} is in no round of these runs{hint} (they have: "
                     f"{', '.join(listed)})")


def _runs_table(outcomes: Sequence[RunOutcome], names: dict[Path, str], reach: str | None, direction: str,
                fmt: str) -> str:
    """One row a run: its strategy and clock, the rounds (and virtual seconds, where some run has them) to the
    target, its best and its final value."""
    clocked = any(o.has_virtual_time for o in outcomes)  # the virtual seconds column only where some run has them
    reaching = ([reach, "virtual s to it"] if clocked else [reach]) if reach else []
    header = ["run", "strategy", "clock", *reaching, f"best ({direction})", "final"]
    rows = []
    for o in outcomes:
        to_target = [str(o.reached_round) if o.reached_round else "not reached",
                     f"{o.reached_virtual_seconds:.1f}" if o.reached_virtual_seconds is not None else "-"][
            :len(reaching)]
        values = [number(o.best), number(o.final)] if o.curve else \
            ["non-finite in every round" if o.non_finite else "no round recorded it", "-"]
        rows.append([names[o.run_dir], strategy_label(o.config),
                     str(o.config.get("clock", {}).get("mode", "off")), *(to_target if reach else []), *values])
    return render(header, rows, fmt)


def _refuse_ungroupable(groups: Sequence[tuple[str, list[RunOutcome]]], names: dict[Path, str], x: str) -> None:
    """Two runs of one config and one seed (a repeat, not another seed), or a run without virtual time drawn
    against it, end the command."""
    for _, members in groups:
        repeat = repeated_seed(members)
        if repeat:
            raise SystemExit(f"mpifl compare: {repeat[0].run_dir} and {repeat[1].run_dir} have the same config and "
                             f"seed {repeat[0].config.get('seed')}: a repeat of one run, not another seed, so the "
                             "mean ± std would count it twice; give one of them (mpifl diff checks that two "
                             "such runs hold the same bits)")
    lacking = [names[o.run_dir] for _, members in groups for o in members if not o.has_virtual_time]
    if x == "virtual" and lacking:
        raise SystemExit(f"mpifl compare: --x virtual draws against the virtual clock's time, which "
                         f"{', '.join(lacking)} did not record (virtual_time in metrics.jsonl: runs with clock.mode); "
                         "leave them out or draw against --x round")


def _seeds_table(groups: Sequence[tuple[str, list[RunOutcome]]], reach: str | None, direction: str,
                 fmt: str) -> str:
    """One row a group of runs that differ only in their seed: the mean ± std of their best and final values and
    of the rounds (and, where every run of some group ran under the virtual clock, virtual seconds) to the
    target."""
    virtual = reach is not None and any(all(o.virtual_at for o in members) for _, members in groups)
    rows = []
    for label, members in groups:
        reached = [float(o.reached_round) for o in members if o.reached_round]
        rows.append([label, str(len(members)), seeds_cell(members), mean_std([o.best for o in members]),
                     mean_std([o.final for o in members]),
                     *([f"{mean_std(reached, 1)} ({len(reached)}/{len(members)} reached)"] if reach else []),
                     *([virtual_to_target(members)] if virtual else [])])
    header = ["runs (seeds pooled)", "n", "seeds", f"best ({direction}), mean ± std", "final, mean ± std",
              *([f"{reach}, mean ± std"] if reach else []), *(["virtual s to target, mean ± std"] if virtual else [])]
    return render(header, rows, fmt)


def latex_notes(text: str) -> str:
    """``text`` with each paragraph that is not a table made a LaTeX comment, so that the output is input as it is
    (a note's underscores and backticks would stop pdflatex)."""
    return "\n\n".join(part if part.startswith("\\begin{tabular}") else
                        "\n".join(f"% {line}" for line in part.splitlines()) for part in text.split("\n\n"))


def virtual_to_target(members: Sequence[RunOutcome]) -> str:
    """A group's virtual seconds to the target as mean ± std over the runs that reached it, or '-' where some run
    has no virtual time (then it is not a group's figure) or none reached it."""
    if not all(o.virtual_at for o in members):
        return "-"
    return mean_std([o.reached_virtual_seconds for o in members if o.reached_virtual_seconds is not None], 1)


def empty_notes(outcomes: Sequence[RunOutcome], names: dict[Path, str], metric: str) -> str:
    """The notes on runs without a value of ``metric``: none recorded (a run that failed before its first round,
    or one that never records it), or only non-finite ones (a diverged model's loss)."""
    text = ""
    missing = [names[o.run_dir] for o in outcomes if not o.curve and not o.non_finite]
    if missing:
        text += (f"\n\n{', '.join(missing)}: no round recorded {metric} (a run that never records it, or one that "
                 "stopped before its first round: `mpifl status` says how far a run got); left out of the groups below "
                 "and of the figure")
    diverged = [names[o.run_dir] for o in outcomes if not o.curve and o.non_finite]
    if diverged:
        text += (f"\n\n{', '.join(diverged)}: {metric} was non-finite (NaN or Inf, null in metrics.jsonl) in every "
                 "round that recorded it (a diverged model: lower the learning rate); left out of the groups below "
                 "and of the figure")
    return text


def group_notes(groups: Sequence[tuple[str, list[RunOutcome]]]) -> str:
    """What the groups' table and labels do not show: a pooled run that stopped short, and the settings the groups
    differ in beyond their labels ("" where there is neither)."""
    notes = []
    if any(len(members) > 1 and o.incomplete for _, members in groups for o in members):
        notes.append("A seed marked (R of N) recorded R of its config's N rounds: its 'final' is round R's, pooled "
                     "with the others' last rounds, and the figure draws its group only to the last round every run "
                     "of the group recorded")
    hidden = unlabelled_differences(groups) if len(groups) > 1 else []
    members_of = [members for _, members in groups]
    if names_of(members_of) is None and variant_labels(members_of) is not None:  # labels naming no setting
        settings = [setting(members[0]) for _, members in groups]
        set_apart = [k for k in differing_keys(settings) if not only_left_out(k, settings)]
        chosen = [k for k in set_apart if k not in AUTOMATIC_KEYS]
        filled = [k for k in set_apart if k in AUTOMATIC_KEYS]
        also = f"; and in {', '.join(filled)}, which mpifl fills in from other keys unless set" if chosen and filled \
            else ""
        notes.append(f"Each group is labelled by its sweep's variants (its run directories' names); the groups differ "
                     f"in {first_few(chosen or filled)}{also} (each run's config.yaml has them all)")
    elif hidden:
        notes.append(f"The groups also differ in {first_few(hidden)}: each label names only the fewest settings that "
                     "tell the groups apart (each run's config.yaml has them all)")
    return "".join(f"\n\n{note}" for note in notes)


def first_few(keys: Sequence[str], shown: int = 8) -> str:
    """``keys`` for a note: the first ``shown`` and how many more (all of them where only one more would be left)."""
    if len(keys) <= shown + 1:
        return ", ".join(keys)
    return ", ".join(keys[:shown]) + f" and {len(keys) - shown} more"


# What a figure calls the metrics a run records most often (its axis keeps the key, the name of --metric)
METRIC_NAMES = {"eval.accuracy": "held-out accuracy", "eval.loss": "held-out loss",
                "eval.perplexity": "held-out perplexity", "train_loss": "training loss (participants' mean)",
                "federated_eval.accuracy": "clients' validation accuracy",
                "federated_eval.loss": "clients' validation loss",
                "federated_eval.personal_accuracy": "clients' validation accuracy, personal models",
                "virtual_time": "virtual time (s)"}


def metric_name(metric: str) -> str:
    """``metric`` as a figure's axis names it: what it measures and the key (``held-out accuracy
    (eval.accuracy)``), or the key alone where mpifl has no name for it."""
    return f"{METRIC_NAMES[metric]} ({metric})" if metric in METRIC_NAMES else metric


LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "x", "P", "*")


def group_style(index: int) -> tuple[str, str]:
    """The ``index``-th group's line style and marker: no two of the first 8 groups share both."""
    return LINE_STYLES[index % len(LINE_STYLES)], MARKERS[index % len(MARKERS)]


def plot_groups(groups: Sequence[tuple[str, list[RunOutcome]]], metric: str, path: str | Path,
                subject: str = "", x: str = "round") -> Path:
    """One figure of ``draw_groups`` against ``x`` ('round', or 'virtual': the virtual clock's seconds);
    ``subject`` leads the title (what was run; default: the metric)."""
    plt = pyplot("compare")
    fig, ax = plt.subplots(figsize=(7, 4))
    draw_groups(ax, groups, fraction_range(groups, metric), x)
    if x == "virtual":
        ax.set_xlabel("virtual time (s); a value holds until the next")
    else:
        ax.set_xlabel("round")
        ax.xaxis.get_major_locator().set_params(integer=True)
        drawn = sorted({r for _, members in groups if members for r in group_curve(members, x)[0]})
        if len(drawn) == 1:  # one round (eval.every = rounds): its own tick, not a span of fractional rounds
            ax.set_xlim(drawn[0] - 1, drawn[0] + 1)
            ax.set_xticks(drawn)
    ax.set_ylabel(textwrap.fill(metric_name(metric), 40))  # a long name on two lines, not past the axes
    pooled = any(len(members) > 1 for _, members in groups)
    ax.set_title(f"{subject or METRIC_NAMES.get(metric, metric)}: "
                 f"{'mean ± std over seeds' if pooled else 'one run each'}")
    # below the axes, one group a line: long labels (several differing keys) widen the figure, not squeeze the plot
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1, frameon=False)
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def fraction_range(groups: Sequence[tuple[str, list[RunOutcome]]], metric: str) -> tuple[float, float] | None:
    """(0, 1) where ``metric`` is a fraction: every value drawn lies in [0, 1] and it is no loss (an accuracy, an
    error rate, a spread of accuracies), so its ± std band may not pass either end; else None."""
    words = set(metric.replace(".", "_").replace(" ", "_").split("_"))
    values = [v for _, members in groups for o in members for v in o.curve.values()]
    if not values or words & {"loss", "perplexity"} or not all(0.0 <= v <= 1.0 for v in values):
        return None
    return 0.0, 1.0


def held_at(o: RunOutcome, times: Sequence[float]) -> list[float]:
    """``o``'s value at each virtual time: the value of the last round that recorded it by then (the model the
    server held; what it was last measured at)."""
    rounds = sorted(o.curve)
    at = [o.virtual_at[r] for r in rounds]
    return [o.curve[rounds[max(bisect.bisect_right(at, t) - 1, 0)]] for t in times]


def group_curve(members: Sequence[RunOutcome], x: str) -> tuple[list[float], list[list[float]]]:
    """A group's common x and each member's values on it: against rounds, the rounds every run recorded; against
    virtual seconds, every time some run recorded a value, within the span all of them cover (``held_at``)."""
    if x != "virtual":
        rounds = sorted(set.intersection(*(set(o.curve) for o in members)))
        return [float(r) for r in rounds], [[o.curve[r] for r in rounds] for o in members]
    spans = [[o.virtual_at[r] for r in sorted(o.curve)] for o in members]
    start, end = max(s[0] for s in spans), min(s[-1] for s in spans)
    times = sorted({t for s in spans for t in s if start <= t <= end})
    return times, [held_at(o, times) for o in members]


def draw_groups(ax: Axes, groups: Sequence[tuple[str, list[RunOutcome]]], clip: tuple[float, float] | None = None,
                x: str = "round") -> list[Line2D]:
    """Each group's mean curve over the rounds every one of its runs recorded, with ± one standard deviation shaded (a
    single run: its curve alone; a single round: an error bar), the band cut to ``clip`` (a fraction's [0, 1]). Each
    group has its own line style and marker, so groups with the same curve (FedAvg and Ditto's global model) stay
    visible one over the other, and a marker at every point, so a round without the metric shows as a gap between
    markers rather than as a point on the line. Against virtual seconds (``x='virtual'``) a curve is a step: a value
    holds until the next one (``group_curve``). A group's colour and style follow its place in ``groups``, so an
    empty group keeps its place: figures that leave out different groups (an algorithm not run on one setting) draw
    the others alike."""
    lines = []
    steps = x == "virtual"
    for index, (label, members) in enumerate(groups):
        at, values = group_curve(members, x) if members else ([], [])
        if not at:
            continue
        means = [statistics.fmean(column) for column in zip(*values)]
        style, marker = group_style(index)
        line, = ax.plot(at, means, label=f"{label} (n={len(members)})", color=f"C{index % 10}", linestyle=style,
                        marker=marker,
                        markersize=max(3.0, 8.0 - index), markerfacecolor="none" if index % 2 else None,
                        drawstyle="steps-post" if steps else "default")
        lines.append(line)
        if len(members) > 1:
            spread = [statistics.stdev(column) for column in zip(*values)]
            low, high = [m - s for m, s in zip(means, spread)], [m + s for m, s in zip(means, spread)]
            if clip:
                low, high = [max(v, clip[0]) for v in low], [min(v, clip[1]) for v in high]
            if len(at) == 1:  # a band needs two points: one round's spread is an error bar
                ax.errorbar(at, means, yerr=[[means[0] - low[0]], [high[0] - means[0]]], color=line.get_color(),
                            capsize=5, linestyle="none")
            else:
                ax.fill_between(at, low, high, color=line.get_color(), alpha=0.2, linewidth=0,
                                step="post" if steps else None)
    return lines
