"""``mpifl run`` as two processes per rank: a small supervisor, which the launcher started, and the rank itself.

Why: a rank that leaves through ``os._exit(0)`` or C's ``_exit(0)`` (in a plug-in, a library or a ``faults:``
entry) skips everything Python would do on its way out. MPICH's ``mpiexec`` then kills the other ranks and itself
exits 0: three times out of three on 2026-11-29 (MPICH 4 from PyPI), with one of six rounds on disk. The job looks
successful. The supervisor knows whether its rank left through mpifl's own exit, because the rank says so on a pipe
just before it exits. An exit status of 0 that the rank did not announce becomes 1, with a line that names the rank,
so that the launcher reports a failure.

A rank that fails before MPI starts on it is a second hazard: the other ranks then wait for it in ``MPI_Init`` for
ever, because MPICH's ``mpiexec`` ends a job only for a rank that was killed, or that failed once MPI had started
(here a rank that exited 1 before ``MPI_Init`` left the others waiting until ``timeout`` ended them). The rank
also tells its supervisor when MPI has started. A rank that ends without MPI started, other than through the
exit status 2 of a problem that every rank finds alike (a config error), makes its supervisor end by SIGKILL,
after a line that says why, and the launcher ends the job.

The supervisor forks before anything heavy is imported (no torch, no MPI: about 20 MiB, shared with the rank until
either writes). The rank inherits the launcher's environment and file descriptors, so MPI starts in it as it would
have in the supervisor.

Signals:

- Launchers signal each rank's whole process group (MPICH's Hydra, Slurm's job steps, PBS), and that group holds
  both processes. So the supervisor ignores SIGINT, SIGHUP and SIGUSR1: the rank receives them itself.
- The supervisor passes SIGTERM on, for a launcher that signals only the process it started. Receiving it twice
  does no harm, because SIGTERM only asks for a stop at the next round boundary (mpifl.roles.launch.StopRequest).
- These four signals are blocked from just before the fork until the supervisor's handlers are set, so one that
  lands in between waits for them instead of ending the supervisor (3-4 times in 30 before, when the rank
  signalled at once).
- The rank dies with its supervisor (Linux's ``PR_SET_PDEATHSIG``), and a supervisor a launcher started (a rank
  variable set: ``PMI_RANK``, ``PMIX_RANK``, ...) dies with the launcher's process that started it (MPICH's
  ``hydra_pmi_proxy``, ``slurmstepd``): with ``mpiexec`` and its proxy killed by SIGKILL, the ranks went on alone
  to the end of the run, writing checkpoints into a run directory that a resume might be writing into too. A
  singleton (``mpifl run`` with no launcher, under ``nohup``, say) outlives the shell that started it.
- The rank's exit status, or the signal that ended it, becomes the supervisor's. A rank ended by a signal (the
  kernel's OOM killer's SIGKILL, most often, on a cluster) says nothing itself, and the launcher's report names a
  PID at best; so the supervisor first says it in one line naming the rank, its host and the signal, and notes it
  in the rank's note in the run directory, which the rank names on the pipe, so that ``mpifl status`` names it.

``MPIFL_SUPERVISE=0`` runs the rank in the launched process itself, as before. Where the C library has no
``prctl`` (not Linux), it always does.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mpifl.logs import SUPERVISOR_PID, env_rank, log

PR_SET_PDEATHSIG = 1  # linux/prctl.h
ANNOUNCED = b"x"  # what the rank writes just before it leaves through mpifl's own exit
MPI_STARTED = b"m"  # what the rank writes once MPI has started on it
NOTES_AT = b"d"  # then "<rank> <run directory>" and a NUL: where the rank keeps its note (tell_run_dir)
SUPERVISOR_FD = "MPIFL_SUPERVISOR_FD"  # the rank's end of the pipe to its supervisor
WAIT_POLL_SECONDS = 0.5  # how often the supervisor looks whether its rank has ended, while it reads the pipe
UNANNOUNCED_EXIT = 1  # the supervisor's status for a rank that left with 0 unannounced
EVERY_RANK_ALIKE = 2  # mpifl run's status for a problem every rank finds the same way, before MPI (config errors)
# why a rank's process may have been ended by a signal it did not raise itself (others: a crash in native code)
SIGNAL_CAUSES: dict[int, str] = {signal.SIGKILL: "the kernel's OOM killer, or a kill -9",
                 signal.SIGSEGV: "a crash in native code (a C extension, the MPI library, a driver)",
                 signal.SIGBUS: "a crash in native code, or a memory-mapped file that went away",
                 signal.SIGABRT: "an abort in native code (a failed assertion)"}
LEFT_TO_THE_RANK = (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)  # the launcher's group signals: ignored here
SUPERVISOR_SIGNALS = frozenset({*LEFT_TO_THE_RANK, signal.SIGTERM})  # what _take_signals handles


def supervised(body: Callable[[], int], command: str = "run") -> int:
    """Run ``body`` (a rank's whole ``mpifl run``, or ``mpifl sweep``: its ``command``) in a child process under this
    one, and return its exit status, made 1 where the child left with 0 without announcing it. Runs ``body`` here
    where supervision is off or not possible."""
    prctl = _prctl()
    if os.environ.get("MPIFL_SUPERVISE", "1") == "0" or prctl is None or not hasattr(os, "fork"):
        return body()
    if env_rank() is not None:  # started by a launcher: ends with the launcher's process that started it
        launcher = os.getppid()
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:  # it died before the line above took effect
            _end_by(signal.SIGKILL)
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    supervisor = os.getpid()
    # Held back from before the fork until the supervisor's handlers are in place: a launcher's group signal that
    # lands in between would otherwise find the supervisor with the default action and end it (SIGUSR1, SIGTERM)
    # or raise KeyboardInterrupt in it (SIGINT). The rank starts with the mask as it was.
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, SUPERVISOR_SIGNALS)
    since = time.time() - 1.0  # a fault recorded after this is this job's (a file's time may round down)
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        os.close(read_end)
        os.environ[SUPERVISOR_PID] = str(supervisor)  # the PID the launcher's reports name (mpifl.roles.runner)
        os.environ[SUPERVISOR_FD] = str(write_end)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != supervisor:  # the supervisor died before the line above took effect
            os._exit(UNANNOUNCED_EXIT)
        _run_announced(body, write_end)
    os.close(write_end)
    _take_signals(child)
    signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
    return _supervise(child, read_end, command, since)


def _run_announced(body: Callable[[], int], write_end: int) -> None:
    """The rank: run ``body``, announce the exit, and leave through Python's own exit (MPI finalises at exit)."""
    code = 1
    try:
        code = body()
    finally:
        os.environ.pop(SUPERVISOR_FD, None)
        os.write(write_end, ANNOUNCED)
        os.close(write_end)
    sys.exit(code)


def mark_mpi_started() -> None:
    """Tell this rank's supervisor, if it has one, that MPI has started here (called once MPI is initialised)."""
    _tell(MPI_STARTED)


def tell_run_dir(run_dir: Path | None, rank: int) -> None:
    """Tell this rank's supervisor, if it has one, where the rank keeps its note, so that it can note there that the
    rank was killed."""
    if run_dir is not None:
        _tell(NOTES_AT + f"{rank} ".encode() + os.fsencode(Path(run_dir).resolve()) + b"\0")


def _tell(message: bytes) -> None:
    """Write ``message`` to this rank's supervisor, if it has one (in one write: a pipe keeps it whole)."""
    fd = os.environ.get(SUPERVISOR_FD, "")
    if fd.isdigit():
        try:
            os.write(int(fd), message)
        except OSError:  # the supervisor is gone: this rank dies with it
            pass


def heard_from_rank(said: bytes) -> tuple[bytes, tuple[int, Path] | None]:
    """What the rank wrote to its supervisor, parsed: its one-byte words, and the rank and run directory it named
    last (``tell_run_dir``), or None. Parsed, not searched: a path may hold the bytes of a word."""
    words, notes_at = bytearray(), None
    while said:
        head, said = said[:1], said[1:]
        if head != NOTES_AT:
            words += head
            continue
        named, _, said = said.partition(b"\0")
        rank, _, path = named.partition(b" ")
        if rank.isdigit() and path:
            notes_at = int(rank), Path(os.fsdecode(path))
    return bytes(words), notes_at


def killed_line(pid: int, signum: int, fault: str | None = None) -> str:
    """What a rank's supervisor says of a rank ended by ``signum``, after the rank and host (``fault``: the config's
    fault that sent it, named)."""
    cause = f"the config's {fault}, as asked" if fault else \
        SIGNAL_CAUSES.get(signum, "from outside the rank, or a crash in native code")
    return f"its process (pid {pid}) was killed by signal {signum} ({signal_name(signum)}): {cause}; the job ends"


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; a number this Python has no name for as ``signal N``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _take_signals(child: int) -> None:
    """The supervisor's signal handling: the launcher's group signals are left to the rank, SIGTERM is passed on."""
    for quiet in LEFT_TO_THE_RANK:
        signal.signal(quiet, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: _pass_on(child, signum))


def _supervise(child: int, read_end: int, command: str, since: float) -> int:
    """The supervisor: wait for the rank, then take on its exit status or the signal that ended it."""
    status, heard = _wait_hearing(child, read_end)
    said, notes_at = heard_from_rank(heard)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # ended by a signal: say so, then end the same way, so the launcher reports what happened
        _say_killed(child, -code, notes_at, since)
        _end_by(-code)
    if code == 0 and ANNOUNCED not in said:
        fault = struck_here(notes_at[1], notes_at[0], "exit", since) if notes_at else None
        how = f"the config's {fault}, as asked" if fault else "os._exit or C's _exit"
        log(f"mpifl: this rank (PID {child}) left with exit status 0 before mpifl {command} finished ({how}, past "
            "Python's cleanup): the run is incomplete; `mpifl status RUN_DIR` says how far it got "
            f"(this rank's supervisor, PID {os.getpid()}, exits {UNANNOUNCED_EXIT} so that the launcher reports a "
            "failure)", rank=env_rank())
        code = UNANNOUNCED_EXIT
    if code not in (0, EVERY_RANK_ALIKE) and MPI_STARTED not in said:
        log(f"mpifl: this rank (PID {child}) ended with exit status {code} before MPI started on it; the other "
            "ranks would wait for it in MPI_Init for ever, so its supervisor ends by SIGKILL, which the launcher "
            "takes as a failure that ends the job", rank=env_rank())
        _end_by(signal.SIGKILL)
    return code


def _say_killed(child: int, signum: int, notes_at: tuple[int, Path] | None, since: float) -> None:
    """Say on stderr, naming the rank and its host, that the rank was killed by ``signum`` (by the config's ``kill``
    fault, where the run directory's record of it says so), and note it in the rank's note (best effort: the
    launcher may end this process any moment once the other ranks notice)."""
    rank = notes_at[0] if notes_at is not None else env_rank()
    fault = struck_here(notes_at[1], notes_at[0], "kill", since) if notes_at and signum == signal.SIGKILL else None
    line = killed_line(child, signum, fault)
    with contextlib.suppress(OSError):
        os.write(2, f"[mpifl rank {rank} on {socket.gethostname()}] {line}\n".encode(errors="replace"))
    if notes_at is not None:
        from mpifl.storage.notes import RankNotes  # light: json and os alone, no h5py or torch

        with contextlib.suppress(Exception):  # a note is for the post-mortem: never in the way of the exit
            RankNotes.picked_up(notes_at[1], notes_at[0]).failed(line, signal=signal_name(signum))


def struck_here(run_dir: Path, rank: int, kind: str, since: float) -> str | None:
    """The config's fault of ``kind`` that struck ``rank`` by the run directory's record of it (``faults-struck``,
    written before the strike acts), written since ``since`` (this job's, not an earlier attempt's), named as
    ``faults[0] ('kill' in round 2)``; else None."""
    from mpifl.storage.notes import struck_records  # light: json and os alone, no h5py or torch

    with contextlib.suppress(OSError):
        mine = [(record.get("time", 0.0), index, round_) for (index, round_), record in struck_records(run_dir).items()
                if record.get("rank") == rank and record.get("kind") == kind and record.get("time", 0.0) >= since]
        if mine:
            _, index, round_ = max(mine)
            return f"faults[{index}] ({kind!r} in round {round_})"
    return None


def _wait_hearing(child: int, read_end: int) -> tuple[int, bytes]:
    """Wait for the rank to end, reading what it writes meanwhile; its wait status and everything it wrote. Read as
    it comes, not once at the end: a sweep's rank names each run's directory in turn, and a pipe holds 64 KiB on
    Linux, so a long enough grid would otherwise block the rank in its write for ever."""
    heard = []
    while True:
        ended, status = os.waitpid(child, os.WNOHANG)
        if ended:
            heard.append(_read_all(read_end))
            return status, b"".join(heard)
        ready, _, _ = select.select([read_end], [], [], WAIT_POLL_SECONDS)
        chunk = os.read(read_end, 4096) if ready else None
        if chunk:
            heard.append(chunk)
        elif chunk == b"":  # every write end closed: the rank (and any child of it) is ending, nothing more comes
            _, status = os.waitpid(child, 0)
            os.close(read_end)
            return status, b"".join(heard)


def _read_all(fd: int) -> bytes:
    """Everything the rank wrote to its supervisor before it ended. Without waiting: a process the rank forked
    (a data loader's worker) may hold a copy of the write end for a while, so the pipe need not have ended."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 64):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    os.close(fd)
    return b"".join(chunks)


def _end_by(signum: int) -> None:
    """End this process by ``signum``, as the rank ended, or so that the launcher ends the job."""
    sys.stdout.flush()
    sys.stderr.flush()
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # which cannot be caught, so are never handled here
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # not reached: the signal ends the process


def _pass_on(child: int, signum: int) -> None:
    """Pass a signal on to the rank (gone already: nothing to do)."""
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass


def _prctl() -> Callable[[int, int], int] | None:
    """Linux's ``prctl``, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
