"""What ``mpifl pbs`` and ``mpifl slurm`` share: their common options, the rank and node count with the
memory checks (``estimate``, ``node_warning`` and ``gpu_warning`` of ``mpifl.cli.plan``), writing the
script, and the final check of the run directory that decides the job's exit status.
"""
from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from mpifl.cli.plan import (
    ModelBytes,
    clients_beside_server,
    estimate,
    fewest_fitting_ranks,
    gpu_warning,
    node_warning,
    planned_config,
    ranks_per_gpu,
)
from mpifl.config import Config, ConfigError
from mpifl.errors import UsageError
from mpifl.planning.memory import MemoryEstimate

# After the launcher exits 0, or by SIGTERM, the run directory decides the job's exit status (both schedulers'
# scripts).
FINAL_CHECK_TEMPLATE = """\
# A launcher can report 0 after a rank left through C's _exit and it killed the others: the run directory
# decides. `mpifl status` says how far the run got and which ranks did not finish; 0 only when complete.
# The launcher reporting 0 with no run directory ran nothing: the job fails, unless {launcher} was set to another
# program on purpose (a dry run: {launcher}=echo prints the launch line).
if [[ "$STATUS" == 0 && -f "$RUN_DIR/config.yaml" ]]; then
  {mpifl} status "$RUN_DIR" || STATUS=$?
elif [[ "$STATUS" == 0 && "${launcher}" == {default} ]]; then
  echo "mpifl: {default} exited 0, but $RUN_DIR holds no run (no config.yaml): nothing ran" >&2
  STATUS=1
elif [[ "$STATUS" == 0 ]]; then
  echo "mpifl: $RUN_DIR holds no run: nothing ran ({launcher}=${launcher}, a dry run?)" >&2
elif [[ ("$STATUS" == 143 || "$STATUS" == 15) && -f "$RUN_DIR/config.yaml" ]]; then
  # SIGTERM (the early stop, or the scheduler's) can reach the ranks while a complete run shuts down: the
  # launcher then reports it, but the run directory holds every round, so the job succeeds.
  FINAL=$({mpifl} status "$RUN_DIR") || FINAL=
  if [[ "$FINAL" == *$'\n'complete && "$FINAL" != *"the job then failed"* ]]; then
    echo "$FINAL"
    echo "mpifl: ${launcher} exited $STATUS (SIGTERM) after the run completed: the job succeeds" >&2
    STATUS=0
  fi
fi
exit "$STATUS"
"""


# A sweep's job: `mpifl sweep` itself says which of its runs failed (exit status 2, or 1 for a failed run) and stops
# with 3 on SIGTERM, resumable; its ranks' supervisor fails it when a rank leaves with 0 past Python's cleanup.
SWEEP_CHECK_TEMPLATE = """\
# The launcher reporting 0 with no runs folder ran nothing: the job fails, unless {launcher} was set to another
# program on purpose (a dry run: {launcher}=echo prints the launch line). `mpifl sweep` says which runs failed.
if [[ "$STATUS" == 0 && ! -d "$RUNS_DIR" && "${launcher}" == {default} ]]; then
  echo "mpifl: {default} exited 0, but $RUNS_DIR holds no runs: nothing ran" >&2
  STATUS=1
elif [[ "$STATUS" == 0 && ! -d "$RUNS_DIR" ]]; then
  echo "mpifl: $RUNS_DIR holds no runs: nothing ran ({launcher}=${launcher}, a dry run?)" >&2
elif [[ ("$STATUS" == 143 || "$STATUS" == 15) && -d "$RUNS_DIR" ]]; then
  # SIGTERM can reach the ranks while a finished sweep shuts down: if every run of the grid is complete, the job
  # succeeds (mpifl sweep --dry-run --resume checks each run as a resubmission would, without MPI)
  FINAL=$({mpifl} sweep "$CONFIG" --runs-dir "$RUNS_DIR" "${{GRID[@]}}" "${{OVERRIDES[@]}}" "${{MORE[@]}}" "$@" \\
    --resume --dry-run 2>/dev/null | tail -n 1) || FINAL=
  if [[ "$FINAL" == *", {complete}" ]]; then
    echo "mpifl: ${launcher} exited $STATUS (SIGTERM) after every run of the sweep completed: the job succeeds" >&2
    STATUS=0
  fi
fi
exit "$STATUS"
"""


def final_check(mpifl: str = "mpifl", launcher: str = "MPIEXEC", default: str = "mpiexec", sweep: bool = False) -> str:
    """The script's last lines, with ``mpifl`` as the script calls it and ``launcher``, the variable that names
    the launcher (``default`` unless set to another program on purpose); for a sweep's job, ``sweep``."""
    if sweep:
        from mpifl.cli.grid import EVERY_RUN_COMPLETE

        return SWEEP_CHECK_TEMPLATE.format(mpifl=mpifl, launcher=launcher, default=default, complete=EVERY_RUN_COMPLETE)
    return FINAL_CHECK_TEMPLATE.format(mpifl=mpifl, launcher=launcher, default=default)


def script_words(job: Job, mpifl: str = "mpifl", launcher: str = "MPIEXEC", default: str = "mpiexec") -> dict[str, str]:
    """What both schedulers' templates fill in alike: the launch (``launch_words``) and the final check."""
    return {**launch_words(job, mpifl),
            "final_check": final_check(mpifl, launcher=launcher, default=default, sweep=bool(job.grid))}


def launch_words(job: Job, mpifl: str) -> dict[str, str]:
    """What a job script's template says differently for one run (``mpifl run`` into ``RUN_DIR``) and for a sweep
    (``mpifl sweep`` over ``GRID`` into ``RUNS_DIR``): the folder's lines, the resume flag, the command and the
    folder's name in the script's first line of output; ``mpifl`` as the script calls it."""
    if not job.grid:
        return {"folder": f"RUN_DIR=${{RUN_DIR:-runs/{job.cfg.name}}}",
                "resume_note": "continue RUN_DIR (fresh if no checkpoint; exit 0 if complete)",
                "resume": "--resume=latest", "launch": f'{mpifl} run "$CONFIG" --run-dir "$RUN_DIR"',
                "folder_said": "run dir $RUN_DIR", "tool": "mpifl run", "more_example": "--memray runs/prof"}
    grid = " ".join(f"--grid '{axis}'" if "'" not in axis else f"--grid {shlex.quote(axis)}" for axis in job.grid)
    # quoted always: a comma between words reads to shellcheck as a mistaken array separator (SC2054)
    return {"folder": f"RUNS_DIR=${{RUNS_DIR:-{job.runs_dir}}}\nGRID=({grid})   # the sweep's axes, as mpifl sweep "
                      "takes them",
            "resume_note": "skip the sweep's finished runs, resume unfinished ones, start the rest",
            "resume": "--resume", "launch": f'{mpifl} sweep "$CONFIG" --runs-dir "$RUNS_DIR" "${{GRID[@]}}"',
            "folder_said": "runs dir $RUNS_DIR", "tool": "mpifl sweep", "more_example": "rounds=50"}


@dataclass(frozen=True)
class Job:
    """A config's job: its ranks, nodes and memory plan, and the command that generated the script."""

    cfg: Config
    nranks: int
    nodes: int
    plan: MemoryEstimate
    command: str
    overrides: tuple[str, ...] = ()  # key=value overrides given with the config: planned with, so run with
    grid: tuple[str, ...] = ()  # a sweep's --grid axes (none: one run)
    runs_dir: str = ""  # the sweep's folder of runs

    @property
    def overrides_words(self) -> str:
        """The overrides as the words of a bash array, each quoted."""
        return " ".join(shlex.quote(o) for o in self.overrides)

    @property
    def memory_note(self) -> str:
        """The memory plan in one line, for the script's header."""
        from mpifl.planning.memory import exchanged_what

        return self.plan.describe(exchanged_what(self.cfg))


def plan_job(args: argparse.Namespace, tool: str, server_alone: bool = False) -> Job:
    """Load and check the config (``planned_config``), count ranks (1 server + client ranks) and nodes, and print the
    memory warning, if any. Raises UsageError for a --nodes that the ranks do not fill exactly at --ranks-per-node.
    With ``--grid`` (a sweep's job) every grid point is loaded and checked; they must plan the same client ranks,
    and the job is planned for the one whose fullest node needs the most memory."""
    if args.runs_dir and not args.grid:
        raise UsageError("argument --runs-dir: it names a sweep's folder of runs; give the sweep's --grid too (one "
                         "run's folder is the script's RUN_DIR)")
    given = tuple(args.overrides)  # the job's own overrides: a sweep's script passes each point's through GRID
    cfg, client_ranks, args, size, plan = planned_point(args, server_alone)
    nranks = client_ranks + 1
    nodes = nodes_filled(nranks, args.ranks_per_node, server_alone)
    problem = node_count_problem(args.nodes, nranks, args.ranks_per_node, server_alone)
    if problem:
        raise UsageError(problem)
    fit = fewest_fitting_ranks(cfg, size, args, args.gpus_per_node, plan)
    for warning in (node_warning(cfg, plan, args.node_memory_gb, server_alone, server_alone_offered=tool != "slurm",
                                 ranks_per_node=args.ranks_per_node, fit=fit),
                    gpu_warning(cfg, plan, args.gpu_memory_gb if args.gpus_per_node > 0 else None,
                                ranks_per_gpu(args.ranks_per_node, args.gpus_per_node, nranks - 1),
                                clients_beside_server(args.ranks_per_node, args.gpus_per_node, nranks, server_alone),
                                fit)):
        if warning:
            print(warning)
    command = f"mpifl {tool} " + " ".join(shlex.quote(a) for a in args.argv)
    return Job(cfg, nranks, nodes, plan, command, given, tuple(args.grid), args.runs_dir or f"runs/{cfg.name}-sweep")


def planned_point(args: argparse.Namespace, server_alone: bool) -> tuple[Config, int, argparse.Namespace, ModelBytes,
                                                                         MemoryEstimate]:
    """The config to plan the job for, its client ranks, the arguments it was planned with (the grid point's
    overrides after the job's), and its model size and memory plan: the config itself, or, for a sweep, every grid
    point checked and the one whose fullest node needs the most (a config warning said once)."""
    from mpifl.cli.grid import GridPoint, grid_points

    points: list[GridPoint | None] = list(grid_points(args.grid)) if args.grid else [None]
    if points == [None]:
        cfg, client_ranks = planned_config(args)
        size, plan = estimate(cfg, client_ranks + 1, args.ranks_per_node, server_alone, args.gpus_per_node)
        return cfg, client_ranks, args, size, plan
    planned, warned = [], {}
    for point in points:
        assert point is not None
        one = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *point.overrides]})
        warnings: list[str] = []
        try:
            cfg, client_ranks = planned_config(one, warnings)
        except ConfigError as err:
            raise ConfigError(f"grid point {' '.join(point.labels)}: {err}") from None
        warned[" ".join(point.labels)] = warnings
        size, plan = estimate(cfg, client_ranks + 1, args.ranks_per_node, server_alone, args.gpus_per_node)
        planned.append((cfg, client_ranks, one, size, plan, point))
    everywhere = set.intersection(*(set(w) for w in warned.values()))
    for warning in sorted(everywhere):  # a warning every point has, once; the others naming their point
        print(f"warning: {warning}")
    for label, warnings in warned.items():
        for warning in warnings:
            if warning not in everywhere:
                print(f"warning: grid point {label}: {warning}")
    ranks = {client_ranks for _, client_ranks, *_ in planned}
    if len(ranks) > 1:
        each = ", ".join(f"{c} for {' '.join(p.labels)}" for _, c, _, _, _, p in planned if p)
        raise UsageError(f"the grid's points plan different client ranks ({each}) and one job runs them all on one "
                         "number: give --client-ranks, or keep clients.per_round (and clients.groups) the same "
                         "across the grid")
    cfg, client_ranks, one, size, plan, _ = max(planned, key=lambda p: p[4].node_bytes)
    return cfg, client_ranks, one, size, plan


def nodes_filled(nranks: int, ranks_per_node: int, server_alone: bool) -> int:
    """The nodes that ``nranks`` ranks fill at ``ranks_per_node`` each (with ``server_alone``, the first holds rank 0
    alone): what the launcher uses, so what the job should ask for."""
    alone = 1 if server_alone else 0
    return alone + math.ceil((nranks - alone) / ranks_per_node)


def node_count_problem(asked: int | None, nranks: int, ranks_per_node: int, server_alone: bool) -> str | None:
    """Why ``--nodes asked`` does not fit ``nranks`` ranks at ``ranks_per_node`` (the launcher places that many on each
    node, and the memory check counts them so), or None. Too few: the launcher cannot place the ranks; too many:
    the nodes past those filled sit idle, charged."""
    needed = nodes_filled(nranks, ranks_per_node, server_alone)
    if asked is None or asked == needed:
        return None
    ranks = (f"{nranks} ranks (1 server + {nranks - 1} client ranks) at --ranks-per-node {ranks_per_node}"
             + (", the server alone on the first node," if server_alone else ""))
    if asked < needed:
        return (f"argument --nodes: {ranks} need {needed} nodes, not {asked}: ask for --nodes {needed} (or leave it "
                "out), raise --ranks-per-node, or lower --client-ranks")
    return (f"argument --nodes: {ranks} fill {needed} node(s), so {asked - needed} of {asked} would sit idle, "
            f"charged: ask for --nodes {needed} (or leave it out), or spread the ranks with a lower --ranks-per-node")


def stop_before_problem(stop: int, limit: int | None, limit_text: str, option: str, asked: bool = False) -> str | None:
    """Why SIGTERM ``stop`` seconds before a time limit of ``limit`` seconds (``limit_text`` as given to ``option``)
    cannot work, or None: the script's timer (or Slurm's --signal) would be due before the job starts, or the
    ``asked`` --stop-before has no limit to come before (0: none)."""
    if asked and stop and limit == 0:
        return (f"argument --stop-before: {option} {limit_text} sets no time limit, so there is nothing to stop "
                f"{stop} s before: give {option} a limit, or --stop-before 0")
    if stop == 0 or not limit or stop < limit:
        return None
    return (f"argument --stop-before: {stop} s is not shorter than the time limit ({option} {limit_text}, {limit} s), "
            f"so the ranks would never get their early SIGTERM: give fewer seconds (the default is a tenth of the "
            "limit, at most 300), or 0 for none")


# Without --stop-before, every rank gets SIGTERM a tenth of the job's time limit before it, at most this long before
# (a PBS script works it out again at run time from the walltime the job was granted: mpifl.cli.pbs)
STOP_SHARE, STOP_CAP_SECONDS = 10, 300


def early_stop_seconds(asked: int | None, limit: int | None) -> int:
    """Seconds before a job's time limit at which every rank gets SIGTERM: ``asked``, else a tenth of the
    ``limit`` (seconds), at most 300 (300 when the limit cannot be read)."""
    if asked is not None:
        return asked
    return STOP_CAP_SECONDS if limit is None else min(STOP_CAP_SECONDS, limit // STOP_SHARE)


def write_script(job: Job, output: str | None, suffix: str, script: str) -> Path:
    """Write an executable job script (default ``<name><suffix>``) and say what it asks for."""
    out = Path(output or f"{job.cfg.name}{suffix}")
    out.write_text(script)
    out.chmod(0o755)
    print(f"wrote {out}: {job.nranks} ranks on {job.nodes} node(s); {job.memory_note}")
    return out
