#!/usr/bin/env bash
# The main job, through the cluster: sets up and builds (scripts/setup.sh), starts a local Spindle
# cluster (spindle-coordinator and two spindle-worker daemons; the GPUs when there are any, else
# CPU slots), submits examples/recall-tiny.json with `spindle submit`, shows it live with
# `spindle watch` to the end, prints the final state and stops the daemons on exit.
# Every port speaks TLS: the coordinator's CA (made at its first start, .runtime/spindle.db.ca.pem)
# signs each worker's certificate when it joins with a bootstrap token (one hour, two joins), and
# the CLI holds the token of a user named after you, an admin (.runtime/users).
# State lives in .runtime/ (database, logs, worker directories, checkpoints). A re-run stops any
# daemons a previous run left behind, starts a fresh database and resubmits; the job resumes from
# its last checkpoint, or starts over when that is its final step. --fresh deletes the checkpoints
# first.
#   ./scripts/run.sh [--fresh]        environment: JOB (spec file), SPINDLE_PORT (default 7070),
#                                     CHECKPOINT_ROOT (default .runtime/checkpoints) and DATA_ROOT
#                                     (default the repository): the workers refuse a job whose
#                                     checkpoint.dir or data file lies outside them
set -euo pipefail
cd "$(dirname "$0")/.."

FRESH=0
for arg in "$@"; do
  case $arg in
    --fresh) FRESH=1 ;;
    *) echo "usage: scripts/run.sh [--fresh]" >&2; exit 2 ;;
  esac
done


JOB=${JOB:-examples/recall-tiny.json}
PORT=${SPINDLE_PORT:-7070}
BUILD=${BUILD_DIR:-build}
RUNTIME=$PWD/.runtime
PIDS=$RUNTIME/pids
LOGS=$RUNTIME/logs
export SPINDLE_COORDINATOR=127.0.0.1:$PORT
SPINDLE=$BUILD/cli/spindle
mkdir -p "$PIDS" "$LOGS"

# Stops the daemon whose pid is in $1 if it is still one of ours: SIGTERM, then SIGKILL after 15 s.
stop_daemon() {
  local file=$1 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if [ -n "$pid" ] && grep -q "spindle-" "/proc/$pid/cmdline" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 150); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}
stop_all() {
  # Workers first (they stop their trainers), then the coordinator.
  stop_daemon "$PIDS/worker-0.pid"
  stop_daemon "$PIDS/worker-1.pid"
  stop_daemon "$PIDS/coordinator.pid"
}
on_exit() {
  local code=$?
  trap - EXIT INT TERM
  echo "run: stopping the cluster (logs in .runtime/logs/)"
  stop_all
  exit "$code"
}

stop_all  # whatever a previous run left behind, before it trains on while this one builds
./scripts/setup.sh
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

rm -f "$RUNTIME"/spindle.db "$RUNTIME"/spindle.db-wal "$RUNTIME"/spindle.db-shm
rm -rf "$RUNTIME/workers"
# The job's checkpoint directory and steps, from the spec.
read -r CKPT STEPS WORLD < <(python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))
p = s.get("parallel", {})
print(s.get("checkpoint", {}).get("dir", ""), s.get("train", {}).get("steps", 100),
      p.get("cp", 1) * p.get("dp", 1))' "$JOB")
if [ -n "$CKPT" ] && [ -f "$CKPT/latest" ]; then
  last=$(sed -n 's/.*step_0*\([0-9][0-9]*\).*/\1/p' "$CKPT/latest")
  if [ "$FRESH" = 0 ] && [ "${last:-0}" -ge "$STEPS" ]; then
    echo "run: $CKPT is already at the last step ($STEPS); training again from the start"
    FRESH=1
  elif [ "$FRESH" = 0 ]; then
    echo "run: resuming from the checkpoint at step ${last:-0} in $CKPT (--fresh starts over)"
  fi
fi
if [ "$FRESH" = 1 ] && [ -n "$CKPT" ]; then
  rm -rf "$CKPT"
fi

# Devices: split the GPUs between the two workers (both share one GPU when there is only one);
# without GPUs each worker offers one CPU slot, and the job's ranks here share the cores.
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
RESOURCES=cpu
WORKER_ENV=("" "")
LOCAL_RANKS=$(( WORLD < 2 ? 1 : 2 ))
THREADS=$(( $(nproc) / LOCAL_RANKS ))
WORKER_FLAGS=(--slots=1 "--cpu_threads_per_slot=$(( THREADS < 1 ? 1 : THREADS ))")
if [ "${NGPU:-0}" -ge 1 ] && grep -q '^CMAKE_CUDA_COMPILER:[A-Z]*=/' "$BUILD/CMakeCache.txt" 2>/dev/null; then
  RESOURCES=cuda
  WORKER_FLAGS=(--slots=0)
  if [ "$NGPU" -ge 2 ]; then
    half=$(( NGPU / 2 ))
    WORKER_ENV=("CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((half - 1)))"
                "CUDA_VISIBLE_DEVICES=$(seq -s, "$half" $((NGPU - 1)))")
  else
    WORKER_ENV=("CUDA_VISIBLE_DEVICES=0" "CUDA_VISIBLE_DEVICES=0")
  fi
fi

CHECKPOINT_ROOT=${CHECKPOINT_ROOT:-$RUNTIME/checkpoints}
DATA_ROOT=${DATA_ROOT:-$PWD}
mkdir -p "$CHECKPOINT_ROOT"

# Credentials: a user token (kept across runs), and a fresh bootstrap token for the two workers.
random_token() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
umask 077
if [ ! -s "$RUNTIME/users" ]; then
  echo "$(random_token) $(id -un | tr -c 'A-Za-z0-9._@\n-' _) admin" >"$RUNTIME/users"
fi
SPINDLE_TOKEN=$(cut -d' ' -f1 "$RUNTIME/users")
export SPINDLE_TOKEN
BOOTSTRAP=$(random_token)
echo "$BOOTSTRAP" >"$RUNTIME/bootstrap-token"
echo "$BOOTSTRAP $(date -u -d '+1 hour' +%Y-%m-%dT%H:%M:%SZ) 2" >"$RUNTIME/bootstrap-tokens"
umask 022
export SPINDLE_TLS_CA=$RUNTIME/spindle.db.ca.pem

"$BUILD/coordinator/spindle-coordinator" --listen="127.0.0.1:$PORT" --db="$RUNTIME/spindle.db" \
    --users_file="$RUNTIME/users" --bootstrap_token_file="$RUNTIME/bootstrap-tokens" \
    --metrics_port=0 --heartbeat_interval=1 --heartbeat_timeout=10 --hang_timeout=300 \
    >"$LOGS/coordinator.log" 2>&1 &
echo $! >"$PIDS/coordinator.pid"
# Workers start once the coordinator serves (it writes its CA, at the first start, before).
for _ in $(seq 100); do
  grep -q "serving clients" "$LOGS/coordinator.log" 2>/dev/null && break
  kill -0 "$(cat "$PIDS/coordinator.pid")" 2>/dev/null || break
  sleep 0.1
done
for i in 0 1; do
  env ${WORKER_ENV[$i]} "$BUILD/worker/spindle-worker" --coordinator="127.0.0.1:$PORT" \
      --worker_id="local-$i" --work_dir="$RUNTIME/workers/local-$i" --metrics_port=0 \
      --metrics_host=127.0.0.1 --advertise_host=127.0.0.1 --probe_rates=true "${WORKER_FLAGS[@]}" \
      --checkpoint_root="$CHECKPOINT_ROOT" --data_root="$DATA_ROOT" \
      --tls_ca_file="$SPINDLE_TLS_CA" --bootstrap_token_file="$RUNTIME/bootstrap-token" \
      >"$LOGS/worker-$i.log" 2>&1 &
  echo $! >"$PIDS/worker-$i.pid"
done

# Wait (up to 60 s) until both workers are registered.
for _ in $(seq 120); do
  alive=$("$SPINDLE" workers --output json --timeout 2 2>/dev/null | grep -o '"state":"alive"' | wc -l || true)
  [ "${alive:-0}" -ge 2 ] && break
  for f in coordinator worker-0 worker-1; do
    if ! kill -0 "$(cat "$PIDS/$f.pid")" 2>/dev/null; then
      echo "run: $f exited; its log (.runtime/logs/$f.log) ends with:" >&2
      tail -n 20 "$LOGS/$f.log" >&2
      if grep -q "cannot listen on 127.0.0.1:$PORT" "$LOGS/$f.log"; then
        echo "run: another program holds port $PORT; choose a free one with SPINDLE_PORT=<port>" >&2
      fi
      exit 1
    fi
  done
  sleep 0.5
done
"$SPINDLE" workers

SPEC=$JOB
if [ "$RESOURCES" != cpu ]; then
  # On the GPUs: the same job with resources "cuda" (its ranks share the GPUs the workers offer).
  SPEC=$RUNTIME/job.json
  python3 - "$JOB" "$SPEC" "$RESOURCES" <<'EOF'
import json, sys
spec = json.load(open(sys.argv[1]))
spec["resources"] = sys.argv[3]
json.dump(spec, open(sys.argv[2], "w"), indent=2)
EOF
fi
out=$("$SPINDLE" submit "$SPEC")
echo "$out"
id=$(echo "$out" | sed -n 's/^submitted \(j-[0-9]*\).*/\1/p')
[ -n "$id" ] || { echo "run: could not read the job id" >&2; exit 1; }

status=0
"$SPINDLE" watch "$id" || status=$?
echo
"$SPINDLE" status "$id"
exit "$status"
