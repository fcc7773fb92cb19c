"""Per-client state, one owner: what a run keeps per logical client on the rank that hosts it, and how each client's
one fp32 vector is laid out, part by part.

A run may keep several kinds at once, each a *part* of every client's vector, always in this order:

============  =====================================================  ==========================================
part          what                                                   chunks (elements)
============  =====================================================  ==========================================
``rule``      SCAFFOLD's c_i or FedDyn's g_i                         one: the trainable parameters that travel
``residuals`` top-k's error-feedback residual                        the exchange's chunks, so it is read by
                                                                     the exchange's chunk indices (first part)
``local``     ``model.local`` tensors (FedBN, FedPer)                one: the local tensors' (+1: its mark)
``personal``  Ditto's personal model                                 the exchange's chunks, then its own local
                                                                     tensors' with ``model.local`` (+ a mark)
``vector:N``  a plug-in trainer's declared vector ``N``              one: its size, then a mark
============  =====================================================  ==========================================

A *mark* is one element set to 1 once the client wrote that part whole: where other parts share the vector, a
vector alone does not say that the client has this part of its own (the others wrote it). A part alone in the
vector needs none (``has``); a plug-in's vectors are always marked. ``rule`` and ``residuals`` need no mark: zeros
are what a client that never trained has. The layouts of one or two built-in kinds are those of the versions
before this module, so their checkpoints resume.

Which parts a run has is decided here from the config alone (``ClientState.of``); how many elements each holds
needs the model's sizes (``StateSizes``), which a client rank and ``mpifl plan`` each know in their own way and
hand to the same ``layout``. Why one owner: run time (mpifl.roles), checkpoints and resume (mpifl.storage), the
loans of ``clients.placement: per_round`` and ``mpifl plan`` read one layout, so no two of them can disagree.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

COVERS = ("trainable", "exchanged", "local", "custom")
STARTS = ("zeros", "global")


@dataclass(frozen=True)
class StateVector:
    """A vector that a plug-in trainer keeps per logical client (``Trainer.client_state``, a mapping of names to
    these): mpifl stores it in RAM or on disk within ``train.state_ram_mb``, checkpoints and resumes it bitwise,
    lends it under ``clients.placement: per_round``, puts it back when its client is dropped past its deadline, and
    counts it in ``mpifl plan``."""

    # which tensors it covers, as one fp32 element each in the model's order: 'trainable' (the parameters that
    # train and travel), 'exchanged' (every tensor that travels, BatchNorm's statistics too), 'local' (the
    # model.local tensors), or 'custom' (``size`` elements of the plug-in's own meaning)
    covers: str = "trainable"
    size: int = 0  # covers='custom': its elements
    # what a client that never wrote it starts from: 'zeros', or 'global': the tensors it covers as the client
    # receives them before its first training (the global model, with the client's own model.local tensors)
    start: str = "zeros"

    def problem(self, name: str) -> str | None:
        """What is wrong with this declaration of vector ``name``, or None."""
        if not name.isidentifier():
            return f"vector name {name!r} is not an identifier"
        if self.covers not in COVERS:
            return f"vector {name!r}: covers={self.covers!r}; choose one of {', '.join(map(repr, COVERS))}"
        if self.start not in STARTS:
            return f"vector {name!r}: start={self.start!r}; choose one of {', '.join(map(repr, STARTS))}"
        if (self.covers == "custom") != (self.size > 0):
            return f"vector {name!r}: size > 0 goes with covers='custom' and only with it (got size={self.size})"
        if self.covers == "custom" and self.start == "global":
            return f"vector {name!r}: a custom vector covers no tensors to start from; start='zeros'"
        return None


@dataclass(frozen=True)
class StateSizes:
    """The model's sizes a layout needs, in fp32 elements: the trainable parameters that travel (SCAFFOLD's and
    FedDyn's vectors), each exchange chunk's elements, and the ``model.local`` tensors'."""

    trainable: int
    chunks: tuple[int, ...]  # elements of each exchange chunk, in order
    local: int
    tensors: int = 0  # elements of the exchanged tensors themselves (the chunks may hold padding between them)

    @property
    def exchanged(self) -> int:
        """Every element that travels."""
        return sum(self.chunks)

    def covered(self, vector: StateVector) -> int:
        """Elements of a declared vector."""
        return {"trainable": self.trainable, "exchanged": self.tensors or self.exchanged, "local": self.local,
                "custom": vector.size}[vector.covers]


@dataclass(frozen=True)
class Part:
    """One kind of state within each client's vector: its chunks' elements, and whether a mark follows."""

    name: str  # 'rule', 'residuals', 'local', 'personal' or 'vector:<declared name>'
    chunks: tuple[int, ...]
    marked: bool
    first: int = 0  # the index of its first chunk in the whole vector's chunks (set by ``layout``)

    @property
    def count(self) -> int:
        """Its chunks, the mark's not counted (the local part's mark is an element of its one chunk)."""
        return len(self.chunks)


@dataclass(frozen=True)
class ClientStateLayout:
    """Each client's one vector: its parts in order, and the chunk boundaries a store reads and writes by."""

    parts: tuple[Part, ...]

    @property
    def firsts(self) -> list[int]:
        """Each chunk's first element, the element count last: what a store (storage.residuals) is opened with."""
        sizes = [size for part in self.parts for size in self._stored_chunks(part)]
        out = [0]
        for size in sizes:
            out.append(out[-1] + size)
        return out

    @property
    def elements(self) -> int:
        """Elements of one client's vector."""
        return self.firsts[-1]

    def part(self, name: str) -> Part | None:
        """The part named ``name``, or None when the run keeps no such state."""
        return next((p for p in self.parts if p.name == name), None)

    def mark(self, part: Part) -> int | None:
        """The element of each client's vector that holds ``part``'s mark (1 once the client wrote that part
        whole), or None for a part without one: the last element of its stored chunks."""
        if not part.marked:
            return None
        return self.firsts[part.first + len(self._stored_chunks(part))] - 1

    def journaled_chunks(self) -> tuple[int, ...]:
        """The chunks put back when a client is dropped past its deadline (``clients.accept_failures``): SCAFFOLD's
        and FedDyn's vectors, which the server's c or h never took the dropped delta into, and every plug-in vector
        with its mark (the client is recorded as not having trained). Residuals, local tensors and a personal model
        keep what the client's training made of them, as before this module."""
        out: list[int] = []
        for part in self.parts:
            if part.name == "rule" or part.name.startswith("vector:"):
                out += range(part.first, part.first + len(self._stored_chunks(part)))
        return tuple(out)

    @property
    def journaled_elements(self) -> int:
        """Elements of one client's journaled chunks: what the put-back of a dropped client copies."""
        firsts = self.firsts
        return sum(firsts[i + 1] - firsts[i] for i in self.journaled_chunks())

    @staticmethod
    def _stored_chunks(part: Part) -> tuple[int, ...]:
        """A part's chunks as stored: a marked local part holds its mark in its one chunk; a marked personal model
        or plug-in vector has a chunk of one element after its own."""
        if part.marked and part.name == "local":
            return (part.chunks[0] + 1,)
        return part.chunks + ((1,) if part.marked else ())


@dataclass(frozen=True)
class ClientState:
    """What a run keeps per logical client, from its config alone: which parts, their RAM budget, where they spill.

    With a client group (clients.ranks_per_client) its leader keeps it and sends the members what they train
    with; error-feedback residuals need nothing on the members: they shape the update the leader alone encodes."""

    what: str  # as the plan and the logs name it
    ram_key: str  # the config keys of its RAM budget
    ram_mb: float  # that budget: beyond it, one HDF5 file per rank
    folder: str  # the folder of those files in the run directory
    # the strategy's built-in client rule (Capabilities.client_rule): 'control_variates' (SCAFFOLD's c_i) or
    # 'dynamic_regularizer' (FedDyn's g_i), one vector of the trainable size each
    rule: str | None = None
    residuals: bool = False
    local: bool = False
    personal: bool = False
    vectors: tuple[tuple[str, StateVector], ...] = ()  # a plug-in trainer's declared vectors, in declared order

    @property
    def restorable(self) -> str:
        """What of it the put-back of a dropped client restores, as the logs name it ("" where none): the strategy's
        rule's vector (SCAFFOLD's c_i, FedDyn's g_i) and a plug-in trainer's declared vectors
        (``ClientStateLayout.journaled_chunks``), which must read as if the client had not trained."""
        kinds = ([KINDS.get(self.rule, PLUGIN_RULE)[0]] if self.rule else []) + (
            [KINDS["vectors"][0]] if self.vectors else [])
        return " and ".join(kinds)

    @property
    def lasting(self) -> str:
        """What of it a client keeps as its training left it though its update is not applied (dropped past its
        deadline, or its round left out), as the logs name it ("" where none): top-k's residuals, local tensors and
        Ditto's personal models, which are the client's own (``ClientStateLayout.journaled_chunks``)."""
        kinds = [kind for kind, kept in (("residuals", self.residuals), ("local", self.local),
                                         ("personal", self.personal)) if kept]
        return " and ".join(KINDS[kind][0] for kind in kinds)

    def layout(self, sizes: StateSizes) -> ClientStateLayout:
        """The layout of each client's vector for a model of ``sizes``."""
        shared = sum(map(bool, (self.rule, self.residuals, self.local, self.personal))) + len(self.vectors) > 1
        parts: list[Part] = []
        if self.rule:
            parts.append(Part("rule", (sizes.trainable,), marked=False))
        if self.residuals:
            parts.append(Part("residuals", sizes.chunks, marked=False))
        if self.local:
            parts.append(Part("local", (sizes.local,), marked=shared))
        if self.personal:  # its own local tensors are its chunk after the model's (PersonalModels)
            parts.append(Part("personal", sizes.chunks + ((sizes.local,) if self.local else ()), marked=shared))
        parts += [Part(f"vector:{name}", (sizes.covered(vector),), marked=True) for name, vector in self.vectors]
        placed, first = [], 0
        for part in parts:
            placed.append(Part(part.name, part.chunks, part.marked, first))
            first += len(ClientStateLayout._stored_chunks(part))
        return ClientStateLayout(tuple(placed))


# a built-in client half's vector, by its rule, as messages name it (mpifl.algorithms: ClientAlgorithm.state)
RULE_VECTORS = {"control_variates": "c_i", "dynamic_regularizer": "g_i"}

# (part, as the logs name it, its RAM budget's config key, its folder in the run directory)
KINDS = {
    "control_variates": ("SCAFFOLD control variates", "strategy.control_ram_mb", "controls"),
    "dynamic_regularizer": ("FedDyn gradient states", "strategy.control_ram_mb", "controls"),
    "residuals": ("error-feedback residuals", "compression.residual_ram_mb", "residuals"),
    "local": ("local tensors (model.local)", "model.local_ram_mb", "locals"),
    "personal": ("Ditto personal models", "train.personal_ram_mb", "personal"),
    "vectors": ("the trainer's per-client vectors", "train.state_ram_mb", "state"),
}

# a plug-in strategy's client half (its client_rule an import path)
PLUGIN_RULE = ("the strategy's per-client vectors", "strategy.control_ram_mb", "controls")


def client_state(rule: str | None, residuals: bool, local: bool, personal: bool,
                 vectors: Mapping[str, StateVector], budgets: Mapping[str, float]) -> ClientState | None:
    """The state a run keeps per client from which kinds it has (``budgets``: each kind's RAM budget by config
    key), or None for none."""
    kinds = [k for k, kept in ((rule, bool(rule)), ("residuals", residuals), ("local", local),
                               ("personal", personal), ("vectors", bool(vectors))) if kept]
    if not kinds:
        return None
    described = [KINDS.get(str(k), PLUGIN_RULE) for k in kinds]
    keys = list(dict.fromkeys(key for _, key, _ in described))
    return ClientState(" and ".join(what for what, _, _ in described), " + ".join(keys),
                       math.fsum(budgets[key] for key in keys), described[0][2], rule=rule, residuals=residuals,
                       local=local, personal=personal, vectors=tuple(vectors.items()))


def declared_vectors(trainer: object, key: str = "train.trainer") -> dict[str, StateVector]:
    """A plug-in trainer's declared per-client vectors (its ``client_state`` attribute: names to ``StateVector``),
    checked; ValueError naming ``key`` when the declaration is malformed."""
    declared = getattr(trainer, "client_state", None) or {}
    name = getattr(trainer, "__name__", type(trainer).__name__)
    if not isinstance(declared, Mapping):
        raise ValueError(f"{key}: {name}.client_state must map vector names to mpifl.api.StateVector, "
                         f"got {type(declared).__name__}")
    for vector_name, vector in declared.items():
        if not isinstance(vector, StateVector):
            raise ValueError(f"{key}: {name}.client_state[{vector_name!r}] is {type(vector).__name__}, not a "
                             "mpifl.api.StateVector")
        problem = vector.problem(str(vector_name))
        if problem:
            raise ValueError(f"{key}: {name}.client_state: {problem}")
    return dict(declared)
