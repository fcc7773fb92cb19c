"""What a round leaves behind: its time split, its derived metrics and the run's closing line."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpifl.logs import log


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

    def split(self) -> dict[str, float]:
        """Disjoint parts that add up to the round: no part is counted twice."""
        receive = self.reduced - self.first_update
        return {
            "dispatch": self.dispatched - self.start,
            "client_train": self.first_update - self.dispatched,
            "return": receive - self.aggregate,
            "aggregate": self.aggregate,
            "eval": self.evaluated - self.reduced,
            "checkpoint": self.checkpointed - self.evaluated,
            "other": self.end - self.checkpointed,
            "round": self.end - self.start,
        }


def secagg_record(metas: dict) -> dict:
    """Secure aggregation's cost this round: clients dropped (their masks removed), the slowest client's
    masking time, and values clamped into the ring's range."""
    usable = [m for m in metas.values() if m.error is None]
    return {"dropped": len(metas) - len(usable),
            "mask_seconds": max((m.metrics.get("secagg_seconds", 0.0) for m in usable), default=0.0),
            "clamped": sum(m.metrics.get("secagg_clamped", 0) for m in usable)}


def federated_evaluation(metas) -> dict | None:
    """Clients' validation metrics of the global model they received, weighted by validation samples."""
    reports = [m.metrics for m in metas if "val_samples" in m.metrics]
    if not reports:
        return None
    n = sum(r["val_samples"] for r in reports)
    keys = [k for k in reports[0] if k.startswith("val_") and k != "val_samples"]
    out = {k[4:]: sum(r[k] * r["val_samples"] for r in reports) / n for k in keys}
    if "perplexity" in out:  # of the pooled loss, not a mean of perplexities
        out["perplexity"] = math.exp(min(out["loss"], 50.0))
    return {**out, "clients": len(reports), "samples": n}


def summary(record: dict) -> str:
    """The round's losses and evaluation scores, on one line."""
    parts = []
    if record.get("train_loss") is not None:
        parts.append(f"train_loss {record['train_loss']:.4f}")
    parts += [f"{k} {v:.4f}" for k, v in record.get("eval", {}).items()]
    if "federated_eval" in record:
        parts += [f"federated_{k} {v:.4f}" for k, v in record["federated_eval"].items()
                  if k not in ("clients", "samples")]
    return ", ".join(parts)


def log_final(history: list[dict], rounds: int, where: str) -> None:
    """One closing line: how far the run got, and its last evaluation."""
    last = next((r for r in reversed(history) if "eval" in r), None)
    reached = history[-1]["round"] if history else 0
    if reached == rounds:
        detail = f"final round {last['round']}: " + summary(last) if last else "no evaluation"
        log(f"finished {len(history)} rounds; {detail}; outputs in {where}", rank=0)
        return
    detail = f"last evaluation after round {last['round']}: " + summary(last) if last else "no evaluation"
    log(f"stopped after round {reached} of {rounds} (continue with --resume); {detail}; outputs in {where}", rank=0)
