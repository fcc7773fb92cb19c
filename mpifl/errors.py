"""Failures that carry their whole explanation (rank, client, stage): reported without a traceback."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

INTERRUPTED = 3  # the exit status of a run a signal stopped before its last round (its checkpoint is on disk)


# a job's failure that a resume repeats (the config's own faults strike the same clients): mpifl status reads it
RESUME_FAILS_THE_SAME_WAY = "a --resume fails the same way"


# advice to change a key a resume keeps (mpifl.config.RESUMABLE lists those it may change): the run starts anew
IN_A_NEW_RUN = "in a new run directory (a resume keeps the run's config)"


def strikes_again(named: str) -> str:
    """What a job's last message advises where the config's faults ``named`` ended it and strike again on a resume
    (a ``raise``, a lost update, a stall of some seconds: only a kill, an exit or a stall for ever strike once)."""
    return f"{named} again on a resume, so {RESUME_FAILS_THE_SAME_WAY}: change the faults section {IN_A_NEW_RUN}"


class JobFailure(RuntimeError):
    """The job cannot go on; the message says why, naming what failed. ``code`` is the job's exit status:
    ``INTERRUPTED`` where a stop on request (SIGTERM) ended it with its last round on disk, even though a rank
    never answered and had to be aborted, so that a batch script resubmits it as it would any stopped job."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class InputRefused(JobFailure):
    """Input this run cannot use, found only once MPI has started and the data is read: a split that cannot be made,
    a client's files, a config key that needs the clients' sizes (``config error: ...``). Found while the ranks agree
    on the rounds (``mpifl.roles.runner``), every rank learns it and the job exits 2 in one line, as a config error
    before MPI does; found by one rank later, it ends the job as any JobFailure, also with exit status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 2)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used, with the file and the reason in the message."""


class MissingExtra(ImportError):
    """An optional dependency that this config needs is not installed; the message names the extra to install."""


class UsageError(ValueError):
    """A command's options that cannot go together (``--nodes`` too few for the ranks, say): reported as argparse
    reports a bad option, with the subcommand's usage and exit status 2."""


@contextlib.contextmanager
def noted(where: str) -> Iterator[None]:
    """Add ``where`` as a note to an exception that escapes (a plug-in's bug, say), so the line a rank aborts with
    says where in the run it struck, not only what (``mpifl.roles.launch.guarded``); mpifl's own failures say it
    already and pass through untouched."""
    try:
        yield
    except (JobFailure, CheckpointError):
        raise
    except Exception as err:
        err.add_note(where)
        raise


def plugin_name(obj: object) -> str:
    """A plug-in's object as errors name it: its class's import path (``badhalves.LeaderNotCM``)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


@contextlib.contextmanager
def entered(make: Callable[[], AbstractContextManager[object]], where: str) -> Iterator[None]:
    """Inside the context manager ``make`` returns (a client half's ``training``), ``where`` noted on what its own
    set-up raises, and a clear TypeError where it returns no context manager, so a plug-in's mistake names the
    plug-in and the call; what the body raises passes through unnoted (it is the trainer's, not the half's)."""
    with contextlib.ExitStack() as stack:
        with noted(where):
            manager = make()
            if not hasattr(manager, "__enter__") or not hasattr(manager, "__exit__"):
                raise TypeError(f"returned {type(manager).__name__}, not a context manager (decorate the method "
                                "with @contextlib.contextmanager and yield inside it)")
            stack.enter_context(manager)
        yield


def noted_in(err: BaseException) -> str:
    """Where ``noted`` says ``err`` struck, as a prefix ("the client half x.Y, in training: "), or ""."""
    return "".join(f"{note}: " for note in getattr(err, "__notes__", ()))
