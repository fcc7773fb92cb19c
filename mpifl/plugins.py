"""User code by import path (``package.module:attribute``), and its keyword arguments checked against its signature."""
from __future__ import annotations

import difflib
import importlib
import inspect
import math
import re
import types
import typing
from typing import Any

_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_import_path(text: str) -> bool:
    """True when ``text`` looks like ``package.module:attribute``."""
    return isinstance(text, str) and bool(_PATH.match(text))


def resolve(path: str) -> Any:
    """Import ``package.module`` and return its ``attribute`` (dots allowed)."""
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import module {module_name!r} from {path!r}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a SyntaxError, or anything the module raises while it loads
        raise ImportError(f"cannot import module {module_name!r} from {path!r}: {type(err).__name__}: {err}") \
            from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})"
                              f"{_closest_attribute(obj, part)}") from None
    return obj


def _closest_attribute(obj: Any, name: str) -> str:
    """"; did you mean 'X'?" for a mistyped class or function name: the closest public name ``obj`` defines
    (a module's own or imported names alike, so an ``MyStratgy`` finds ``MyStrategy``), else nothing."""
    public = [n for n in dir(obj) if not n.startswith("_")]
    close = difflib.get_close_matches(name, public, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def kwargs_problem(fn: Any, kwargs: dict, key: str, supplied: tuple[str, ...] = ()) -> str | None:
    """What is wrong with ``kwargs`` for ``fn`` (a name it does not take, with the closest one; a parameter
    without a default left unset), or None.

    ``supplied`` are the parameters mpifl passes itself (a model's input shape, say): users may not set them.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return None
    fn_name = getattr(fn, "__name__", fn)
    allowed = [n for n, p in params.items() if n not in supplied and n != "self"
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name in kwargs:
        if name in supplied:
            return f"{key}.{name}: mpifl passes {name} itself; remove it"
        if name not in allowed and not open_ended:
            close = difflib.get_close_matches(str(name), allowed, n=1, cutoff=0.5)
            passed = [n for n in supplied if n in params]
            takes = ", ".join(allowed) or ("no settings besides what mpifl passes it: " + ", ".join(passed)
                                           if passed else "nothing")
            hint = f"did you mean '{key}.{close[0]}'?" if close else f"it takes: {takes}"
            return f"unknown key '{key}.{name}': not a parameter of {fn_name}; {hint}"
    missing = [n for n in allowed if params[n].default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        return f"{key}.{missing[0]}: {fn_name} takes {missing[0]} without a default; set it"
    return None


def call_problem(fn: Any, called: str, args: tuple[str, ...], keywords: tuple[str, ...] = ()) -> str | None:
    """Why ``fn`` cannot be called as mpifl calls it, with the positional ``args`` and the ``keywords`` (their
    names, as the contract writes them), or None: "LeaderNoCfg.__init__(work, store) cannot take mpifl's call
    leader(work, store, cfg): too many positional arguments". A class is checked as its ``__init__``
    (without self), a method of a class as the class's function (self then given too). Why before MPI: the call
    would otherwise fail on every client rank once it starts training, with a traceback each."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return None
    try:
        signature.bind(*args, **{k: None for k in keywords})
    except TypeError as err:
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
        if inspect.isclass(fn):
            name += ".__init__"
        shown = ", ".join(n for n in signature.parameters)
        return f"{name}({shown}) cannot take mpifl's call {called}: {err}"
    return None


# a number written as text, as YAML 1.1 leaves `1e6`: the config schema reads it with the same pattern
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def typed_kwargs(fn: Any, kwargs: dict, key: str) -> tuple[dict, str | None]:
    """``kwargs`` converted to the types ``fn``'s parameters are annotated with, and what could not be, or None.

    YAML 1.1 reads ``1e6`` (no dot) as a string, and ``1`` as an int where a float is meant: a plug-in's settings
    are converted as the built-in keys are (a number written as text to int or float, an int to float), so that
    ``strategy.kwargs.clip: 1e6`` reaches ``clip: float`` as 1000000.0. Parameters without an annotation, or with
    one that is not a plain scalar, a list of scalars or an optional of either, are passed as written."""
    hints = _annotations(fn)
    out = dict(kwargs)
    for name, value in kwargs.items():
        hint = hints.get(name)
        if hint is None:
            continue
        try:
            out[name] = _converted(value, hint)
        except (TypeError, ValueError) as err:
            return kwargs, f"{key}.{name}: {err}"
    return out, None


def _annotations(fn: Any) -> dict[str, Any]:
    """The annotations of ``fn``'s parameters (of ``__init__`` for a class), each resolved on its own: one that names
    something the module imports only for type checkers (``if TYPE_CHECKING:``) is left out, and only it, so the
    plug-in's other settings are still converted."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        return typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - some annotation does not resolve: resolve them one by one below
        pass
    raw = getattr(inspect.unwrap(target), "__annotations__", {})
    namespace = getattr(inspect.unwrap(target), "__globals__", {})
    hints = {}
    for name, annotation in raw.items():
        try:
            hints[name] = typing.get_type_hints(_Holder(name, annotation), globalns=namespace)[name]
        except Exception:  # noqa: BLE001 - this one names what only a type checker sees: passed as written
            continue
    return hints


class _Holder:
    """A stand-in carrying one annotation, for typing.get_type_hints to resolve alone."""

    def __init__(self, name: str, annotation: Any):
        self.__annotations__ = {name: annotation}


def _converted(value: Any, hint: Any) -> Any:
    """``value`` as annotation ``hint`` asks (ValueError naming what was expected where it cannot be)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        scalars = [a for a in args if a is not type(None)]
        if len(scalars) == 1:
            return _converted(value, scalars[0])
        return value  # a union of several types: the plug-in sorts it out
    if origin in (list, tuple) and args and value is not None and isinstance(value, (list, tuple)):
        inner = args[0]
        items = [_converted(v, inner) for v in value]
        return items if origin is list else tuple(items)
    if hint is float:
        return _number(value, float)
    if hint is int:
        return _number(value, int)
    if hint is bool and not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    if hint is str and not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__} {value!r}")
    return value


def _number(value: Any, kind: type) -> int | float:
    """``value`` as an int or a float: a number, or text that spells one (``1e6``); never a bool."""
    if isinstance(value, str) and NUMBER.fullmatch(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    if kind is float:
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value!r}")
        return float(value)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)
