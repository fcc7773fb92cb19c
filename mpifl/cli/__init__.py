"""The ``mpifl`` command: run, validate, inspect, diff, export, report, profile-report, pbs, slurm, bench."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mpifl.cli import commands
from mpifl.cli.job_options import add_pbs_parser, add_plan_parser, add_slurm_parser
from mpifl.cli.parsing import add_subcommand, refuse_unrecognized, subcommand_parser
from mpifl.cli.sweep import sweep
from mpifl.config import ConfigError
from mpifl.errors import CheckpointError, MissingExtra, UsageError
from mpifl.logs import env_rank, log

if TYPE_CHECKING:
    from mpi4py import MPI

# Commands whose trailing key=value words are config overrides.
TAKES_OVERRIDES = ("run", "sweep", "validate", "pbs", "slurm", "plan", "partition")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpifl", description="MPI federated learning simulation.",
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_sweep, _add_config_checks, _add_compare, _add_calibrate, _add_checkpoint_commands,
                _add_run_readers, _add_job_scripts, _add_bench):
        add(sub)
    return p


def _add_run(sub: argparse._SubParsersAction) -> None:
    """``mpifl run``: one federated experiment, under mpiexec."""
    run = _config_arguments(_command(sub, "run", "run a federated experiment (under mpiexec, >= 2 ranks)"))
    run.add_argument("--run-dir", help="output directory (default: output.dir or runs/<name>-<time>)")
    run.add_argument("--resume", nargs="?", const="latest", metavar="CKPT",
                     help="continue from the newest checkpoint in the run directory, or from CKPT")
    run.add_argument("--memray", metavar="DIR", help="profile every rank with memray: DIR/rank00000.bin, ...")
    run.add_argument("--memray-native", action="store_true", help="record native stacks too (slower)")
    run.set_defaults(func=commands.run)


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    """``mpifl sweep``: a grid of one config's runs in one MPI job."""
    grid = _config_arguments(_command(sub, "sweep", "run a grid of one config's runs one after another in one MPI "
                                                    "job (under mpiexec), each an ordinary run in its own directory"))
    grid.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                      help="an axis of the grid (repeat for more; the last changes fastest); NAME=@FILE: one run per "
                           "variant in FILE, each setting its own keys; no --grid: one run")
    grid.add_argument("--runs-dir", required=True, help="the folder of the runs: RUNS_DIR/KEY=V,KEY2=V2 each")
    grid.add_argument("--resume", action="store_true",
                      help="skip finished runs, resume unfinished ones from their newest checkpoint, start the rest")
    grid.add_argument("--dry-run", action="store_true",
                      help="list the runs and check each one's config as validate does, without MPI")
    grid.set_defaults(func=sweep)


def _add_config_checks(sub: argparse._SubParsersAction) -> None:
    """``mpifl validate`` and ``mpifl partition``: a config read without MPI."""
    validate = _command(sub, "validate", "check a config without running it (no MPI needed)")
    _config_arguments(validate).set_defaults(func=commands.validate)
    part = _config_arguments(_command(sub, "partition", "print how a config splits the data (clients x "
                                            "labels); optional plot"))
    part.add_argument("--plot", metavar="PNG", help="also save a stacked bar chart (needs the 'plot' extra)")
    part.set_defaults(func=commands.partition)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    """``mpifl compare``: runs side by side, seeds pooled, one figure."""
    cmp_ = _command(sub, "compare", "runs side by side (best, final, rounds to a target), and runs that differ "
                                    "only in their seed as mean ± std; optionally one figure of their curves")
    cmp_.add_argument("run_dirs", nargs="+", help="run directories to compare (each with metrics.jsonl)")
    cmp_.add_argument("--target", type=float, help="a value to reach, e.g. 0.9: the first round (and virtual "
                      "second) that reaches it")
    cmp_.add_argument("--metric", default="eval.accuracy", help="dotted key in each round's record")
    cmp_.add_argument("--better", choices=("auto", "higher", "lower"), default="auto", help="which way is better: "
                      "auto reads it from the metric's name (loss, perplexity, error, seconds, time, bytes, "
                      "staleness, std, epsilon, floor, clamped, dropped: lower)")
    cmp_.add_argument("--format", choices=("markdown", "latex"), default="markdown", help="the tables' format")
    cmp_.add_argument("--plot", metavar="PNG", help="also draw each group's mean curve with ± one std shaded "
                      "(needs the 'plot' extra)")
    cmp_.add_argument("--x", choices=("round", "virtual"), default="round", help="the figure's x axis: rounds, or "
                      "the virtual clock's seconds (runs with clock.mode; an asynchronous step is no sync round)")
    cmp_.add_argument("--complete-only", action="store_true", help="pool only the runs that recorded every round "
                      "their config asks; a stopped or failed seed stays in the per-run table, out of the means")
    cmp_.set_defaults(func=commands.compare)


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    """``mpifl calibrate``: the virtual clock's cost model fitted to a measured run."""
    cal = _command(sub, "calibrate", "fit the virtual-time cost model (clock.task_overhead, seconds_per_sample, "
                                     "speed_sigma) to a measured run's client times")
    cal.add_argument("run_dir", help="a run directory whose clients trained for real (its metrics.jsonl has timing)")
    cal.set_defaults(func=commands.calibrate)


def _add_checkpoint_commands(sub: argparse._SubParsersAction) -> None:
    """``mpifl inspect``, ``diff`` and ``export``: what a checkpoint holds, checked."""
    ins = _command(sub, "inspect", "print a checkpoint's round, tensors, config and versions")
    ins.add_argument("checkpoint", help="an mpifl checkpoint (.h5): ckpt-r<round>.h5 or model.h5")
    ins.add_argument("--verify", action="store_true", help="read every dataset and check its checksum (exit 2 "
                     "naming the first corrupt tensor)")
    ins.set_defaults(func=commands.inspect)
    diff = _command(sub, "diff", "whether two runs (or checkpoints) hold the same bits: every tensor of the model, "
                                 "the server's state and every client's kept vector, each read once, its checksums "
                                 "checked as it passes; what differs, by how much, where they do (exit 0: bitwise "
                                 "equal, 1: they differ, 2: unreadable or corrupt)")
    diff.add_argument("a", help="a run directory (its model.h5 and newest checkpoint), or an .h5 file")
    diff.add_argument("b", help="the other")
    diff.set_defaults(func=commands.diff)
    exp = _command(sub, "export", "write a checkpoint's model as safetensors, once its checksums hold (exit 2 "
                                  "naming the first corrupt tensor, nothing written)")
    exp.add_argument("checkpoint", help="an mpifl checkpoint (.h5) to export")
    exp.add_argument("out", help="output .safetensors file")
    exp.add_argument("--client", type=int, metavar="ID", help="the model logical client ID uses instead: its Ditto "
                     "personal model (train.ditto_lambda), or the global tensors with its own model.local ones "
                     "(FedPer, FedBN), read from the checkpoint's per-rank files (exit 2 where it has none)")
    exp.set_defaults(func=commands.export)


def _add_run_readers(sub: argparse._SubParsersAction) -> None:
    """``mpifl status``, ``report`` and ``profile-report``: what a run did, read from its directory."""
    status = _command(sub, "status", "after a job: how far a run got, which ranks did not finish and when each "
                               "was last heard of, and whether a resume can start from its newest checkpoint (exit 0 "
                               "only for a complete run); for a job script's epilogue")
    status.add_argument("run_dir", help="a run directory, or a sweep's folder of runs (each run, then how many are "
                        "complete)")
    status.set_defaults(func=commands.status)
    rep = _command(sub, "report", "plot a run's metrics (quality, time split, bytes, memory) as PNGs")
    rep.add_argument("run_dir", help="a run directory (with metrics.jsonl)")
    rep.add_argument("--out", help="output folder (default RUN_DIR/report)")
    rep.set_defaults(func=commands.report)
    prof = _command(sub, "profile-report", "peak table and memory-over-time plots from --memray profiles")
    prof.add_argument("profile_dir", help="the --memray DIR of a run (rank00000.bin, ...)")
    prof.add_argument("--flamegraph", action="store_true", help="also write memray flamegraph HTML per rank")
    prof.set_defaults(func=commands.profile_report)


def _add_job_scripts(sub: argparse._SubParsersAction) -> None:
    """``mpifl pbs``, ``slurm`` and ``plan``: job scripts and the memory plan."""
    add_pbs_parser(sub)
    add_slurm_parser(sub)
    add_plan_parser(sub)
    sub.choices["pbs"].set_defaults(func=commands.pbs)
    sub.choices["slurm"].set_defaults(func=commands.slurm)
    sub.choices["plan"].set_defaults(func=commands.plan)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    """``mpifl bench exchange``: the exchange against raw MPI and pickle, under mpiexec."""
    bench = _command(sub, "bench", "benchmarks (under mpiexec)")
    kinds = bench.add_subparsers(dest="kind", required=True)
    ex = _command(kinds, "exchange", "model-only exchange: mpifl vs raw MPI floor vs pickle")
    ex.add_argument("--model-mb", type=float, default=100.0, help="model size in MiB")
    ex.add_argument("--chunk-mb", type=float, default=16.0, help="chunk size in MiB")
    ex.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the model's dtype")
    ex.add_argument("--rounds", type=int, default=3, help="timed rounds per method (median reported)")
    ex.add_argument("--pickle-rounds", type=int, default=None, help="rounds for the slow pickle path "
                    "(default: same as --rounds, where the server's node can hold it: the server keeps every "
                    "client's copy; else skipped, saying why); 0 skips it")
    ex.add_argument("--strategy", default="fedavg", help="mpifl's strategy (e.g. median: the server stacks "
                    "participants x chunk); the floor and pickle paths always average")
    ex.add_argument("--wire-dtype", choices=("bfloat16", "float16"), default=None,
                    help="clients send updates in this dtype (mpifl only)")
    ex.add_argument("--inflight", type=int, default=4, help="chunks in flight per peer (mpifl and the floor)")
    ex.add_argument("--pool-mb", type=float, default=None, help="mpifl's transport.pool_mb (default: the config's)")
    ex.add_argument("--dispatch-fanout", type=int, default=0, help="mpifl's transport.dispatch_fanout: send the "
                    "model down a broadcast tree (the floor stays point-to-point)")
    ex.add_argument("--reduce", choices=("direct", "chain"), default="direct", help="mpifl's transport.reduce "
                    "(chain: one reduction group per client rank, partial sums added along a chain)")
    ex.add_argument("--json", help="write the results to this JSON file")
    ex.set_defaults(func=commands.bench_exchange)

def _command(sub: argparse._SubParsersAction, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` shows its summary and every option's default."""
    return add_subcommand(sub, name, help=summary, description=summary)


def _config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A config file and key=value overrides, as every config-taking command reads them."""
    parser.add_argument("config", help="experiment YAML file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rounds=5 train.lr=0.1")
    return parser


def main(argv: list[str] | None = None, comm: MPI.Intracomm | None = None) -> int:
    """Entry point of the console script. ``comm``: the communicator ``run`` takes as its world (default
    ``MPI.COMM_WORLD``), so that a program already under MPI can run experiments one after another on a
    sub-communicator of its own, each rank importing torch once for all of them (the test suite's job pool does).
    The run's ranks are ``comm``'s; plug-ins that ask ``MPI.COMM_WORLD`` for their rank see the same number only
    when ``comm`` holds world ranks 0..n-1 in order."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    args.comm = comm
    # key=value overrides may also come after options (`run CFG --run-dir D rounds=3`)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray or (extra and args.command not in TAKES_OVERRIDES):
        refuse_unrecognized(parser, args.command, stray or extra)
    if isinstance(getattr(args, "resume", None), str) and "=" in args.resume and not Path(args.resume).exists():
        extra.append(args.resume)  # `--resume rounds=9`: the optional CKPT swallowed an override
        args.resume = "latest"
    if extra:
        args.overrides = [*args.overrides, *extra]
    args.argv = list(argv if argv is not None else sys.argv[1:])[1:]  # as typed, for generated scripts
    try:
        return args.func(args)
    except BrokenPipeError:  # `mpifl inspect CKPT | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's documented way out
        return 0
    except UsageError as err:  # options that are each valid but cannot go together: argparse's own report
        subcommand_parser(parser, args.command).error(str(err))
    except MissingExtra as err:  # an optional dependency this config needs, with its install line
        if env_rank() in (0, None):
            log(f"mpifl: {err}")
        return 2
    except (ConfigError, CheckpointError) as err:
        if env_rank() in (0, None):  # under mpiexec every rank finds the same error: say it once
            log(f"mpifl: config error: {err}" if isinstance(err, ConfigError) else f"mpifl: {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
