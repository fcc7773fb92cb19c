"""``mpifl bench exchange``: model-only exchange, mpifl against the raw-MPI floor and the pickle path.

All three run in one job on the same ranks, one after another:
1. mpifl: the real ``mpifl run`` machinery (blob model, no training, every client every round).
   Peak RSS per rank is read right after this phase, before the other paths can raise it.
2. floor: the fastest plain mpi4py way to do the same work: chunked Isend/Irecv of raw bytes,
   sleep-polled waits, fused multiply-add into an fp32 accumulator in arrival order (narrow
   chunks widened into a scratch first, the same fast fold mpifl uses).
3. pickle: what FedML/APPFL do: ``comm.send(state_dict)`` out and back, the server keeping
   every client's model until all have arrived, then averaging.
Each method runs one warm-up round (not timed) and then ``--rounds`` timed rounds; medians are
reported.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

import torch
from mpi4py import MPI

from mpifl.aggregation.floor import FloorExchange
from mpifl.config import Config, load_config
from mpifl.learning.models import Blob
from mpifl.metrics import peak_rss_bytes
from mpifl.roles.launch import guarded
from mpifl.roles.runner import check_world, run_rank
from mpifl.units import MIB
from mpifl.wire.flat import DTYPES
from mpifl.wire.spec import itemsize
from mpifl.wire.transport import wait_all

TAG_DOWN, TAG_UP = 101, 102


def exchange_main(args: argparse.Namespace) -> int:
    """Entry point of ``mpifl bench exchange``."""
    comm = MPI.COMM_WORLD
    cfg = exchange_config(args, comm.Get_size())
    check_world(comm.Get_size(), cfg)
    return guarded(lambda: _exchange(comm, cfg, args))


def exchange_config(args: argparse.Namespace, nranks: int) -> Config:
    """The run config of the benchmark's mpifl phase: a blob model, no training, every client every round."""
    chain = args.reduce == "chain"  # one reduction group per client rank
    return load_config(None, data={
        "name": "bench-exchange", "rounds": args.rounds + 1,
        "clients": {"num_clients": nranks - 1, "fraction": 1.0, "groups": nranks - 1 if chain else 0},
        "model": {"name": "blob", "kwargs": {"size_mb": args.model_mb},
                  "dtype": "bfloat16" if args.dtype == "bf16" else "float32"},
        "train": {"trainer": "none"}, "eval": {"every": 0},
        "strategy": {"name": args.strategy, "wire_dtype": args.wire_dtype},
        "transport": {"chunk_mb": args.chunk_mb, "inflight": args.inflight,
                      "dispatch_fanout": args.dispatch_fanout, "reduce": "chain" if chain else "direct",
                      **({"pool_mb": args.pool_mb} if args.pool_mb else {})},
        "output": {"progress": False, "save_model": False}})


def _exchange(comm: MPI.Comm, cfg: Config, args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    rank = comm.Get_rank()
    comm.Barrier()
    outcome = run_rank(comm, cfg, None)
    history = outcome.history if outcome is not None else None
    peaks = comm.gather(peak_rss_bytes(), root=0)
    gc.collect()
    dtype = DTYPES[cfg.model.dtype]
    width = itemsize(cfg.model.dtype)
    model_bytes = int(args.model_mb * MIB) // width * width
    exchange = FloorExchange(comm, model_bytes, dtype, cfg.transport.chunk_bytes, cfg.transport.inflight,
                             (TAG_DOWN, TAG_UP))
    floor = _timed(comm, args.rounds, exchange.round)
    floor_split = exchange.split[1:]
    del exchange  # free the floor's buffers before the pickle path allocates its own
    pickle_rounds = args.rounds if args.pickle_rounds is None else args.pickle_rounds
    if args.pickle_rounds is None and not comm.bcast(_pickle_fits(comm, model_bytes), root=0):
        pickle_rounds = 0  # by default, only where the server's node can hold it
    pickled = _pickle_rounds(comm, args.model_mb, dtype, pickle_rounds)
    if rank != 0:
        return 0
    assert history is not None and peaks is not None  # rank 0 gets the history and the gathered peaks
    mpifl_times = [r["time"]["round"] for r in history[1:]]
    result = {
        "model_bytes": model_bytes, "clients": comm.Get_size() - 1, "dtype": args.dtype,
        "strategy": args.strategy, "wire_dtype": args.wire_dtype,
        "chunk_bytes": cfg.transport.chunk_bytes, "rounds": args.rounds,
        "seconds_per_round": {"mpifl": statistics.median(mpifl_times), "floor": statistics.median(floor),
                              "pickle": statistics.median(pickled) if pickled else None},
        "spread": {"mpifl": [min(mpifl_times), max(mpifl_times)], "floor": [min(floor), max(floor)]},
        "time_split": {k: statistics.median(r["time"][k] for r in history[1:]) for k in history[1]["time"]},
        "server_bytes": {"sent": history[-1]["bytes_sent"], "received": history[-1]["bytes_received"]},
        "floor_split": {k: statistics.median(s[k] for s in floor_split) for k in ("dispatch", "return")},
        "peak_rss_bytes": {"server": peaks[0], "clients": peaks[1:]},
    }
    secs = result["seconds_per_round"]
    result["ratio_to_floor"] = {k: (v / secs["floor"] if v is not None else None) for k, v in secs.items()
                                if k != "floor"}
    print(_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _timed(comm: MPI.Comm, rounds: int, fn: Callable[[], None]) -> list[float]:
    """Warm up once, then time ``rounds`` calls on rank 0's clock (all ranks in step)."""
    times = []
    for i in range(rounds + 1):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - start)
    return times


PICKLE_SHARE = 0.8  # of the node's available memory the pickle path may plan to take


def pickle_node_bytes(model_bytes: int, clients: int, client_ranks_here: int) -> int:
    """The pickle path's peak on the server's node: the server keeps every client's unpickled model until all
    have arrived, besides its own state, the sum and one pickled message; each client rank on the node holds the
    state it received, that message and the one it sends back."""
    return model_bytes * (clients + 3) + client_ranks_here * 3 * model_bytes


def available_bytes() -> int | None:
    """The kernel's estimate of the memory available to new work (MemAvailable), or None where it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _pickle_fits(comm: MPI.Comm, model_bytes: int) -> bool:
    """On rank 0: whether the pickle path fits its node; says why when it does not (a kernel OOM kill of a
    rank would lose the whole benchmark)."""
    here = comm.Split_type(MPI.COMM_TYPE_SHARED)
    client_ranks_here = here.Get_size() - 1 if comm.Get_rank() == 0 else 0
    here.Free()
    if comm.Get_rank() != 0:
        return True
    need, available = pickle_node_bytes(model_bytes, comm.Get_size() - 1, client_ranks_here), available_bytes()
    if available is None or need <= PICKLE_SHARE * available:
        return True
    print(f"pickle path skipped: it would hold about {need / MIB / 1024:.1f} GiB on this node (the server keeps "
          f"each of the {comm.Get_size() - 1} clients' models until all have arrived), past "
          f"{PICKLE_SHARE:.0%} of the {available / MIB / 1024:.1f} GiB available; --pickle-rounds N runs it "
          "anyway, or take a smaller --model-mb", flush=True)
    return False


def _pickle_rounds(comm: MPI.Comm, model_mb: float, dtype: torch.dtype, rounds: int) -> list[float]:
    """``comm.send(state_dict)`` both ways; the server holds all client models, then averages."""
    gc.collect()
    if rounds == 0:
        return []
    rank, clients = comm.Get_rank(), comm.Get_size() - 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state = Blob(model_mb, dtype=dtype).state_dict()

    def one_round() -> None:
        nonlocal state
        if rank != 0:
            state = comm.recv(source=0, tag=TAG_DOWN)
            comm.send(state, dest=0, tag=TAG_UP)
            return
        wait_all([comm.isend(state, dest=c, tag=TAG_DOWN) for c in range(1, clients + 1)])
        received = [comm.recv(source=c, tag=TAG_UP) for c in range(1, clients + 1)]
        state = {k: sum(r[k].float() for r in received).div_(clients).to(dtype) for k in state}

    return _timed(comm, rounds, one_round)


def _table(r: dict) -> str:
    secs, ratio = r["seconds_per_round"], r["ratio_to_floor"]
    lines = [f"model-only exchange: {r['model_bytes'] / MIB:.0f} MiB {r['dtype']}, {r['clients']} clients, "
             f"{r['chunk_bytes'] / MIB:g} MiB chunks, mpifl strategy {r['strategy']}"
             + (f", {r['wire_dtype']} updates" if r["wire_dtype"] else "") + f", median of {r['rounds']} rounds",
             f"{'method':<8} {'s/round':>9} {'x floor':>8}  {'min-max s':>13}"]
    for name in ("mpifl", "floor", "pickle"):
        s = secs[name]
        x = 1.0 if name == "floor" else ratio[name]
        spread = "{:.3f}-{:.3f}".format(*r["spread"][name]) if name in r["spread"] else ""
        lines.append(f"{name:<8} {s:>9.3f} {x:>8.2f}  {spread:>13}" if s is not None else f"{name:<8} {'skipped':>9}")
    peaks = r["peak_rss_bytes"]
    lines.append(f"mpifl peak RSS: server {peaks['server'] / MIB:.0f} MiB; clients "
                 + ", ".join(f"{p / MIB:.0f}" for p in peaks["clients"]) + " MiB")
    lines.append("mpifl server traffic per round: sent {sent:,} bytes, received {received:,} bytes".format(
        **r["server_bytes"]))
    lines.append("mpifl time split (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["time_split"].items()))
    lines.append("floor time split (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["floor_split"].items()))
    return "\n".join(lines)

