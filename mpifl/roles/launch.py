"""One launch path for every rank: agreement on setup errors, SIGTERM, GPU and core binding, abort-on-exception."""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

from mpifl.errors import INTERRUPTED, JobFailure, noted_in
from mpifl.planning import binding

if TYPE_CHECKING:  # mpi4py is imported only inside the functions: GPU binding must come before MPI starts
    from mpi4py import MPI

T = TypeVar("T")


class SetupError(RuntimeError):
    """A problem every rank detects identically: reported once, exit status 2, no abort."""


class StopRequest:
    """Records SIGTERM (what PBS sends at walltime) so the server can stop at a round boundary."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> StopRequest:
        """Start listening for SIGTERM (and ignore SIGXFSZ), and print every thread's Python stack to this rank's
        stderr on SIGUSR1 (``kill -USR1 PID``: where a rank that seems hung is, without stopping it); returns
        itself, to chain after construction."""
        signal.signal(signal.SIGTERM, self._handle)
        if hasattr(signal, "SIGXFSZ"):  # past a file-size limit, a write fails (EFBIG) and is reported, not fatal
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True


SETUP_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, SetupError)


def agree(comm: MPI.Comm, fn: Callable[[], T], refusals: tuple[type[BaseException], ...] = SETUP_ERRORS) -> T:
    """Run ``fn`` on rank 0 and share its result with every rank; its error of one of the ``refusals`` types
    becomes SetupError everywhere (any other ends the job from rank 0, as every failure there does)."""
    from mpifl.wire.transport import arrive_together  # here: importing mpi4py starts MPI (see mpifl.cli.supervisor)

    result = error = None
    if comm.Get_rank() == 0:
        try:
            result = fn()
        except refusals as err:
            error = str(err)
    arrive_together(comm)  # the other ranks sleep while rank 0 runs ``fn``
    result, error = comm.bcast((result, error), root=0)
    if error:
        raise SetupError(error)
    return result


STARTUP_FLOOR_SECONDS = 30.0  # never less, however fast the other ranks were
STARTUP_FACTOR = 10.0  # a rank may take this many times the slowest rank that has reported
STARTUP_FALLBACK_SECONDS = 300.0  # before any rank has reported: minutes, not half an hour ...
STARTUP_BYTES_PER_SECOND = 200e6  # ... plus the time to initialise the model at a slow 200 MB/s (a 70B model: 12 min)


def startup_limit(took: list[float], model_bytes: int) -> float:
    """Seconds rank 0 waits for a rank to finish a start-up stage: 10x the slowest rank that finished it (at
    least 30 s), or, while none has, 300 s plus the model's bytes at 200 MB/s."""
    if took:
        return max(STARTUP_FLOOR_SECONDS, STARTUP_FACTOR * max(took))
    return STARTUP_FALLBACK_SECONDS + model_bytes / STARTUP_BYTES_PER_SECOND


def gather_within(comm: MPI.Comm, value: object, stage: str, elapsed: float, model_bytes: int, *, tag: int,
                  comparable: bool = True) -> list | None:
    """Every rank's ``value`` on rank 0 (None elsewhere), like ``comm.gather``, but rank 0 waits for a rank only
    as long as ``startup_limit`` allows, counted from the start of the stage: a rank stuck in it (a model
    plug-in that never returns, say) ends the job in one line naming the rank, the stage and the seconds,
    instead of hanging it. ``elapsed``: the seconds this rank's stage took; rank 0's counts as a measure only
    when ``comparable`` (it did the same work)."""
    from mpi4py import MPI

    from mpifl.wire.transport import Backoff

    if comm.Get_rank() != 0:
        comm.send((value, elapsed), dest=0, tag=tag)
        return None
    values, took = {0: value}, ([elapsed] if comparable else [])
    pending, backoff, start = set(range(1, comm.Get_size())), Backoff(), time.monotonic() - elapsed
    status = MPI.Status()
    while pending:
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
            rank = status.Get_source()
            values[rank], seconds = comm.recv(source=rank, tag=tag)
            took.append(seconds)
            pending.discard(rank)
        limit = startup_limit(took, model_bytes)
        if pending and time.monotonic() - start > limit:
            stuck = sorted(pending)
            raise JobFailure(f"start-up: rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} did not "
                             f"finish '{stage}' within {limit:.0f} s ("
                             + (f"{STARTUP_FACTOR:g}x the slowest of the ranks that did, {max(took):.1f} s"
                                if took else "no rank finished it, so the default for this model's size")
                             + "); a rank stuck in user code (a model or dataset plug-in)? Its host and pid are in "
                             "ranks.txt")
        if pending:
            backoff.pause()
    return [values[r] for r in range(comm.Get_size())]


def env_local_rank() -> int | None:
    """The current process's rank within its node, as the launcher tells it (mpifl.planning.binding.LAUNCHERS)."""
    found = binding.launcher_local_rank(os.environ)
    return found.rank if found is not None else None


def bind_gpu_from_local_rank(proc: Path | None = None) -> None:
    """Before CUDA (or an MPI that starts it) is loaded, let the rank see only its slot's GPU, the node's GPU
    (launcher local rank mod count), through CUDA_VISIBLE_DEVICES. ``proc``: where the GPUs are counted."""
    local = binding.launcher_local_rank(os.environ)
    try:
        if local is None or not binding.bind_requested(os.environ):
            return
        gpu = binding.slot_gpu(binding.node_gpus(os.environ, proc), local.rank)
    except ValueError:  # a bad MPIFL_BIND or MPIFL_GPUS_PER_NODE: bind_rank names it on every rank once MPI is up
        return
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu


def bind_rank(comm: MPI.Comm, threads: int | str = 1, proc: Path | None = None) -> binding.Binding:
    """Bind this rank to its node-local slot's cores, and to its GPU when no launcher variable named the slot
    before MPI started (mpifl.planning.binding has the rule, and what ``threads``, train.threads, becomes).
    Collective over ``comm``."""
    from mpi4py import MPI

    from mpifl.wire.transport import arrive_together  # here: importing mpi4py starts MPI (see mpifl.cli.supervisor)

    try:
        binding.bind_requested(os.environ)
        binding.node_gpus(os.environ, proc)
    except ValueError as err:  # the same environment on every rank: each raises here, none waits in the split
        raise SetupError(str(err)) from None
    launcher = binding.launcher_local_rank(os.environ)
    arrive_together(comm)  # the server is here long before its client ranks, which import torch._dynamo
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        every = node.allgather((launcher.rank if launcher is not None else None, _affinity()))
        chosen = binding.choose(os.environ, every, node.Get_rank(), threads, proc,
                                binding.thread_siblings(frozenset().union(*(cores for _, cores in every))))
    finally:
        node.Free()
    if chosen.cores_from == "split" and set(chosen.cores) != _affinity() and not _set_affinity(chosen.cores):
        chosen = dataclasses.replace(chosen, cores=tuple(sorted(_affinity())))  # say what it runs on
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen.cores_from == "MPIFL_BIND=none" or chosen.gpu is None or chosen.gpu == current:
        return chosen
    if _cuda_started():  # too late: CUDA read CUDA_VISIBLE_DEVICES when it started
        return dataclasses.replace(chosen, gpu=",".join(binding.node_gpus(os.environ, proc)) or None)
    os.environ["CUDA_VISIBLE_DEVICES"] = chosen.gpu
    return chosen


def _affinity() -> frozenset[int]:
    """The cores this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def _set_affinity(cores: tuple[int, ...]) -> bool:
    """Bind every thread of the process (MPI's may already run) to ``cores``; False where the OS refuses or
    cannot (no sched_setaffinity, cores outside the job's cpuset)."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    try:
        for thread in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
                os.sched_setaffinity(thread, cores)
    except OSError:
        return False
    return True


def _cuda_started() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


ABORT_GRACE_SECONDS = 1.0
_REAL_EXIT = os._exit


def guarded(fn: Callable[[], T]) -> T:
    """Run ``fn``; on any escape (exception, ``sys.exit``, Ctrl-C, ``os._exit``) say why, then abort every rank.

    A rank that left quietly would hang the others in their waits (``sys.exit(0)``) or end the
    job with status 0 and no word (``os._exit``), so every way out of ``fn`` ends the whole job.
    """
    with _os_exit_aborts():
        try:
            return fn()
        except SetupError:  # raised identically on every rank (see agree): each exits 2 by itself
            raise
        except JobFailure as err:
            abort(str(err), err.code, "stopped on request" if err.code == INTERRUPTED else "failed")
        except SystemExit as err:
            fault = getattr(err, "fault", None)  # roles.faults.InjectedExit: the config's fault asked for it
            why = f"asked for by the config's {fault}" if fault else "(sys.exit in user code?)"
            abort(f"SystemExit({err.code!r}) inside the run {why}: one rank cannot leave while "
                  "the others wait for it\n" + _traceback(err),
                  err.code if isinstance(err.code, int) and 0 < err.code < 256 else 1)
        except KeyboardInterrupt as err:
            abort("interrupted (KeyboardInterrupt)\n" + _traceback(err))
        except BaseException as err:  # noqa: BLE001 - any escape from a rank must end the job
            # the culprit in one line (where errors.noted says it struck), then details
            abort(f"{noted_in(err)}{type(err).__name__}: {err}" + _traceback(err))


def abort(reason: str, code: int = 1, what: str = "failed") -> NoReturn:
    """Print ``reason`` with rank and host, give the launcher a moment to forward it, abort every rank with
    ``code`` as the job's exit status (a ``sys.exit(code)`` inside the run keeps its code, a stop on request exits
    ``INTERRUPTED``; 1 otherwise). ``what`` happened, as the line says it: failed, or stopped on request."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    sys.stderr.write(f"[mpifl rank {rank} on {socket.gethostname()}] {what}, aborting the job: {reason.rstrip()}\n")
    sys.stderr.flush()
    # The launcher kills every rank on Abort, possibly before its proxy has forwarded
    # what we just wrote: give it a moment, so the reason reaches the user.
    time.sleep(ABORT_GRACE_SECONDS)
    MPI.COMM_WORLD.Abort(code)
    _REAL_EXIT(code)  # Abort may return before the launcher kills us: never unwind further


def _traceback(err: BaseException) -> str:
    return "\n" + "".join(traceback.format_exception(type(err), err, err.__traceback__))


@contextlib.contextmanager
def _os_exit_aborts() -> Iterator[None]:
    """While the run is on, ``os._exit`` (which MPI would take for a normal end) aborts the job, saying so."""
    def refuse(status: int) -> NoReturn:  # named as os._exit's parameter, so it can stand in for it
        abort(f"os._exit({status}) called inside the run (user code?): ending the whole job")

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = _REAL_EXIT
