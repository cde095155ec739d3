#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh), then runs every test through ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cd "${BUILD_DIR:-build}"
ctest --output-on-failure --timeout 900 -j "${CTEST_JOBS:-2}" "$@"
