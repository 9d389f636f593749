#!/bin/sh
# CTest's python_rank_raises_in_backward: tests/python/raise_in_backward.py at 2 ranks must end
# with a non-zero status, rank 1's error and the abort notice, well before the script's 60 s
# watchdog timeout (the 50 s limit here would be reached first if the job waited for it).
# usage: run_failing_rank.sh VENV MPIEXEC SCRIPT [SCRIPT_ARG...]
set -u
venv=$1 mpiexec=$2 script=$3
shift 3
if ! "$venv/bin/python" -c "import torch, mxddp.torch" 2>/dev/null; then
  echo "SKIP: $venv has no torch or mxddp (scripts/setup.sh, then CTest's python_package_install)"
  exit 77
fi
out=$(timeout 50 "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np 2 "$venv/bin/python" "$script" "$@" 2>&1)
rc=$?
printf '%s\n' "$out"
[ "$rc" -ne 0 ] || { echo "FAIL: the job exited 0"; exit 1; }
[ "$rc" -ne 124 ] || { echo "FAIL: the job was still running after 50 s"; exit 1; }
printf '%s\n' "$out" | grep -q "rank 1 fails in backward on purpose" || { echo "FAIL: no error from rank 1"; exit 1; }
printf '%s\n' "$out" | grep -q "mxddp: rank 1 raised RuntimeError; ending the job" || { echo "FAIL: no abort notice"; exit 1; }
if printf '%s\n' "$out" | grep -q "rank 0 finished the grad sync"; then echo "FAIL: rank 0 went on"; exit 1; fi
echo "PASS: the job ended with rank 1's error (exit $rc)"
