#!/usr/bin/env bash
# Peak device memory per rank of a 1b training step under CP, measured with both ranks on one GPU:
# two standalone spindle-train processes (ranks sharing a GPU exchange through Gloo; their device
# buffers are those of the NCCL path, which adds only host staging), every layer recomputing, one
# step. Prints each rank's "mem_peak_bytes" (weights, gradients and optimizer state plus the
# caching allocator's peak) from its step event, in GiB, beside the planner's estimate.
# Run from the repository root with the packed binaries (bench/cuda/pack_for_device.sh) unpacked in
# .cuda-run. Usage: bench/cuda/cp_memory_one_gpu.sh T LIGHTNING_MODE MLA_MODE [CP, default 2]
set -euo pipefail
T=$1 LMODE=$2 MMODE=$3 CP=${4:-2}
dir=$(mktemp -d)
cat > "$dir/job.json" <<JOB
{"name": "cp-memory", "model": {"preset": "1b"}, "data": {"source": "synthetic:recall"},
 "seq_len": $T, "parallel": {"cp": $CP, "lightning_mode": "$LMODE", "mla_mode": "$MMODE"},
 "train": {"steps": 1, "recompute": true}, "resources": "cuda"}
JOB
bin=${SPINDLE_TRAIN_BINARY:-.cuda-run/spindle-train}
for ((r = CP - 1; r >= 1; r--)); do
  "$bin" --job "$dir/job.json" --rank $r --world "$CP" --file-store "$dir/store" > "$dir/rank$r.out" 2>&1 &
done
"$bin" --job "$dir/job.json" --rank 0 --world "$CP" --file-store "$dir/store" > "$dir/rank0.out" 2>&1 || true
wait || true
for ((r = 0; r < CP; r++)); do
  peak=$(grep -o '"mem_peak_bytes": *[0-9]*' "$dir/rank$r.out" | tail -1 | grep -o '[0-9]*$' || true)
  if [ -n "$peak" ]; then
    awk -v p="$peak" -v r=$r -v t=$T -v l=$LMODE -v m=$MMODE \
      'BEGIN {printf "T %d cp modes %s/%s rank %d: peak %.2f GiB\n", t, l, m, r, p / 2^30}'
  else
    echo "T $T modes $LMODE/$MMODE rank $r: no step event"; tail -5 "$dir/rank$r.out"
  fi
done
.cuda-run/spindle plan "$dir/job.json" --device-memory 139.8 2>&1 | grep "memory per rank" || true
rm -rf "$dir"
