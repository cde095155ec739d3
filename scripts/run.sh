#!/usr/bin/env bash
# The main job: sets up and builds (scripts/setup.sh), then trains the default long-context job
# (examples/recall-tiny.json: the tiny hybrid model on synthetic key-value recall across 512-token
# gaps) and shows live progress. A re-run resumes from the job's last checkpoint; pass --fresh to
# start over. Any other arguments go to spindle-train.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
JOB=${JOB:-examples/recall-tiny.json}
if [ "${1:-}" = "--fresh" ]; then
  shift
  rm -rf .runtime/checkpoints/recall-tiny
fi
mkdir -p .runtime
./build/worker/spindle-train --job "$JOB" "$@" | ./scripts/progress.py
