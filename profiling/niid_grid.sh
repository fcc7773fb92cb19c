#!/usr/bin/env bash
# NIID-Bench's Fashion-MNIST grid, breadth first: seed 0 of every setting and algorithm, then seed 1, then seed 2,
# so that a grid stopped part way has one run in as many cells as possible. Each cell is one call of
# profiling/niid_bench.py into runs/niid_grid-<setting>; a call finds its finished runs there and resumes an
# unfinished one from its newest checkpoint, so this script can be stopped (SIGTERM the harness, then its mpiexec)
# and started again, in this session or the next.
#
#   nohup nice -n 19 profiling/niid_grid.sh >> runs/niid_grid.out 2>&1 &
#   SEEDS="0" SETTINGS="iid label1" profiling/niid_grid.sh    # a part of the grid
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RANKS=${RANKS:-3}
SEEDS=${SEEDS:-0 1 2}
SETTINGS=${SETTINGS:-label2 iid label1 label3 quantity}
ALGORITHMS=${ALGORITHMS:-fedavg fedprox scaffold fednova}
for seed in $SEEDS; do
    for setting in $SETTINGS; do
        for algorithm in $ALGORITHMS; do
            "$PYTHON" profiling/niid_bench.py --setting "$setting" --algorithms "$algorithm" --seeds "$seed" \
                --ranks "$RANKS" --work "runs/niid_grid-$setting" "$@"
        done
    done
done
