"""Failures that carry their whole explanation (rank, client, stage): reported without a traceback."""


class JobFailure(RuntimeError):
    """The job cannot go on; the message says why, naming what failed."""


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used, with the file and the reason in the message."""


class MissingExtra(ImportError):
    """An optional dependency that this config needs is not installed; the message names the extra to install."""


class UsageError(ValueError):
    """A command's options that cannot go together (``--nodes`` too few for the ranks, say): reported as argparse
    reports a bad option, with the subcommand's usage and exit status 2."""
