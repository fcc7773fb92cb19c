"""``mpifl sweep``: a grid of runs of one config, one after another in one MPI job.

Why: each rank of a fresh job spends seconds importing Python, torch and MPI before its first round (on a
cluster's shared file system, often more), and a batch scheduler charges for every job's queue wait. A grid of
seeds and algorithms in one allocation pays both once. Each run is an ordinary ``mpifl run`` in its own run
directory, so ``mpifl report``, ``compare`` and ``--resume`` work on each as on any other.
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from mpifl.cli.commands import run, world_of
from mpifl.cli.supervisor import supervised
from mpifl.config import ConfigError
from mpifl.errors import INTERRUPTED
from mpifl.logs import log
from mpifl.planning.world import too_few_ranks
from mpifl.units import range_list


def grid_overrides(grid: list[str]) -> list[list[str]]:
    """Every combination of the ``KEY=V1,V2,...`` axes as ``KEY=V`` overrides, the last axis changing fastest
    (as nested loops written in the same order would visit them). Values are split at commas, so a grid value
    cannot hold one (a list value stays in the config or a plain override)."""
    axes: dict[str, list[str]] = {}
    for axis in grid:
        key, sep, values = axis.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--grid {axis!r}: expected KEY=VALUE1,VALUE2,...")
        if key in axes:
            raise ConfigError(f"--grid names a key twice: {key}")
        choices = values.split(",")
        if any(not v for v in choices):
            raise ConfigError(f"--grid {axis!r}: an empty value")
        axes[key] = [f"{key}={v}" for v in choices]
    points = [list(combination) for combination in itertools.product(*axes.values())]
    named: dict[str, list[str]] = {}
    for point in points:
        other = named.setdefault(run_dir_name(point), point)
        if other is not point:
            raise ConfigError(f"--grid: the points {' '.join(other)} and {' '.join(point)} would share the run "
                              f"directory {run_dir_name(point)!r} (a directory name keeps no quotes, brackets or "
                              "wildcards): write the two values so that they differ in letters or digits")
    return points


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
    if getattr(args, "comm", None) is not None:
        return _sweep(args)
    return supervised(lambda: _sweep(args), command="sweep")


def _sweep(args: argparse.Namespace) -> int:
    """``sweep`` on this rank, in the process that runs MPI."""
    from mpi4py import MPI

    world = world_of(getattr(args, "comm", None))
    points = grid_overrides(args.grid)
    speaks = world.Get_rank() == 0
    if world.Get_size() < 2:  # every point would be refused alike: say it once, before any run directory
        log(f"mpifl sweep: {too_few_ranks('sweep')} ...", rank=0)
        return 2
    failed: dict[int, int] = {}  # run number -> its exit status, for the runs that failed
    for number, point in enumerate(points, 1):
        run_dir = point_dir(Path(args.runs_dir), point)
        if speaks:
            log(f"mpifl sweep: run {number} of {len(points)}: {' '.join(point)} -> {run_dir}", rank=0)
        one = argparse.Namespace(config=args.config, overrides=[*args.overrides, *point], run_dir=str(run_dir),
                                 resume="latest" if args.resume else None, memray=None, memray_native=False,
                                 comm=world.Dup())  # its own message space: nothing of one run reaches the next
        try:
            status = run(one)  # a config problem is said and agreed on by the ranks (exit status 2)
        finally:
            one.comm.Free()
        if status == 2 and speaks:  # the other grid points may still be valid
            log(f"mpifl sweep: config error in run {number} ({' '.join(point)}), said above: the other runs go on",
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
        return f"mpifl sweep: {total} runs in {runs_dir}"
    refused = sorted(n for n, status in failed.items() if status == 2)
    if len(refused) == total:
        return (f"mpifl sweep: none of the {total} runs started: every run's config was refused (said above); "
                "a key or value the grid gives every run is the likeliest cause")
    return (f"mpifl sweep: {total} runs in {runs_dir}: {total - len(failed)} finished, {len(failed)} failed (run "
            f"{range_list(sorted(failed))}" + (f"; the config of run {range_list(refused)} was refused" if refused
                                               else "") + ", said above)")
