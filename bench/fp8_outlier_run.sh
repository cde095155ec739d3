#!/usr/bin/env bash
# FP8 recipes against bf16 on the CPU engine, with and without outliers (issue 49 item 4): the
# `small` preset trained for N steps (default 300) in six runs of one job otherwise the same
# (synthetic key-value recall, AdamW with warm-up and cosine decay, gradient clipping, seed 1):
# bf16, fp8 tensorwise and fp8 blockwise (train.precision, train.fp8_recipe), and the three again
# for each outlier factor with one outlier injected into each layer's FFN input (spindle-train's
# developer flag --inject-outliers FACTOR, worker/engine/numerics.h), and prints the mean loss
# over the last 50 steps of each with its difference from the bf16 run of the same model (with
# outliers: bf16 with the same outliers). The fp8 runs are the CPU emulation of the GPU's FP8
# GEMMs (bench/FP8_NOTES.md).
#
# Usage: bench/fp8_outlier_run.sh [steps, default 300]
# Environment: SEQ_LEN (default 1024), THREADS per run (default 1), JOBS runs at once (default
# 9), FACTORS the outlier multipliers (default "1000 100000": each adds three runs), TRAIN the
# spindle-train binary (default build/worker/spindle-train), OUT where the job files and JSON logs
# go (default a fresh temporary directory; a run that finished in an earlier call on the same OUT
# is kept, not rerun). The defaults run the nine at once, one thread each, on a 16-core host;
# on the 2-core development machine SEQ_LEN=256 JOBS=2 THREADS=1 (two single-threaded runs fare
# better than one of two threads on a loaded machine). bench/FP8_NOTES.md says what ran where.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-300}
seq_len=${SEQ_LEN:-1024}
threads=${THREADS:-1}
jobs=${JOBS:-9}
factors=${FACTORS:-1000 100000}
train=${TRAIN:-build/worker/spindle-train}
out=${OUT:-$(mktemp -d)}
if [ "$steps" -lt 50 ]; then
  echo "steps must be at least 50 (the table averages the last 50), got $steps" >&2
  exit 2
fi
if [ ! -x "$train" ]; then
  echo "no spindle-train at $train (build it: cmake --build build --target spindle-train)" >&2
  exit 2
fi
gap=$((seq_len / 8))
# name, precision, fp8_recipe, outlier factor (0: none)
runs=()
for f in 0 $factors; do
  suffix=""
  [ "$f" != 0 ] && suffix="-x$f"
  runs+=("bf16$suffix bf16 tensorwise $f" "fp8-tensorwise$suffix fp8 tensorwise $f"
         "fp8-blockwise$suffix fp8 blockwise $f")
done
echo "steps $steps, seq_len $seq_len, $threads threads per run, $jobs at once, outlier factors" \
     "$factors, logs in $out"
names=()
running=0
for r in "${runs[@]}"; do
  read -r name precision recipe factor <<<"$r"
  names+=("$name")
  cat > "$out/$name.json" <<JOB
{"name": "$name", "model": {"preset": "small"},
 "data": {"source": "synthetic:recall", "recall_pairs": 16, "recall_gap": $gap},
 "seq_len": $seq_len,
 "train": {"steps": $steps, "lr": 2e-3, "warmup_steps": 20, "schedule": "cosine",
           "optimizer": "adamw", "grad_clip": 1.0, "seed": 1, "precision": "$precision",
           "fp8_recipe": "$recipe"}}
JOB
  if grep -qs "exit 0 " "$out/$name.rc"; then  # finished in an earlier call on this OUT
    echo "$name: kept from $out"
    continue
  fi
  flags=()
  [ "$factor" != 0 ] && flags=(--inject-outliers "$factor")
  (
    start=$(date +%s)
    "$train" --job "$out/$name.json" --threads "$threads" "${flags[@]}" > "$out/$name.log" 2> "$out/$name.err"
    rc=$?
    echo "$name: exit $rc after $(( $(date +%s) - start )) s" | tee "$out/$name.rc"
  ) &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n
    running=$((running - 1))
  fi
done
wait
python3 - "$out" "$steps" "${names[@]}" <<'PY'
import json, sys
out, steps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
mean, first, secs, ok = {}, {}, {}, True
for n in names:
    losses = []
    for line in open(f"{out}/{n}.log"):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "step":
            losses.append(e["loss"])
    secs[n] = open(f"{out}/{n}.rc").read().split()[-2]
    if len(losses) < steps:
        print(f"{n}: only {len(losses)} of {steps} steps (see {out}/{n}.err)")
        ok = False
        continue
    first[n], mean[n] = losses[0], sum(losses[-50:]) / 50
print("| run | first loss | mean of the last 50 | against | difference | s |")
print("|---|---|---|---|---|---|")
for n in names:
    if n not in mean:
        continue
    ref = "bf16" + (n[n.index("-x"):] if "-x" in n else "")
    if n == ref or ref not in mean:
        against, diff = "-", "-"
    else:
        d = mean[n] / mean[ref] - 1
        against = ref
        diff = f"{100 * d:+.2f}% ({'within' if abs(d) <= 0.01 else 'outside'} 1%)"
    print(f"| {n} | {first[n]:.4f} | {mean[n]:.4f} | {against} | {diff} | {secs[n]} |")
sys.exit(0 if ok else 1)
PY
