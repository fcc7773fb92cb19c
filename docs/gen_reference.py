"""Write the generated reference pages from the code itself, so they cannot drift.

- ``docs/reference/config.md``: every config key, from the dataclasses of ``mpifl.config``
  (``Config`` and its nested sections) and the metadata ``mpifl.config.schema.field_`` stores
  on each field: its doc, ``choices``, ``import_ok``, ``min``/``max``/``exclusive_min``.
- ``docs/reference/cli.md``: every subcommand of ``mpifl`` with its arguments, from the
  argparse parser (``mpifl.cli._parser()``).

Run it from anywhere after changing the config schema or the command line:

    .venv/bin/python docs/gen_reference.py

The output depends only on the code: no dates, no terminal width, no hash order.
``tests/test_docs.py`` imports this file by path and fails when a committed page differs.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import types
import typing
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
CONFIG_PAGE = DOCS / "reference" / "config.md"
CLI_PAGE = DOCS / "reference" / "cli.md"
SCRIPT = "docs/gen_reference.py"

if str(ROOT) not in sys.path:  # run as a script from a checkout without an installed mpifl
    sys.path.insert(0, str(ROOT))


def _cell(text: object) -> str:
    """Text for a Markdown table cell: no line breaks, and nothing Markdown or HTML would eat."""
    out = " ".join(str(text).split())
    for char, escaped in (("\\", "\\\\"), ("|", "\\|"), ("*", "\\*"), ("_", "\\_"), ("`", "\\`"),
                          ("<", "&lt;"), (">", "&gt;"), ("[", "\\["), ("]", "\\]")):
        out = out.replace(char, escaped)
    return out


DOCS_PATH = re.compile(r"\bdocs/((?:[\w.-]|\\_)+(?:/(?:[\w.-]|\\_)+)*\.md)")


def _linked(cell: str) -> str:
    """A cell whose ``docs/PAGE.md`` mentions are links, relative to the reference pages in docs/reference/."""
    return DOCS_PATH.sub(lambda m: f"[{m.group(0)}](../{m.group(1).replace(chr(92), '')})", cell)


def _code(value: object) -> str:
    """A value as inline code (a table-safe pipe is the only escape code spans need here)."""
    text = str(value).replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _yaml(value: object) -> str:
    """A default as YAML spells it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{}" if not value else "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(int(value)) + ".0" if value.is_integer() and abs(value) < 1e16 else repr(value)
    return str(value)


def _type_name(hint: object) -> str:
    """``int``, ``float or null``, ``list of str``..."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + (" or null" if type(None) in args else "")
    if hint is list:
        return "list"
    if typing.get_origin(hint) in (list, tuple):  # list[int]; tuple[Section, ...]: a list of that section's mappings
        item = args[0]
        return "list of " + ("mappings" if dataclasses.is_dataclass(item) else _type_name(item))
    return _cell(getattr(hint, "__name__", str(hint)))


def _allowed(meta: typing.Mapping) -> str:
    """Choices and range of a field, from its ``field_`` rules."""
    parts = []
    if meta.get("choices"):
        parts.append(", ".join(_code(c) for c in meta["choices"]))
        if meta.get("import_ok"):
            parts[-1] += ", or an import path `package.module:attr`"
    bounds = []
    if "min" in meta:
        low = meta.get("min_text", _yaml(meta["min"]))
        bounds.append(f"{'>' if meta.get('exclusive_min') else '≥'} {low}")
    if "max" in meta:
        bounds.append(f"≤ {_yaml(meta['max'])}")
    if bounds:
        parts.append(", ".join(bounds))
    return "; ".join(parts)


def _allowed_or_type(meta: typing.Mapping, hint: object, key: str = "") -> str:
    """The field's rules, or what its type alone allows (``key``: the field's, to name a list's item section)."""
    text = _allowed(meta)
    if text:
        return f"a list of {text}" if hint is list or typing.get_origin(hint) is list else text
    if typing.get_origin(hint) is tuple:
        return f"a list of mappings, each with the keys of `{key}[]` below"
    base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return {bool: "`true`, `false`", dict: "a mapping", list: "a list of strings", str: "a string",
            int: "an integer", float: "a number"}.get(base[0], "any")


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def config_sections() -> list[tuple[str, type, list[tuple[str, object, object, typing.Mapping]]]]:
    """(dotted prefix, section class, [(key, type, default, metadata)]) for the top level and every
    nested section, depth first in declaration order."""
    from mpifl.config import Config

    out: list = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        rows, nested = [], []
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                nested.append((f.name, hint))
            elif typing.get_origin(hint) is tuple and dataclasses.is_dataclass(typing.get_args(hint)[0]):
                rows.append((prefix + f.name, hint, [], f.metadata))  # a list of sections: its items' keys below
                nested.append((f.name + "[]", typing.get_args(hint)[0]))
            else:
                rows.append((prefix + f.name, hint, _default(f), f.metadata))
        out.append((prefix.rstrip("."), cls, rows))
        for name, hint in nested:
            walk(hint, f"{prefix}{name}.")

    walk(Config, "")
    return out


def config_keys() -> list[str]:
    """Every dotted leaf key of the schema."""
    return [key for _, _, rows in config_sections() for key, *_ in rows]


# The page gives its width to the tables (Material's per-page ``hide``): the sections are linked from its top instead
CONFIG_FRONT_MATTER = "---\nhide:\n  - toc\n---\n\n"
CONFIG_INTRO = f"""# Configuration keys

<!-- Generated by {SCRIPT} from the config schema (mpifl.config). Do not edit: run the script. -->

A config is one YAML file with one section per component. Every key below may also be set on
the command line as `key=value`, with a YAML value: `rounds=5 train.lr=0.1
'model.kwargs={{hidden: [32]}}'`. The whole config is checked before any MPI work starts: an
unknown key is named with the closest valid one, a bad type or a value out of range names the
key and what is allowed, and an import path (`package.module:attr`) must resolve; every such
problem is listed at once, one line each. An empty
section (`clients:`) means its defaults. Booleans are `true` and `false` only, as in YAML 1.2:
`off`, `on`, `yes` and `no` are words, so `clock: {{mode: off}}` needs no quotes. A relative
path (a data folder, a partition file, a trace, `model.init_from`) is read from the working
directory of the command, not from the config file's folder: the shipped configs name
`configs/traces/...` and run from the repository's root.

Columns: the dotted key, its type, its default, the values or range it accepts, and the doc
the schema itself carries. `null` is YAML's none. How user code plugs in through import paths
is in [Plug-in contracts](plugins.md).
"""


def render_config() -> str:
    """The whole config reference page."""
    sections = [(prefix, cls, rows) for prefix, cls, rows in config_sections() if rows]
    titles = [f"`{prefix}`" if prefix else "Top level" for prefix, _, _ in sections]
    lines = [CONFIG_FRONT_MATTER + CONFIG_INTRO,
             "Sections: " + " · ".join(f"[{t}](#{_anchor(t)})" for t in titles) + ".", ""]
    for (_, cls, rows), title in zip(sections, titles):
        doc = (cls.__doc__ or "").strip().split("\n\n")[0]
        # in a div of its own, so that docs/css/extra.css can keep the doc column readable beside long keys
        lines += [f"## {title}", "", _linked(" ".join(doc.split())), "", '<div class="config-keys" markdown>', "",
                  "| key | type | default | allowed | doc |", "|---|---|---|---|---|"]
        for key, hint, default, meta in rows:
            allowed = _allowed_or_type(meta, hint, key)
            lines.append(f"| `{key}` | {_type_name(hint)} | {_code(_yaml(default))} | {allowed} | "
                         f"{_linked(_cell(meta.get('doc', '')))} |")
        lines += ["", "</div>", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _anchor(title: str) -> str:
    """The id MkDocs' table of contents gives a heading (Python-Markdown's default slugify)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(command words, parser, help) for every leaf subcommand, in the parser's order."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                words = f"{prefix} {name}".strip()
                nested = _subcommands(sub, words)
                out += nested or [(words, sub, helps.get(name) or "")]
    return out


def cli_commands() -> list[tuple[str, argparse.ArgumentParser, str]]:
    """Every leaf subcommand of the ``mpifl`` parser."""
    from mpifl.cli import _parser

    return _subcommands(_parser(), "")


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]


def _metavar(action: argparse.Action) -> str:
    if action.metavar:
        return str(action.metavar)
    if action.choices and not action.option_strings:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper()


def _usage_word(action: argparse.Action) -> str:
    """One argument as a usage line shows it, without argparse's width-dependent wrapping."""
    name = _metavar(action)
    if not action.option_strings:
        word = {"*": f"[{name} ...]", "+": f"{name} [{name} ...]", "?": f"[{name}]"}.get(action.nargs, name)
        return word
    flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
    if action.nargs == 0:
        word = flag
    elif action.nargs == "?":
        word = f"{flag} [{name}]"
    else:
        word = f"{flag} {name}"
    return word if action.required else f"[{word}]"


def _wrapped(words: list[str], width: int = 96) -> list[str]:
    """A usage line broken between arguments at ``width`` characters, continued with a backslash."""
    lines = [words[0]]
    for word in words[1:]:
        if len(lines[-1]) + 1 + len(word) > width:
            lines[-1] += " \\"
            lines.append("    " + word)
        else:
            lines[-1] += " " + word
    return lines


def _argument_default(action: argparse.Action) -> str:
    if action.nargs == 0:  # a flag
        return "off"
    if not action.option_strings and action.nargs in ("*", "?"):
        return "none"
    if action.default is None or action.default == argparse.SUPPRESS:
        return "required" if action.required else "—"
    return _code(action.default)


def _argument_help(action: argparse.Action) -> str:
    text = _linked(_cell((action.help or "").replace("%%", "%")))  # argparse %-formats help: a literal % is written %%
    if action.choices and action.option_strings:
        text = (text + "; " if text else "") + "one of " + ", ".join(_code(c) for c in action.choices)
    if action.nargs == "?" and action.const is not None:
        text += f" (given without a value: {_code(action.const)})"
    return text or "—"


CLI_INTRO = f"""# Command line

<!-- Generated by {SCRIPT} from the argparse parser (mpifl.cli). Do not edit: run the script. -->

`mpifl COMMAND ...`, or `python -m mpifl COMMAND ...`. `run` and `bench` run under `mpiexec`
(rank 0 is the server, ranks 1..N the client ranks); every other command is a plain process.
Commands that take a config also take trailing `key=value` overrides, before or after the
options. A config error exits with status 2 and one line naming the key.
"""


def render_cli() -> str:
    """The whole command-line reference page."""
    lines = [CLI_INTRO]
    for words, parser, help_text in cli_commands():
        args = _arguments(parser)
        summary = " ".join((parser.description or help_text).split()).rstrip(".")
        lines += [f"## `mpifl {words}`", "", _cell(summary[:1].upper() + summary[1:]) + ".", "",
                  "```text", *_wrapped([f"mpifl {words}", *(_usage_word(a) for a in args)]), "```", ""]
        if args:
            lines += ["| argument | default | meaning |", "|---|---|---|"]
            for a in args:
                value = f" {_metavar(a)}" if a.option_strings and a.nargs != 0 else ""
                names = ", ".join(f"`{o}{value}`" for o in a.option_strings) or f"`{_metavar(a)}`"
                lines.append(f"| {names} | {_argument_default(a)} | {_argument_help(a)} |")
            lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def pages() -> dict[Path, str]:
    """Every generated page and its content."""
    return {CONFIG_PAGE: render_config(), CLI_PAGE: render_cli()}


def main() -> int:
    for path, text in pages().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        old = path.read_text() if path.exists() else None
        if old != text:
            path.write_text(text)
        print(f"{'wrote' if old != text else 'unchanged'} {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
