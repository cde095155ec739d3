#!/usr/bin/env bash
# The calls to make first on a machine with several GPUs of one host (the device tool's
# nvidia-h200-x2, -x4 or -x8), each within its 600 s limit:
#   check            every test that needs more than one GPU (they skip the sizes the visible GPUs
#                    do not allow): the NCCL communicator's collectives and all-to-all by pieces
#                    at worlds 2, 4 and 8, the GPU trainer over NCCL, and the cluster's cp = 2 job
#                    on two GPU workers;
#   scale CP_LIST    the context-parallel scaling benchmark of the 1b model at 256K tokens, one
#                    document, every layer recomputing: a cp = 1 row, then each cp of CP_LIST
#                    (e.g. 2,4); each size takes 2-3 minutes (mostly creating the 1B models), so
#                    on eight GPUs run `scale 2,4` and `scale 8 --single 0` in two calls (the
#                    second then has no cp = 1 row of its own: take the first call's).
# Run from the repository root with .cuda-run (bench/cuda/pack_for_device.sh build) carried.
# Usage: bench/cuda/multi_gpu_run.sh check | scale CP_LIST [bench_cp_cuda flags]
set -uo pipefail
source bench/cuda/device_env.sh
date -u +%Y-%m-%dT%H:%MZ
nvidia-smi --query-gpu=index,name --format=csv,noheader
case "${1:-}" in
  check)
    timeout 120 "$R/nccl_comm_test" 2>&1 | grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) '
    timeout 200 "$R/engine_cuda_test" --gtest_filter='CudaTrainerTest.*Nccl*' 2>&1 | tail -3
    timeout 250 "$R/cluster_cuda_test" --gtest_filter='*TwoGpu*' 2>&1 | tail -3
    ;;
  scale)
    [ $# -ge 2 ] || { echo "usage: $0 scale CP_LIST [bench_cp_cuda flags]" >&2; exit 2; }
    cps=$2
    shift 2
    timeout 590 "$R/bench_cp_cuda" --T 262144 --cp "$cps" --warmup 1 --steps 3 "$@"
    ;;
  *)
    echo "usage: $0 check | scale CP_LIST [bench_cp_cuda flags]" >&2
    exit 2
    ;;
esac
date -u +%Y-%m-%dT%H:%MZ
