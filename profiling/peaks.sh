#!/usr/bin/env bash
# Peak resident memory (VmHWM) of each rank of one mpifl job, polled from /proc/<pid>/status every
# 0.3 s while the job runs; the rank of each process is read from the run directory's ranks.txt.
# The job's own output goes to peaks_job.log. docs/explanation/memory.md's held-out evaluation
# figures (configs/gpt2.yaml, 2026-12-01) were measured with this script.
#   profiling/peaks.sh RUNDIR -- COMMAND...   (COMMAND writes its run to RUNDIR), for example
#   profiling/peaks.sh runs/e1 -- timeout 300 mpiexec -n 3 mpifl run configs/gpt2.yaml rounds=1 --run-dir runs/e1
rd=$1
shift 2
"$@" >peaks_job.log 2>&1 &
job=$!
declare -A hwm
while kill -0 "$job" 2>/dev/null; do
  for p in $(pgrep -f "mpifl run.*$rd"); do
    v=$(awk '/VmHWM/{print $2}' "/proc/$p/status" 2>/dev/null)
    [ -n "$v" ] && hwm[$p]=$v
  done
  sleep 0.3
done
wait "$job"
echo "rc=$?"
for p in "${!hwm[@]}"; do
  r=$(awk -v p="$p" '$3==p{print $1}' "$rd/ranks.txt")
  echo "pid $p rank ${r:-?} VmHWM $((hwm[$p] / 1024)) MiB"
done | sort -k4
