"""``mpifl report RUN_DIR``: PNG plots from a run's metrics.jsonl (needs the 'plot' extra)."""
from __future__ import annotations

import json
from pathlib import Path

from mpifl.units import MIB

SPLIT = ("dispatch", "client_train", "return", "aggregate", "eval", "checkpoint", "other")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("mpifl report needs matplotlib: pip install 'mpifl[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_metrics(run_dir: Path) -> list[dict]:
    """The run's per-round records."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"mpifl report: {path} does not exist (is {run_dir} a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metric_of(record: dict, dotted: str) -> float | None:
    """A dotted key (``eval.accuracy``) of a round's record, or None where absent."""
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def rounds_to_target(records: list[dict], target: float, metric: str = "eval.accuracy") -> int | None:
    """The first round whose metric reaches ``target`` (None if never)."""
    return next((r["round"] for r in records if (metric_of(r, metric) or float("-inf")) >= target), None)


def compare_table(run_dirs: list[str], target: float, metric: str = "eval.accuracy") -> str:
    """A Markdown table: per run, its strategy, rounds to ``target``, best and final metric."""
    import yaml

    rows = [f"| run | strategy | rounds to {metric} >= {target} | best | final |", "|---|---|---|---|---|"]
    for run_dir in map(Path, run_dirs):
        records = load_metrics(run_dir)
        config = run_dir / "config.yaml"
        strategy = (yaml.safe_load(config.read_text()) or {}).get("strategy", {}) if config.is_file() else {}
        values = [v for v in (metric_of(r, metric) for r in records) if v is not None]
        reached = rounds_to_target(records, target, metric)
        rows.append(f"| {run_dir.name} | {strategy.get('name', '?')} | {reached if reached else 'not reached'} | "
                    f"{max(values, default=float('nan')):.4f} | {values[-1] if values else float('nan'):.4f} |")
    return "\n".join(rows)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write quality, time-split, bytes and memory plots; return their paths."""
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    records = load_metrics(run_dir)
    plt = _pyplot()
    written = []
    for name, draw in (("quality.png", _quality), ("time_split.png", _time_split), ("bytes.png", _bytes),
                       ("memory.png", _memory)):
        fig, ax = plt.subplots(figsize=(7, 4))
        draw(fig, ax, records)
        if not fig.legends:
            fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    return written


def _quality(fig, ax, records: list[dict]) -> None:
    ax.plot([r["round"] for r in records], [r.get("train_loss") for r in records], marker=".",
            label="train loss (clients)")
    evals = [(r["round"], r["eval"]) for r in records if "eval" in r]
    if evals:
        ax.plot([e[0] for e in evals], [e[1].get("loss") for e in evals], marker="o", label="held-out loss")
        if any("accuracy" in e[1] for e in evals):
            acc = ax.twinx()
            acc.plot([e[0] for e in evals], [e[1].get("accuracy") for e in evals], color="tab:green", marker="s",
                     label="held-out accuracy")
            acc.set_ylabel("accuracy")
            acc.set_ylim(0, 1)
    ax.set_xlabel("round")
    ax.set_ylabel("loss")
    ax.set_title("Model quality")
    fig.legend(loc="lower center", ncols=3, fontsize="small")
    fig.subplots_adjust(bottom=0.25)


def _time_split(fig, ax, records: list[dict]) -> None:
    rounds, bottom = [r["round"] for r in records], [0.0] * len(records)
    for part in SPLIT:
        values = [r["time"].get(part, 0.0) for r in records]
        if any(values):
            ax.bar(rounds, values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("round")
    ax.set_ylabel("seconds")
    ax.set_title("Where each round's time goes (parts add up to the round)")
    ax.legend(fontsize="small")


def _bytes(fig, ax, records: list[dict]) -> None:
    rounds = [r["round"] for r in records]
    ax.plot(rounds, [r["bytes_sent"] / MIB for r in records], marker=".", label="sent by server")
    ax.plot(rounds, [r["bytes_received"] / MIB for r in records], marker=".", label="received by server")
    ax.set_xlabel("round")
    ax.set_ylabel("MiB")
    ax.set_title("Bytes moved per round")
    ax.legend()


def _memory(fig, ax, records: list[dict]) -> None:
    rounds = [r["round"] for r in records]
    ax.plot(rounds, [r["server_rss_bytes"] / MIB for r in records], marker=".", label="server RSS")
    ax.plot(rounds, [r["server_peak_rss_bytes"] / MIB for r in records], linestyle="--", label="server peak RSS")
    if any("client_peak_rss_bytes" in r for r in records):
        ax.plot(rounds, [r.get("client_peak_rss_bytes", 0) / MIB for r in records], linestyle=":",
                label="largest client peak RSS")
    ax.set_xlabel("round")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title("Memory")
    ax.legend()
