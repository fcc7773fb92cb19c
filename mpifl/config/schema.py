"""Typed dataclass sections from plain dicts: defaults, docs and rules per field, errors that name the key.

Every field is declared with ``field_`` (a default, a one-line doc and rules such as
``min``, ``max``, ``choices``, ``import_ok``). ``build`` checks a raw mapping against a
section class: an unknown key names itself and the closest valid key; a bad value names the
key and what is allowed; an import path (``pkg.module:attr``) must resolve.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import field
from typing import Any

import yaml

from mpifl.plugins import NUMBER, is_import_path, resolve


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true and false. YAML 1.1, PyYAML's default, also reads
    on, off, yes and no as booleans, so ``mode: off`` (clock.mode, privacy.mode) came out as False. A key written
    twice in one mapping is an error, as YAML 1.2 says, not the last one silently winning (PyYAML keeps the last);
    keys a merge (``<<: *defaults``) brings in may be overridden, as YAML's merge key means."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """The mapping, once no key is written twice in it (a merged-in key may be)."""
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found the key {key!r} twice, first on line {seen[key]}", key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))


def read_yaml(text: str, name: str | None = None) -> Any:
    """A config's YAML (a file or an override's value) as Python values, booleans as YAML 1.2 reads them;
    ``name``, the file's, is what a parse error's position names (PyYAML's own is ``<unicode string>``)."""
    loader = ConfigLoader(text)  # a SafeLoader subclass: safe
    if name is not None:
        loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def field_(default: Any, doc: str, **rules: Any) -> Any:
    """A section field with its default, its one-line doc and its validation rules."""
    factory = dict(default_factory=default) if callable(default) else dict(default=default)
    return field(metadata={"doc": doc, **rules}, **factory)


def merge(base: dict, extra: dict) -> dict:
    """``base`` updated with ``extra``, section by section (nested mappings merge; other values replace)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def dotted_values(config: dict, prefix: str = "", empty_lists: bool = False) -> dict[str, Any]:
    """A nested config as dotted keys; a list of sections (``faults``) by index, ``faults.0.fraction``, as an
    override names a key. An empty list adds no key (it is what a config that leaves the section out holds) unless
    ``empty_lists``: the keys a config may set, as opposed to the values it holds."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(dotted_values(value, dotted + ".", empty_lists))
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            out.update(dotted_values({str(i): item for i, item in enumerate(value)}, dotted + ".", empty_lists))
        elif value != [] or empty_lists:
            out[dotted] = value
    return out


def apply_override(raw: dict, item: str) -> None:
    """Set one dotted ``key=value`` override in ``raw`` (the value is read as YAML; empty means None)."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. rounds=5)")
    node: dict | list = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[list_index(node, part, item, ".".join(parts[:i]))]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    try:
        value = read_yaml(text) if text else None
    except yaml.YAMLError as err:
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ConfigError(f"override {item!r}: the value of {key!r} is not valid YAML ({problem}); quote strings that "
                          f"start with '*', '&' or '!' or hold ': ', as in {quoted_example(key, text)}") from None
    if isinstance(node, list):
        node[list_index(node, parts[-1], item, ".".join(parts[:-1]))] = value
    else:
        node[parts[-1]] = value


def list_index(items: list, part: str, item: str, where: str) -> int:
    """``part`` of override ``item`` as an index into the list at ``where`` (``faults.0.fraction=0.3``: the first
    fault's fraction, which a sweep's ``--grid`` can then vary)."""
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"override {item!r}: {where} is a list of {len(items)}, so {part!r} must be one of its "
                          f"indices, 0 to {len(items) - 1}" if items else f"override {item!r}: {where} is empty")
    return int(part)


def quoted_example(key: str, text: str) -> str:
    """``key=text`` as the shell should pass it, with each YAML string quoted (lists item by item)."""
    def quoted(word: str) -> str:
        return '"' + word.strip().strip("\"'") + '"'

    if text.startswith("[") and text.endswith("]"):
        return f"{key}='[{', '.join(quoted(item) for item in text[1:-1].split(',') if item.strip())}]'"
    return f"{key}='{quoted(text)}'"


# Other frameworks' names for a key (Hugging Face's TrainingArguments, PyTorch's, Flower's), close spellings
# included: "did you mean" where the spelling is no help ("learning_rate" is nothing like "lr").
SYNONYMS = {"learning_rate": "lr", "epochs": "local_epochs", "num_epochs": "local_epochs",
            "batch": "batch_size", "per_device_train_batch_size": "batch_size", "clients": "num_clients",
            "n_clients": "num_clients", "num_rounds": "rounds", "clients_per_round": "per_round"}


def build(cls: type, raw: Any, prefix: str) -> Any:
    """An instance of section class ``cls`` from mapping ``raw``; errors name the key under ``prefix``. Every
    key-level problem is reported at once, not only the first, so a config with three typos takes one fix."""
    problems: list[str] = []
    built = _build(cls, raw, prefix, problems)
    if problems:
        raise ConfigError(problems_message(problems))
    return built


def problems_message(problems: list[str]) -> str:
    """One problem as itself; several as a count and one line each, in the order the config's keys are read."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {problem}" for problem in problems)


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    """``build``'s walk: each problem is appended to ``problems`` and the walk goes on; a section with a problem
    of its own or in a section under it is not constructed (None)."""
    where = prefix.rstrip(".") or "top level"
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping, got {type(raw).__name__}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    before = len(problems)
    for key in raw:
        if key not in fields:
            problems.append(f"unknown key '{prefix}{key}'" + _spelling_hint(str(key), fields, prefix))
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        hint = hints[name]
        try:
            if dataclasses.is_dataclass(hint):  # an empty section (``clients:``) means its defaults; [] is a mistake
                # a type hint that is a dataclass is a section class, never an instance
                values[name] = _build(typing.cast(type, hint), {} if raw[name] is None else raw[name],
                                      f"{prefix}{name}.", problems)
            elif (item := _section_list(hint)) is not None:  # a list of sections (``faults:``), item by item
                values[name] = _build_list(item, raw[name], f"{prefix}{name}", problems)
            else:
                values[name] = _check_value(f"{prefix}{name}", raw[name], hint, f.metadata)
        except ConfigError as err:
            problems.append(str(err))
    if len(problems) > before:
        return None
    try:
        return cls(**values)
    except ConfigError as err:  # a section's own check of its keys together
        problems.append(str(err))
        return None


def _spelling_hint(key: str, fields: typing.Iterable[str], prefix: str) -> str:
    """"did you mean" for an unknown key: a close spelling, or another framework's name for one of ours."""
    fields = list(fields)
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.5) or [
        ours for word, ours in SYNONYMS.items()
        if ours in fields and difflib.get_close_matches(key, [word], n=1, cutoff=0.8)]
    return f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"


def _section_list(hint: Any) -> type | None:
    """The section class of a ``tuple[Section, ...]`` field, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis \
            and dataclasses.is_dataclass(args[0]):
        return typing.cast(type, args[0])
    return None


def _build_list(cls: type, raw: Any, key: str, problems: list[str]) -> tuple:
    """A tuple of ``cls`` sections from a YAML list (None or absent: none); errors name the item, ``key[i].x``."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{key}: expected a list of mappings (one per item), got {type(raw).__name__} {raw!r}")
    return tuple(_build(cls, item, f"{key}[{i}].", problems) for i, item in enumerate(raw))


def _check_value(key: str, value: Any, hint: Any, rules: typing.Mapping) -> Any:
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: a value is required ({rules.get('doc', '')})")
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if typing.get_origin(base) in (typing.Union, types.UnionType):  # ``int | str``: a number, or a word of choices
        return _number_or_word(key, value, rules)
    if base == list[int]:  # ids or rounds: each an integer within min/max
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ConfigError(f"{key}: expected a list of integers, got {value!r}")
        for i, item in enumerate(value):
            _check_rules(f"{key}[{i}]", item, rules)
        return value
    value = _coerce(key, value, base)
    _check_rules(key, value, rules)
    return value


def _number_or_word(key: str, value: Any, rules: typing.Mapping) -> Any:
    """An ``int | str`` field: an integer within ``min``/``max``, or one of the words in ``choices`` ('auto')."""
    words = rules.get("choices", ())
    if isinstance(value, str) and value in words:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (
            isinstance(value, str) and not NUMBER.fullmatch(value.strip())):
        low = f" >= {rules['min']}" if "min" in rules else ""
        raise ConfigError(f"{key}: expected an integer{low} or {' or '.join(map(repr, words))}, got {value!r}")
    value = _coerce(key, value, int)
    _check_rules(key, value, {k: v for k, v in rules.items() if k != "choices"})
    return value



def _coerce(key: str, value: Any, base: Any) -> Any:
    if base in (int, float) and isinstance(value, str) and NUMBER.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads 1e-9 (no dot) as a string: take it as the number it means
        if base is int and value.is_integer():
            value = int(value)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    if base is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if base in (float, str, dict, list) and not isinstance(value, base):
        raise ConfigError(f"{key}: expected {base.__name__}, got {type(value).__name__} {value!r}")
    if base is list and not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
    return value


def _check_rules(key: str, value: Any, rules: typing.Mapping) -> None:
    if "min" in rules and (value < rules["min"] or (rules.get("exclusive_min") and value == rules["min"])):
        op = ">" if rules.get("exclusive_min") else ">="
        raise ConfigError(f"{key}: must be {op} {rules.get('min_text', rules['min'])}, got {value!r}")
    if "max" in rules and value > rules["max"]:
        raise ConfigError(f"{key}: must be <= {rules['max']}, got {value!r}")
    choices = rules.get("choices")
    if choices and isinstance(value, list):  # a list of choices (output.trackers): each one allowed, once
        for item in value:
            if item not in choices:
                raise ConfigError(f"{key}: {item!r} is not allowed; choose from {', '.join(map(repr, choices))}")
            if value.count(item) > 1:
                raise ConfigError(f"{key}: {item!r} is listed twice")
        return
    if choices and value not in choices:
        if rules.get("import_ok") and is_import_path(value):
            try:
                resolve(value)
            except ImportError as err:
                raise ConfigError(f"{key}: {err}") from None
            return
        extra = " or an import path 'package.module:name' (a class or a function)" if rules.get("import_ok") else ""
        hint = rules.get("elsewhere", {}).get(str(value).lower())
        extra += f" ({hint})" if hint else ""
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, choices))}{extra}")


