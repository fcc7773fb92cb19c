#!/usr/bin/env bash
# NIID-Bench's Fashion-MNIST grid, breadth first: seed 0 of every algorithm and setting, FedAvg on every setting
# first, then seed 1, then seed 2, so that a grid stopped part way has one run in as many cells as possible, each
# setting with its FedAvg baseline. Each cell is one call of profiling/niid_bench.py into runs/niid_grid-<setting>;
# a call reads a cell's kept record (profiling/results/niid_bench) instead of running it, finds its finished runs
# there, and resumes an unfinished one from its newest checkpoint, so this script can be stopped (SIGTERM this
# script, then the harness, niid_bench.py, which stops its job: the ranks checkpoint their round) and started again,
# in this session or on another machine (PACK=1 below).
#
#   nohup nice -n 19 profiling/niid_grid.sh >> runs/niid_grid.out 2>&1 &
#   SEEDS="0" SETTINGS="iid label1" profiling/niid_grid.sh    # a part of the grid
#   START_BEFORE=2026-11-30T09:00 profiling/niid_grid.sh      # start no run after 09:00 (a session's or job's end)
#   PACK=1 profiling/niid_grid.sh                             # carry the unfinished runs to another machine
set -euo pipefail
cd "$(dirname "$0")/.."
# A run unfinished when its machine goes (a session's, a job's) is carried to the next one: PACK=1 packs each run
# directory without a model.h5 (its newest checkpoint only, and its log: about 200 KB; the partition is drawn again) into
# profiling/results/niid_bench/unfinished/<run>.tar.gz, to be committed; every later call unpacks the ones whose run
# is not under runs/ yet, and the grid resumes them from that checkpoint. A run once recorded is read from its
# record, so a stale archive is harmless (delete it when the run is recorded).
UNFINISHED=profiling/results/niid_bench/unfinished
if [[ ${PACK:-} == 1 ]]; then
    mkdir -p "$UNFINISHED"
    for run in runs/niid_grid-*/*-seed*/; do
        run=${run%/}
        [[ -e $run/model.h5 || ! -d $run/checkpoints ]] && continue
        newest=
        for ckpt in "$run"/checkpoints/ckpt-r*.h5; do  # the glob sorts, and rounds are zero-padded
            [[ ${ckpt##*/} =~ ^ckpt-r[0-9]+\.h5$ ]] && newest=${ckpt##*/}
        done
        [[ -z $newest ]] && continue
        older=()
        for ckpt in "$run"/checkpoints/*; do
            [[ ${ckpt##*/} != "$newest" && ${ckpt##*/} != "${newest%.h5}.residuals" ]] && older+=(--exclude "${ckpt#runs/}")
        done
        members=("${run#runs/}")
        [[ -e $run.log ]] && members+=("${run#runs/}.log")
        tar -czf "$UNFINISHED/${run##*/}.tar.gz" -C runs "${older[@]}" --exclude "${run#runs/}/.lock" "${members[@]}"
        echo "niid_grid: packed $run at ${newest} into $UNFINISHED/${run##*/}.tar.gz"
    done
    exit 0
fi
mkdir -p runs
for packed in "$UNFINISHED"/*.tar.gz; do
    [[ -e $packed ]] || continue
    run=$(tar -tzf "$packed" | head -1 || true)  # head leaves tar a closed pipe
    if [[ ! -d runs/${run%%/*}/$(basename "$packed" .tar.gz) ]]; then
        tar -xzf "$packed" -C runs && echo "niid_grid: unpacked $packed into runs/ to resume it"
    fi
done
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
