"""A Llama-shaped client sharded over 2 and 4 ranks (``clients.sharding: fsdp``) against one rank and DDP, on CPU.

One logical client trains for one round (AdamW, fp32, 8 blocks of 128 tokens a step) in each form:

- R=1: one client rank holds the whole model (``clients.ranks_per_client=1``);
- R=2 and R=4, DDP (``clients.sharding=replicate``): every rank of the group holds the whole model;
- R=2 and R=4, FSDP (``clients.sharding=fsdp``): every rank holds 1/R of it.

For each it prints every client rank's peak RSS (VmHWM, sampled from /proc every 0.1 s while the job runs) beside
what ``mpifl plan`` says for the same config, the round's training seconds, and the final model's distance to
R=1's (relative L2). Forms run one after another, never two at once; on a machine with fewer cores than ranks the
times say what oversubscription costs, not what FSDP does.

    python profiling/sharded_client.py                       # the Llama shape below, about 5 minutes on 2 cores
    python profiling/sharded_client.py model.transformers.config.num_hidden_layers=4 --forms 1 fsdp2 fsdp4

It exits 1 where a sharded rank's peak is more than 10% off its plan.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mpifl.cli.plan import estimate
from mpifl.config import load_config
from mpifl.storage.hdf5 import load_tensors

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from job_memory import job_processes, supervisors_of  # noqa: E402 - a sibling script

LLAMA = {"num_hidden_layers": 8, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
         "num_key_value_heads": 16, "vocab_size": 32000, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
CONFIG = {
    "name": "sharded-client", "seed": 0, "rounds": 1,
    "clients": {"num_clients": 1},
    "data": {"dataset": "text", "kwargs": {"vocab_size": 8192, "seq_len": 128, "test_fraction": 0.02}},
    "model": {"name": "transformers", "dtype": "float32",
              "transformers": {"architecture": "llama", "config": LLAMA}},
    "train": {"trainer": "causal_lm", "optimizer": "adamw", "lr": 1e-4, "batch_size": 8, "local_steps": 2},
    "eval": {"every": 0},
}
FORMS = {"1": ["clients.ranks_per_client=1"],
         "ddp2": ["clients.ranks_per_client=2", "clients.sharding=replicate"],
         "ddp4": ["clients.ranks_per_client=4", "clients.sharding=replicate"],
         "fsdp2": ["clients.ranks_per_client=2", "clients.sharding=fsdp"],
         "fsdp4": ["clients.ranks_per_client=4", "clients.sharding=fsdp"]}
TOLERANCE = 0.10


def peak_kib(pid: str) -> int | None:
    """VmHWM of ``pid`` in KiB, or None once it has gone."""
    try:
        found = re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return int(found.group(1)) if found else None


def rank_of(pid: str) -> int | None:
    """The MPI rank of a job process, from its environment (MPICH's PMI_RANK)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"PMI_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def run(config: Path, overrides: list[str], ranks: int, run_dir: str, bin_dir: str) -> dict[int, int]:
    """Run the job; each rank's peak RSS in bytes (its supervisor left out)."""
    cmd = [f"{bin_dir}/mpiexec", "-n", str(ranks), f"{bin_dir}/python", "-m", "mpifl", "run", str(config), *overrides,
           "--run-dir", run_dir]
    job = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, MPIFL_BIND="none"), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    while job.poll() is None:
        pids = job_processes(run_dir)
        supervisors = supervisors_of(pids)
        for pid in pids:
            if pid in supervisors:
                continue
            rank, kib = rank_of(pid), peak_kib(pid)
            if rank is not None and kib is not None:
                peaks[rank] = max(peaks.get(rank, 0), kib * 1024)
        time.sleep(0.1)
    if job.returncode:
        tail = job.stderr.read()[-3000:] if job.stderr else ""
        raise SystemExit(f"{' '.join(cmd)} failed ({job.returncode}):\n{tail}")
    return peaks


def relative_l2(a: Path, b: Path) -> float:
    """The distance between two runs' final models, relative to the second's norm."""
    x, y = load_tensors(a / "model.h5"), load_tensors(b / "model.h5")
    num = sum(float(((x[k].double() - y[k].double()) ** 2).sum()) for k in y)
    den = sum(float((y[k].double() ** 2).sum()) for k in y)
    return float(np.sqrt(num / den))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides (key=value) for every form")
    p.add_argument("--forms", nargs="+", default=["1", "ddp2", "fsdp2", "fsdp4"], choices=sorted(FORMS))
    p.add_argument("--bin", default=str(Path(sys.executable).parent))
    args = p.parse_intermixed_args()
    work = Path(tempfile.mkdtemp(prefix="sharded-client-"))
    config = work / "config.yaml"
    config.write_text(json.dumps(CONFIG))
    rows, worst, reference = [], 0.0, None
    for form in args.forms:
        overrides = [*FORMS[form], *args.overrides]
        cfg = load_config(config, overrides)
        ranks = cfg.clients.ranks_per_client + 1
        size, plan = estimate(cfg, nranks=ranks, ranks_per_node=ranks, server_alone=False)
        run_dir = work / form
        peaks = run(config, overrides, ranks, str(run_dir), args.bin)
        record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        train = record.get("client_train_seconds") or 0.0
        reference = reference or run_dir
        distance = relative_l2(run_dir, reference)
        clients = [peaks[r] for r in sorted(peaks) if r > 0]
        ratios = [c / plan.client_bytes for c in clients]
        if cfg.clients.sharding == "fsdp":
            worst = max([worst, *(abs(r - 1) for r in ratios)])
        rows.append((form, ranks - 1, plan.client_bytes, clients, ratios, train, distance))
    print(f"Llama-shaped client, {size.parameters:,} parameters, fp32, {' '.join(args.overrides) or 'defaults'}")
    print("| form | client ranks | planned per rank (GiB) | measured peak per rank (GiB) | measured / planned | "
          "train seconds | rel. L2 to the first form |")
    print("|---|---|---|---|---|---|---|")
    for form, count, planned, clients, ratios, train, distance in rows:
        print(f"| {form} | {count} | {planned / 2**30:.3f} | {', '.join(f'{c / 2**30:.3f}' for c in clients)} | "
              f"{', '.join(f'{r:.2f}' for r in ratios)} | {train:.1f} | {distance:.2e} |")
    print(f"runs in {work}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
