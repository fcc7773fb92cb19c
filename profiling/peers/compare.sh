#!/usr/bin/env bash
# mpifl vs pfl-research (2 processes and 1) vs Flower (simulation engine, Ray) on one cross-device task
# (profiling/peers/task.py): FEMNIST-like data, 1,000 clients, LEAF CNN, FedAvg 20 clients per round;
# then a communication-heavy variant (a 93 MB MLP, ~5 samples per client). Each peer gets its own venv
# under profiling/peers/.venvs (never an mpifl dependency), torch pinned to the CPU 2.13.0 wheel. From
# the repository root:
#
#     bash profiling/peers/compare.sh     # PEERS="flower pfl" REPEATS=3 ROUNDS=10 BIG_ROUNDS=4 WORKERS=2 COHORT100=0 NHWC=1
#     PEERS=pfl bash profiling/peers/compare.sh                 # skip Flower (slow)
#
# NHWC=1 (the default) also times the CNN with every Conv2d's output in channels_last order, in mpifl
# (model.memory_format: channels_last) and in pfl (the same forward hooks, task.nhwc_activations), and mpifl with
# PyTorch's own max-pooling kernel (model.nhwc_pooling: false, the kernels pfl runs as given), so that the
# table separates what the framework does from what the memory format and the pooling kernel do.
#
# Runs are interleaved: repeat 1 of every framework on every task, then repeat 2, ...; each run is saved
# as logs/TASK-FORM-rN.json (forms: mpifl, flower, pfl2 = torchrun --nproc-per-node 2, pfl1 = 1 process),
# merged into results.json; the table gives medians over the repeats and mpifl's ratios to pfl.
#
# Peak memory: every run is wrapped by `task.py measure`, which samples the whole process tree of the
# run from /proc and keeps the peak of the summed RSS (VmRSS in /proc/PID/status, every 0.2 s), of the
# summed PSS (shared pages split between processes: the fairer sum; smaps_rollup, every 1 s) and the
# largest single process's RSS. PSS is read 5x less often because the kernel walks a process's page
# tables to count it: 10-20 ms per read of a 500 MB process, CPU taken from 2 cores, more for a form
# with more processes (until 2026-11-26 both were read every 0.2 s).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD HERE=$PWD/profiling/peers
PEERS=${PEERS-flower pfl} REPEATS=${REPEATS:-3}
ROUNDS=${ROUNDS:-10} BIG_ROUNDS=${BIG_ROUNDS:-4} WORKERS=${WORKERS:-2} COHORT100=${COHORT100:-0} NHWC=${NHWC:-1}
COMMAND="PEERS=\"$PEERS\" REPEATS=$REPEATS ROUNDS=$ROUNDS BIG_ROUNDS=$BIG_ROUNDS WORKERS=$WORKERS COHORT100=$COHORT100 NHWC=$NHWC bash profiling/peers/compare.sh"
PY=${PYTHON:-python3}
VENVS=$HERE/.venvs OUT=$HERE/logs
mkdir -p "$VENVS" "$OUT"
rm -f "$OUT"/*.json
echo "torch==2.13.0" > "$VENVS/constraints.txt"   # the CPU wheel; an unpinned torch pulls CUDA builds
START=$(date +%s)
wants() { [[ " $PEERS " == *" $1 "* ]]; }
for p in $PEERS; do [[ $p == flower || $p == pfl ]] || { echo "PEERS: unknown peer '$p' (flower, pfl)"; exit 2; }; done

# ---- environments ------------------------------------------------------------------------------
[ -x .venv/bin/mpifl ] || make install PYTHON="$PY"
venv() {  # venv NAME PACKAGE...: create once, install the packages with torch pinned
    local name=$1; shift
    [ -f "$VENVS/$name/.installed" ] && return 0
    "$PY" -m venv "$VENVS/$name"
    "$VENVS/$name/bin/pip" install -q -c "$VENVS/constraints.txt" torch==2.13.0 "$@" >"$OUT/install-$name.log" 2>&1 \
        || { echo "!! $name: pip install $* failed (see $OUT/install-$name.log):"; grep -v "is ignored" "$OUT/install-$name.log" | tail -5; return 1; }
    touch "$VENVS/$name/.installed"
}
FLOWER_OK=0 PFL_OK=0
if wants flower; then FLOWER_OK=1; venv flower 'flwr[simulation]' || FLOWER_OK=0; fi
if wants pfl; then PFL_OK=1; venv pfl 'pfl[pytorch]' || PFL_OK=0; fi
versions() { "$VENVS/$1/bin/python" -c "import importlib.metadata as m; print(', '.join(p + ' ' + m.version(p) for p in '$2'.split()))"; }
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || COMMIT="$COMMIT (with uncommitted changes)"
HEADER="$(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')), $(date -u +%Y-%m-%d), commit $COMMIT"
HEADER="$HEADER; mpifl: $(VENVS=$ROOT versions .venv 'mpifl torch mpi4py')"
[ $FLOWER_OK = 1 ] && HEADER="$HEADER; flower: $(versions flower 'flwr ray torch')"
[ $PFL_OK = 1 ] && HEADER="$HEADER; pfl: $(versions pfl 'pfl torch')"
HEADER="$HEADER; command: $COMMAND"
echo "$HEADER"

# ---- runs ----------------------------------------------------------------------------------------
measure() { "$PY" "$HERE/task.py" measure "$OUT/$1.json" -- "${@:2}" >"$OUT/$1.log" 2>&1 \
            || echo "!! $1 failed (rc $?): see $OUT/$1.log"; grep -h '^RESULT' "$OUT/$1.log" | cut -c1-160 || true; }
export PYTHONPATH=$HERE
run_task() {  # run_task LABEL TASK ROUNDS PER_ROUND REPEAT
    local label=$1 task=$2 rounds=$3 per=$4 r=$5 model samples
    model=$([ "$task" = cnn ] && echo leaf_cnn || echo big_mlp); samples=$([ "$task" = cnn ] && echo 20 || echo 5)
    echo "== repeat $r/$REPEATS, $label: $task, $rounds rounds, $per clients per round, $WORKERS workers"
    # mpifl: one reduction group per client rank, formed each round by work (clients.group_by: cost), so the ranks
    # finish together; any rank may train any client, the data shared once per node (--data plugin)
    local mpifl_args=(--json --model "$model" --samples "$samples" --rounds "$rounds" --per-round "$per"
                      --ranks "$WORKERS" --groups "$WORKERS" --placement per_round --group-by cost --data plugin)
    measure "$label-mpifl-r$r" .venv/bin/python profiling/cross_device.py "${mpifl_args[@]}"
    if [ "$NHWC" = 1 ] && [ "$task" = cnn ]; then
        measure "$label-mpifl_torchpool-r$r" .venv/bin/python profiling/cross_device.py "${mpifl_args[@]}" \
            --nhwc-pooling false
        measure "$label-mpifl_nhwc-r$r" .venv/bin/python profiling/cross_device.py "${mpifl_args[@]}" \
            --memory-format channels_last
    fi
    if [ $FLOWER_OK = 1 ]; then
        measure "$label-flower-r$r" "$VENVS/flower/bin/python" "$HERE/flower_task.py" --task "$task" --rounds "$rounds" \
            --per-round "$per" --workers "$WORKERS"
    fi
    if [ $PFL_OK = 1 ]; then
        for n in "$WORKERS" 1; do
            measure "$label-pfl$n-r$r" "$VENVS/pfl/bin/torchrun" --standalone --nproc-per-node "$n" "$HERE/pfl_task.py" \
                --task "$task" --rounds "$rounds" --per-round "$per"
            if [ "$WORKERS" = 1 ]; then break; fi
        done
        if [ "$NHWC" = 1 ] && [ "$task" = cnn ]; then
            for n in "$WORKERS" 1; do
                measure "$label-pfl${n}_nhwc-r$r" "$VENVS/pfl/bin/torchrun" --standalone --nproc-per-node "$n" \
                    "$HERE/pfl_task.py" --task "$task" --rounds "$rounds" --per-round "$per" --memory-format channels_last
                if [ "$WORKERS" = 1 ]; then break; fi
            done
        fi
    fi
}
for r in $(seq 1 "$REPEATS"); do
    run_task cnn20 cnn "$ROUNDS" 20 "$r"
    [ "$COHORT100" = 1 ] && run_task cnn100 cnn "$ROUNDS" 100 "$r"
    run_task mlp100mb mlp100mb "$BIG_ROUNDS" 20 "$r"
done

echo
echo "## mpifl vs pfl-research vs Flower ($WORKERS client workers each; $(( $(date +%s) - START )) s in all)"
echo
"$PY" "$HERE/task.py" table "$HERE/results.json" --header "$HEADER" "$OUT"/*.json
wants flower && [ $FLOWER_OK = 0 ] && echo "Flower: not installed (see above), no rows"
wants pfl && [ $PFL_OK = 0 ] && echo "pfl: not installed (see above), no rows"
true
