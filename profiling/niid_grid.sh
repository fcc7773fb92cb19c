#!/usr/bin/env bash
# NIID-Bench's Fashion-MNIST grid, breadth first: seed 0 of every algorithm and setting, FedAvg on every setting
# first, then seed 1, then seed 2, so that a grid stopped part way has one run in as many cells as possible, each
# setting with its FedAvg baseline. Each cell is one call of profiling/niid_bench.py into runs/niid_grid-<setting>;
# a call reads a cell's kept record (profiling/results/niid_bench) instead of running it, finds its finished runs
# there, and resumes an unfinished one from its newest checkpoint, so this script can be stopped (SIGTERM the
# harness, then its mpiexec) and started again, in this session or on another machine.
#
#   nohup nice -n 19 profiling/niid_grid.sh >> runs/niid_grid.out 2>&1 &
#   SEEDS="0" SETTINGS="iid label1" profiling/niid_grid.sh    # a part of the grid
#   START_BEFORE=2026-11-30T09:00 profiling/niid_grid.sh      # start no run after 09:00 (a session's or job's end)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RANKS=${RANKS:-3}
SEEDS=${SEEDS:-0 1 2}
SETTINGS=${SETTINGS:-label2 iid label1 label3 quantity}
ALGORITHMS=${ALGORITHMS:-fedavg fedprox scaffold fednova}
# A cell whose run fails (its log names why) does not stop the grid: the others go on, the failed ones are listed
# at the end, and the exit status is 1 if there were any. A second call resumes a failed run from its checkpoint.
failed=()
for seed in $SEEDS; do
    for algorithm in $ALGORITHMS; do
        for setting in $SETTINGS; do
            "$PYTHON" profiling/niid_bench.py --setting "$setting" --algorithms "$algorithm" --seeds "$seed" \
                --ranks "$RANKS" --work "runs/niid_grid-$setting" ${START_BEFORE:+--start-before "$START_BEFORE"} "$@" \
                || failed+=("$setting $algorithm seed $seed")
        done
    done
done
if ((${#failed[@]})); then
    printf 'niid_grid: %d cell(s) failed (their logs are in runs/niid_grid-<setting>/):\n' "${#failed[@]}"
    printf '  %s\n' "${failed[@]}"
    exit 1
fi
