#!/usr/bin/env bash
# Packs the CUDA tests and benchmarks built here, and the cluster's binaries (coordinator, worker,
# trainer, CLI), with the non-system shared libraries they need, into .cuda-run/ (listed in
# .git/info/exclude) for a run on the GPU machine, which lacks OpenBLAS, Abseil and Gloo. See
# kernels/cuda/README.md for the run command.
# Usage: bench/cuda/pack_for_device.sh [build dir, default build-cuda]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-cuda}
out=.cuda-run
rm -rf "$out" && mkdir -p "$out/lib"
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >> "$exclude"
bins=()
for bin in tests/cuda/kernels_cuda_test tests/cuda/nccl_comm_test tests/cuda/engine_cuda_test \
           tests/cuda/cluster_cuda_test \
           bench/cuda/bench_kernels_cuda \
           bench/cuda/bench_model_cuda bench/cuda/bench_cp_cuda worker/spindle-train \
           bench/bench_cost_model \
           worker/spindle-worker coordinator/spindle-coordinator cli/spindle; do
  if [ -x "$build/$bin" ]; then
    strip -o "$out/$(basename "$bin")" "$build/$bin"
    bins+=("$out/$(basename "$bin")")
  fi
done
[ ${#bins[@]} -gt 0 ] || { echo "pack_for_device: nothing built under $build" >&2; exit 1; }
# Everything ldd resolves outside libc/libstdc++/libm/libgcc and the CUDA toolkit travels.
ldd "${bins[@]}" | awk '/=> \//{print $3}' | sort -u |
  grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt)\.so|/usr/local/cuda' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
# One xz archive keeps the carried folder small (OpenBLAS alone is 36 MB); the device side unpacks
# it with: tar -C .cuda-run -xJf .cuda-run/run.tar.xz
tar -C "$out" -cf - . | xz -T2 -6 > /tmp/spindle-run.tar.xz
rm -rf "$out" && mkdir -p "$out" && mv /tmp/spindle-run.tar.xz "$out/run.tar.xz"
du -sh "$out"
