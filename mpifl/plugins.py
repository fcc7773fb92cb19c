"""User code by import path (``package.module:attribute``), and its keyword arguments checked against its signature."""
from __future__ import annotations

import difflib
import importlib
import inspect
import re
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
            raise ImportError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
    return obj


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
