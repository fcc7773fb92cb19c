"""Failures that carry their whole explanation (rank, client, stage): reported without a traceback."""


class JobFailure(RuntimeError):
    """The job cannot go on; the message says why, naming what failed."""


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used, with the file and the reason in the message."""
