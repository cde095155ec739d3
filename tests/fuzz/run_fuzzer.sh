#!/usr/bin/env bash
# Runs one libFuzzer target for ctest.
#   run_fuzzer.sh campaign BINARY SEED_DIR WORK_DIR SECONDS
#     fuzzes for SECONDS from the committed seeds (read only) into WORK_DIR (new inputs go
#     there, never into the source tree); a crash fails the test and leaves its input in WORK_DIR.
#   run_fuzzer.sh regressions BINARY DIR
#     runs every committed crash input under DIR once (passes when DIR holds none).
set -euo pipefail
mode="$1" bin="$2"
case "$mode" in
  campaign)
    seeds="$3" work="$4" seconds="$5"
    mkdir -p "$work"
    cd "$work"  # crash-* and leak-* files land here
    exec "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
      "$work" "$seeds"
    ;;
  regressions)
    dir="$3"
    shopt -s nullglob
    inputs=("$dir"/*)
    if [ ${#inputs[@]} -eq 0 ]; then
      echo "no regression inputs under $dir"
      exit 0
    fi
    exec "$bin" -timeout=10 -rss_limit_mb=4096 "${inputs[@]}"
    ;;
  *)
    echo "usage: $0 campaign BINARY SEED_DIR WORK_DIR SECONDS | regressions BINARY DIR" >&2
    exit 2
    ;;
esac
