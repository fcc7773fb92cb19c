"""The memory of a whole mpifl job, as a node sees it: each rank's peak RSS, and the peak of the ranks' summed PSS
(proportional set size, which splits shared pages among the processes that map them, so memory shared by the
ranks of a node counts once). Sampled every 0.1 s from /proc while the job runs (Linux only).

    python profiling/job_memory.py configs/fashion_mnist.yaml --ranks 5 rounds=1 eval.every=0 clients.per_round=4

Run it on each version to compare (e.g. before and after a change, interleaved), one timing at a time.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def job_processes(run_dir: str) -> list[str]:
    """The pids of the job's ranks: python processes running ``mpifl run`` into ``run_dir``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mpifl" in cmd and run_dir.encode() in cmd and not any(b"mpiexec" in c for c in cmd):
            pids.append(pid)
    return pids


def supervisors_of(pids: list[str]) -> set[str]:
    """Those of ``pids`` that are the parent of another: each rank's supervisor, whose child is the rank."""
    parents = set()
    for pid in pids:
        try:
            parents.add(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
    return parents & set(pids)


def sample(pid: str) -> tuple[int, int] | None:
    """(RSS, PSS) of ``pid`` in MiB, or None once it has gone."""
    try:
        rss = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
        pss = re.search(r"^Pss:\s+(\d+)", Path(f"/proc/{pid}/smaps_rollup").read_text(), re.M)
    except OSError:
        return None
    return (int(rss.group(1)) // 1024, int(pss.group(1)) // 1024) if rss and pss else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--ranks", type=int, default=5)
    p.add_argument("--bin", default=str(Path(sys.executable).parent))
    args = p.parse_intermixed_args()
    run_dir = tempfile.mkdtemp(prefix="job-memory-")
    cmd = [f"{args.bin}/mpiexec", "-n", str(args.ranks), f"{args.bin}/python", "-m", "mpifl", "run", args.config,
           *args.overrides, "--run-dir", run_dir]
    job = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, MPIFL_BIND="none"), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    peak_rss: dict[str, int] = {}
    peak_pss_sum = 0
    while job.poll() is None:
        pids = job_processes(run_dir)
        samples = {pid: s for pid in pids if (s := sample(pid)) is not None}
        supervisors = supervisors_of(pids)  # each rank's small parent (mpifl.cli.supervisor): in the PSS sum only
        for pid, (rss, _) in samples.items():
            if pid not in supervisors:
                peak_rss[pid] = max(peak_rss.get(pid, 0), rss)
        peak_pss_sum = max(peak_pss_sum, sum(pss for _, pss in samples.values()))
        time.sleep(0.1)
    if job.returncode:
        print(job.stderr.read()[-3000:] if job.stderr else "", file=sys.stderr)
        return job.returncode
    print(f"{args.config} {' '.join(args.overrides)} on {args.ranks} ranks: peak RSS per rank (MiB, ascending) "
          f"{sorted(peak_rss.values())}; peak of the summed PSS {peak_pss_sum} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
