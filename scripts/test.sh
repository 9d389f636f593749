#!/usr/bin/env bash
# The whole test suite: builds the given preset (release by default; asan or tsan for the
# sanitizer builds) and runs every test through CTest, the mpirun suites included.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
preset="${1:-release}"
source scripts/setup.sh "$preset" --tests
ctest --preset "$preset" -j2
