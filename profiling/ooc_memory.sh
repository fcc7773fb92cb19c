#!/usr/bin/env bash
# Out-of-core server memory: peak RSS of rank 0 with a small and a large model (model-only
# exchange, 2 clients, server.state=disk). The two figures should agree within ~10%.
#   profiling/ooc_memory.sh [SMALL_MB] [LARGE_MB] [RUN_ROOT]
# EXTRA adds config overrides, e.g. DP-FedAvg with int8 updates:
#   EXTRA="strategy.update=delta strategy.weighting=equal privacy.mode=central compression.method=int8" \
#     bash profiling/ooc_memory.sh 250 2000
set -euo pipefail
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
SMALL_MB=${1:-250}
LARGE_MB=${2:-2000}
ROOT=${3:-runs/ooc-memory}
BIN=${BIN:-.venv/bin}
CONFIG=$(mktemp --suffix=.yaml)
trap 'rm -f "$CONFIG"' EXIT
cat >"$CONFIG" <<'YAML'
rounds: 2
clients: {num_clients: 2}
model: {name: blob}
train: {trainer: none}
eval: {every: 0}
server: {state: disk}
checkpoint: {keep: 1}
output: {progress: false}
YAML
for mb in "$SMALL_MB" "$LARGE_MB"; do
  dir="$ROOT/model-${mb}mb"
  rm -rf "$dir"
  "$BIN/mpiexec" -n 3 "$BIN/mpifl" run "$CONFIG" --run-dir "$dir" "model.kwargs.size_mb=$mb" "${EXTRA_ARGS[@]}" \
    >/dev/null
  "$BIN/python" - "$dir" "$mb" <<'PY'
import json, sys
rec = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
print(f"model {sys.argv[2]:>5} MiB: server peak RSS {rec[-1]['server_peak_rss_bytes'] / 2**20:.0f} MiB, "
      f"round {rec[-1]['time']['round']:.2f} s, received {rec[-1]['bytes_received'] / 2**20:.0f} MiB"
      + (f", epsilon {rec[-1]['privacy']['epsilon']:.2f}" if "privacy" in rec[-1] else ""))
PY
  rm -rf "$dir/checkpoints" "$dir/model.h5"   # large files; the metrics stay
done
