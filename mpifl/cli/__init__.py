"""The ``mpifl`` command: run, validate, inspect, export, report, profile-report, pbs, bench."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mpifl.config import Config, ConfigError, dump_config, load_config
from mpifl.roles.launch import agree, bind_gpu_from_local_rank, guarded, log
from mpifl.storage.hdf5 import CheckpointError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpifl", description="MPI federated learning simulation.")
    sub = p.add_subparsers(dest="command", required=True)
    run = _config_arguments(sub.add_parser("run", help="run a federated experiment (under mpiexec, >= 2 ranks)"))
    run.add_argument("--run-dir", help="output directory (default: output.dir or runs/<name>-<time>)")
    run.add_argument("--resume", nargs="?", const="latest", metavar="CKPT",
                     help="continue from the newest checkpoint in the run directory, or from CKPT")
    run.add_argument("--memray", metavar="DIR", help="profile every rank with memray: DIR/rank00000.bin, ...")
    run.add_argument("--memray-native", action="store_true", help="record native stacks too (slower)")
    _config_arguments(sub.add_parser("validate", help="check a config without running it (no MPI needed)"))
    part = _config_arguments(sub.add_parser("partition", help="print how a config splits the data (clients x "
                                            "labels); optional plot"))
    part.add_argument("--plot", metavar="PNG", help="also save a stacked bar chart (needs the 'plot' extra)")
    cmp_ = sub.add_parser("compare", help="rounds to a target accuracy, per run directory (e.g. one per strategy)")
    cmp_.add_argument("run_dirs", nargs="+")
    cmp_.add_argument("--target", type=float, required=True, help="accuracy to reach, e.g. 0.9")
    cmp_.add_argument("--metric", default="eval.accuracy", help="dotted key in each round's record")
    ins = sub.add_parser("inspect", help="print a checkpoint's round, tensors, config and versions")
    ins.add_argument("checkpoint")
    exp = sub.add_parser("export", help="write a checkpoint's model as safetensors")
    exp.add_argument("checkpoint")
    exp.add_argument("out", help="output .safetensors file")
    rep = sub.add_parser("report", help="plot a run's metrics (quality, time split, bytes, memory) as PNGs")
    rep.add_argument("run_dir")
    rep.add_argument("--out", help="output folder (default RUN_DIR/report)")
    prof = sub.add_parser("profile-report", help="peak table and memory-over-time plots from --memray profiles")
    prof.add_argument("profile_dir")
    prof.add_argument("--flamegraph", action="store_true", help="also write memray flamegraph HTML per rank")
    from mpifl.cli.pbs import add_parser as add_pbs_parser, add_plan_parser
    add_pbs_parser(sub)
    add_plan_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (under mpiexec)")
    kinds = bench.add_subparsers(dest="kind", required=True)
    ex = kinds.add_parser("exchange", help="model-only exchange: mpifl vs raw MPI floor vs pickle")
    ex.add_argument("--model-mb", type=float, default=100.0, help="model size in MiB")
    ex.add_argument("--chunk-mb", type=float, default=16.0, help="chunk size in MiB")
    ex.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ex.add_argument("--rounds", type=int, default=3, help="timed rounds per method (median reported)")
    ex.add_argument("--pickle-rounds", type=int, default=None, help="rounds for the slow pickle path "
                    "(default: same as --rounds); 0 skips it")
    ex.add_argument("--strategy", default="fedavg", help="mpifl's strategy (e.g. median: the server stacks "
                    "participants x chunk); the floor and pickle paths always average")
    ex.add_argument("--wire-dtype", choices=("bfloat16", "float16"), default=None,
                    help="clients send updates in this dtype (mpifl only)")
    ex.add_argument("--json", help="write the results to this JSON file")
    return p


def _config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A config file and key=value overrides, as every config-taking command reads them."""
    parser.add_argument("config", help="experiment YAML file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rounds=5 train.lr=0.1")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also come after options (`run CFG --run-dir D rounds=3`)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray or (extra and args.command not in ("run", "validate", "pbs", "plan", "partition")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if getattr(args, "resume", None) and "=" in args.resume and not Path(args.resume).exists():
        extra.append(args.resume)  # `--resume rounds=9`: the optional CKPT swallowed an override
        args.resume = "latest"
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        if args.command == "validate":
            return _validate(args)
        if args.command == "run":
            cfg = load_config(args.config, args.overrides)
            if cfg.model.name == "transformers":  # config keys checked on every rank before MPI starts
                from mpifl.learning.hf import load_config as load_transformers_config
                load_transformers_config(cfg.model)
            resume = _find_resume(cfg, args) if args.resume else None
            return _run(cfg, args.run_dir, resume, args.memray, args.memray_native)
        if args.command == "partition":
            return _partition(load_config(args.config, args.overrides), args.plot)
        if args.command == "compare":
            from mpifl.cli.report import compare_table
            print(compare_table(args.run_dirs, args.target, args.metric))
            return 0
        if args.command == "report":
            from mpifl.cli.report import write_report
            for path in write_report(args.run_dir, args.out):
                print(f"wrote {path}")
            return 0
        if args.command == "profile-report":
            from mpifl.cli.profiling import write_profile_report
            write_profile_report(args.profile_dir, args.flamegraph)
            return 0
        if args.command == "plan":
            from mpifl.cli.pbs import plan_main
            return plan_main(args)
        if args.command == "pbs":
            from mpifl.cli.pbs import main as pbs_main
            args.argv = list(argv if argv is not None else sys.argv[1:])[1:]
            return pbs_main(args)
        if args.command in ("inspect", "export"):
            from mpifl.cli import checkpoints as tools
            return tools.inspect(args.checkpoint) if args.command == "inspect" else tools.export(args.checkpoint,
                                                                                                  args.out)
        from mpifl.cli.bench import exchange_main
        return exchange_main(args)
    except ConfigError as err:
        log(f"mpifl: config error: {err}")
        return 2
    except CheckpointError as err:
        log(f"mpifl: {err}")
        return 2


def _partition(cfg: Config, plot: str | None) -> int:
    from mpifl.learning.datasets import load_dataset, partition_histogram, partition_table, plot_partition

    histogram = partition_histogram(cfg.data, load_dataset(cfg.data), cfg.clients.num_clients, cfg.seed)
    print(partition_table(histogram, max_rows=10**6))
    if plot:
        plot_partition(histogram, plot)
        print(f"wrote {plot}")
    return 0


def _find_resume(cfg: Config, args: argparse.Namespace) -> Path:
    """The checkpoint to resume from, checked against the config before any MPI work."""
    import yaml

    from mpifl.config import resume_conflict
    from mpifl.storage.hdf5 import Checkpoint, latest_checkpoint

    if args.resume == "latest":
        run_dir = args.run_dir or cfg.output.dir
        if not run_dir:
            raise ConfigError("--resume without a checkpoint path needs --run-dir (or output.dir) of the run")
        ckpt = latest_checkpoint(Path(run_dir) / "checkpoints")
        if ckpt is None:
            raise CheckpointError(f"{run_dir}/checkpoints: no usable checkpoint to resume from")
    else:
        ckpt = Checkpoint(args.resume)
    with ckpt:
        conflict = resume_conflict(yaml.safe_load(ckpt.config) or {}, cfg.to_dict())
        if conflict:
            raise ConfigError(f"cannot resume from {ckpt.path}: {conflict} (only "
                              "rounds, checkpoint.*, output.*, eval.*, transport.*, server.* may change)")
        if ckpt.round >= cfg.rounds:
            raise ConfigError(f"{ckpt.path} is already at round {ckpt.round} >= rounds={cfg.rounds}; "
                              "raise rounds to continue")
        return ckpt.path


def _validate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    model = f"{cfg.model.name} {cfg.model.dtype}"
    if cfg.model.name == "transformers":  # the transformers config is checked by building it on meta
        from mpifl.cli.pbs import GIB, model_bytes
        size = model_bytes(cfg)
        model += (f" ({size.parameters / 1e9:.3f} B parameters, {size.exchanged / GIB:.2f} GiB exchanged, "
                  f"{size.frozen / GIB:.2f} GiB frozen)")
    print(f"{args.config}: valid ({cfg.rounds} rounds, {cfg.clients_per_round()} of "
          f"{cfg.clients.num_clients} clients per round, model {model}, strategy {cfg.strategy.name})")
    return 0


def _run(cfg: Config, run_dir_arg: str | None, resume: Path | None = None, memray_dir: str | None = None,
         memray_native: bool = False) -> int:
    bind_gpu_from_local_rank()
    from mpi4py import MPI

    from mpifl.cli.profiling import tracked

    from mpifl.roles.launch import SetupError
    from mpifl.roles.runner import check_world, run_rank

    comm = MPI.COMM_WORLD
    try:
        check_world(comm.Get_size(), cfg)
        run_dir = agree(comm, lambda: _prepare_run_dir(cfg, run_dir_arg, resume))
        with tracked(memray_dir, comm.Get_rank(), memray_native):
            guarded(lambda: run_rank(comm, cfg, run_dir, resume))
    except SetupError as err:
        if comm.Get_rank() == 0:
            log(f"mpifl: {err}", rank=0)
        return 2
    return 0


def _prepare_run_dir(cfg: Config, run_dir_arg: str | None, resume: Path | None) -> Path:
    path = Path(run_dir_arg or cfg.output.dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if resume is not None:
        _rewind_metrics(path / "metrics.jsonl", resume)
    elif (path / "metrics.jsonl").exists():
        from mpifl.roles.launch import SetupError
        raise SetupError(f"run directory {str(path)!r} already holds a run (metrics.jsonl); "
                         "choose another --run-dir so nothing is overwritten")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(dump_config(cfg))
    return path


def _rewind_metrics(metrics: Path, resume: Path) -> None:
    """Keep the metrics lines up to the checkpoint's round (atomically): no duplicated or missing rounds."""
    import json
    import os

    from mpifl.storage.hdf5 import Checkpoint

    with Checkpoint(resume) as ckpt:
        saved, upto = ckpt.metrics(), ckpt.round
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    kept = [line for line in lines if line.strip() and json.loads(line)["round"] <= upto]
    if [json.loads(line)["round"] for line in kept] != list(range(1, upto + 1)):
        kept = [json.dumps(r) for r in saved]  # the file lost lines: the checkpoint's copy is complete
    metrics.parent.mkdir(parents=True, exist_ok=True)
    tmp = metrics.with_name(metrics.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, metrics)


if __name__ == "__main__":
    sys.exit(main())
