"""Per-round records, memory readings and the JSON-lines sink."""
from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

# Names an update's header carries for mpifl's own records: the ranks' peaks and costs (rank_*), a client group's
# costs (group_*), secure aggregation's (secagg_*) and Ditto's (ditto_*). A trainer's metric must not take them:
# the server would read it as mpifl's own, and leave it out of client_metrics.
OWN_METRIC_PREFIXES = ("rank_", "group_", "secagg_", "ditto_")
# Ditto (train.ditto_lambda): the client's personal training went non-finite, so its v_i was not kept (the round's
# record names these clients: ``personal_diverged``)
PERSONAL_DIVERGED = "ditto_personal_diverged"


def own_metric_names(names: Iterable[object]) -> list[str]:
    """Those of ``names`` that are mpifl's own (``OWN_METRIC_PREFIXES``), sorted."""
    return sorted(str(n) for n in names if str(n).startswith(OWN_METRIC_PREFIXES))


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


def bytes_written() -> int | None:
    """Bytes this process has sent to storage so far: ``write_bytes`` of /proc/self/io, counted by the kernel as
    pages are dirtied, so files written and memory-mapped windows alike (the out-of-core server's); None where
    there is no such file (not Linux). Not ``wchar``, which counts every write call, sockets included: a sharded
    client's gloo traffic counted there as 1.4 GB "written" in a round that wrote one 185 MB checkpoint. A file
    system that does not account its writes (tmpfs) adds nothing."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None



def json_line(record: dict) -> str:
    """``record`` as one line of RFC 8259 JSON: a non-finite float (epsilon without noise is infinite, a diverged
    loss NaN) becomes null, since Python's ``Infinity`` and ``NaN`` stop strict readers (jq, JavaScript)."""
    return json.dumps(finite_or_null(record), allow_nan=False)


@dataclass(frozen=True)
class ReadRecords:
    """A metrics.jsonl read up to its first line that is torn or not JSON: the records before it, and that line's
    number (None where every line reads), JSON's complaint about it, and whether it is the file's last line (a job
    killed while it appended) or has records after it (the file was damaged)."""

    records: list[dict]
    bad_line: int | None = None
    complaint: str = ""
    bad_line_is_last: bool = False


def read_records(path: Path) -> ReadRecords:
    """The records of the JSON-lines file ``path`` (none where it does not exist), blank lines skipped."""
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines() if path.exists() else [], 1)
             if line.strip()]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            complaint = f"{err.msg.removesuffix(' at')} at column {err.colno}"  # json's msg may end in 'at'
            return ReadRecords(records, number, complaint, index == len(lines) - 1)
    return ReadRecords(records)


def finite_or_null(value: object) -> object:
    """``value`` with every non-finite float inside it (dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value

class CostMeter:
    """What this process has spent since the last reading: CPU-seconds (user and system, every thread:
    ``time.process_time``) and bytes written (``bytes_written``; left out where it cannot be read)."""

    def __init__(self) -> None:
        self.cpu, self.written = time.process_time(), bytes_written()

    def since_last(self) -> dict[str, float]:
        """``cpu_seconds`` and ``bytes_written`` since the last call (or since this meter was made)."""
        cpu, written = time.process_time(), bytes_written()
        out: dict[str, float] = {"cpu_seconds": cpu - self.cpu}
        if written is not None and self.written is not None:
            out["bytes_written"] = written - self.written
        self.cpu, self.written = cpu, written
        return out


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
            self._file.write(json_line(record) + "\n")
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
