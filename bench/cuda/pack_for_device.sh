#!/usr/bin/env bash
# Packs the CUDA kernel tests and benchmark built here (build-cuda, SPINDLE_KERNELS_ONLY=ON) with
# the non-system shared libraries they need into .cuda-run/ (listed in .git/info/exclude), for a
# run on the GPU machine, which lacks OpenBLAS. See kernels/cuda/README.md for the run command.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.cuda-run
rm -rf "$out" && mkdir -p "$out/lib"
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
for bin in build-cuda/tests/cuda/kernels_cuda_test build-cuda/bench/cuda/bench_kernels_cuda; do
  strip -o "$out/$(basename "$bin")" "$bin"
done
# Everything ldd resolves outside libc/libstdc++/libm/libgcc and the CUDA toolkit travels.
ldd "$out"/kernels_cuda_test "$out"/bench_kernels_cuda | awk '/=> \//{print $3}' | sort -u |
  grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt)\.so|/usr/local/cuda' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
du -sh "$out" "$out"/lib/*
