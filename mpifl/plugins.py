"""User code by import path: ``package.module:attribute``."""
from __future__ import annotations

import importlib
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
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
    return obj
