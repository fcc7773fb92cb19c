"""``mpifl sweep``: a grid of runs of one config, one after another in one MPI job.

Why: each rank of a fresh job spends seconds importing Python, torch and MPI before its first round (on a
cluster's shared file system, often more), and a batch scheduler charges for every job's queue wait. A grid of
seeds and algorithms in one allocation pays both once. Each run is an ordinary ``mpifl run`` in its own run
directory, so ``mpifl report``, ``compare`` and ``--resume`` work on each as on any other.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from mpifl.cli.commands import checked_config, run, validated_summary, world_of
from mpifl.cli.grid import COMPLETE, EVERY_RUN_COMPLETE, grid_points, point_dir
from mpifl.cli.supervisor import supervised
from mpifl.config import Config, ConfigError
from mpifl.errors import INTERRUPTED, CheckpointError
from mpifl.logs import env_rank, log
from mpifl.planning.world import too_few_ranks
from mpifl.units import range_list


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
        except (ConfigError, CheckpointError) as err:  # a checkpoint that cannot be read refuses its point alone
            refused.append(number)
            lines.append((f"{head}\n  {'config error: ' if isinstance(err, ConfigError) else ''}{err}", []))
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


def existing_run(cfg: Config, run_dir: Path, resume: bool) -> str:
    """What the sweep will do with a run already in ``run_dir`` ('' where none is): without ``--resume`` it refuses
    the point (a ConfigError, as the run would); with it, it skips a complete run, goes on from the newest
    checkpoint, or refuses one whose checkpoint's config differs from the point's (the key, as ``--resume`` says)."""
    from mpifl.storage.rundir import (
        FINAL_MODEL,
        METRICS,
        RunComplete,
        already_holds_a_run,
        find_resume,
        finished_without_checkpoint,
    )

    if not (run_dir / METRICS).exists():
        return ""
    if not resume:
        raise ConfigError(already_holds_a_run(run_dir).replace("--run-dir", "--runs-dir"))
    try:
        checkpoint = find_resume(cfg, str(run_dir), "latest")
    except RunComplete:
        return f"{COMPLETE}: --resume skips it"
    if checkpoint is None and (run_dir / FINAL_MODEL).exists():  # as the run refuses it: its model is its result
        raise ConfigError(finished_without_checkpoint(run_dir, cfg.rounds))
    if checkpoint is None:
        return "no checkpoint: --resume starts it over"
    return f"--resume goes on from {checkpoint.name}"


def _sweep(args: argparse.Namespace) -> int:
    """``sweep`` on this rank, in the process that runs MPI."""
    from mpi4py import MPI

    from mpifl.wire.transport import arrive_together  # here: importing mpi4py starts MPI (see mpifl.cli.supervisor)

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
        # ranks agree on the worst status, so that all stop, or all go on to the next point; the clients, done
        # first, sleep until the server has written the run's last files
        arrive_together(world)
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
