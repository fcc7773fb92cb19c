"""How every ``mpifl`` subcommand parses its options: whole option names only, and each default shown once."""
from __future__ import annotations

import argparse
from typing import Any


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` adds "(default: X)" to an option, unless its own text already says its default or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def add_subcommand(sub: argparse._SubParsersAction, name: str, **options: Any) -> argparse.ArgumentParser:
    """The subcommand ``name``: whole option names only (argparse's prefix matching would read
    ``mpifl plan --ranks 5`` as ``--ranks-per-node 5``), and its defaults in ``--help``."""
    return sub.add_parser(name, formatter_class=DefaultsFormatter, allow_abbrev=False, **options)
