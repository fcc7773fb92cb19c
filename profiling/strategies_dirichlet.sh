#!/usr/bin/env bash
# Rounds to 85% held-out accuracy under Dirichlet(0.1) label skew, per strategy and seed
# (README, "Strategies under label skew"). Usage: profiling/strategies_dirichlet.sh [OUT_DIR]
set -euo pipefail
out=${1:-runs/strategies-dirichlet01}
mpiexec=${MPIEXEC:-mpiexec}
declare -A strategies=(
  [fedavg]="strategy.name=fedavg"
  [fedavgm]="strategy.name=fedavgm strategy.server_lr=0.5 strategy.momentum=0.5"
  [fedadam]="strategy.name=fedadam"
  [fedyogi]="strategy.name=fedyogi"
)
for seed in 0 1 2; do
  for name in fedavg fedavgm fedadam fedyogi; do
    # shellcheck disable=SC2086  # the overrides are separate words on purpose
    "$mpiexec" -n 5 mpifl run configs/dirichlet01.yaml ${strategies[$name]} seed=$seed output.progress=false \
      --run-dir "$out/seed$seed-$name" 2>&1 | tail -n 1
  done
done
for seed in 0 1 2; do
  mpifl compare "$out"/seed$seed-* --target 0.85
done
