#!/usr/bin/env bash
# Server and client peak RSS of synchronous FedAvg, FedBuff and FedAsync on the same model-only
# federation (a blob of SIZE_MB, 12 clients, 3 per round or a buffer of 3, 2 client ranks), from
# each run's metrics.jsonl. Usage: bash profiling/async_memory.sh [SIZE_MB]   (from the repository root)
set -euo pipefail
SIZE_MB=${1:-512}
BIN=${BIN:-.venv/bin}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/base.yaml" <<YAML
rounds: 4
clients: {num_clients: 12, per_round: 3}
model: {name: blob, kwargs: {size_mb: $SIZE_MB}}
train: {trainer: none}
eval: {every: 0}
output: {progress: false, save_model: false}
YAML
printf '| mode | server peak RSS | largest client peak RSS | received per round |\n|---|---|---|---|\n'
for mode in off fedbuff fedasync; do
  case $mode in
    off) extra=() ;;
    fedbuff) extra=(clock.mode=fedbuff clock.buffer=3 clock.concurrency=6 strategy.update=delta) ;;
    fedasync) extra=(clock.mode=fedasync clock.concurrency=6) ;;
  esac
  "$BIN/mpiexec" -n 3 "$BIN/mpifl" run "$WORK/base.yaml" --run-dir "$WORK/$mode" "${extra[@]}" 2>/dev/null
  "$BIN/python" - "$WORK/$mode/metrics.jsonl" "$mode" <<'PY'
import json, sys
rs = [json.loads(line) for line in open(sys.argv[1])]
mib = lambda b: b / 2**20
print(f"| {sys.argv[2]} | {mib(max(r['server_peak_rss_bytes'] for r in rs)):.0f} MiB | "
      f"{mib(max(r['client_peak_rss_bytes'] for r in rs)):.0f} MiB | {mib(rs[-1]['bytes_received']):.0f} MiB |")
PY
done
