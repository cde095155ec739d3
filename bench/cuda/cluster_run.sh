#!/usr/bin/env bash
# Runs a job spec through a whole local cluster on the GPU machine, from the binaries that
# bench/cuda/pack_for_device.sh packed into .cuda-run: spindle-coordinator, one spindle-worker per
# GPU (each offering its GPU), `spindle plan` against the registered workers, `spindle submit`,
# `spindle watch` until the job ends, `spindle status`, and the workers' GPU metrics from their
# /metrics endpoints. What scripts/run.sh does on a machine that can build; this one installs and
# builds nothing. Logs, the database and the checkpoints go under $OUT/cluster (or /tmp/cluster).
# Usage: bench/cuda/cluster_run.sh JOB.json [steps] [checkpoint every]
set -euo pipefail
job=${1:?usage: bench/cuda/cluster_run.sh JOB.json [steps] [checkpoint every]}
source bench/cuda/device_env.sh
out=${OUT:-/tmp}/cluster
rm -rf "$out" && mkdir -p "$out"
port=${SPINDLE_PORT:-7070}
export SPINDLE_COORDINATOR=127.0.0.1:$port

# The spec with its steps and checkpoint interval replaced (when given) and its checkpoints under
# $out.
spec=$out/job.json
python3 - "$job" "$spec" "$out/ckpt" "${2:-}" "${3:-}" <<'EOF'
import json, sys
src, dst, ckpt, steps, every = sys.argv[1:]
spec = json.load(open(src))
spec.setdefault("checkpoint", {})["dir"] = ckpt
if steps:
    spec.setdefault("train", {})["steps"] = int(steps)
if every:
    spec["checkpoint"]["every"] = int(every)
json.dump(spec, open(dst, "w"), indent=2)
EOF

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 2
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

"$R/spindle-coordinator" --listen="127.0.0.1:$port" --db="$out/spindle.db" --metrics_port=0 \
    --heartbeat_interval=1 --heartbeat_timeout=10 --hang_timeout=900 >"$out/coordinator.log" 2>&1 &
pids+=($!)
n=$(nvidia-smi -L | grep -c '^GPU')
for i in $(seq 0 $((n - 1))); do
  CUDA_VISIBLE_DEVICES=$i "$R/spindle-worker" --coordinator="127.0.0.1:$port" \
      --worker_id="gpu-$i" --work_dir="$out/work-$i" --slots=0 --metrics_host=127.0.0.1 \
      --metrics_port=$((9401 + i)) --advertise_host=127.0.0.1 --trainer_binary="$R/spindle-train" \
      --checkpoint_root="$out" --data_root="${DATA_ROOT:-$PWD}" \
      >"$out/worker-$i.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 60); do
  alive=$("$R/spindle" workers --output json --timeout 2 2>/dev/null | grep -o '"state":"alive"' |
          wc -l || true)
  [ "${alive:-0}" -ge "$n" ] && break
  sleep 0.5
done
"$R/spindle" workers
"$R/spindle" plan "$spec"
submitted=$("$R/spindle" submit "$spec")
echo "$submitted"
id=$(echo "$submitted" | sed -n 's/^submitted \(j-[0-9]*\).*/\1/p')
status=0
"$R/spindle" watch "$id" || status=$?
echo
"$R/spindle" status "$id"
for i in $(seq 0 $((n - 1))); do
  echo "== gpu-$i /metrics"
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$((9401 + i))/metrics').read().decode())" |
    grep -E '^spindle_(device_memory_bytes|host_pinned_bytes|tokens_per_second|training_step|loss|mfu|comm_seconds_total|worker_device_memory_bytes)' ||
    true
done
exit "$status"
