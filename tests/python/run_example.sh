#!/bin/sh
# CTest's python_example_*: an example from examples/ as docs/python.md launches it, at 2 ranks;
# it must exit 0 and print EXPECT (a grep -E pattern).
# usage: run_example.sh VENV MPIEXEC EXPECT SCRIPT [ARGS...]
set -eu
venv=$1 mpiexec=$2 expect=$3
shift 3
if ! "$venv/bin/python" -c "import torch, transformers, mxddp.torch" 2>/dev/null; then
  echo "SKIP: $venv has no torch, transformers or mxddp (scripts/setup.sh, then CTest's python_package_install)"
  exit 77
fi
out=$("$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np 2 "$venv/bin/python" "$@" 2>&1)
printf '%s\n' "$out"
printf '%s\n' "$out" | grep -Eq "$expect" || { echo "FAIL: the output has no line matching '$expect'"; exit 1; }
