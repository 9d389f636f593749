#!/bin/sh
# CTest's python_dcp_reshard: a torch.distributed.checkpoint (DCP) save of a mxddp model and its
# DistributedOptimizer at dp 2, loaded at dp 1 and at dp 4 (as a DDP and as an FSDP), each
# continuing with the losses of an uninterrupted run at that dp (dcp_job.py checks them).
# usage: run_dcp_reshard.sh VENV MPIEXEC SCRIPT
set -u
venv=$1 mpiexec=$2 script=$3
if ! "$venv/bin/python" -c "import torch.distributed.checkpoint, mxddp.torch.dcp" 2>/dev/null; then
  echo "SKIP: $venv has no torch or mxddp (scripts/setup.sh, then CTest's python_package_install)"
  exit 77
fi
if ! "$venv/bin/python" -c "import sys, mxddp.torch.dcp as d; sys.exit(0 if d.has_checkpointable_tensors() else 1)"; then
  echo "SKIP: $venv's torch has no DCP CheckpointableTensor protocol, which mxddp.torch.dcp needs (it refuses such a torch)"
  exit 77
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
fail() {
  for log in "$dir"/*.log; do [ -e "$log" ] && { echo "--- $log"; tail -n 40 "$log"; }; done
  echo "FAIL: $1"
  exit 1
}
job() {
  np=$1; shift
  timeout 200 "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np "$np" "$venv/bin/python" "$script" "$@"
}

job 2 save "$dir/ckpt" > "$dir/save.log" 2>&1 || fail "the save at dp 2 failed"
grep -q 'saved at dp 2' "$dir/save.log" || fail "the save at dp 2 did not report"
for np in 1 4; do
  job "$np" resume "$dir/ckpt" > "$dir/resume$np.log" 2>&1 || fail "the load at dp $np failed"
  grep -q "resumed at dp $np: OK" "$dir/resume$np.log" || fail "the load at dp $np did not report OK"
  grep -o "resumed at dp $np: OK.*" "$dir/resume$np.log"
done
echo "PASS: saved at dp 2, resumed at dp 1 and 4 with the uninterrupted runs' losses"
