#!/usr/bin/env bash
# The main job: builds mxddp and runs a multi-rank job on the in-process (local) backend.
# Until the training job lands this is the collective self-check on 4 ranks; extra arguments go
# to `mxddp selfcheck` (e.g. --ranks 8).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh release
./build/release/mxddp selfcheck --ranks 4 "$@"
