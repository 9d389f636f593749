#!/bin/sh
# Every output of `mxddp train` is checked at the start on every rank (issue 40 item 12): an output
# one rank cannot write refuses the run before its first iteration, on every rank, naming the rank
# and the path, instead of failing after all the iterations (or never, on a rank that does not
# write it). Under mpirun the ranks' views differ as on two hosts: rank R runs in a mount namespace
# of its own (unshare --mount) where a directory is a read-only bind mount, or where a tmpfs hides
# the --save directory the other rank sees (a path on each host's own disk).
#   proc_report             --ranks 2 --report /proc/NAME (root cannot create files in /proc)
#   readonly_report_rank0   mpirun -np 2; rank 0's --report directory is read-only
#   readonly_metrics_rank1  mpirun -np 2; rank 1's --metrics-file directory is read-only
#   readonly_save_rank1     mpirun -np 2; rank 1's --save directory is read-only
#   unshared_save_rank1     mpirun -np 2; rank 1 sees another directory under the --save path
# Exits 0 when the run is refused as it must be, 1 otherwise (printing why and the output), 77 when
# this machine cannot make mount namespaces (needs root and unshare).
# usage: outputs_checked.sh MXDDP WORKDIR CASE [MPIEXEC (default: mpirun)]
set -u
mxddp=$1
work=$2
case_name=$3
mpiexec=${4:-mpirun}
rm -rf "$work" && mkdir -p "$work/out" || exit 1
train="train --model tiny --train-iters 3 --eval-iters 0 --timeout-ms 60000"
fail() {
  echo "FAIL ($case_name): $*"
  echo "---- output"; cat "$work/run.txt"; exit 1
}
# Runs the job with rank `ns_rank` (0 or 1) inside a mount namespace prepared by `ns_setup`, every
# rank with the same flags.
mpirun_with_namespace() {
  ns_rank=$1 ns_setup=$2
  shift 2
  plain="$mxddp $train $*"
  inside="unshare --mount sh -c '$ns_setup && exec $plain'"
  if [ "$ns_rank" = 0 ]; then first=$inside second=$plain; else first=$plain second=$inside; fi
  eval "timeout 120 $mpiexec --allow-run-as-root --oversubscribe --bind-to none -np 1 $first : -np 1 $second" \
    > "$work/run.txt" 2>&1
}
readonly_bind() { echo "mount --bind $1 $1 && mount -o remount,ro,bind $1"; }

if [ "$case_name" != proc_report ]; then
  [ "$(id -u)" = 0 ] || { echo "SKIP: mount namespaces need root (uid $(id -u))"; exit 77; }
  unshare --mount sh -c "mount -t tmpfs tmpfs $work/out" 2> /dev/null ||
    { echo "SKIP: 'unshare --mount' and mount are not permitted here"; exit 77; }
fi

# Each branch runs the job last, so that the case's status is the job's.
case $case_name in
  proc_report)
    target=/proc/mxddp_outputs_checked_$$.json
    expect="--report '$target' cannot be written: a file cannot be created in /proc"
    # shellcheck disable=SC2086
    timeout 120 "$mxddp" $train --ranks 2 --report "$target" > "$work/run.txt" 2>&1 ;;
  readonly_report_rank0)
    expect="rank 0: .*--report '$work/out/report.json' cannot be written: a file cannot be created in $work/out (Read-only file system)"
    mpirun_with_namespace 0 "$(readonly_bind "$work/out")" --report "$work/out/report.json" ;;
  readonly_metrics_rank1)
    expect="rank 1: .*--metrics-file '$work/out/metrics.jsonl' cannot be written: a file cannot be created in $work/out (Read-only file system)"
    mpirun_with_namespace 1 "$(readonly_bind "$work/out")" --metrics-file "$work/out/metrics.jsonl" ;;
  readonly_save_rank1)
    expect="rank 1: .*--save '$work/out/ck' cannot be written by this rank (Read-only file system)"
    mkdir -p "$work/out/ck" && mpirun_with_namespace 1 "$(readonly_bind "$work/out/ck")" --save "$work/out/ck" ;;
  unshared_save_rank1)
    expect="rank 1: .*--save '$work/out/ck' is not the directory rank 0 saves to: rank 0 has just written its lock file '$work/out/ck/mxddp.lock' ('[^']*'), and this rank cannot open it (No such file or directory)\. Every rank writes its own part of each checkpoint into --save, so it must be one directory shared by every rank's host"
    mpirun_with_namespace 1 "mount -t tmpfs tmpfs $work/out" --save "$work/out/ck" ;;
  *) echo "outputs_checked.sh: unknown case '$case_name'" >&2; exit 2 ;;
esac
rc=$?
[ $rc -ne 0 ] || fail "the run was not refused (exit status 0)"
[ $rc -ne 124 ] || fail "the run did not end within 120 s"
grep -q -- "$expect" "$work/run.txt" || fail "no error matching: $expect"
! grep -q "^ iteration" "$work/run.txt" || fail "the run trained before refusing"
if [ -e "$work/out/report.json" ] || [ -e "$work/out/ck/iter_0000003" ]; then fail "an output was written"; fi
echo "PASS ($case_name): refused before the first iteration"
