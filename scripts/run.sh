#!/usr/bin/env bash
# The main job: builds mxddp and trains the reference GPT (the `tiny` preset on the built-in
# corpus, 300 iterations) on 4 in-process ranks with overlapped gradient reduce-scatter and param
# all-gather, writing a JSON report to build/release/train_report.json. Extra arguments go to
# `mxddp train` (e.g. --ranks 2 --train-iters 100, or --model small).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh release
./build/release/mxddp train --ranks 4 --overlap-grad-reduce --ddp-bucket-size 40000 --overlap-param-gather \
  --report build/release/train_report.json "$@"
