"""Where mpifl keeps what it can always rebuild but need not rebuild in every process: the robust aggregators'
compiled kernels (mpifl.aggregation.native) and the standard library's parsed docstrings (mpifl.learning.text).

``$MPIFL_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpifl`` or ``~/.cache/mpifl``, else a folder of the user's in the
temporary directory. Everything in it is keyed by what it was made from, so a stale or half-written entry is
never read as a fresh one, and deleting the folder loses nothing but time.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder: $MPIFL_CACHE_DIR, else the user's cache folder where it can be written, else a temporary
    one (a read-only home on a compute node)."""
    if os.environ.get("MPIFL_CACHE_DIR"):
        return Path(os.environ["MPIFL_CACHE_DIR"])
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpifl"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"mpifl-{os.getuid()}"


def read_json(name: str) -> object | None:
    """The JSON document cached as ``name``, or None where there is none or it cannot be read whole."""
    text = read_text(name)
    try:
        return json.loads(text) if text is not None else None
    except ValueError:
        return None


def write_json(name: str, document: object) -> None:
    """Cache ``document`` as ``name`` (``write_text``)."""
    write_text(name, json.dumps(document))


def read_text(name: str) -> str | None:
    """The text cached as ``name``, or None where there is none or it cannot be read."""
    try:
        return (cache_dir() / name).read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None


def write_text(name: str, text: str) -> None:
    """Cache ``text`` as ``name``, published by rename (processes writing at once each publish a whole file, and
    none is read half-written); best effort: a cache that cannot be written costs time, never the run."""
    folder = cache_dir()
    partial = folder / f".{name}.{os.getpid()}"
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, folder / name)
    with contextlib.suppress(OSError):
        partial.unlink(missing_ok=True)
