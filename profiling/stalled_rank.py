"""What one rank that stays slow costs a run under ``clients.accept_failures``: the same run clean and with rank 2
stalled once for many rounds' worth, side by side, in interleaved repeats.

The run: 6 clients on 3 client ranks, every client each round, 40 rounds, each client's training a fixed
``--client-seconds`` (the test suite's ``fl_helpers:Straggling`` trainer, which reports progress while it waits, so
the stalled rank is slow, not silent). In the stalled run, rank 2's first client of round 2 takes ``--stall``
seconds, past the ``--straggler`` deadline. Before mpifl left busy ranks out, every later round waited for it;
now round 2 is dropped at the deadline and the rest do not wait. The figure is each run's wall time (the median
over ``--repeats``), and the stalled run's extra time in straggler deadlines. Run from the repository root, on a
quiet machine:

    python profiling/stalled_rank.py --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """
seed: 3
rounds: {rounds}
clients: {{num_clients: 6, per_round: 6, accept_failures: true}}
data: {{dataset: digits, partition: iid}}
model: {{name: "fl_helpers:tiny_mlp"}}
train: {{trainer: "fl_helpers:Straggling", lr: 0.02}}
timeouts: {{straggler: {straggler}}}
eval: {{every: 0}}
output: {{progress: false}}
"""


def run_once(folder: Path, stall: float | None, args: argparse.Namespace) -> tuple[float, int]:
    """One run's wall seconds (launch to exit) and the rounds that left rank 2's clients out or dropped them."""
    cfg = folder / "run.yaml"
    cfg.write_text(CONFIG.format(rounds=args.rounds, straggler=args.straggler))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
               FL_HELPERS_CLIENT_SECONDS=str(args.client_seconds))
    if stall is not None:
        env.update(FL_HELPERS_SLOW_RANK="2", FL_HELPERS_SLOW_CALLS="3",
                   FL_HELPERS_SLOW_FACTOR=str(stall / args.client_seconds))
    mpiexec = Path(sys.executable).parent / "mpiexec"
    run_dir = folder / ("stalled" if stall else "clean")
    started = time.perf_counter()
    done = subprocess.run([str(mpiexec), "-n", "4", sys.executable, "-m", "mpifl", "run", str(cfg),
                           "--run-dir", str(run_dir)], env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return seconds, sum(1 for r in records if r["dropped"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--client-seconds", type=float, default=0.05)
    parser.add_argument("--stall", type=float, default=8.0, help="rank 2's one slow client, seconds")
    parser.add_argument("--straggler", type=float, default=1.5, help="timeouts.straggler, seconds")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    clean, stalled, left_out = [], [], []
    for repeat in range(args.repeats):  # interleaved: the machine's drift hits both alike
        with tempfile.TemporaryDirectory() as tmp:
            clean.append(run_once(Path(tmp), None, args)[0])
            seconds, rounds = run_once(Path(tmp), args.stall, args)
            stalled.append(seconds)
            left_out.append(rounds)
        print(f"repeat {repeat + 1}: clean {clean[-1]:.1f} s, stalled {stalled[-1]:.1f} s "
              f"({left_out[-1]} rounds without rank 2's clients)", flush=True)
    a, b = statistics.median(clean), statistics.median(stalled)
    print(f"median of {args.repeats}: clean {a:.1f} s, stalled {b:.1f} s: {b - a:+.1f} s = "
          f"{(b - a) / args.straggler:.1f} straggler deadlines ({args.straggler:g} s) for a {args.stall:g} s stall "
          f"({statistics.median(left_out):g} rounds without rank 2's clients)")


if __name__ == "__main__":
    main()
