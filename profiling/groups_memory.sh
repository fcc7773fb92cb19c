#!/usr/bin/env bash
# Server memory with several participants per client rank: 6 participants on 2 client ranks,
# a model-only exchange of a SIZE_MB fp32 model, three ways:
#   plain       every update travels (a rank's participants arrive one after another, so the
#               server's accumulator window must span the whole model);
#   groups      clients.groups=2: each rank sums its 3 participants first, 2 fp32 sums travel;
#   groups+disk the same with the out-of-core server.
#   profiling/groups_memory.sh [SIZE_MB] [RUN_ROOT]
set -euo pipefail
SIZE_MB=${1:-1024}
ROOT=${2:-runs/groups-memory}
BIN=${BIN:-.venv/bin}
CONFIG=$(mktemp --suffix=.yaml)
trap 'rm -f "$CONFIG"' EXIT
cat >"$CONFIG" <<'YAML'
rounds: 3
clients: {num_clients: 6}
model: {name: blob}
train: {trainer: none}
eval: {every: 0}
checkpoint: {keep: 1}
output: {progress: false, save_model: false}
YAML
run() {
  local name=$1; shift
  local dir="$ROOT/$name"
  rm -rf "$dir"
  "$BIN/mpiexec" -n 3 "$BIN/mpifl" run "$CONFIG" --run-dir "$dir" "model.kwargs.size_mb=$SIZE_MB" "$@" >/dev/null
  "$BIN/python" - "$dir" "$name" "$SIZE_MB" <<'PY'
import json, statistics, sys
rec = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
model = float(sys.argv[3]) * 2**20
peak = max(r["server_peak_rss_bytes"] for r in rec)
print(f"{sys.argv[2]:<12} server peak {peak / 2**20:6.0f} MiB = {peak / model:.2f} x model; "
      f"received {rec[-1]['bytes_received'] / 2**20:6.0f} MiB/round; "
      f"round {statistics.median(r['time']['round'] for r in rec):.2f} s (median of {len(rec)})")
PY
  rm -rf "$dir/checkpoints"   # large files; the metrics stay
}
run plain
run groups clients.groups=2
run groups+disk clients.groups=2 server.state=disk
