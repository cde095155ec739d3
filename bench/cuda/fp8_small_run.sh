#!/usr/bin/env bash
# One device call: the `small` preset trained for 300 steps on one GPU in bf16 and in fp8
# (train.precision), the same job otherwise (synthetic key-value recall, 8K-token sequences,
# AdamW with warm-up and cosine decay, seed 1), and the mean loss over the last 50 steps of each,
# which fp8 must hold within 1% of bf16's. Run from the repository root on the GPU machine with
# .cuda-run carried (bench/cuda/pack_for_device.sh). Writes each run's JSON progress under $OUT.
# Usage: bench/cuda/fp8_small_run.sh [steps, default 300]
set -uo pipefail
out=${OUT:-/tmp}
steps=${1:-300}
source bench/cuda/device_env.sh
for precision in bf16 fp8; do
  cat > "$out/small-$precision.json" <<JOB
{"name": "small-$precision", "model": {"preset": "small"},
 "data": {"source": "synthetic:recall", "recall_pairs": 16, "recall_gap": 1024},
 "seq_len": 8192,
 "train": {"steps": $steps, "lr": 2e-3, "warmup_steps": 20, "schedule": "cosine",
           "optimizer": "adamw", "grad_clip": 1.0, "seed": 1, "precision": "$precision"},
 "resources": "cuda"}
JOB
  timeout 240 "$R/spindle-train" --job "$out/small-$precision.json" > "$out/small-$precision.log" 2>&1
  echo "$precision: exit $?"
done
python3 - "$out" "$steps" <<'PY'
import json, sys
out, steps = sys.argv[1], int(sys.argv[2])
mean = {}
for p in ("bf16", "fp8"):
    losses, tps = [], []
    for line in open(f"{out}/small-{p}.log"):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "step":
            losses.append(e["loss"]); tps.append(e["tokens_per_s"])
    if len(losses) < steps:
        print(f"{p}: only {len(losses)} steps"); sys.exit(1)
    mean[p] = sum(losses[-50:]) / 50
    tps.sort()
    print(f"| {p} | first loss {losses[0]:.4f} | mean of the last 50 {mean[p]:.4f} | "
          f"median tokens/s {tps[len(tps) // 2]:.0f} |")
d = mean["fp8"] / mean["bf16"] - 1
print(f"fp8 against bf16: {100 * d:+.2f}% ({'within' if abs(d) <= 0.01 else 'outside'} 1%)")
PY
