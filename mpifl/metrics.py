"""Per-round records, memory readings and the JSON-lines sink."""
from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import IO


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss) in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    """This process's resident set size now, in bytes (Linux /proc; peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


class JsonLines:
    """Appends one JSON object per line and flushes it, so a crash loses no finished round."""

    def __init__(self, path: Path | None):
        self.path = path
        self._file: IO[str] | None = open(path, "a") if path else None

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
