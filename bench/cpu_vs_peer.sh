#!/usr/bin/env bash
# Side-by-side CPU comparison on this machine: Spindle's training step for the `small` preset
# against the CPU peer (../shared/peer/cpu_peer.py: the same model in plain PyTorch, Debian's
# python3-torch), both on the same number of threads, T = 4096 and 8192, run back to back.
# Usage: bench/cpu_vs_peer.sh [threads] (default 2). Needs a built tree (scripts/setup.sh) and
# python3-torch (apt-get install python3-torch). Run it on a quiet machine: both sides use
# OpenMP barriers, which a loaded machine turns into scheduler waits.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-2}
PEER=${PEER:-../shared/peer/cpu_peer.py}
BENCH=${BENCH:-build/bench/bench_cpu}
printf "| T | Spindle tokens/s | peer tokens/s | ratio |\n|---|---|---|---|\n"
for T in 4096 8192; do
  ours=$(OMP_NUM_THREADS=$THREADS "$BENCH" --T "$T" --repeats 1 --steps 3 | awk -F'|' '/\| small/ {gsub(/ /,"",$6); print $6}')
  peer=$(/usr/bin/python3 "$PEER" --threads "$THREADS" --T "$T" --steps 3 |
         /usr/bin/python3 -c 'import json,sys; print(round(json.load(sys.stdin)["tokens_per_s"]))')
  ratio=$(awk -v a="$ours" -v b="$peer" 'BEGIN { printf "%.2f", a / b }')
  printf "| %s | %s | %s | %sx |\n" "$T" "$ours" "$peer" "$ratio"
done
