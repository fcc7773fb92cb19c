"""``mpifl report RUN_DIR``: PNG plots from a run's metrics.jsonl (needs the 'plot' extra)."""
from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from mpifl.metrics import read_records
from mpifl.planning.faults import ALTERS_THE_UPDATE
from mpifl.roles.records import MEMORY_SIGNALS, cost_line
from mpifl.units import MIB

if TYPE_CHECKING:  # the 'plot' extra: matplotlib is imported only when plotting
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 110  # the report's PNGs: what a plot that draws one mark per client measures its pixel columns at
SPLIT = ("dispatch", "client_train", "dropped_wait", "return", "aggregate", "eval", "checkpoint", "other")


def pyplot(command: str = "report") -> ModuleType:
    """The pyplot module of matplotlib on the Agg backend (files, no display), or a clear exit naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"mpifl {command} needs matplotlib to draw: pip install 'mpifl[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_path(path: str, command: str) -> Path:
    """Where ``--plot`` writes its figure, checked before any work: its folder must exist, and matplotlib must be
    installed (a figure that cannot be written would otherwise end the command after the table, with a
    traceback)."""
    target = Path(path)
    if not target.parent.is_dir():
        what = "is a file, not a folder" if target.parent.exists() else "does not exist"
        raise SystemExit(f"mpifl {command}: --plot {path}: folder {str(target.parent)!r} {what}")
    if target.is_dir():
        raise SystemExit(f"mpifl {command}: --plot {path} is a folder: give the figure's file name (say "
                         f"{target / 'figure.png'})")
    pyplot(command)
    from matplotlib.backend_bases import FigureCanvasBase  # the writers matplotlib registers, read without a figure

    formats = FigureCanvasBase.get_supported_filetypes()
    kind = target.suffix.lstrip(".").lower()
    if kind not in formats:
        raise SystemExit(f"mpifl {command}: --plot {path}: matplotlib writes no {kind or 'suffix-less'} figure; end "
                         f"the name in one of {', '.join('.' + k for k in sorted(formats))}")
    return target


def report_folder(out: Path) -> Path:
    """``mpifl report --out``: the folder its plots go to, made if missing; a path that is a file, or a folder that
    cannot be made, ends the command naming it (before any plot is drawn)."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"mpifl report: --out {out} is a file, not a folder for the plots")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SystemExit(f"mpifl report: --out {out}: cannot make the folder ({err.strerror})") from None
    return out


def load_metrics(run_dir: Path, command: str = "report") -> list[dict]:
    """The run's per-round records (``command``: the mpifl command that says so when there are none). A torn last
    line (a job killed while it appended) is left out, saying so; any other line that is not JSON ends the command
    naming the file and the line, since the records around it can no longer be trusted to be the run's."""
    path = run_dir / "metrics.jsonl"
    if run_dir.is_file():
        raise SystemExit(f"mpifl {command}: {run_dir} is a file: give the run directory that holds the run's "
                         f"records ({run_dir.parent})")
    if not path.is_file():
        raise SystemExit(f"mpifl {command}: {path} does not exist (is {run_dir} a run directory?)")
    read = read_records(path)
    if read.bad_line is not None and not read.bad_line_is_last:
        raise SystemExit(f"mpifl {command}: {path}: line {read.bad_line} is not JSON ({read.complaint})")
    if read.bad_line is not None:
        print(f"mpifl {command}: {path}: line {read.bad_line} is torn (a job killed while writing it?); reading the "
              "rounds before it", file=sys.stderr)
    return read.records


def metric_of(record: dict, dotted: str) -> float | None:
    """A dotted key (``eval.accuracy``) of a round's record, or None where absent."""
    value: Any = record  # a nested section, then the leaf value
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def metric_keys(records: list[dict], holds: Callable[[Any], bool] | None = None) -> set[str]:
    """The dotted keys of every number in the records (``eval.accuracy``, ``time.dispatch``): what --metric takes;
    ``holds``: instead the keys whose value it accepts (a list of numbers: ``staleness``)."""
    keys: set[str] = set()
    accepts = holds or (lambda value: isinstance(value, (int, float)) and not isinstance(value, bool))

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for inner, item in value.items():
                walk(item, f"{key}.{inner}" if key else str(inner))
        elif accepts(value):
            keys.add(key)

    for record in records:
        walk(record, "")
    return keys


def saved_config(run_dir: Path) -> dict:
    """The config the run recorded (``config.yaml``, resolved), or {} where it has none."""
    config = run_dir / "config.yaml"
    return (yaml.safe_load(config.read_text()) or {}) if config.is_file() else {}


def write_report(run_dir: str | Path, out: str | Path | None = None, records: list[dict] | None = None
                 ) -> list[Path]:
    """Write quality, time-split, bytes and memory plots; return their paths (``records``: the run's, where the
    caller has read them already)."""
    run_dir = Path(run_dir)
    records = load_metrics(run_dir) if records is None else records
    if not records:
        raise SystemExit(f"mpifl report: {run_dir / 'metrics.jsonl'} holds no round yet, so there is nothing to "
                         f"plot; `mpifl status {run_dir}` says how far the run got")
    out = report_folder(Path(out) if out else run_dir / "report")
    plt = pyplot()
    written = []
    local = kept_local_tensors(run_dir)
    plots = [("quality.png", lambda fig, ax, records: _quality(fig, ax, records, local)),
             ("time_split.png", _time_split), ("bytes.png", _bytes), ("memory.png", _memory)]
    if any("virtual_time" in r for r in records):
        clients = (saved_config(run_dir).get("clients") or {}).get("num_clients")
        plots += [("virtual_time.png", _virtual_time),
                  ("participation.png", lambda fig, ax, records: _participation(fig, ax, records, clients))]
    if any(r.get("staleness") for r in records):
        plots.append(("staleness.png", _staleness))
    if any("cost" in r for r in records):
        plots.append(("cost.png", _cost))
    if privacy_series(records)[0]:
        budget = (saved_config(run_dir).get("privacy") or {}).get("epsilon_budget")
        plots.append(("privacy.png", lambda fig, ax, records: _privacy(fig, ax, records, budget)))
    if any(r.get("faults") or r.get("dropped") for r in records):
        plots.append(("faults.png", _faults))
    clock = saved_config(run_dir).get("clock") or {}
    if clock.get("availability", "always") != "always" and any("virtual_time" in r for r in records):
        plots.append(("availability.png", lambda fig, ax, records: _availability(fig, ax, records, run_dir)))
    for name, draw in plots:
        fig, ax = plt.subplots(figsize=(7, 4))
        try:
            draw(fig, ax, records)
        except FileNotFoundError as err:  # availability's trace, named in config.yaml as the run was launched
            if name != "availability.png":
                raise
            plt.close(fig)
            print(f"mpifl report: skipped {name}: {err.strerror}: {err.filename!r}, which the run's config.yaml "
                  "names relative to the folder it was launched from: run mpifl report there", file=sys.stderr)
            continue
        if not fig.legends:
            fig.tight_layout()
        fig.savefig(out / name, dpi=DPI, bbox_inches="tight")  # a legend placed below the axes is kept
        plt.close(fig)
        written.append(out / name)
    return written


# The accuracies a run's records may hold: (record key, metric, label, colour, marker). The clients' own
# validation splits (eval.federated_every) are what personalisation is judged by: the global model there, and
# Ditto's personal models beside it. Each label says what was measured and when, since at one round they are not
# alike: the server scores the model the round made, each client the model it received before training on it, and
# Ditto's personal model after this round's training on it.
ACCURACIES = (("eval", "accuracy", "held-out: global model, after the round", "tab:green", "s"),
              ("federated_eval", "accuracy", "clients' validation: global model, before local training",
               "tab:purple", "^"),
              ("federated_eval", "personal_accuracy",
               "clients' validation: personal models, after this round's training", "tab:red", "v"))


# With model.local (FedBN, FedPer) no model is "the global one": the server evaluates the averaged tensors with the
# local ones as built, each client the averaged ones with its own (docs: how-to/personalization.md)
WITH_LOCAL = {"held-out: global model, after the round": "held-out: averaged + built local tensors, after the round",
              "clients' validation: global model, before local training":
                  "clients' validation: averaged + own local tensors, before local training"}


def accuracy_series(records: list[dict], local: bool = False) -> list[tuple[str, list[int], list[float], str, str]]:
    """Each accuracy some round recorded: (label, rounds, values, colour, marker), in ACCURACIES' order; ``local``:
    the run kept tensors per client (model.local), and the labels say which local tensors each model had."""
    out = []
    for key, metric, label, colour, marker in ACCURACIES:
        points = [(r["round"], r[key][metric]) for r in records if isinstance(r.get(key), dict) and metric in r[key]]
        if points:
            out.append((WITH_LOCAL.get(label, label) if local else label, [p[0] for p in points],
                        [p[1] for p in points], colour, marker))
    return out


# The clients' validation losses (eval.federated_every): the global model's and Ditto's personal models', as
# ACCURACIES names them
# (drawn dotted in its accuracy's colour: one colour, one model and split)
FEDERATED_LOSSES = (("loss", "clients' validation loss: global model", "tab:purple"),
                    ("personal_loss", "clients' validation loss: personal models (gaps: not finite)", "tab:red"))


def loss_series(records: list[dict]) -> list[tuple[str, list[int], list[float | None], str]]:
    """Each clients' validation loss some round recorded: (label, rounds, values, colour); a round whose loss was not
    finite (a diverged personal model: NaN, written null) is a gap."""
    out = []
    for metric, label, colour in FEDERATED_LOSSES:
        points = [(r["round"], r["federated_eval"][metric]) for r in records
                  if isinstance(r.get("federated_eval"), dict) and metric in r["federated_eval"]]
        if points:
            values = [v if isinstance(v, (int, float)) and math.isfinite(v) else None for _, v in points]
            out.append((label, [p[0] for p in points], values, colour))
    return out


def privacy_series(records: list[dict]) -> tuple[list[int], list[float]]:
    """(rounds, epsilon) of the rounds whose record has the privacy accountant's epsilon."""
    points = [(r["round"], r["privacy"]["epsilon"]) for r in records
              if isinstance(r.get("privacy"), dict) and isinstance(r["privacy"].get("epsilon"), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _privacy(fig: Figure, ax: Axes, records: list[dict], budget: float | None = None) -> None:
    """The privacy spent, epsilon against round (delta in the label, the budget as a line), and held-out accuracy
    on a second axis: what a DP study trades, read off one figure."""
    rounds, epsilons = privacy_series(records)
    delta = next((r["privacy"].get("delta") for r in records if isinstance(r.get("privacy"), dict)), None)
    ax.plot(rounds, epsilons, color="tab:red", marker=".", label=f"ε (δ = {delta:g})" if delta else "ε")
    if budget:
        ax.axhline(budget, color="tab:red", linestyle="--", linewidth=1, label=f"privacy.epsilon_budget = {budget:g}")
    ax.set_ylabel("ε spent")
    ax.set_ylim(bottom=0)
    _label_rounds(ax)
    evals = [(r["round"], r["eval"]["accuracy"]) for r in records
             if isinstance(r.get("eval"), dict) and "accuracy" in r["eval"]]
    if evals:
        acc = ax.twinx()
        acc.plot([e[0] for e in evals], [e[1] for e in evals], color="tab:green", marker="s",
                 label="held-out accuracy")
        acc.set_ylabel("accuracy")
        acc.set_ylim(0, 1)
    ax.set_title("Privacy spent and accuracy")
    fig.legend(loc="lower center", ncols=3, fontsize="small")
    fig.subplots_adjust(bottom=0.25)


def fault_counts(records: list[dict]) -> tuple[list[int], dict[str, list[int]], list[int]]:
    """(rounds, strikes of each kind by round, clients dropped by round): what ``faults.png`` draws."""
    rounds = [r["round"] for r in records]
    kinds = sorted({f["kind"] for r in records for f in r.get("faults", [])})
    strikes = {kind: [sum(1 for f in r.get("faults", []) if f["kind"] == kind) for r in records] for kind in kinds}
    return rounds, strikes, [len(r.get("dropped", [])) for r in records]


def _faults(fig: Figure, ax: Axes, records: list[dict]) -> None:
    """Each round's strikes of the config's faults, stacked by kind, and the clients dropped from it (whatever
    the cause: a fault, a deadline, a refused update): in real time as under a virtual clock."""
    from matplotlib.ticker import MaxNLocator

    rounds, strikes, dropped = fault_counts(records)
    bottom = [0] * len(rounds)
    for kind, counts in strikes.items():
        ax.bar(rounds, counts, bottom=bottom, label=f"{kind} strikes")
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax.plot(rounds, dropped, color="black", marker="o", linestyle="-", label="clients dropped")
    ax.set_ylabel("clients")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of clients: no tick between two
    _label_rounds(ax)
    ax.set_title("Faults struck and clients dropped per round")
    ax.legend(fontsize="small")


def kept_local_tensors(run_dir: Path) -> bool:
    """Whether the run's saved config names model.local patterns."""
    return bool((saved_config(run_dir).get("model") or {}).get("local"))


LOG_DECADES = 3  # a loss axis spanning more than this many orders of magnitude is drawn on a log scale


def spans_decades(ax: Axes, decades: float = LOG_DECADES) -> bool:
    """Whether the finite positive values of ``ax``'s lines span more than ``decades`` orders of magnitude."""
    values = [float(v) for line in ax.get_lines() for v in np.asarray(line.get_ydata(), dtype=float)
              if math.isfinite(v) and v > 0]
    return bool(values) and math.log10(max(values) / min(values)) > decades


def _quality(fig: Figure, ax: Axes, records: list[dict], local: bool = False) -> None:
    # a round without a training loss plots as a gap (None); matplotlib's stubs admit numbers only
    ax.plot([r["round"] for r in records], [r.get("train_loss") for r in records], marker=".",  # type: ignore[arg-type]
            label="train loss (clients)")
    evals = [(r["round"], r["eval"]) for r in records if "eval" in r]
    if evals:  # dotted in its accuracy's colour (ACCURACIES): one colour, one model and split
        ax.plot([e[0] for e in evals], [e[1].get("loss") for e in evals], color="tab:green", marker="o",
                linestyle=":", label="held-out loss")
    for name, at, losses, colour in loss_series(records):  # a gap is None: the stubs admit numbers only
        ax.plot(at, losses, color=colour, marker="^", linestyle=":", label=name)  # type: ignore[arg-type]
    if spans_decades(ax):  # a diverged run's 1e27 would flatten every other loss onto the axis
        ax.set_yscale("log")
    series = accuracy_series(records, local)
    if series:
        acc = ax.twinx()
        for label, rounds, values, colour, marker in series:
            acc.plot(rounds, values, color=colour, marker=marker, label=label)
        acc.set_ylabel("accuracy")
        acc.set_ylim(0, 1)
    _label_rounds(ax)
    ax.set_ylabel("loss (log scale)" if ax.get_yscale() == "log" else "loss")
    ax.set_title("Model quality")
    if len(series) > 1:  # one label a line: each says what was measured and when
        fig.set_size_inches(7, 4 + 0.2 * len(series))
        fig.legend(loc="lower center", ncols=1, fontsize="small")
        fig.subplots_adjust(bottom=(0.6 + 0.18 * (len(ax.get_lines()) + len(series))) / fig.get_figheight())
    else:
        fig.legend(loc="lower center", ncols=3, fontsize="small")
        fig.subplots_adjust(bottom=0.25)


def time_axis_limit(totals: Sequence[float], factor: float = 1.5, percentile: float = 90.0) -> float | None:
    """The seconds axis's top when one round (start-up's first, typically) would flatten the others into
    slivers: ``factor`` times the ``percentile`` of the rounds after the first; None when nothing passes it."""
    if len(totals) < 2:
        return None
    top = factor * float(np.percentile(totals[1:], percentile))
    return top if top > 0 and max(totals) > top else None


def time_parts(records: list[dict]) -> list[tuple[str, list[float]]]:
    """The split's parts that any round spent time in, each with its seconds per round (in SPLIT order)."""
    parts = [(part, [r["time"].get(part, 0.0) for r in records]) for part in SPLIT]
    return [(part, values) for part, values in parts if any(values)]


MANY_BARS = 60  # rounds beyond which a bar is a pixel or two wide: bars then touch


def bar_width(bars: int) -> float:
    """A round's bar width: 0.8 of a round, gaps between, while the bars are wide; 1 (touching) for more than
    ``MANY_BARS``, where gaps a pixel wide fall on the screen's pixels unevenly and stripe the plot like a change
    in the run."""
    return 1.0 if bars > MANY_BARS else 0.8


def _time_split(fig: Figure, ax: Axes, records: list[dict]) -> None:
    """Seconds per round, the axis cut above the usual round so start-up does not hide the rest; below,
    each round's parts as shares of it, so every round's make-up is visible."""
    from matplotlib.ticker import PercentFormatter

    fig.set_size_inches(7, 6.5)
    ax.remove()
    seconds, shares = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    rounds, parts = [r["round"] for r in records], time_parts(records)
    totals = [sum(column) for column in zip(*(values for _, values in parts))] or [0.0] * len(records)
    bottom, share_bottom = [0.0] * len(records), [0.0] * len(records)
    width = bar_width(len(rounds))
    for part, values in parts:
        share = [v / t if t else 0.0 for v, t in zip(values, totals)]
        colour = f"C{SPLIT.index(part)}"  # a part keeps its colour whichever others a run shows
        seconds.bar(rounds, values, width, bottom=bottom, label=part, color=colour, linewidth=0)
        shares.bar(rounds, share, width, bottom=share_bottom, color=colour, linewidth=0)
        bottom = [b + v for b, v in zip(bottom, values)]
        share_bottom = [b + s for b, s in zip(share_bottom, share)]
    top = time_axis_limit(totals)
    if top is not None:
        seconds.set_ylim(0, top)
        for x, total in zip(rounds, totals):
            if total > top:
                _mark_clipped(seconds, x, top, total, leftward=x > (rounds[0] + rounds[-1]) / 2)
    seconds.set_ylabel("seconds" if top is None else "seconds (tall bars cut: totals on them)")
    seconds.set_title("Where each round's time goes (parts add up to the round)")
    shares.set_ylim(0, 1)
    shares.yaxis.set_major_formatter(PercentFormatter(1.0))
    shares.set_ylabel("share of the round")
    _label_rounds(shares)
    if 0 < len(rounds) <= 20:
        shares.set_xticks(rounds)
    fig.tight_layout(rect=(0, 0.045, 1, 1))
    if parts:
        fig.legend(loc="lower center", ncols=len(parts), fontsize="small")


def _label_rounds(ax: Axes) -> None:
    """Label a round axis and tick it at whole rounds only (matplotlib ticks a 3-round run at 1.25, 1.5, ...)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _mark_clipped(ax: Axes, x: float, top: float, total: float, leftward: bool = False) -> None:
    """A bar taller than the axis: a break near its top, and its true total written on it (towards the
    plot's middle, so a late round's label stays inside the axes)."""
    for y in (0.90, 0.94):
        ax.plot([x - 0.42, x + 0.42], [top * (y - 0.015), top * (y + 0.015)], color="white", linewidth=2.5)
    ax.annotate(f"round {x:g}: {total:.2f} s", xy=(x, top), xytext=(-6 if leftward else 6, -4),
                textcoords="offset points", ha="right" if leftward else "left", va="top", fontsize="small",
                bbox={"boxstyle": "round", "fc": "white", "ec": "0.6"})


def _bytes(fig: Figure, ax: Axes, records: list[dict]) -> None:
    rounds = [r["round"] for r in records]
    ax.plot(rounds, [r["bytes_sent"] / MIB for r in records], marker=".", label="sent by server")
    ax.plot(rounds, [r["bytes_received"] / MIB for r in records], marker=".", label="received by server")
    _label_rounds(ax)
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)  # from 0, so that a ratio of heights is the ratio of bytes
    ax.set_title("Bytes moved per round")
    ax.legend()


def _cost(fig: Figure, ax: Axes, records: list[dict]) -> None:
    """CPU-seconds per round, the server's and the client ranks' stacked, and bytes written on a second axis; the
    run's totals (the last record's ``cost_to_date``) in the title."""
    measured = [r for r in records if "cost" in r]
    rounds = [r["round"] for r in measured]
    server = [r["cost"]["server_cpu_seconds"] for r in measured]
    width = bar_width(len(rounds))
    ax.bar(rounds, server, width, color="tab:blue", label="server", linewidth=0)
    ax.bar(rounds, [r["cost"]["client_cpu_seconds"] for r in measured], width, bottom=server, color="tab:orange",
           label="client ranks", linewidth=0)
    ax.set_ylabel("CPU-seconds")
    _label_rounds(ax)
    written_in = [r for r in measured if "bytes_written" in r["cost"]]
    if written_in:  # drawn through the rounds that have it (absent where a rank could not count its own)
        written = ax.twinx()
        written.plot([r["round"] for r in written_in], [r["cost"]["bytes_written"] / MIB for r in written_in],
                     color="tab:gray", marker=".", label="bytes written")
        written.set_ylabel("MiB written")
        written.set_ylim(bottom=0)  # from 0, as the bars are: a flat line of checkpoints must not look like swings
    # one legend below the axes, for both: inside, either would cover a round's bar or point
    handles = [h for axis in fig.axes for h in axis.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=len(handles), frameon=False)
    ax.set_title(cost_line(measured[-1]["cost_to_date"]).replace("cost: ", "run: ", 1), fontsize=8)


def _memory(fig: Figure, ax: Axes, records: list[dict]) -> None:
    rounds = [r["round"] for r in records]
    ax.plot(rounds, [r["server_rss_bytes"] / MIB for r in records], marker=".", label="server RSS")
    ax.plot(rounds, [r["server_peak_rss_bytes"] / MIB for r in records], linestyle="--", label="server peak RSS")
    if any("client_peak_rss_bytes" in r for r in records):
        ax.plot(rounds, [r.get("client_peak_rss_bytes", 0) / MIB for r in records], linestyle=":",
                label="largest client peak RSS")
    if any("client_peak_device_bytes" in r for r in records):  # client ranks that train on a GPU
        ax.plot(rounds, [r.get("client_peak_device_bytes", 0) / MIB for r in records], linestyle="-.",
                label="largest client peak GPU memory")
    _note_memory_warnings(ax, records)
    _label_rounds(ax)
    ax.set_ylabel("MiB")
    ax.set_ylim(0, 1.1 * ax.get_ylim()[1])  # from 0; headroom so that a flat peak is not drawn on the frame
    ax.set_title("Memory")
    ax.legend(loc="lower right")  # the lines run high (from 0, memory is mostly held): the bottom is free


def memory_notes(records: list[dict]) -> list[str]:
    """The server's memory-growth warnings, the first one per signal, short enough to print on the plot."""
    grew = {key: what for _, key, _, what in MEMORY_SIGNALS}
    first: dict[str, dict] = {}
    for r in records:
        for w in r.get("memory_warning", ()):
            first.setdefault(w["signal"], w)
    return [f"warning: {grew[signal]} grew {w['per_round_bytes'] / MIB:.1f} MiB per round "
            f"(rounds {w['from_round'] + 1}-{w['to_round']}, {w['growth_fraction']:.0%})"
            for signal, w in first.items()]


def _note_memory_warnings(ax: Axes, records: list[dict]) -> None:
    """Mark the rounds the server warned of memory growth, and say how fast it grew."""
    flagged = [(r["round"], r[w["signal"]] / MIB) for r in records for w in r.get("memory_warning", ())]
    if flagged:
        ax.plot(*zip(*flagged), linestyle="none", marker="x", color="tab:red", label="memory-growth warning")
    notes = memory_notes(records)
    if notes:
        ax.text(0.01, 0.03, "\n".join(notes), transform=ax.transAxes, ha="left", va="bottom", fontsize="small",
                color="tab:red")


AVAILABILITY_CLIENTS = 40  # the most clients drawn one per row
AVAILABILITY_SAMPLES = 600  # instants across the run at which each client's availability is read


def _availability(fig: Figure, ax: Axes, records: list[dict], run_dir: Path) -> None:
    """Who was online when (clock.availability), rebuilt from the run's own config and seed: one row per client
    (the first 40), shaded where the client could be sampled, with each round's (or step's) end marked; with batch
    jobs, a cross where a preemption took a client offline, and a circle where the record says a task was lost."""
    from matplotlib.ticker import MaxNLocator

    from mpifl.clock.availability import availability_for
    from mpifl.clock.queue import QueueAvailability
    from mpifl.config import load_config

    cfg = load_config(run_dir / "config.yaml")
    shown = min(cfg.clients.num_clients, AVAILABILITY_CLIENTS)
    model = availability_for(cfg.clock, cfg.clients.num_clients, cfg.seed)
    end = max(r["virtual_time"] for r in records if "virtual_time" in r)
    times = np.linspace(0.0, end, AVAILABILITY_SAMPLES)
    if isinstance(model, QueueAvailability):  # the rows drawn only: its online(t) asks every client's jobs
        online = np.array([[model.is_online(c, t) for t in times] for c in range(shown)])
    else:
        online = np.array([model.online(t)[:shown] for t in times]).T
    ax.imshow(online, aspect="auto", interpolation="nearest", cmap="Greens", vmin=0, vmax=1.6,
              extent=(0.0, end, shown - 0.5, -0.5))
    for r in records:
        if "virtual_time" in r:
            ax.axvline(r["virtual_time"], color="tab:gray", linewidth=0.4, alpha=0.6)
    if isinstance(model, QueueAvailability):
        runs = {c: model.runs(c, end) for c in range(shown)}
        cuts = [(b, c) for c, stretches in runs.items() for _, b, cut in stretches if cut and b <= end]
        if cuts:
            ax.plot(*zip(*cuts), linestyle="none", marker="x", color="tab:red", label="job preempted")
        lost = lost_tasks(records, runs.get)
        if lost:
            ax.plot(*zip(*lost), linestyle="none", marker="o", markersize=9, markerfacecolor="none",
                    color="black", label="task lost (the record's preempted or job_ended)")
        if cuts or lost:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, fontsize="small", frameon=False)
    ax.set_xlabel("virtual time (s); grey lines: round (or step) ends")
    ax.set_ylabel("logical client")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # client ids: no tick between two of them
    what = {"queue": "batch jobs running", "diurnal": "diurnal windows", "trace": "trace intervals"}
    ax.set_title(f"Clients online ({what.get(cfg.clock.availability, cfg.clock.availability)}): "
                 f"{shown} of {cfg.clients.num_clients}")


def lost_tasks(records: list[dict], runs_of: Callable[[int], list[tuple[float, float, bool]] | None]
               ) -> list[tuple[float, int]]:
    """(virtual time, client) of every task a record lists as lost (``preempted``, ``job_ended``), at the end of the
    client's online stretch that lost it: in a round, the one its task started in (at the round's start); in an
    asynchronous step, the last to end by the step. ``runs_of``: a client's stretches (None: not drawn)."""
    out = []
    for r in records:
        t = r["virtual_time"]
        start = t - r["virtual_round_seconds"] if "virtual_round_seconds" in r else None
        for c in (*r.get("preempted", ()), *r.get("job_ended", ())):
            runs = runs_of(c) or []
            ends = [b for a, b, _ in runs if (a <= start < b if start is not None else b <= t)]
            if ends:
                out.append((ends[-1], c))
    return out


def _virtual_time(fig: Figure, ax: Axes, records: list[dict]) -> None:
    evals = [(r["virtual_time"], r["round"], r["eval"]) for r in records if "eval" in r and "virtual_time" in r]
    key = "accuracy" if any("accuracy" in e[2] for e in evals) else "loss"
    ax.plot([e[0] for e in evals], [e[2].get(key) for e in evals], marker="o", label=f"held-out {key}")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel(key)
    top = ax.secondary_xaxis("top", functions=(lambda t: t, lambda t: t))
    top.set_ticks([e[0] for e in evals][:: max(1, len(evals) // 8)],
                  labels=[str(e[1]) for e in evals][:: max(1, len(evals) // 8)])
    top.set_xlabel("round (or asynchronous step)")  # ticks at the evaluations, labelled with their rounds
    ax.set_title(f"Held-out {key} against virtual time", pad=28)
    ax.legend()


# (record outcome, label, colour), stacked in this order
PARTICIPATION = (("applied", "updates applied", "tab:blue"),
                 ("rejected", "usable, left out by the\nstrategy (Krum's rejected)", "tab:brown"),
                 ("dropped", "dropped (failed, or its rank late)", "tab:purple"),
                 ("unapplied", "usable, but its round\nnot applied", "tab:olive"),
                 ("stragglers", "stragglers (past the deadline\nor over-selected)", "tab:orange"),
                 ("preempted", "task lost to a preemption", "tab:red"),
                 ("job_ended", "task lost at its job's end\n(walltime or run time)", "tab:gray"))


def participation_counts(records: list[dict]) -> dict[str, dict[int, int]]:
    """Rounds per client by outcome (``PARTICIPATION``'s keys): an update is applied only if its client took part,
    was not dropped, and its round was applied (a round under a virtual clock with too few usable updates leaves
    the model unchanged: its record's ``unapplied``, and its usable updates count as such); a straggler whose task
    its job lost is counted under that cause, not twice (an asynchronous step lists its lost tasks, and no
    stragglers)."""
    counts: dict[str, dict[int, int]] = {key: {} for key, _, _ in PARTICIPATION}
    for r in records:
        dropped = {d["client"] for d in r.get("dropped", [])}
        lost = set(r.get("preempted", [])) | set(r.get("job_ended", []))
        usable = [c for c in r.get("participants", []) if c not in dropped]
        applied, unapplied = ([], usable) if "unapplied" in r else (usable, [])
        rejected = [c for c in applied if c in set(r.get("rejected", []))]
        applied = [c for c in applied if c not in rejected]
        outcomes = {"applied": applied, "rejected": rejected, "unapplied": unapplied, "dropped": sorted(dropped),
                    "stragglers": [c for c in r.get("stragglers", []) if c not in lost],
                    "preempted": r.get("preempted", []), "job_ended": r.get("job_ended", [])}
        for key, clients in outcomes.items():
            for c in clients:
                counts[key][c] = counts[key].get(c, 0) + 1
    return counts


def attacked_counts(records: list[dict]) -> dict[int, int]:
    """Rounds per client whose applied update a fault altered (``faults:`` kinds that change a usable update's values:
    scale, noise, corrupt, label_flip), from each record's ``faults`` entries folded into an applied round (an entry
    the strategy rejected, Krum's, is ``rejected``), or held (asynchronous: trained in that step, applied in a
    later one)."""
    counts: dict[int, int] = {}
    for r in records:
        if "unapplied" in r:
            continue
        for entry in r.get("faults", []):  # asynchronous: counted in the step that dispatched it (held)
            if entry.get("kind") in ALTERS_THE_UPDATE and entry.get("outcome") in ("folded", "held"):
                counts[entry["client"]] = counts.get(entry["client"], 0) + 1
    return counts


def _participation(fig: Figure, ax: Axes, records: list[dict], num_clients: int | None = None) -> None:
    """Each client's rounds, stacked by outcome: applied updates first, then why the others were not; with more
    clients than the axes have pixel columns for (``bar_columns``), how many clients had 0, 1, 2, ... rounds of each
    outcome instead (``participation_histogram``), since bars narrower than a pixel merge or vanish."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    counts = participation_counts(records)
    attacked = attacked_counts(records)
    left_out = unapplied_note(counts)
    seen = sorted({c for per_client in counts.values() for c in per_client})
    shown = [(key, label, colour) for key, label, colour in PARTICIPATION if key == "applied" or counts[key]]
    handles = [Patch(color=colour, label=label) for _, label, colour in shown]
    if attacked:
        handles.append(Patch(facecolor="none", edgecolor="black", hatch=ATTACK_HATCH,
                             label="applied, altered by a fault\n(scale, noise, corrupt, label_flip)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    clients = max(num_clients or 0, len(seen), max(seen, default=-1) + 1)
    if clients > bar_columns(fig, ax):
        _participation_histogram(ax, counts, shown, clients, left_out)
        return
    every = list(range(clients))  # a client never sampled keeps its place and tick, with no bar
    bottom = np.zeros(clients)
    for key, _, colour in shown:
        heights = np.array([counts[key].get(c, 0) for c in every])
        ax.bar(every, heights, bottom=bottom, color=colour)
        bottom += heights
    if attacked:  # hatched over the foot of the applied bar: the rounds whose applied update an attack altered
        ax.bar(every, [attacked.get(c, 0) for c in every], facecolor="none", edgecolor="black", hatch=ATTACK_HATCH,
               linewidth=0.0)
    ax.set_xlabel("logical client")
    if clients <= AVAILABILITY_CLIENTS:
        ax.set_xticks(every)
    ax.set_ylabel("rounds (asynchronous: tasks)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of rounds: no tick between two
    never = clients - len(seen)
    note = f"\n({never} client{'s' if never != 1 else ''} never sampled: no bar)" if never else ""
    title = ax.set_title(f"Participation per client{left_out}{note}")
    if left_out or note:
        title.set_fontsize("medium")


def unapplied_note(counts: dict[str, dict[int, int]]) -> str:
    """The title's note of the usable updates left out of "updates applied" (their rounds were not applied), or ""."""
    n = sum(counts["unapplied"].values())
    return f"\n({n} usable update{'s' if n != 1 else ''} to rounds not applied, not counted as applied)" if n else ""


ATTACK_HATCH = "////"  # participation.png: the applied rounds a fault altered

PIXELS_PER_BAR = 2  # a bar and a gap: narrower, neighbouring bars merge and antialiasing fades a lone one


def bar_columns(fig: Figure, ax: Axes) -> int:
    """How many clients ``ax`` can draw a bar each for in the saved PNG: its width in pixel columns at the report's
    ``DPI``, ``PIXELS_PER_BAR`` to a client."""
    return int(ax.get_position().width * fig.get_figwidth() * DPI) // PIXELS_PER_BAR


def participation_histogram(counts: dict[str, dict[int, int]], clients: int) -> dict[str, list[int]]:
    """For each outcome, how many of the ``clients`` had 0, 1, 2, ... rounds of it (index: rounds)."""
    out = {}
    for key, per_client in counts.items():
        rounds = np.zeros(clients, dtype=int)
        for client, n in per_client.items():
            rounds[client] = n
        out[key] = np.bincount(rounds).tolist()
    return out


def _participation_histogram(ax: Axes, counts: dict[str, dict[int, int]], shown: list[tuple[str, str, str]],
                             clients: int, left_out: str = "") -> None:
    """Clients by their number of rounds of each outcome, side by side, on a log axis so that a handful of
    stragglers shows beside hundreds of clients never sampled; each bar's count written on it."""
    from matplotlib.ticker import MaxNLocator

    histogram = participation_histogram(counts, clients)
    width = 0.8 / len(shown)
    for i, (key, _, colour) in enumerate(shown):
        heights = histogram[key]
        bars = ax.bar(np.arange(len(heights)) + (i - (len(shown) - 1) / 2) * width, heights, width=width,
                      color=colour)
        ax.bar_label(bars, labels=[str(h) if h else "" for h in heights], fontsize=6)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5)  # a bar of one client stays visible
    ax.set_xlabel("rounds of the outcome (asynchronous: tasks)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("clients")
    ax.set_title(f"Participation of {clients} clients: how many had each number of rounds\n"
                 f"(too many clients for a bar each){left_out}", fontsize="medium")


def applied_staleness(records: list[dict]) -> tuple[list[int], int, int]:
    """The staleness of every applied update, and how many were left out: dropped ones, then the usable ones of a
    step not applied (its record's ``unapplied``: too few usable updates, the model left unchanged). A step's
    ``staleness`` holds each arrival's, aligned with ``arrival_order``, a dropped one's too (its client is in
    ``dropped``)."""
    applied, dropped_out, unapplied = [], 0, 0
    for r in records:
        dropped = {d["client"] for d in r.get("dropped", [])}
        staleness = r.get("staleness", [])
        for client, value in zip(r.get("arrival_order", [None] * len(staleness)), staleness):
            if client in dropped:
                dropped_out += 1
            elif "unapplied" in r:
                unapplied += 1
            else:
                applied.append(value)
    return applied, dropped_out, unapplied


def _staleness(fig: Figure, ax: Axes, records: list[dict]) -> None:
    from matplotlib.ticker import MaxNLocator

    values, dropped, unapplied = applied_staleness(records)
    ax.hist(values, bins=range(0, max(values, default=0) + 2), align="left", rwidth=0.85)
    ax.set_xlabel("staleness (versions between dispatch and application)")
    ax.set_ylabel("updates")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of updates
    left_out = f"; {dropped} dropped update{'s' if dropped != 1 else ''} not counted" if dropped else ""
    note = f"\n({unapplied} usable update{'s' if unapplied != 1 else ''} to steps not applied, not counted as " \
        "applied)" if unapplied else ""
    title = ax.set_title((f"Staleness of {len(values)} applied updates (median {float(np.median(values)):g}{left_out})"
                          if values else f"Staleness (no applied updates{left_out})") + note)
    if note:
        title.set_fontsize("medium")
