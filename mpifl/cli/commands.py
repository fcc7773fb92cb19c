"""The config-taking commands: ``run``, ``validate``, ``partition``; and the small checkpoint and report ones."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mpifl.cli.preflight import check_model, check_partition, check_plugins, check_trainer, partition_counts_of
from mpifl.cli.supervisor import mark_mpi_started, supervised, tell_run_dir
from mpifl.config import Config, ConfigError, load_config
from mpifl.config.capabilities import BUILTIN_CAPABILITIES, ORDER_STATISTIC, WHOLE_UPDATE_RULES
from mpifl.errors import INTERRUPTED, CheckpointError, MissingExtra
from mpifl.logs import log
from mpifl.planning.faults import fault_summary
from mpifl.roles.launch import SetupError, agree, bind_gpu_from_local_rank, guarded
from mpifl.units import range_list

if TYPE_CHECKING:
    from mpi4py import MPI



def world_of(comm: MPI.Intracomm | None) -> MPI.Intracomm:
    """The communicator a command runs on: the caller's (``mpifl.cli.main(argv, comm=...)``), else the world."""
    from mpi4py import MPI

    mark_mpi_started()  # mpi4py initialised MPI on import: a failure from here on ends the job through MPI
    return comm if comm is not None else MPI.COMM_WORLD


def run(args: argparse.Namespace) -> int:
    """``mpifl run``: every rank checks the config, rank 0 readies the run directory, then the roles run; in a
    child process under a supervisor that the launcher sees (mpifl.cli.supervisor), unless the run is on a
    communicator the caller passed (``main(argv, comm)``: a program already under MPI)."""
    if getattr(args, "comm", None) is not None:
        return _run_command(args)
    return supervised(lambda: _run_command(args))


def _run_command(args: argparse.Namespace) -> int:
    """Check the config on every rank before MPI starts, agree on what the checks found, then run."""
    from mpifl.storage.rundir import RunComplete, find_resume, resume_warnings

    checked, problem, complete = None, None, None
    try:
        cfg = load_config(args.config, args.overrides)
        warnings = check_plugins(cfg)
        if cfg.model.local:  # which tensors stay is known only from the built model (a plug-in: on the ranks)
            check_model(cfg)
        resume = find_resume(cfg, args.run_dir, args.resume) if args.resume else None
        warnings += resume_warnings(cfg, resume) if resume is not None else []
        checked = cfg, warnings, resume
    except RunComplete as done:
        complete = str(done)
    except (ConfigError, CheckpointError, MissingExtra) as err:
        problem = f"mpifl: config error: {err}" if isinstance(err, ConfigError) else f"mpifl: {err}"
    bind_gpu_from_local_rank()  # before MPI starts (world_of imports it)
    comm = world_of(getattr(args, "comm", None))
    verdict = agree_on_checks(comm, problem, complete)
    if verdict is not None:
        return verdict
    assert checked is not None  # every rank's checks passed
    cfg, warnings, resume = checked
    for warning in warnings if comm.Get_rank() == 0 else []:
        log(f"mpifl: warning: {warning}", rank=0)
    return _run(comm, cfg, args.run_dir, resume, args.resume, args.memray, args.memray_native)


def agree_on_checks(comm: MPI.Intracomm, problem: str | None, complete: str | None) -> int | None:
    """What every rank's checks before MPI found, agreed over ``comm``: None to go on, else the exit status for
    every rank (2: a problem, 0: the run is already complete). Rank 0 says it once, naming the ranks that found it
    when not all did: a problem found on one rank only (a file missing on one node) must end the job, not leave
    the other ranks waiting."""
    from mpifl.wire.transport import arrive_together  # here: importing mpi4py starts MPI (see mpifl.cli.supervisor)

    arrive_together(comm)  # the ranks end their checks (torch's import among them) at different times
    outcomes = comm.allgather((problem, complete))
    problems: dict[str, list[int]] = {}
    for rank, (line, _) in enumerate(outcomes):
        if line is not None:
            problems.setdefault(line, []).append(rank)
    completes = [rank for rank, (_, done) in enumerate(outcomes) if done is not None]
    if not problems and not completes:
        return None
    says = comm.Get_rank() == 0 and not _another_singleton(comm)
    size = comm.Get_size()
    for line, ranks in problems.items() if says else ():
        log(line + ("" if len(ranks) == size else f" (found on rank {range_list(ranks)} only)"), rank=0)
    if problems:
        return 2
    if len(completes) < size:
        if says:
            log(f"mpifl: ranks {range_list(completes)} found the run complete and the others did not (a shared file "
                "system not yet in step?); nothing was run", rank=0)
        return 2
    if says:
        log(f"mpifl: {outcomes[0][1]}", rank=0)
    return 0


def _run(comm: MPI.Intracomm, cfg: Config, run_dir_arg: str | None, resume: Path | None,
         resume_asked: str | None, memray_dir: str | None, memray_native: bool) -> int:
    from mpifl.cli.profiling import tracked
    from mpifl.roles.runner import check_world, run_rank
    from mpifl.storage.lock import release_run_dir
    from mpifl.storage.rundir import prepare_run_dir

    try:
        check_world(comm.Get_size(), cfg)
        run_dir, point = agree(comm, lambda: prepare_run_dir(cfg, run_dir_arg, resume, resume_asked))
        tell_run_dir(run_dir, comm.Get_rank())  # its supervisor notes there a death by a signal
        try:
            with tracked(memray_dir, comm.Get_rank(), memray_native):
                outcome = guarded(lambda: run_rank(comm, cfg, run_dir, point))
        finally:
            release_run_dir(run_dir)  # rank 0's: the run is over (a rank that aborted took it with its process)
    except SetupError as err:
        if comm.Get_rank() == 0 and not _another_singleton(comm):
            log(f"mpifl: {err}", rank=0)
        return 2
    if outcome is not None and outcome.interrupted:  # exit 0 means every round asked for is on disk
        return INTERRUPTED
    return 0


def _another_singleton(comm: MPI.Intracomm) -> bool:
    """Whether this is one of several srun tasks that each started alone, and not the first: the first says why
    for all of them, so the job's log holds the reason once."""
    return comm.Get_size() == 1 and os.environ.get("SLURM_PROCID", "0") != "0"


def validate(args: argparse.Namespace) -> int:
    """``mpifl validate``: check a config (transformers and plug-in models are built on meta) without MPI."""
    cfg, warnings = checked_config(args.config, args.overrides)
    for warning in warnings:
        print(f"warning: {warning}")
    print(f"{args.config}: valid ({validated_summary(cfg)})")
    return 0


def checked_config(config: str, overrides: list[str]) -> tuple[Config, list[str]]:
    """The config with every check ``validate`` makes (plug-ins, the model on meta, the trainer, the partition, the
    virtual-time schedule), and its warnings; a problem is a ConfigError naming the key."""
    cfg = load_config(config, overrides)
    warnings = check_plugins(cfg, partition_follows=True)
    check_model(cfg, batched=True)
    check_trainer(cfg)
    warnings += check_schedule(cfg, check_partition(cfg))
    return cfg, warnings


def validated_summary(cfg: Config) -> str:
    """What ``validate`` says of a valid config: the schedule, the model, the strategy and what clients send."""
    model = f"{cfg.model.name} {cfg.model.dtype}"
    if cfg.model.name == "transformers":
        from mpifl.cli.plan import model_bytes, parameters_text
        from mpifl.units import format_bytes

        size = model_bytes(cfg)
        model += (f" ({parameters_text(size.parameters)}, {format_bytes(size.exchanged)} exchanged, "
                  f"{format_bytes(size.frozen)} frozen)")
    sends = "deltas" if cfg.strategy.update == "delta" else "weights"  # update and weighting as resolved
    weights = validated_weighting(cfg)
    faults = "; ".join(f"faults[{i}]: {fault_summary(f)}" for i, f in enumerate(cfg.faults))
    from mpifl.cli.compare import strategy_label  # the strategy as compare's table names it: fedavg + prox(μ=0.01)

    return (f"{validated_schedule(cfg)}, model {model}, strategy {strategy_label(cfg.to_dict())}: clients send "
            f"{sends}, {weights}" + (f"; {faults}" if faults else ""))


def validated_schedule(cfg: Config) -> str:
    """What ``validate`` says of the rounds: each round's clients, or, for the asynchronous clocks, the server steps,
    what each applies and how many clients train at once (``clients.per_round`` plays no part there)."""
    clock, clients = cfg.clock, cfg.clients.num_clients
    if not clock.asynchronous:
        rounds = f"{cfg.rounds} round{'s' * (cfg.rounds != 1)}"
        return f"{rounds}, {cfg.clients_per_round()} of {clients} clients per round"
    applies = {"fedasync": "1 update", "fedbuff": f"{clock.buffer} buffered updates (clock.buffer)"}.get(
        clock.mode, "an arrival group")
    return (f"{cfg.rounds} {clock.mode} server step{'s' * (cfg.rounds != 1)}, each applying {applies}, "
            f"{clock.in_flight()} of {clients} clients training at once (clock.concurrency)")


def check_schedule(cfg: Config, sizes: list[int] | None) -> list[str]:
    """Plan the whole virtual-time schedule (``clock.mode`` other than 'off') as the run's server does before round
    1, for ``mpifl validate``: a schedule that cannot be made (an availability trace that runs out before the last
    round) is a ConfigError naming the key and the round. It needs each client's training samples (``sizes``, from
    ``check_partition``) unless clients train fixed local_steps or on no data; not checked where it needs them and
    they were not read, nor where faults name ranks (the schedule then depends on the job's ranks): the server checks
    it as it starts. What it returns: warnings of the schedule's (faults that would never strike their client)."""
    from mpifl.cli.plan import model_specs
    from mpifl.clock.planners import AsyncSampler, clock_sampler, task_samples, unstruck_targets
    from mpifl.learning.datasets import needs_dataset
    from mpifl.planning.federation import placement_for
    from mpifl.wire.layout import ExchangeLayout

    sized = sizes is not None or cfg.train.local_steps or not needs_dataset(cfg)
    if cfg.clock.mode == "off" or not sized or any(f.ranks for f in cfg.faults):
        return []
    layout = ExchangeLayout.build(model_specs(cfg)[0], cfg.transport, cfg.compression, cfg.strategy.wire_dtype,
                                  cfg.clients.groups > 0)
    work = [float(n * cfg.train.local_epochs) for n in sizes] if sizes and not cfg.train.local_steps else None
    placement = placement_for(cfg.clients, max(1, cfg.clients.groups or cfg.clients_per_round()), work)
    samples = task_samples(sizes, cfg.clients.num_clients, cfg.train.local_epochs, cfg.train.local_steps,
                           cfg.train.batch_size)
    try:
        sampler = clock_sampler(cfg, placement, samples, layout.model_bytes, layout.update_bytes, quiet=True)
    except (ValueError, OSError) as err:
        raise ConfigError(f"cannot plan the virtual-time schedule: {err}") from None
    return unstruck_targets(cfg, sampler.steps) if isinstance(sampler, AsyncSampler) else []

def validated_weighting(cfg: Config) -> str:
    """How a round combines the clients' updates, as the run will: what ``validate`` says. The asynchronous clocks
    weigh each update by its staleness (mpifl.clock.planners), not by samples, whatever strategy.weighting says."""
    clock, statistic = cfg.clock, order_statistic(cfg)
    if clock.mode == "fedasync":
        return f"each update mixed in at alpha x s(staleness), alpha {clock.alpha:g}, s {clock.staleness}"
    caps = BUILTIN_CAPABILITIES.get(cfg.strategy.name)
    if caps is not None and caps.whole_update:
        buffered = clock.mode in ("fedbuff", "fedcompass")
        weights = f"s(staleness) ({clock.staleness})" if buffered else \
            ("equal weights" if cfg.strategy.weighting == "equal" else "samples")
        return distance_rule(cfg, "each step's" if buffered else "the round's", weights)
    if statistic and clock.mode in ("fedbuff", "fedcompass"):
        return (f"the {statistic} of each step's updates, unweighted: a stale update counts as much as a fresh one "
                f"(s(staleness) is not applied)")
    if clock.mode in ("fedbuff", "fedcompass"):
        return f"each update weighted by s(staleness) ({clock.staleness}), the sum divided by the updates applied"
    if statistic:
        return f"the {statistic} of the round's updates, unweighted"
    owner = own_weighting(cfg) if caps is None else None
    if owner is not None:
        return f"weighted by {owner}, the plug-in's own (strategy.weighting={cfg.strategy.weighting!r} is not read)"
    return "equal weights" if cfg.strategy.weighting == "equal" else "weighted by samples"


def own_weighting(cfg: Config) -> str | None:
    """Where a plug-in strategy's combiner weighs the participants by its own ``weight_of`` or ``weight`` (the
    method's import path), rather than by mpifl's, which read ``strategy.weighting``; None where mpifl's do."""
    from mpifl.aggregation.strategies import make_strategy

    weigher = type(make_strategy(cfg.strategy).weigher)
    for name in ("weight_of", "weight"):
        method = getattr(weigher, name, None)
        if method is not None and not getattr(method, "__module__", "mpifl.").startswith("mpifl."):
            return f"{method.__module__}.{method.__qualname__}"
    return None


def distance_rule(cfg: Config, updates: str, weights: str) -> str:
    """What a built-in rule over whole updates (mpifl.aggregation.distances: Capabilities.whole_update) takes of
    ``updates``, the mean or median weighted by ``weights`` (capabilities.WHOLE_UPDATE_RULES' words)."""
    s = cfg.strategy
    m = f"m={s.krum_keep}" if s.krum_keep else f"n - f = n - {s.byzantine_clients}"
    return WHOLE_UPDATE_RULES[s.name].format(updates=updates, weights=weights, f=s.byzantine_clients, m=m,
                                             iterations=s.geomed_iterations)


def order_statistic(cfg: Config) -> str | None:
    """What a built-in robust strategy takes of the updates, coordinate by coordinate (its fold ignores the weights:
    mpifl.aggregation.combiners.SortedStack), or None for another strategy."""
    if BUILTIN_CAPABILITIES.get(cfg.strategy.name) != ORDER_STATISTIC:
        return None
    return f"coordinate-wise {cfg.strategy.name.replace('_', ' ')}"


def partition(args: argparse.Namespace) -> int:
    """``mpifl partition``: the clients x labels table of what each client trains on, optionally plotted; a split
    that cannot be made is one line, exit 2."""
    from mpifl.cli.report import figure_path
    from mpifl.learning.partitions import partition_table, plot_partition

    if args.plot:
        figure_path(args.plot, "partition")
    cfg = load_config(args.config, args.overrides)
    histogram, validation = partition_counts_of(cfg)
    print(partition_table(histogram, max_rows=10**6, validation=validation))
    if args.plot:
        plot_partition(histogram, args.plot, validation)
        print(f"wrote {args.plot}")
    return 0


def compare(args: argparse.Namespace) -> int:
    """``mpifl compare``: runs side by side, seeds pooled into mean ± std, and optionally one figure."""
    from mpifl.cli.compare import compare_runs, plot_groups
    from mpifl.cli.report import figure_path

    if args.x != "round" and not args.plot:
        raise SystemExit(f"mpifl compare: --x {args.x} is the figure's axis: give --plot FILE.png too")
    if args.plot:
        figure_path(args.plot, "compare")
    text, groups = compare_runs(args.run_dirs, args.metric, args.target, args.better, args.format, args.x,
                                args.complete_only)
    print(text)
    if args.plot:  # beside a LaTeX table on stdout, on stderr: `> table.tex` keeps the table alone
        print(f"wrote {plot_groups(groups, args.metric, args.plot, x=args.x)}",
              file=sys.stderr if args.format == "latex" else sys.stdout)
    return 0


def calibrate(args: argparse.Namespace) -> int:
    """``mpifl calibrate``: the cost model fitted to a measured run."""
    from mpifl.cli.calibrate import CalibrationError, render
    from mpifl.cli.calibrate import calibrate as fit

    try:
        print(render(fit(args.run_dir)))
    except CalibrationError as err:
        raise SystemExit(f"mpifl calibrate: {err}") from None
    return 0


def report(args: argparse.Namespace) -> int:
    """``mpifl report``: PNG plots of a run's metrics."""
    from mpifl.cli.report import load_metrics, write_report
    from mpifl.roles.records import cost_line

    records = load_metrics(Path(args.run_dir))
    for path in write_report(args.run_dir, args.out, records):
        print(f"wrote {path}")
    last = records[-1]
    if "cost_to_date" in last:
        print(f"{cost_line(last['cost_to_date'])} (rounds 1-{last['round']})")
    return 0


def profile_report(args: argparse.Namespace) -> int:
    """``mpifl profile-report``: peak table and plots from memray profiles."""
    from mpifl.cli.profiling import write_profile_report

    write_profile_report(args.profile_dir, args.flamegraph)
    return 0


def inspect(args: argparse.Namespace) -> int:
    """``mpifl inspect``: a checkpoint's round, tensors, config and versions."""
    from mpifl.cli import checkpoints

    return checkpoints.inspect(args.checkpoint, args.verify)


def diff(args: argparse.Namespace) -> int:
    """``mpifl diff``: two results bit for bit."""
    from mpifl.cli import checkpoints

    return checkpoints.diff(args.a, args.b)


def export(args: argparse.Namespace) -> int:
    """``mpifl export``: a checkpoint's model (or one client's, ``--client``) as safetensors."""
    from mpifl.cli import checkpoints

    return checkpoints.export(args.checkpoint, args.out, args.client)


def plan(args: argparse.Namespace) -> int:
    """``mpifl plan``: bytes and memory per rank, nothing allocated."""
    from mpifl.cli.plan import plan_main

    return plan_main(args)


def pbs(args: argparse.Namespace) -> int:
    """``mpifl pbs``: a PBS Pro job script."""
    from mpifl.cli.pbs import main as pbs_main

    return pbs_main(args)


def slurm(args: argparse.Namespace) -> int:
    """``mpifl slurm``: a Slurm batch script."""
    from mpifl.cli.slurm import main as slurm_main

    return slurm_main(args)


def bench_exchange(args: argparse.Namespace) -> int:
    """``mpifl bench exchange``: mpifl against the raw-MPI floor and the pickle path."""
    from mpifl.cli.bench import exchange_main

    return exchange_main(args)


def status(args: argparse.Namespace) -> int:
    """``mpifl status``: the post-mortem of a run directory, or of each run in a sweep's folder of runs (``--runs-dir``)
    and how many are complete; exit 0 when complete (every run), 1 otherwise."""
    from mpifl.storage.rundir import post_mortem

    run_dir = Path(args.run_dir)
    runs = sorted(d for d in run_dir.iterdir() if (d / "config.yaml").is_file()) if run_dir.is_dir() else []
    if not (run_dir / "config.yaml").is_file() and runs:  # a sweep's folder of runs: each run, then the count
        done = 0
        for one in runs:
            complete, lines = post_mortem(one)
            done += complete
            print("\n".join(lines[:1] + lines[-1:] if complete else lines))
        unfinished = "" if done == len(runs) else (": the sweep's own command with --resume finishes them and starts "
                                                   "the grid points not begun, which are not counted here")
        print(f"{run_dir}: {done} of {len(runs)} runs complete{unfinished}")
        return 0 if done == len(runs) else 1
    if not (run_dir / "config.yaml").is_file():
        what = "does not exist" if not run_dir.exists() else \
            "is not an mpifl run directory (no config.yaml), nor a sweep's folder of them"
        raise SystemExit(f"mpifl status: {run_dir} {what}")
    complete, lines = post_mortem(run_dir)
    print("\n".join(lines))
    return 0 if complete else 1

