#!/usr/bin/env bash
# One device call: the CUDA kernel tests, Spindle's kernel benchmark and the peer's kernel benchmark
# (FLA chunk_simple_gla, PyTorch SDPA) side by side on the same GPU. Run from the repository root
# on the GPU machine with .cuda-run (bench/cuda/pack_for_device.sh) and .peer (see
# /work/shared/peer/README.md) carried. Writes its outputs under $OUT when set.
# Usage: bench/cuda/device_run.sh [gtest filter] [racecheck filter]
set -uo pipefail
out=${OUT:-/tmp}
export LD_LIBRARY_PATH=$PWD/.cuda-run/lib:/usr/local/cuda/lib64
date -u +%Y-%m-%dT%H:%MZ
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
echo "== tests"
timeout 240 .cuda-run/kernels_cuda_test --gtest_brief=1 --gtest_filter="${1:-*}" 2>&1 | tail -80
echo "== spindle kernel bench"
timeout 150 .cuda-run/bench_kernels_cuda 2>&1 | tee "$out/bench_spindle.txt"
echo "== peer kernel bench"
timeout 200 python3 .peer/kernel_bench.py > "$out/peer.txt" 2>&1
tail -70 "$out/peer.txt"
if [ -n "${2:-}" ]; then
  echo "== racecheck $2"
  timeout 90 compute-sanitizer --tool racecheck .cuda-run/kernels_cuda_test --gtest_filter="$2" 2>&1 | tail -6
fi
