"""Federated evaluation on a client rank (``eval.federated_every``): each sampled client scores the model it received
on its own validation split before it trains (``accuracy``, ``loss``, ``samples``), and Ditto's personal model after
its update (``personal_*``). The scores travel in the update header's own field (``UpdateMeta.evaluation``), never
among the trainer's metrics, so a trainer that reports ``val_accuracy`` cannot replace them; the server summarises
them per round (roles.records.federated_evaluation)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mpifl.learning.datasets import ClientData
from mpifl.learning.trainers import Evaluator


@dataclass
class FederatedEvaluation:
    """When a client's validation split is scored, and how."""

    evaluate: Evaluator | None = None  # None: no federated evaluation
    every: int = 0  # eval.federated_every
    rounds: int = 0  # the run's last round, always scored

    def ends_at(self, round_: int) -> None:
        """The run ends at ``round_``, before its configured last round (privacy.epsilon_budget): score it too."""
        self.rounds = round_

    def due(self, round_: int, val: ClientData | None) -> bool:
        """Whether federated evaluation runs this round on this client's validation split."""
        return bool(self.every) and self.evaluate is not None and val is not None and len(val) > 0 and not (
            round_ % self.every and round_ != self.rounds)

    def received(self, model: nn.Module, round_: int, val: ClientData | None) -> dict:
        """The received model's scores on the client's validation split (before training), when due."""
        if not self.due(round_, val):
            return {}
        assert self.evaluate is not None and val is not None  # due: an evaluator and a validation split
        return {**self.evaluate(model, val.x, val.y), "samples": len(val)}

    def personal(self, model: nn.Module, round_: int, val: ClientData | None) -> Callable[[], dict] | None:
        """What scores a Ditto personal model once it is in ``model``, when due; else None."""
        if not self.due(round_, val):
            return None
        evaluate = self.evaluate
        assert evaluate is not None and val is not None  # due: an evaluator and a validation split
        return lambda: {f"personal_{k}": v for k, v in evaluate(model, val.x, val.y).items()}
