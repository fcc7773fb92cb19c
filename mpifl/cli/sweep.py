"""``mpifl sweep``: a grid of runs of one config, one after another in one MPI job.

Why: each rank of a fresh job spends seconds importing Python, torch and MPI before its first round (on a
cluster's shared file system, often more), and a batch scheduler charges for every job's queue wait. A grid of
seeds and algorithms in one allocation pays both once. Each run is an ordinary ``mpifl run`` in its own run
directory, so ``mpifl report``, ``compare`` and ``--resume`` work on each as on any other.
"""
from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path

import yaml

from mpifl.cli.commands import checked_config, run, validated_summary, world_of
from mpifl.cli.supervisor import supervised
from mpifl.config import Config, ConfigError
from mpifl.config.schema import read_yaml
from mpifl.errors import INTERRUPTED
from mpifl.logs import env_rank, log
from mpifl.planning.world import too_few_ranks
from mpifl.units import range_list


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


def config_keys(values: dict, prefix: str = "") -> set[str]:
    """Every dotted key of a config's values (``seed``, ``strategy.name``, ...)."""
    keys = set()
    for key, value in values.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= config_keys(value, f"{prefix}{key}.")
    return keys - {key for key, value in values.items() if isinstance(value, dict)}  # a section may name an axis


CONFIG_KEYS = config_keys(Config().to_dict())  # what a variants axis may not be named


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


def sweep(args: argparse.Namespace) -> int:
    """Run every grid point of ``args.config`` under ``args.runs_dir``; exit status 0 when all succeeded, 3 when a
    signal stopped one (the sweep stops there: ``--resume`` goes on), else the first failure's. Each rank runs
    under a supervisor, as ``mpifl run``'s do (``mpifl.cli.supervisor``), unless the caller passed its own
    communicator."""
    if getattr(args, "dry_run", False):
        return dry_run(args)
    if getattr(args, "comm", None) is not None:
        return _sweep(args)
    return supervised(lambda: _sweep(args), command="sweep")


def dry_run(args: argparse.Namespace) -> int:
    """``mpifl sweep --dry-run``: each grid point's run directory and the keys it sets, each config checked as
    ``mpifl validate`` checks one, in a plain process (no MPI), so that a grid submitted to a batch queue holds no
    refused point. A warning every valid point shares is said once, first; exit status 2 when any point is
    refused."""
    points = grid_points(args.grid)
    if env_rank() not in (0, None):  # started under mpiexec after all: the first rank says it for all
        return 0
    lines: list[tuple[str, list[str]]] = []
    warned: list[set[str]] = []
    refused: list[int] = []
    complete = 0
    for number, point in enumerate(points, 1):
        run_dir = point_dir(Path(args.runs_dir), point.labels)
        head = f"run {number} of {len(points)}: {point.describe()} -> {run_dir}"
        try:
            cfg, warnings = checked_config(args.config, [*args.overrides, *point.overrides])
            there = existing_run(cfg, run_dir, bool(args.resume))
        except ConfigError as err:
            refused.append(number)
            lines.append((f"{head}\n  config error: {err}", []))
            continue
        complete += there.startswith(COMPLETE)
        lines.append((f"{head}" + (f" ({there})" if there else "") + f"\n  valid ({validated_summary(cfg)})",
                      warnings))
        warned.append(set(warnings))
    everywhere = set.intersection(*warned) if len(warned) > 1 else set()  # among the valid points
    for warning in sorted(everywhere):
        print(f"warning (every run): {warning}")
    for text, warnings in lines:
        print(text)
        for warning in warnings:
            if warning not in everywhere:
                print(f"  warning: {warning}")
    runs = f"{len(points)} run{'s' if len(points) > 1 else ''}"
    if refused:
        print(f"mpifl sweep --dry-run: {runs}, run {range_list(refused)} refused")
        return 2
    print(f"mpifl sweep --dry-run: {runs}, every config valid" + (f", {EVERY_RUN_COMPLETE}" if complete == len(points)
                                                                   else ""))
    return 0


# What --dry-run --resume says of a finished run, and of a grid whose every run is: a sweep's job script reads the
# latter after a SIGTERM that reached the ranks once the last run had completed (mpifl.cli.jobs)
COMPLETE, EVERY_RUN_COMPLETE = "complete", "every run complete"


def existing_run(cfg: Config, run_dir: Path, resume: bool) -> str:
    """What the sweep will do with a run already in ``run_dir`` ('' where none is): without ``--resume`` it refuses
    the point (a ConfigError, as the run would); with it, it skips a complete run, goes on from the newest
    checkpoint, or refuses one whose checkpoint's config differs from the point's (the key, as ``--resume`` says)."""
    from mpifl.storage.rundir import METRICS, RunComplete, already_holds_a_run, find_resume

    if not (run_dir / METRICS).exists():
        return ""
    if not resume:
        raise ConfigError(already_holds_a_run(run_dir).replace("--run-dir", "--runs-dir"))
    try:
        checkpoint = find_resume(cfg, str(run_dir), "latest")
    except RunComplete:
        return f"{COMPLETE}: --resume skips it"
    if checkpoint is None:
        return "no checkpoint: --resume starts it over"
    return f"--resume goes on from {checkpoint.name}"


def _sweep(args: argparse.Namespace) -> int:
    """``sweep`` on this rank, in the process that runs MPI."""
    from mpi4py import MPI

    world = world_of(getattr(args, "comm", None))
    points = grid_points(args.grid)
    speaks = world.Get_rank() == 0
    if world.Get_size() < 2:  # every point would be refused alike: say it once, before any run directory
        log(f"mpifl sweep: {too_few_ranks('sweep')} ...", rank=0)
        return 2
    failed: dict[int, int] = {}  # run number -> its exit status, for the runs that failed
    for number, point in enumerate(points, 1):
        run_dir = point_dir(Path(args.runs_dir), point.labels)
        if speaks:
            log(f"mpifl sweep: run {number} of {len(points)}: {point.describe()} -> {run_dir}", rank=0)
        one = argparse.Namespace(config=args.config, overrides=[*args.overrides, *point.overrides],
                                 run_dir=str(run_dir),
                                 resume="latest" if args.resume else None, memray=None, memray_native=False,
                                 comm=world.Dup())  # its own message space: nothing of one run reaches the next
        try:
            status = run(one)  # a config problem is said and agreed on by the ranks (exit status 2)
        finally:
            one.comm.Free()
        if status == 2 and speaks:  # the other grid points may still be valid
            log(f"mpifl sweep: config error in run {number} ({' '.join(point.labels)}), said above: the other runs go "
                "on",
                rank=0)
        # only the server learns that a signal stopped the run (the clients end as after the last round): the
        # ranks agree on the worst status, so that all stop, or all go on to the next point
        status = world.allreduce(status, op=MPI.MAX)
        if status == INTERRUPTED:
            if speaks:
                log(f"mpifl sweep: stopped by a signal in run {number} of {len(points)}; rerun with --resume to go "
                    "on", rank=0)
            return status
        if status:
            failed[number] = status
    if speaks:
        log(sweep_summary(len(points), args.runs_dir, failed), rank=0)
    return next(iter(failed.values()), 0)


def sweep_summary(total: int, runs_dir: str, failed: dict[int, int]) -> str:
    """The sweep's last line: how many of its ``total`` runs finished and which failed (``failed``: run number to
    exit status; 2 is a config the ranks refused before the run started)."""
    if not failed:
        return f"mpifl sweep: {total} run{'s' if total > 1 else ''} in {runs_dir}"
    refused = sorted(n for n, status in failed.items() if status == 2)
    if len(refused) == total:
        return (f"mpifl sweep: none of the {total} runs started: every run was refused (said above); a key or value "
                "the grid gives every run, or run directories that already hold runs (add --resume), are the "
                "likeliest causes")
    return (f"mpifl sweep: {total} runs in {runs_dir}: {total - len(failed)} finished, {len(failed)} failed (run "
            f"{range_list(sorted(failed))}" + (f"; the config of run {range_list(refused)} was refused" if refused
                                               else "") + ", said above)")
