"""A sweep's grid: its axes (``KEY=V1,V2`` and variants files, ``NAME=@FILE``), their combinations, and each
point's run directory. Torch-free and MPI-free, so that ``mpifl sweep``, its ``--dry-run`` and the job scripts of
``mpifl pbs`` and ``mpifl slurm`` read one grid the same way."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import yaml

from mpifl.config import Config, ConfigError
from mpifl.config.schema import dotted_values, read_yaml


@dataclass(frozen=True)
class GridPoint:
    """One run of a sweep: one (label, overrides) pair per axis. A label is ``KEY=VALUE`` for a plain axis, whose
    overrides are that word alone, and ``NAME=VARIANT`` for a variants axis, whose overrides are the variant's
    keys."""

    choices: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def labels(self) -> list[str]:
        """What names the run's directory: each axis's label."""
        return [label for label, _ in self.choices]

    @property
    def overrides(self) -> list[str]:
        """The ``KEY=VALUE`` words the run applies, axis by axis."""
        return [word for _, words in self.choices for word in words]

    def describe(self) -> str:
        """The point for a log line: its labels, each variant followed by the keys it sets."""
        return " ".join(label if list(words) in ([label], []) else f"{label} ({' '.join(words)})"
                        for label, words in self.choices)


def grid_points(grid: list[str]) -> list[GridPoint]:
    """Every combination of the axes, the last axis changing fastest (as nested loops written in the same order
    would visit them). A plain axis is ``KEY=V1,V2,...``: values split at commas, so a grid value cannot hold one.
    A variants axis is ``NAME=@FILE``: FILE maps each variant's name to the keys it sets, so that one grid value
    can set several keys, or a list (``variant_overrides``)."""
    axes: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for axis in grid:
        key, sep, values = axis.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--grid {axis!r}: expected KEY=VALUE1,VALUE2,... or NAME=@FILE")
        if key in axes:
            raise ConfigError(f"--grid names a key twice: {key}")
        if values.startswith("@"):
            if key in CONFIG_KEYS:
                raise ConfigError(f"--grid {axis!r}: {key!r} is a config key, and a variants axis's name goes into "
                                  "each run's directory beside the keys it sets: name the axis for what its variants "
                                  "are (method, attack, split)")
            axes[key] = [(f"{key}={name}", tuple(words)) for name, words in read_variants(axis, Path(values[1:]))]
            continue
        choices = values.split(",")
        if any(not v for v in choices):
            raise ConfigError(f"--grid {axis!r}: an empty value")
        axes[key] = [(f"{key}={v}", (f"{key}={v}",)) for v in choices]
    clash = shared_key(axes)
    if clash:
        raise ConfigError(clash)
    points = [GridPoint(combination) for combination in itertools.product(*axes.values())]
    named: dict[str, GridPoint] = {}
    for point in points:
        other = named.setdefault(run_dir_name(point.labels), point)
        if other is not point:
            raise ConfigError(f"--grid: the points {' '.join(other.labels)} and {' '.join(point.labels)} would share "
                              f"the run directory {run_dir_name(point.labels)!r} (a directory name keeps no quotes, "
                              "brackets or wildcards): write the two values so that they differ in letters or digits")
    return points


# What a variants axis may not be named: every key a config may set (a section, such as strategy, may name one)
CONFIG_KEYS = set(dotted_values(Config().to_dict(), empty_lists=True))


def shared_key(axes: dict[str, list[tuple[str, tuple[str, ...]]]]) -> str | None:
    """Why two axes cannot go together, or None: both set one key (or one a key inside the other's section), so a
    run would take the later axis's value while its directory names both."""
    keys = {axis: {word.partition("=")[0] for _, words in choices for word in words} for axis, choices in axes.items()}
    for (first, a), (second, b) in itertools.combinations(keys.items(), 2):
        for x, y in itertools.product(sorted(a), sorted(b)):
            if x == y or x.startswith(y + ".") or y.startswith(x + "."):
                return (f"--grid: the axes {first!r} and {second!r} both set {min(x, y, key=len)}: a run would take "
                        f"the later axis's value while its directory names both; set each key on one axis only")
    return None


def read_variants(axis: str, path: Path) -> list[tuple[str, list[str]]]:
    """A variants file's entries in the file's order, each as (name, its ``KEY=VALUE`` overrides). The file's top
    level maps each variant's name to a mapping of config keys (sections nested or dotted, as in a config file);
    an empty variant (``clean: {}``) runs the config as it is."""
    where = f"--grid {axis!r}"
    if not str(path) or str(path) == ".":
        raise ConfigError(f"{where}: no file follows '@' (NAME=@FILE reads each variant's keys from FILE)")
    if not path.is_file():
        raise ConfigError(f"{where}: the variants file {str(path)!r} does not exist (NAME=@FILE reads each variant's "
                          "keys from FILE)")
    try:
        raw = read_yaml(path.read_text(), str(path))
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: {path}: not valid YAML: {err}") from None
    if raw is None or raw == {} or (isinstance(raw, dict) and all(str(k).startswith("_") for k in raw)):
        raise ConfigError(f"{where}: {path} holds no variant: write one entry per grid value, e.g. "
                          "'clean: {}' and 'sign_flip: {faults: [{kind: scale, factor: -5, clients: [0, 1]}]}'")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {path}: the top level must map each variant's name to the keys it sets, e.g. "
                          "'sign_flip: {faults: [{kind: scale, factor: -5, clients: [0, 1]}]}'")
    variants = []
    for name, keys in raw.items():
        if isinstance(name, str) and name.startswith("_"):  # a YAML anchor's holder (_common: &common {...}), no run
            continue
        if not isinstance(name, (str, int, float)) or isinstance(name, bool) or not str(name).strip() or any(
                c in str(name) for c in ",="):  # a run directory's name splits at both
            raise ConfigError(f"{where}: {path}: a variant's name must be a word without ',' or '=', not {name!r}"
                              + (" (YAML reads true, false, null and such unquoted as values: quote the name)"
                                 if name is None or isinstance(name, bool) else ""))
        if keys is not None and not isinstance(keys, dict):
            raise ConfigError(f"{where}: {path}: variant {name!r} must be a mapping of config keys (or empty), "
                              f"got {type(keys).__name__}")
        variants.append((str(name), variant_overrides(keys or {}, f"{where}: {path}: variant {name!r}")))
    return variants


def variant_overrides(keys: dict, where: str, prefix: str = "") -> list[str]:
    """A variant's keys as ``KEY=VALUE`` overrides, applied as a config file's would be: a nested mapping sets its
    keys one by one (``train: {prox_mu: 0.01, lr: 0.05}`` leaves the config's other train keys), any other
    value (a list, a scalar) replaces the key's value whole. Each value is written as YAML flow text, which the
    override reads back as the same value."""
    words = []
    for key, value in keys.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where}: a key must be a name, not {key!r}")
        dotted = prefix + key
        if isinstance(value, dict) and value:
            words += variant_overrides(value, where, dotted + ".")
        else:
            words.append(f"{dotted}={yaml_flow(value)}")
    return words


def yaml_flow(value: object) -> str:
    """``value`` as one line of YAML that reads back as itself (strings YAML 1.1 would take for booleans, such as
    'off', quoted)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True,
                          sort_keys=False).strip()
    return text.removesuffix("...").strip()


# What a directory name keeps of a grid point: no '/' (a value never makes a subdirectory), no ':' (it splits paths
# for TensorBoard's --logdir_spec, scp and rsync: an import path reads pkg.mod.Net), and none of the characters a
# shell would read (quotes, brackets, wildcards, spaces), so a run's directory is typed and globbed as it is written.
DIRECTORY_SAFE = str.maketrans({"/": "_", ":": ".", " ": "_", "\\": "_", "*": "x", "?": "x", **dict.fromkeys(
    "'\"[]{}()$`!&;|<>~#", None)})


def run_dir_name(overrides: list[str]) -> str:
    """A run's directory name: its grid overrides joined by commas (``seed=0,strategy.name=fedavg``), the form
    Hydra's multirun gives its run directories, with only the characters a shell and a path take as they are
    (``DIRECTORY_SAFE``): ``model.local=['5.*']`` names ``model.local=5.x``."""
    return ",".join(overrides).translate(DIRECTORY_SAFE) or "run"


def point_dir(runs_dir: Path, overrides: list[str]) -> Path:
    """Where a grid point's run lives: ``run_dir_name``, or where it is already there (so ``--resume`` still finds
    it) a name that earlier sweeps gave it: with ':' kept (before 2026-12-01), or with quotes, brackets and
    wildcards kept (before 2026-12-02)."""
    joined = ",".join(overrides).replace("/", "_")
    for earlier in (runs_dir / joined, runs_dir / joined.replace(":", ".")):
        if earlier.name and earlier.name != run_dir_name(overrides) and earlier.exists():
            return earlier
    return runs_dir / run_dir_name(overrides)


# What --dry-run --resume says of a finished run, and of a grid whose every run is: a sweep's job script reads the
# latter after a SIGTERM that reached the ranks once the last run had completed (mpifl.cli.jobs)
COMPLETE, EVERY_RUN_COMPLETE = "complete", "every run complete"
