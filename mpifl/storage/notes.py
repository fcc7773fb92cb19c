"""Each rank's last word in its run directory (``ranks/rank<rank>.json``), for ``mpifl status``'s post-mortem.

Apart from ``storage.rundir`` so that it imports nothing heavy (no h5py, no torch): a rank's supervisor
(``cli.supervisor``), which forked before any of them were imported, notes here that its rank was killed.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

RANK_NOTES = "ranks"  # <run dir>/ranks/rank<rank>.json: each rank's last word, for a post-mortem
RANK_NOTE = "rank{rank:05d}.json"
UNWRITTEN_NOTE = "rank{rank:05d}.unwritten"  # empty: this rank's newest note could not be written (a full disk)
# <run dir>/faults-struck/<index>-r<round>: each strike that ended an attempt, holding {kind, client, rank} as JSON
# (empty where an older mpifl wrote it)
FAULTS_STRUCK = "faults-struck"


def struck_records(run_dir: Path | None) -> dict[tuple[int, int], dict]:
    """(fault index, round) of every strike that ended an attempt of the run, each with what its file says of it
    (``kind``, ``client``, ``rank`` and ``time``, its file's; no more where an older mpifl left it empty). Here, not in
    ``storage.rundir``, so that a rank's supervisor can say that the config's fault killed its rank."""
    folder = run_dir / FAULTS_STRUCK if run_dir is not None else None
    if folder is None or not folder.is_dir():
        return {}
    struck = {}
    for path in folder.iterdir():
        index, _, round_ = path.name.partition("-r")
        if index.isdigit() and round_.isdigit():
            record: dict = {}
            with contextlib.suppress(OSError, ValueError):
                record = {**json.loads(path.read_text() or "{}"), "time": path.stat().st_mtime}
            struck[(int(index), int(round_))] = record if isinstance(record, dict) else {}
    return struck


def note_rank(run_dir: Path | None, rank: int, state: str, round_: int, **detail: object) -> None:
    """Record what ``rank`` is doing (``started``, ``round``, ``finished``, ``failed``, ...) with the time, by
    atomic rename: if the launcher kills the job, the run directory still says which rank went quiet, when,
    and in which round (``mpifl status``).

    Best effort: a note is for the post-mortem, so one the file system refuses (a full disk, most often while
    the job is already failing on a checkpoint) must not raise over the error that ends the job. It is dropped,
    the previous note kept, its temporary file removed, and an empty ``UNWRITTEN_NOTE`` left where the disk
    still takes one (a new file needs no data block), so that ``mpifl status`` knows the notes are incomplete."""
    if run_dir is None:
        return
    folder = run_dir / RANK_NOTES
    note = {"rank": rank, "state": state, "round": round_, "time": time.time(), **detail}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _replace_text(folder / RANK_NOTE.format(rank=rank), json.dumps(note))
    except OSError:
        _touch_quietly(folder / UNWRITTEN_NOTE.format(rank=rank))
        return
    with contextlib.suppress(OSError):  # a later note is on disk: the notes are whole again
        (folder / UNWRITTEN_NOTE.format(rank=rank)).unlink(missing_ok=True)


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` by atomic rename; on failure, leave ``path`` as it was and no temporary file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def _touch_quietly(path: Path) -> None:
    """Create ``path`` empty if the file system lets us; nothing otherwise."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))


class RankNotes:
    """One rank's notes (``note_rank``), remembering the round, so a failure is noted where it happened."""

    def __init__(self, run_dir: Path | None, rank: int):
        self.run_dir, self.rank, self.last_round, self.last_state = run_dir, rank, 0, ""

    def __call__(self, state: str, round_: int | None = None, **detail: object) -> None:
        """Note ``state`` in ``round_`` (default: the last round noted)."""
        self.last_round = self.last_round if round_ is None else round_
        self.last_state = state
        note_rank(self.run_dir, self.rank, state, self.last_round, **detail)

    @classmethod
    def picked_up(cls, run_dir: Path, rank: int) -> RankNotes:
        """``rank``'s notes as its last note left them (its round and state), for a note from outside the rank (its
        supervisor's, once it was killed)."""
        notes = cls(run_dir, rank)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            last = json.loads((run_dir / RANK_NOTES / RANK_NOTE.format(rank=rank)).read_text())
            notes.last_round, notes.last_state = int(last["round"]), str(last["state"])
        return notes

    def failed(self, reason: str, signal: str | None = None) -> None:
        """Note a failure; one after this rank finished (rank 0 taking up a silent rank's late update once every
        round is on disk), or after a stop on request (a rank silent past SIGTERM's grace, aborted), leaves that
        state, with the failure as what came after. ``signal``: the signal that killed the rank (``SIGKILL``), which
        ``mpifl status`` names first."""
        if self.last_state in ("finished", "interrupted"):
            self(self.last_state, then_failed=reason, signal=signal)
        else:
            self("failed", reason=reason, signal=signal)


def read_rank_notes(run_dir: Path) -> dict[int, dict]:
    """Every rank's last word, by rank (ranks that never wrote one are absent)."""
    notes = {}
    for path in sorted((run_dir / RANK_NOTES).glob("rank*.json")):
        try:
            note = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        notes[int(note["rank"])] = note
    return notes


def unwritten_notes(run_dir: Path) -> list[int]:
    """The ranks whose newest note could not be written (``note_rank``): what their notes say is not their last word."""
    return sorted(int(path.stem[4:]) for path in (run_dir / RANK_NOTES).glob("rank*.unwritten")
                  if path.stem[4:].isdigit())
