"""Per-round records, memory readings and the JSON-lines sink."""
from __future__ import annotations

import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Protocol


def peak_rss_bytes() -> int:
    """The current process's peak resident set size in bytes: the kernel's high-water mark (VmHWM), else ru_maxrss.

    ``/proc/self/statm`` (the current RSS) and ``ru_maxrss`` count differently (statm includes
    shared file pages that ru_maxrss may not), so the peak is read from ``/proc/self/status``,
    which counts like the current RSS, and never reported below it.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024
    try:
        with open("/proc/self/status") as f:
            hwm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
    except OSError:
        hwm = 0
    return max(peak, hwm)


def current_rss_bytes() -> int:
    """The current process's resident set size now, in bytes (VmRSS; the peak where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return peak_rss_bytes()


class RecordSink(Protocol):
    """Where each round's record goes besides metrics.jsonl (the experiment trackers: ``mpifl.trackers``)."""

    def write(self, record: dict) -> None:
        """Take one round's record."""

    def close(self) -> None:
        """No more records."""


class JsonLines:
    """Appends one JSON object per line and flushes it, so a crash loses no finished round; then hands the
    same record to each of ``also`` (the experiment trackers)."""

    def __init__(self, path: Path | None, also: Sequence[RecordSink] = ()):
        self.path = path
        self._file: IO[str] | None = open(path, "a") if path else None
        self.also = list(also)

    def write(self, record: dict) -> None:
        """Append ``record`` as one line and flush it (nothing without a path), then give it to ``also``."""
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        for sink in self.also:
            sink.write(record)

    def close(self) -> None:
        """Close the file, if one was opened, and then ``also``."""
        try:
            if self._file:
                self._file.close()
        finally:
            for sink in self.also:
                sink.close()
