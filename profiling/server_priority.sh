#!/usr/bin/env bash
# Does the server's folding steal from the training ranks? The cross-device task (profiling/cross_device.py) with
# every update travelling to the server (clients.groups 0, round-robin placement: the server folds 20 updates a
# round while both client ranks still train, 3 processes on 2 cores), the server at its usual priority and under
# `nice -n 10` (MPMD launch), interleaved; prints the median seconds per round (rounds after the first, evaluation
# excluded) of each run. From the repository root:
#
#     bash profiling/server_priority.sh            # MODEL=leaf_cnn ROUNDS=10 REPEATS=3
#     MODEL=big_mlp ROUNDS=5 bash profiling/server_priority.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-leaf_cnn} ROUNDS=${ROUNDS:-10} REPEATS=${REPEATS:-3}
SAMPLES=$([ "$MODEL" = big_mlp ] && echo 5 || echo 20)
BIN=.venv/bin WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH=$PWD/profiling
# the config cross_device.py writes (its run directory keeps it, resolved)
$BIN/python profiling/cross_device.py --model "$MODEL" --samples "$SAMPLES" --rounds 2 --groups 0 \
    --placement round_robin --data plugin --keep "$WORK/setup" >/dev/null
CONFIG=$WORK/setup/config.yaml
median() {  # median seconds per round of a run directory, rounds after the first, evaluation excluded
    $BIN/python -c "import json, statistics, sys
r = [json.loads(line) for line in open(sys.argv[1] + '/metrics.jsonl')][1:]
print(f\"{statistics.median(x['time']['round'] - x['time']['eval'] for x in r):.3f}\")" "$1"
}
echo "$MODEL, $ROUNDS rounds, every update to the server; median s/round (rounds 2..$ROUNDS), commit $(git rev-parse --short HEAD)"
for r in $(seq "$REPEATS"); do
    for nice in 0 10; do
        run=$WORK/r$r-nice$nice
        args=(run "$CONFIG" "rounds=$ROUNDS" --run-dir "$run")
        if [ "$nice" = 0 ]; then
            $BIN/mpiexec -n 3 $BIN/mpifl "${args[@]}" >/dev/null 2>&1
        else
            $BIN/mpiexec -n 1 nice -n "$nice" $BIN/mpifl "${args[@]}" : -n 2 $BIN/mpifl "${args[@]}" >/dev/null 2>&1
        fi
        echo "repeat $r, server nice $nice: $(median "$run")"
    done
done
