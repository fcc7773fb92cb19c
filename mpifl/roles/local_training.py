"""One logical client's local training on a client rank: alone, with its group of ranks
(``clients.ranks_per_client``) or as a lane of its batch (``train.batched_clients``), inside its client half's
rule (SCAFFOLD's correction, FedDyn's term), with Ditto's personal model beside it; and the failure rule that says
whether a raise ends the job or becomes the client's error."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mpifl.errors import IN_A_NEW_RUN, JobFailure, entered, noted_in, plugin_name, strikes_again
from mpifl.learning.datasets import ClientData
from mpifl.learning.device import deterministic_hint
from mpifl.learning.trainers import (
    ConfiguredTrainer,
    TrainContext,
    Trainer,
    TrainResult,
    accepts_context,
    result_problem,
    trainer_name,
)
from mpifl.logs import world_rank
from mpifl.planning.faults import FaultPlan, Strike
from mpifl.planning.seeds import client_seed, personal_seed
from mpifl.roles.batched import BatchedClients
from mpifl.roles.client_state import ClientStateParts, vector_divergence
from mpifl.roles.evaluation import FederatedEvaluation
from mpifl.roles.faults import FaultInjector, InjectedFault
from mpifl.wire.flat import FlatModel
from mpifl.wire.layout import ExchangeLayout

if TYPE_CHECKING:  # roles.group imports roles.client's neighbours only: the type alone, no import at run time
    from mpifl.roles.group import GroupLeader


VECTORS_ADVICE = "change each vector in place, as context.state hands it over"
DIVERGED_ADVICE = "if its training diverged, lower train.lr or set train.max_grad_norm"
RETURN_ADVICE = "make every train() call return one"


class ClientFailure(RuntimeError):
    """A logical client's training raised: the message names the client, its rank and the round."""


@dataclass(kw_only=True)
class TrainingParts:
    """How a client rank's logical clients train, each part built from its own config section."""

    trainer: Trainer
    seed: int  # the root seed: each logical client's seed derives from it, the round and its id
    num_clients: int = 0  # clients.num_clients: a plug-in trainer's TrainContext
    accept_failures: bool  # clients.accept_failures: a failing client is reported, not fatal
    group: GroupLeader | None = None  # clients.ranks_per_client > 1: this rank leads a group that trains together
    batched: BatchedClients | None = None  # train.batched_clients: clients trained K at a time, served one by one
    faults: FaultPlan | None = None  # the config's faults: what strikes this rank's clients, and when
    spend_fault: Callable[[Strike], None] | None = None  # records a kill or exit before it ends the job
    classes: int = 0  # the dataset's class count (a label_flip fault flips labels among them); 0: none, or no labels


class LocalTraining:
    """Trains the rank's logical clients one at a time in ``work``, the model that trains."""

    def __init__(self, parts: TrainingParts, work: FlatModel, state: ClientStateParts, plan: ExchangeLayout,
                 evaluation: FederatedEvaluation, faults: FaultInjector | None, rank: int):
        self.parts, self.work, self.state, self.plan, self.evaluation = parts, work, state, plan, evaluation
        self.trainer, self.faults, self.rank = parts.trainer, faults, rank
        self.context = accepts_context(parts.trainer)  # whether the trainer takes a TrainContext
        self.trainer_name = trainer_name(parts.trainer)  # as errors say it
        self.participants = 0  # this round's logical clients on every rank together (a trainer's TrainContext)
        self.vectors: dict[str, torch.Tensor] = {}  # the training client's declared vectors, kept once it is usable
        self.trained_context: TrainContext | None = None  # the last client's, as its training left it

    def train(self, round_: int, client: int, data: ClientData | None,
              anchor: torch.Tensor | None = None) -> tuple[TrainResult, str | None]:
        """Local training of one logical client (``anchor``: the global model beside the one that trains, for
        SCAFFOLD's and FedDyn's rules); a raise, a result that is not a TrainResult, or a declared vector left not
        as declared or holding NaN or Inf, ends the job, or is its error under accept_failures."""
        result, error = self._attempt(round_, client, data, anchor)
        if error is not None:
            return result, error
        problem = result_problem(self.trainer_name, result)
        if problem is not None:
            return TrainResult(0, {}), self.refused(problem, round_, client, RETURN_ADVICE)
        problem = self._vectors_problem()
        if problem is not None:
            return TrainResult(0, {}), self.refused(problem, round_, client, VECTORS_ADVICE)
        diverged = None if self.state.declared is None else vector_divergence(self.trainer_name, self.vectors)
        if diverged is not None:
            return TrainResult(0, {}), self.refused(diverged, round_, client, DIVERGED_ADVICE)
        return result, None

    def _attempt(self, round_: int, client: int, data: ClientData | None,
                 anchor: torch.Tensor | None) -> tuple[TrainResult, str | None]:
        """Train ``client`` within its faults and its client half's rule; a raise is the failure rule's."""
        controls = self.state.controls
        in_group = False  # whether a group of ranks trains with this one now (a raise then strands it mid-collective)
        try:
            assert anchor is not None or controls is None  # scaffold and feddyn send deltas: the rank keeps the global
            if self.faults:
                self.faults.before_training(round_, client)
            began = time.perf_counter()
            in_group = self.parts.group is not None
            with entered(lambda: controls.training(client, anchor), f"the client half {plugin_name(controls)}, in "
                         "training") if controls and anchor is not None else contextlib.nullcontext():
                result = self._steps(round_, client, data)
            in_group = False
            if self.faults:
                self.faults.after_training(round_, client, self.work, self.plan, anchor, time.perf_counter() - began)
            return result, None
        except Exception as err:  # noqa: BLE001 - a failing client is data when accept_failures is on
            return TrainResult(0, {}), self.failed(err, round_, client, "", in_group)

    def _steps(self, round_: int, client: int, data: ClientData | None) -> TrainResult:
        """The local steps themselves: as a lane of the client's batch (the model holds the global one; the batch
        seeds its lanes), with the group of ranks, or by the trainer alone."""
        if self.parts.batched is not None:
            return self.parts.batched.train(self.work.module, client)
        seed = client_seed(self.parts.seed, round_, client)
        if self.parts.group is not None:
            return self._train_in_group(client, data, seed)
        if self.context:
            self.trained_context = self._context(round_, client)
            return self.trainer.train(self.work.module, data, seed,  # type: ignore[call-arg]
                                      context=self.trained_context)
        return self.trainer.train(self.work.module, data, seed)

    def personalized_scores(self, round_: int, client: int, val: ClientData | None, trained: bool) -> dict:
        """A plug-in trainer's personalised model (its ``personalized``), scored on ``client``'s validation split as
        ``personal_*`` when federated evaluation is due, right after the client trained, with the context it trained
        with (its vectors as training left them); the trained model, exchanged and local tensors, is put back
        bitwise afterwards, whatever the trainer's context manager did to it. Nothing for a client that failed to
        train (``trained`` false)."""
        personalized = getattr(self.trainer, "personalized", None)
        context = self.trained_context
        if not trained or personalized is None or context is None or (context.client, context.round) != (client,
                                                                                                      round_):
            return {}
        evaluate = self.evaluation.personal(self.work.module, round_, val)
        if evaluate is None:  # not due this round, or no validation split
            return {}
        model = self.work.buffer.clone()
        local = [t.detach().clone() for _, t in self.work.local_tensors()]
        try:
            with personalized(self.work.module, context):
                return evaluate()
        finally:
            with torch.no_grad():
                self.work.buffer.copy_(model)
                for (_, tensor), saved in zip(self.work.local_tensors(), local):
                    tensor.copy_(saved)

    def failed(self, err: Exception, round_: int, client: int, doing: str, in_group: bool = False) -> str:
        """The failure rule: a raise in a client's training ends the job, naming the client, its rank and the round;
        under clients.accept_failures it is the client's error instead, but where it struck while a group of ranks
        trained with this one (``in_group``), which cannot go on mid-collective. A group's client that fails before
        its group was ordered to train (an injected ``raise``) or after (a lost update) is dropped as any other."""
        hint = deterministic_hint(err)
        if not self.parts.accept_failures or in_group:
            why = ("its group of ranks (clients.ranks_per_client) cannot go on mid-collective"
                   if in_group else "clients.accept_failures=false")
            again = f"; {strikes_again(f'faults[{err.index}] ({err.kind!r}) strikes logical client {client}')}" \
                if isinstance(err, InjectedFault) and err.index >= 0 else ""
            raise ClientFailure(f"logical client {client} on rank {world_rank(self.rank)} failed in round "
                                f"{round_}{doing}: {noted_in(err)}{type(err).__name__}: {err} ({why}{hint}){again}"
                                ) from err
        return f"{noted_in(err)}{type(err).__name__}: {err}{hint}"

    def _vectors_problem(self) -> str | None:
        """What is wrong with the declared vectors the trainer handed back, or None (none declared, or all as
        declared)."""
        declared = self.state.declared
        return None if declared is None else declared.problem(self.trainer_name, self.vectors)

    def refused(self, problem: str, round_: int, client: int, advice: str) -> str:
        """A client whose trainer returned what mpifl cannot use (not a TrainResult, a declared vector not as
        declared): its error under clients.accept_failures (dropped from the round, its old vectors kept), else the
        end of the job in one line with ``advice``, as mpifl's own check found it (no traceback: no code of the
        trainer's raised)."""
        if not self.parts.accept_failures:
            raise JobFailure(f"round {round_}: logical client {client} (rank {world_rank(self.rank)}): {problem} "
                             f"(clients.accept_failures=false); {advice}, or drop such clients from their rounds "
                             f"with clients.accept_failures=true {IN_A_NEW_RUN}")
        return problem

    def non_finite(self, round_: int, client: int, count: int, injected: str | None = None) -> str:
        """An update with ``count`` NaN/Inf values: the client's error under clients.accept_failures, else the end of
        the job in one line with what to change (mpifl's own check found it: no traceback). ``injected``: the
        config's fault that put them there, if one did (then the training did not diverge, and the advice would
        mislead)."""
        error = f"update contains {count} NaN/Inf values" + (f", put there by {injected}" if injected else "")
        if not self.parts.accept_failures:
            advice = (f"{strikes_again(f'{injected} strikes logical client {client}')}, or drop such clients from "
                      f"their rounds with clients.accept_failures=true {IN_A_NEW_RUN}" if injected else
                      f"{DIVERGED_ADVICE}, or drop such clients from their rounds with clients.accept_failures=true "
                      f"{IN_A_NEW_RUN}")
            raise JobFailure(f"round {round_}: logical client {client} (rank {world_rank(self.rank)}): {error} "
                             f"(clients.accept_failures=false); {advice}")
        return error

    def _context(self, round_: int, client: int) -> TrainContext:
        """What a plug-in trainer learns of the client it trains, with the client's declared vectors loaded."""
        declared = self.state.declared
        if declared is None:
            return TrainContext(client, round_, self.participants, self.parts.num_clients)
        self.vectors, fresh = declared.load(client)
        return TrainContext(client, round_, self.participants, self.parts.num_clients, self.vectors, fresh,
                            declared.covered)

    def _train_in_group(self, client: int, data: ClientData | None, seed: int) -> TrainResult:
        """Train ``client`` with this rank's group (clients.ranks_per_client); its metrics add the group's setup
        (round 1 only), the weights' dispatch to the group, and the training itself, in seconds."""
        assert self.parts.group is not None  # _steps calls this only for a group's leader
        own_steps = self.trainer.cfg.local_steps if isinstance(self.trainer, ConfiguredTrainer) else None
        # SCAFFOLD's c - c_i or FedDyn's g_i, set as the training began: the members'
        controls = self.state.controls
        costs = self.parts.group.dispatch(client, seed, own_steps, controls.shared if controls else None)
        began = time.perf_counter()
        result = self.trainer.train(self.work.module, data, seed)
        if isinstance(result, TrainResult):  # anything else is refused by ``train``, naming what it is
            result.metrics.update(costs, group_train_seconds=time.perf_counter() - began)
        return result

    def personal(self, round_: int, client: int, data: ClientData | None, val: ClientData | None,
                 anchor: torch.Tensor) -> tuple[dict, str | None]:
        """Ditto: update ``client``'s personal model (evaluated when federated evaluation is due); its scores, and
        None or the client's error. A raise ends the job, or, under accept_failures, is the client's error: the
        client is dropped from the round and its personal model stays as it was."""
        assert self.state.models is not None  # called only for Ditto
        try:
            return self.state.models.train(client, data, anchor, personal_seed(self.parts.seed, round_, client),
                                           self.evaluation.personal(self.work.module, round_, val)), None
        except Exception as err:  # noqa: BLE001 - a failing client is data when accept_failures is on
            return {}, "training its personal model: " + self.failed(err, round_, client,
                                                                     " while training its personal model",
                                                                     self.parts.group is not None)
