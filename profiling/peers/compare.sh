#!/usr/bin/env bash
# mpifl vs Flower (simulation engine, Ray) vs pfl-research on one cross-device task (profiling/peers/task.py):
# FEMNIST-like data, 1,000 clients, LEAF CNN, FedAvg 20 clients per round; then a communication-heavy
# variant (a 93 MB MLP, ~5 samples per client). Each peer gets its own venv under profiling/peers/.venvs
# (never an mpifl dependency), torch pinned to the CPU 2.13.0 wheel. From the repository root:
#
#     bash profiling/peers/compare.sh            # ROUNDS=10 BIG_ROUNDS=4 WORKERS=2 COHORT100=0
#
# Peak memory: every run is wrapped by `task.py measure`, which samples the whole process tree of the
# run every 0.2 s from /proc (smaps_rollup) and keeps the peak of the summed RSS, of the summed PSS
# (shared pages split between processes: the fairer sum) and the largest single process's RSS.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD PEERS=$PWD/profiling/peers
ROUNDS=${ROUNDS:-10} BIG_ROUNDS=${BIG_ROUNDS:-4} WORKERS=${WORKERS:-2} COHORT100=${COHORT100:-0}
PY=${PYTHON:-python3}
VENVS=$PEERS/.venvs OUT=$PEERS/logs
mkdir -p "$VENVS" "$OUT"
rm -f "$OUT"/*.json
echo "torch==2.13.0" > "$VENVS/constraints.txt"   # the CPU wheel; an unpinned torch pulls CUDA builds
START=$(date +%s)

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
FLOWER_OK=1 PFL_OK=1
venv flower 'flwr[simulation]' || FLOWER_OK=0
venv pfl 'pfl[pytorch]' || PFL_OK=0
versions() { "$VENVS/$1/bin/python" -c "import importlib.metadata as m; print(', '.join(p + ' ' + m.version(p) for p in '$2'.split()))"; }
echo "mpifl: $(VENVS=$ROOT versions .venv 'mpifl torch mpi4py')"
[ $FLOWER_OK = 1 ] && echo "flower: $(versions flower 'flwr ray torch')"
[ $PFL_OK = 1 ] && echo "pfl: $(versions pfl 'pfl torch')"

# ---- runs ----------------------------------------------------------------------------------------
measure() { "$PY" "$PEERS/task.py" measure "$OUT/$1.json" -- "${@:2}" >"$OUT/$1.log" 2>&1 \
            || echo "!! $1 failed (rc $?): see $OUT/$1.log"; grep -h '^RESULT' "$OUT/$1.log" || true; }
export PYTHONPATH=$PEERS
run_task() {  # run_task LABEL TASK ROUNDS PER_ROUND
    local label=$1 task=$2 rounds=$3 per=$4 model samples
    model=$([ "$task" = cnn ] && echo leaf_cnn || echo big_mlp); samples=$([ "$task" = cnn ] && echo 20 || echo 5)
    echo "== $label: $task, $rounds rounds, $per clients per round, $WORKERS workers"
    measure "$label-mpifl" .venv/bin/python profiling/cross_device.py --json --model "$model" --samples "$samples" \
        --rounds "$rounds" --per-round "$per" --ranks "$WORKERS" --groups "$WORKERS"
    if [ $FLOWER_OK = 1 ]; then
        measure "$label-flower" "$VENVS/flower/bin/python" "$PEERS/flower_task.py" --task "$task" --rounds "$rounds" \
            --per-round "$per" --workers "$WORKERS"
    fi
    if [ $PFL_OK = 1 ]; then
        measure "$label-pfl" "$VENVS/pfl/bin/torchrun" --standalone --nproc-per-node "$WORKERS" "$PEERS/pfl_task.py" \
            --task "$task" --rounds "$rounds" --per-round "$per"
    fi
}
run_task cnn20 cnn "$ROUNDS" 20
[ "$COHORT100" = 1 ] && run_task cnn100 cnn "$ROUNDS" 100
run_task mlp100mb mlp100mb "$BIG_ROUNDS" 20

echo
echo "## mpifl vs Flower vs pfl ($(nproc) cores, $WORKERS client workers each; $(( $(date +%s) - START )) s in all)"
echo
"$PY" "$PEERS/task.py" table "$PEERS/results.json" "$OUT"/*.json
[ $FLOWER_OK = 1 ] || echo "Flower: not installed (see above), no rows"
[ $PFL_OK = 1 ] || echo "pfl: not installed (see above), no rows"
