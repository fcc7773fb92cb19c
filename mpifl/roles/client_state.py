"""A client rank's per-client state: the one store of its hosted clients' vectors, opened, reloaded on a resume, and
cut into one view per part of the layout (mpifl.config.client_state), which each part's rule reads and writes as a
store of its own.

Why views over one store rather than a store per kind: a rank keeps one file of them, a checkpoint one snapshot per
rank, and ``clients.placement: per_round`` lends each client's one vector, whatever kinds it holds.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mpifl.algorithms.contract import ClientHalf
from mpifl.algorithms.ditto import PersonalModels
from mpifl.algorithms.local_layers import PersonalTensors
from mpifl.config import Config
from mpifl.config.client_state import ClientStateLayout, StateVector
from mpifl.errors import JobFailure
from mpifl.learning.steps import gather, trainable
from mpifl.logs import log
from mpifl.roles.lending import StateLending
from mpifl.storage.residuals import (
    RANK_FILE,
    Borrowing,
    DiskResiduals,
    MarkedChunks,
    RamResiduals,
    ResidualStore,
    Section,
    UndoJournal,
    load_snapshot,
    open_residuals,
)
from mpifl.storage.rundir import ResumePoint
from mpifl.units import MIB, range_list
from mpifl.wire.flat import FlatModel, dtype_name


def open_client_state(cfg: Config, layout: ClientStateLayout, rank: int, hosted: list[int], run_dir: Path | None,
                      resume: ResumePoint | None, shard: tuple[int, int] = (0, 1)) -> RamResiduals | DiskResiduals:
    """The hosted clients' vectors, in RAM or on disk within the state's budget, reloaded on a resume (``shard``:
    the rows a rank of a sharded client group keeps them over, ``storage.residuals.load_snapshot``)."""
    state = cfg.client_state()
    assert state is not None  # a layout exists only for a run with per-client state
    firsts = layout.firsts
    path = run_dir / state.folder / RANK_FILE.format(rank=rank) if run_dir else None
    try:
        store = open_residuals(firsts, len(hosted), int(state.ram_mb * MIB), path, state.ram_key)
    except ValueError as err:
        raise JobFailure(str(err)) from None
    if resume is not None:
        try:
            found = load_snapshot(store, firsts, resume.residual_files or [], hosted, shard)
        except ValueError as err:
            raise JobFailure(f"rank {rank}: {err}") from None
        log(f"resume: {state.what} of {found} of its {len(hosted)} clients ({store.where})", rank=rank)
    return store


@dataclass
class StateViews:
    """Each part of the rank's per-client state as a store of its own (None: the run keeps no such part)."""

    rule: ResidualStore | None = None  # the strategy's client half's vector (SCAFFOLD's c_i, FedDyn's g_i): one chunk
    residuals: ResidualStore | None = None  # top-k's residuals, read by the exchange's chunk indices
    local: ResidualStore | None = None  # model.local tensors: one chunk
    local_marked: bool = False  # whether that chunk ends in its mark (PersonalTensors)
    personal: ResidualStore | None = None  # Ditto's personal models: chunks, then a mark when marked
    vectors: dict[str, ResidualStore] = field(default_factory=dict)  # a plug-in trainer's, each one marked chunk
    journal: UndoJournal | None = None  # clients.accept_failures: the put-back of dropped clients' vectors


def state_views(cfg: Config, layout: ClientStateLayout, state: ResidualStore) -> StateViews:
    """The views of ``state`` (the rank's store, or its ``Borrowing`` under per-round placement), through the undo
    journal where the run puts back the vectors of dropped clients (a borrowed client's is its home's to put back)."""
    journal = None
    if cfg.undoes_dropped_state:
        journal = UndoJournal(state, layout.journaled_chunks(),
                              lambda c: not isinstance(state, Borrowing) or c not in state.borrowed)
    base: ResidualStore = journal or state
    views = StateViews(journal=journal)
    for part in layout.parts:
        if part.name == "rule":
            views.rule = Section(base, part.first)
        elif part.name == "residuals":
            assert part.first == 0  # the compressor reads it by the exchange's chunk indices
            views.residuals = base
        elif part.name == "local":
            views.local, views.local_marked = Section(base, part.first), part.marked
        elif part.name == "personal":
            views.personal = MarkedChunks(base, part.first, part.count) if part.marked else base
        else:
            views.vectors[part.name.removeprefix("vector:")] = MarkedChunks(base, part.first, part.count)
    return views


def covered_tensors(flat: FlatModel, vector: StateVector) -> list[torch.Tensor]:
    """The model's tensors a declared vector covers, in its order (none for a custom vector)."""
    if vector.covers == "trainable":
        return [p for _, p in trainable(flat.module, flat.local)]
    if vector.covers == "exchanged":
        return [t for _, t in flat.tensors()]
    if vector.covers == "local":
        return [t for _, t in flat.local_tensors()]
    return []


VECTOR_DTYPE = torch.float32  # every declared vector's: its elements are fp32 (StateVector), as the store keeps them


def vector_problem(trainer: str, state: Mapping[str, object], declared: Mapping[str, int]) -> str | None:
    """What is wrong with the vectors ``trainer`` handed back, each declared with ``declared[name]`` elements, or
    None: each must be there, a flat fp32 tensor of its declared size, as mpifl handed it over. Refused, never
    reshaped or cast: a vector of another size holds something else than its declaration says, and a cast would
    change silently what is kept and checkpointed (the model's dtypes are refused on a mismatch, not cast, too)."""
    for name, elements in declared.items():
        if name not in state:
            return f"trainer {trainer} left no client vector {name!r} (it was declared; change it in place)"
        value = state[name]
        if not isinstance(value, torch.Tensor):
            return f"trainer {trainer} left client vector {name!r} as a {type(value).__name__}, not a torch.Tensor"
        mismatch = vector_mismatch(value, elements)
        if mismatch is not None:
            return f"trainer {trainer} left client vector {name!r} with {mismatch}"
    extra = [name for name in state if name not in declared]
    if extra:
        return (f"trainer {trainer} left client vector {extra[0]!r}, which its client_state does not declare (it "
                f"declares {', '.join(map(repr, declared))})")
    return None


def vector_divergence(trainer: str, state: Mapping[str, torch.Tensor]) -> str | None:
    """The first of the vectors ``trainer`` handed back (each as declared) that holds NaN or Inf, said with how
    many, or None. Such a client fails as one whose update diverged does: its update folded beside its old vectors
    would break what the two halves keep in step (FedDC's server mean of the clients' drifts, for one)."""
    for name, value in state.items():
        non_finite = int((~torch.isfinite(value)).sum())
        if non_finite:
            return f"trainer {trainer} left {non_finite} NaN/Inf values in client vector {name!r}"
    return None


def vector_mismatch(value: torch.Tensor, elements: int) -> str | None:
    """How ``value`` differs from a vector declared with ``elements`` fp32 elements ("shape (5,) where (1,) was
    declared"), or None."""
    checks: tuple[tuple[str, object, object], ...] = (
        ("shape", tuple(value.shape), (elements,)), ("dtype", dtype_name(value.dtype), dtype_name(VECTOR_DTYPE)))
    wrong = [(what, got, want) for what, got, want in checks if got != want]
    if not wrong:
        return None
    got = " and ".join(f"{what} {got}" for what, got, _ in wrong)
    declared = " and ".join(str(want) for _, _, want in wrong)
    return f"{got} where {declared} {'were' if len(wrong) > 1 else 'was'} declared"


class DeclaredVectors:
    """A plug-in trainer's per-client vectors on the rank (``Trainer.client_state``): each one copied out of the
    store into the training client's ``TrainContext.state`` before it trains, and written back after, unless its
    training failed or left a vector not as declared or holding NaN or Inf (the client fails then: ``problem``, and
    keeps its old ones). A vector the client never wrote starts as zeros or, with ``start='global'``, as the
    tensors it covers hold on arrival."""

    def __init__(self, flat: FlatModel, declared: tuple[tuple[str, StateVector], ...],
                 stores: dict[str, ResidualStore]):
        self.declared, self.stores = dict(declared), stores
        self.covered = {name: covered_tensors(flat, vector) for name, vector in declared}
        self.device = flat.device

    def load(self, client: int) -> tuple[dict[str, torch.Tensor], dict[str, bool]]:
        """``client``'s vectors (fresh fp32 tensors on the model's device, the trainer's to change in place) and
        whether each is new (never written by this client before)."""
        state, fresh = {}, {}
        for name, vector in self.declared.items():
            store = self.stores[name]
            fresh[name] = not store.has(client)
            if fresh[name] and vector.start == "global":
                state[name] = gather([t.float() for t in self.covered[name]],
                                     torch.empty(store.firsts[-1], device=self.device))
            else:
                state[name] = store.read(client, 0).to(self.device, copy=True)
        return state, fresh

    def problem(self, trainer: str, state: Mapping[str, object]) -> str | None:
        """What is wrong with the vectors ``trainer`` handed back for a client against their declarations, or None
        (``vector_problem``): asked before any of them, or anything else of the client's, is kept."""
        return vector_problem(trainer, state, {name: self.stores[name].firsts[-1] for name in self.declared})

    def keep(self, client: int, state: dict[str, torch.Tensor]) -> None:
        """Store ``client``'s vectors after it trained, each as declared (``problem`` found nothing, NaN and Inf
        included: a client whose vectors diverged fails, so that an update is never folded beside vectors it did not
        leave)."""
        for name, values in state.items():
            self.stores[name].write(client, 0, values.detach().cpu())


@dataclass
class ClientStateParts:
    """A client rank's per-client state: its one store and each rule that reads a part of it (None: the run keeps no
    such part)."""

    store: ResidualStore | None = None  # the rank's store (a Borrowing under per-round placement): what checkpoints
    views: StateViews = field(default_factory=StateViews)  # its parts as stores of their own
    controls: ClientHalf | None = None  # the strategy's client half over its vector (SCAFFOLD's c_i, FedDyn's g_i)
    controls_state: str = ""  # that vector, as the logs name it ("c_i")
    personal: PersonalTensors | None = None  # model.local tensors
    models: PersonalModels | None = None  # Ditto's personal models
    declared: DeclaredVectors | None = None  # a plug-in trainer's vectors
    lending: StateLending | None = None  # per_round placement: each round's loans of the store's vectors

    @property
    def journal(self) -> UndoJournal | None:
        """clients.accept_failures: the put-back of dropped clients' vectors (None where nothing is put back)."""
        return self.views.journal

    def put_back(self) -> str:
        """What a dropped client's put-back restores, as the log names it."""
        rule = [self.controls_state] if self.controls is not None else []
        return " and ".join(rule + (["trainer state"] if self.declared is not None else []))

    @property
    def residuals(self) -> ResidualStore | None:
        """Top-k's error-feedback residuals, read by the exchange's chunk indices."""
        return self.views.residuals


def put_back_line(clients: Sequence[int], state: str, where: str = "") -> str:
    """The log line of a rank that put back ``clients``' ``state`` (its journaled vectors) as a header named them:
    dropped past a deadline, refused or failed, or in a round not applied; ``where`` adds where it is put back."""
    one = len(clients) == 1
    who = f"logical client {clients[0]} was" if one else f"logical clients {range_list(clients)} were"
    return (f"{who} dropped from the round {'it' if one else 'they'} trained (past its deadline, its update refused or "
            f"failed, or the round not applied): {'its' if one else 'each one' + chr(39) + 's'} {state} is put "
            f"back{where} as it was before it trained")
