"""How every ``mpifl`` subcommand parses its options: whole option names only, and each default shown once."""
from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn


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


def subcommand_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of subcommand ``command`` (``parser`` itself when it has none of that name): its errors show
    the subcommand's usage, not the top level's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def refuse_unrecognized(parser: argparse.ArgumentParser, command: str | None, stray: list[str]) -> NoReturn:
    """Exit with argparse's error for arguments no option takes, from the subcommand's own parser (its usage, not the
    top level's), naming the subcommand's options that a mistyped one may mean: those whose name contains it as a
    word (``mpifl plan --ranks``: ``--client-ranks`` or ``--ranks-per-node``), else the closest spelling."""
    chosen = subcommand_parser(parser, command)
    options = [o for action in chosen._actions for o in action.option_strings if o.startswith("--")]
    hints = []
    for arg in stray:
        if not arg.startswith("--"):
            continue
        name = arg.split("=")[0]
        near = [o for o in options if name[2:] in o[2:].split("-")] or difflib.get_close_matches(name, options, n=1)
        if near:
            hints.append(f"{name}: did you mean {' or '.join(near[:3])}?")
    chosen.error(f"unrecognized arguments: {' '.join(stray)}" + (f" ({'; '.join(hints)})" if hints else ""))
