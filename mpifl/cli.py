"""The ``mpifl`` command: run, validate, bench."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .config import Config, ConfigError, dump_config, load_config
from .launch import env_rank, guarded, log


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpifl", description="MPI federated learning simulation.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a federated experiment (under mpiexec, >= 2 ranks)")
    run.add_argument("config", help="experiment YAML file")
    run.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rounds=5 train.lr=0.1")
    run.add_argument("--run-dir", help="output directory (default: output.dir or runs/<name>-<time>)")
    val = sub.add_parser("validate", help="check a config without running it (no MPI needed)")
    val.add_argument("config")
    val.add_argument("overrides", nargs="*")
    bench = sub.add_parser("bench", help="benchmarks (under mpiexec)")
    kinds = bench.add_subparsers(dest="kind", required=True)
    ex = kinds.add_parser("exchange", help="model-only exchange: mpifl vs raw MPI floor vs pickle")
    ex.add_argument("--model-mb", type=float, default=100.0, help="model size in MiB")
    ex.add_argument("--chunk-mb", type=float, default=16.0, help="chunk size in MiB")
    ex.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ex.add_argument("--rounds", type=int, default=3, help="timed rounds per method (median reported)")
    ex.add_argument("--pickle-rounds", type=int, default=None, help="rounds for the slow pickle path "
                    "(default: same as --rounds); 0 skips it")
    ex.add_argument("--json", help="write the results to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "validate":
            return _validate(args)
        if args.command == "run":
            cfg = load_config(args.config, args.overrides)
            return _run(cfg, args.run_dir)
        from .bench import exchange_main
        return exchange_main(args)
    except ConfigError as err:
        log(f"mpifl: config error: {err}")
        return 2


def _validate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    print(f"{args.config}: valid ({cfg.rounds} rounds, {cfg.clients_per_round()} of "
          f"{cfg.clients.num_clients} clients per round, model {cfg.model.name} {cfg.model.dtype}, "
          f"strategy {cfg.strategy.name})")
    return 0


def _run(cfg: Config, run_dir_arg: str | None) -> int:
    from mpi4py import MPI

    from .launch import SetupError
    from .runner import check_world, run_rank

    comm = MPI.COMM_WORLD
    try:
        check_world(comm.Get_size(), cfg)
        run_dir = _agree(comm, lambda: _prepare_run_dir(cfg, run_dir_arg))
        guarded(lambda: run_rank(comm, cfg, run_dir))
    except SetupError as err:
        if comm.Get_rank() == 0:
            log(f"mpifl: {err}", rank=0)
        return 2
    return 0


def _agree(comm, fn):
    """Run ``fn`` on rank 0 and share its result (or its error) with every rank."""
    from .launch import SetupError

    result = error = None
    if comm.Get_rank() == 0:
        try:
            result = fn()
        except (OSError, SetupError) as err:
            error = str(err)
    result, error = comm.bcast((result, error), root=0)
    if error:
        raise SetupError(error)
    return result


def _prepare_run_dir(cfg: Config, run_dir_arg: str | None) -> Path:
    path = Path(run_dir_arg or cfg.output.dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if (path / "metrics.jsonl").exists():
        from .launch import SetupError
        raise SetupError(f"run directory {str(path)!r} already holds a run (metrics.jsonl); "
                         "choose another --run-dir so nothing is overwritten")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(dump_config(cfg))
    return path


if __name__ == "__main__":
    sys.exit(main())
