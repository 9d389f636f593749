#!/bin/sh
# Issue 40 item 13: under an address-space limit (prlimit --as, ulimit -v) `mxddp train` either runs
# or exits non-zero with an out-of-memory error (or the up-front refusal naming ulimit -v): never a
# signal's death (oneDNN's compiled kernels and OpenMPI crash when they cannot map memory), never
# glibc's "libgcc_s.so.1 must be installed for unwinding" abort, never a hang.
# usage: resource_address_space.sh MXDDP WORKDIR local|mpirun [MPIEXEC (default: mpirun)] [MiB ...]
#   local:  --ranks 2 (ranks as threads of one process), the limit on that process.
#   mpirun: 2 ranks under mpirun, the limit on each rank (mpirun's own daemons are left unlimited:
#           they are OpenMPI's, not mxddp's).
set -u
mxddp=$1 dir=$2 mode=$3 mpiexec=${4:-mpirun}
shift 3; [ $# -gt 0 ] && shift
limits_mib=${*:-"100 150 200 300 500"}
model="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 --global-batch-size 16 --corpus-bytes 65536 --eval-iters 0 --train-iters 2"

command -v prlimit >/dev/null 2>&1 || { echo "resource_address_space: skipped: prlimit (util-linux) is not installed"; exit 77; }
command -v timeout >/dev/null 2>&1 || { echo "resource_address_space: skipped: timeout (coreutils) is not installed"; exit 77; }
case $mode in
  local) launch="" ranks="--ranks 2" ;;
  mpirun) launch="$mpiexec --allow-run-as-root --oversubscribe --bind-to none -np 2" ranks="" ;;
  *) echo "usage: resource_address_space.sh MXDDP WORKDIR local|mpirun [MPIEXEC] [MiB ...]" >&2; exit 2 ;;
esac
rm -rf "$dir" && mkdir -p "$dir" || exit 1

failed=0
for mib in $limits_mib; do
  log="$dir/as_${mib}MiB.log"
  timeout 120 $launch prlimit --as=$((mib * 1024 * 1024)) "$mxddp" train $ranks $model >"$log" 2>&1
  rc=$?
  if [ $rc -eq 124 ]; then
    verdict="FAIL: still running after 120 s (a hang)"
  elif grep -q "libgcc_s" "$log"; then
    verdict="FAIL: glibc's unwinder could not be loaded (rc $rc)"
  elif [ $rc -eq 0 ]; then
    verdict="ran"
  elif [ $rc -ge 128 ]; then
    verdict="FAIL: killed by signal $((rc - 128))"
  elif grep -q "out of memory" "$log"; then
    verdict="out of memory: $(grep -m1 "out of memory" "$log" | cut -c1-200)"
  elif grep -q "(ulimit -v, RLIMIT_AS)" "$log"; then
    verdict="refused up front: $(grep -m1 -o "this run [^:]*" "$log")"
  else
    verdict="FAIL: exit $rc without an out-of-memory message"
  fi
  echo "--as=${mib}MiB, $mode: $verdict"
  case $verdict in FAIL*) failed=1; sed 's/^/    /' "$log" | tail -20 ;; esac
done
[ $failed -eq 0 ] || { echo "resource_address_space ($mode): FAILED"; exit 1; }
echo "resource_address_space ($mode): ok"
