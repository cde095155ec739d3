#!/usr/bin/env bash
# Installs the Debian packages Spindle builds and tests with (idempotent, quiet when everything is
# already there), then configures and builds into build/ (CUDA targets too when nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(build-essential cmake ninja-build ccache pkg-config git
          libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
          libgloo-dev libsqlite3-dev libopenblas-dev nlohmann-json3-dev libcpp-httplib-dev
          zlib1g-dev libssl-dev libgtest-dev libgmock-dev prometheus openssl python3 python3-torch
          iproute2 clang libclang-rt-14-dev)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${SPINDLE_CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
