"""The algorithms whose client half runs where clients train, each in one file with both of its halves.

- ``scaffold``: SCAFFOLD (control variates: a per-client c_i, the server's c as a summed stream in the model);
- ``feddyn``: FedDyn (a per-client gradient state g_i, the server's h);
- ``ditto``: Ditto (a personal model per client, ``train.ditto_lambda``, beside any strategy);
- ``local_layers``: FedBN and FedPer (each client's own ``model.local`` tensors).

``contract`` is what a client half is (``ClientAlgorithm``), public through ``mpifl.api``. A strategy names its client
half by ``Capabilities.client_rule``: a built-in rule below, or a plug-in's import path ``package.module:attr`` to a
``ClientAlgorithm``. Nothing outside ``mpifl.aggregation.registry`` and ``mpifl.config.capabilities`` names a
strategy; this table names client halves only.
"""
from __future__ import annotations

import typing

from mpifl.algorithms import feddyn, scaffold
from mpifl.algorithms.contract import ClientAlgorithm, ClientHalf, LaneCorrections
from mpifl.learning.models import Streams
from mpifl.plugins import call_problem, is_import_path, resolve

# Capabilities.client_rule of a built-in strategy -> its client half
BUILTIN_RULES: dict[str, ClientAlgorithm] = {"control_variates": scaffold.CLIENT, "dynamic_regularizer": feddyn.CLIENT}


def client_algorithm(rule: str) -> ClientAlgorithm | None:
    """The client half a strategy's ``client_rule`` names (None for none); ValueError for a name that is neither
    a built-in rule nor an import path to a ``ClientAlgorithm``."""
    if not rule:
        return None
    if rule in BUILTIN_RULES:
        return BUILTIN_RULES[rule]
    if not is_import_path(rule):
        raise ValueError(f"client_rule {rule!r} is neither one of {sorted(BUILTIN_RULES)} nor an import path "
                         "'package.module:attr' to a mpifl.api.ClientAlgorithm")
    found = resolve(rule)
    if not isinstance(found, ClientAlgorithm):
        raise ValueError(f"client_rule {rule!r} is {type(found).__name__}, not a mpifl.api.ClientAlgorithm")
    return found


def client_rule_problem(rule: str, strategy_name: str) -> str | None:
    """What stops ``rule`` (a strategy's ``Capabilities.client_rule``) from naming a client half, as a config error
    naming ``strategy.name``; None when it names one or is empty. Why before MPI: the client ranks import it only
    when they start training, so a mistyped path would otherwise be a traceback on every rank of a started job."""
    try:
        algorithm = client_algorithm(rule)
    except (ImportError, ValueError) as err:
        return f"strategy.name: {strategy_name!r} names its client half by Capabilities.client_rule: {err}"
    problem = half_problem(algorithm) if algorithm is not None and rule not in BUILTIN_RULES else None
    if problem:
        return f"strategy.name: {strategy_name!r}, its client half {rule!r}: {problem}"
    return None


# What mpifl calls of a client half: the builders (ClientAlgorithm's fields), then the methods of the classes they
# build, where the builder is the class or declares it (``_declared_half``), with their arguments as the contract
# names them (mpifl.algorithms.contract)
BUILDER_CALLS = (("leader", ("work", "store", "cfg")), ("member", ("work", "cfg")), ("shard", ("rows", "store", "cfg")),
                 ("streams", ("model", "local")))
LEADER_CALLS = (("training", ("client", "global_bytes")), ("update", ("client", "global_bytes", "steps", "weight")))
MEMBER_CALLS = (("training", ()),)
SHARD_CALLS = (("training", ("client",)), ("update", ("client", "steps", "weight")))


def half_problem(algorithm: ClientAlgorithm) -> str | None:
    """Why mpifl cannot call a plug-in client half as the contract says it will, or None: a builder that does not
    take its arguments (``leader(work, store, cfg)``), or, in the class a builder declares, a method missing or not
    taking its arguments (``update(client, global_bytes, steps, weight)``). Why before MPI: each would otherwise be
    a TypeError on every client rank once training starts. A half built by a lambda is checked only as far as its
    builder; what its methods do is known only when they run."""
    for field, args in BUILDER_CALLS:
        builder = getattr(algorithm, field)
        problem = call_problem(builder, f"{field}({', '.join(args)})", args) if builder is not None else None
        if problem:
            return problem
    for field, calls in (("leader", LEADER_CALLS), ("member", MEMBER_CALLS), ("shard", SHARD_CALLS)):
        builder = getattr(algorithm, field)
        half = _declared_half(builder) if builder is not None else None
        problem = methods_problem(half, calls) if half is not None else None
        if problem:
            return problem
    return None


def methods_problem(half: type, calls: tuple[tuple[str, tuple[str, ...]], ...]) -> str | None:
    """Why the class ``half`` lacks a method mpifl calls, or takes other arguments than it is called with."""
    for method, args in calls:
        fn = getattr(half, method, None)
        called = f"{method}({', '.join(args)})"
        if not callable(fn):
            return f"{half.__name__} has no method {called}, which mpifl calls"
        problem = call_problem(fn, called, ("self", *args))
        if problem:
            return problem
    return None


def lanes_problem(rule: str, batched_clients: int) -> str | None:
    """What stops ``train.batched_clients`` from training the clients of the client half ``rule`` as lanes, as a
    config error naming that key; None when nothing does, or when the half's type is not declared. A lane takes a
    client half only as a correction of every step (``LaneCorrections``), which the half's class tells: the
    ``ClientAlgorithm.leader`` given as a class, or as a function annotated to return one. Why before MPI: the
    half is built only as a rank starts training, where a refusal ends the job with an abort; a half whose type
    is undeclared (a lambda) is still checked there, once built (``no_lanes``)."""
    if not batched_clients:
        return None
    algorithm = client_algorithm(rule)
    half = _declared_half(algorithm.leader) if algorithm is not None else None
    if half is None or issubclass(half, LaneCorrections):
        return None
    return no_lanes(half.__name__)


def no_lanes(half: str) -> str:
    """The refusal of ``train.batched_clients`` for the client half of class ``half``, which corrects no step."""
    return (f"train.batched_clients: the strategy's client half ({half}) has no correction a lane can take (a "
            "mpifl.api.LaneCorrections: a method correction(client) giving the client's step correction); set "
            "train.batched_clients=0")


def _declared_half(leader: typing.Callable[..., ClientHalf]) -> type | None:
    """The class ``leader`` builds: itself when it is one, else its return annotation when that resolves to a
    class; None when neither tells (a lambda, an annotation naming what its module does not import)."""
    if isinstance(leader, type):
        return leader
    try:
        returned = typing.get_type_hints(leader).get("return")
    except Exception:  # noqa: BLE001 - any unresolvable annotation only means the type is not declared
        return None
    return returned if isinstance(returned, type) else None


def model_streams(rule: str) -> Streams | None:
    """The summed streams the client half ``rule`` appends to the model (SCAFFOLD's c), or None."""
    algorithm = client_algorithm(rule)
    return algorithm.streams if algorithm is not None else None
