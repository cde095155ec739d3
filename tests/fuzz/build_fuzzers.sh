#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ with clang (-fsanitize=fuzzer,address,undefined,
# -O1) into DIR (default build/fuzz): a second, small CMake build of only the sources the
# targets need, beside the main g++ build. Used by ctest's fuzz_build test; JOBS sets the
# parallelism (default: the number of cores).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:-$here/../../build/fuzz}"
clangxx="$(command -v clang++ || command -v clang++-14)"
clang="$(command -v clang || command -v clang-14)"
if [ ! -f "$dir/build.ninja" ]; then
  cmake -S "$here" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=None \
    -DCMAKE_C_COMPILER="$clang" -DCMAKE_CXX_COMPILER="$clangxx" >/dev/null
fi
cmake --build "$dir" -j "${JOBS:-$(nproc)}"
