#!/bin/sh
# The MPI watchdog end to end: a job with a stalled rank must end on its own, within its timeout
# plus a few seconds, with a non-zero exit and a message naming the collective, its sequence number
# and the rank waited on; and no process of it may outlive it.
#
#   mpi_stall.sh sigstop MPIEXEC MXDDP DIR      mxddp train on 2 ranks, --timeout-ms 3000; rank 1
#                                               is stopped (SIGSTOP) once training has started
#   mpi_stall.sh skip[_unchecked] MPIEXEC PROG DIR
#                                               tests/comm/mpi_watchdog_skip.cc on 3 ranks (timeout
#                                               1000 ms): rank 2 skips barrier #2
#
# Prints "stall ended after S s" on success. Without the watchdog the job never ends by itself;
# this script gives up after the bound, kills it and fails.
set -u
mode=$1 mpiexec=$2 prog=$3 dir=$4
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
rm -rf "$dir" && mkdir -p "$dir" || exit 1
out=$dir/stdout err=$dir/stderr

mpirun_pid= rank_pids=
# Whatever happens, nothing of the job survives the test: a stopped rank is continued and killed.
cleanup() {
  [ -n "$mpirun_pid" ] && find_rank_pids
  for p in $rank_pids; do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  [ -n "$mpirun_pid" ] && kill -KILL "$mpirun_pid" 2>/dev/null
  return 0
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

fail() {
  echo "FAIL: $*"
  # The tails only: mxddp's progress bar (mpirun hands ranks a terminal) is one long line.
  echo "--- stdout"; tail -c 2000 "$out"; echo; echo "--- stderr"; tail -c 4000 "$err"
  exit 1
}
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

# The job's rank processes (mpirun's children here; OpenMPI starts local ranks itself) by rank.
find_rank_pids() {
  rank_pids=
  for status in /proc/[0-9]*/status; do
    p=${status#/proc/}; p=${p%/status}
    ppid=$(awk '/^PPid:/ {print $2}' "$status" 2>/dev/null)
    [ "$ppid" = "$mpirun_pid" ] && rank_pids="$rank_pids $p"
  done
}
pid_of_rank() {
  for p in $rank_pids; do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1" && { echo "$p"; return; }
  done
}

launch() {  # np, then the command
  np=$1; shift
  "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np "$np" "$@" > "$out" 2> "$err" &
  mpirun_pid=$!
}

# Waits for the job to end within bound_ms of start_ms; sets rc.
await_end() {
  start_ms=$1 bound_ms=$2
  while kill -0 "$mpirun_pid" 2>/dev/null; do
    [ $(( $(now_ms) - start_ms )) -gt "$bound_ms" ] && fail "the job still runs $((bound_ms / 1000)) s after the stall"
    sleep 0.1
  done
  wait "$mpirun_pid"; rc=$?
  elapsed_ms=$(( $(now_ms) - start_ms ))
  mpirun_pid=
}

case $mode in
  sigstop)
    launch 2 "$prog" train --backend mpi --timeout-ms 3000 --train-iters 1000000 --eval-iters 0 \
      --global-batch-size 16 --micro-batch-size 2 --seq-length 32 --num-layers 2 --hidden-size 64 \
      --num-attention-heads 4
    # Training has started once rank 0 reports an iteration's loss (a plain line: under mpirun the
    # output is a log, whatever terminal mpirun hands the ranks).
    t0=$(now_ms)
    until grep -q "lm loss: [0-9]" "$out" 2>/dev/null; do
      kill -0 "$mpirun_pid" 2>/dev/null || fail "the job ended before training started"
      [ $(( $(now_ms) - t0 )) -gt 120000 ] && fail "training did not start within 120 s"
      sleep 0.1
    done
    find_rank_pids
    victim=$(pid_of_rank 1)
    [ -n "$victim" ] || fail "no process of rank 1 among mpirun's children ($rank_pids)"
    kill -STOP "$victim"
    start=$(now_ms)
    await_end "$start" 30000
    [ "$rc" -ne 0 ] || fail "the job exited 0 after rank 1 was stopped"
    grep -Eq "mpi watchdog: rank 0: [a-z_]+ #[0-9]+ made no progress for 3000 ms \(timeout_ms\); waiting on rank\(s\) 1:" "$err" \
      || fail "no watchdog message naming the collective, its sequence number and rank 1"
    # mpirun has returned; its ranks must be gone too (a zombie awaiting its reaper counts as gone).
    t0=$(now_ms)
    while state=$(awk '/^State:/ {print $2}' "/proc/$victim/status" 2>/dev/null) && [ -n "$state" ] && [ "$state" != Z ]; do
      [ $(( $(now_ms) - t0 )) -gt 5000 ] && fail "rank 1 (pid $victim, state $state) outlived the job by 5 s"
      sleep 0.1
    done
    ;;
  skip|skip_unchecked)
    # Ranks 0 and 1 both time out; the first to abort may kill the other before it prints, so
    # either one's message counts. With the exchange each names rank 2 only; without, its peers.
    if [ "$mode" = skip ]; then
      launch 3 "$prog"; expect="waiting on rank\(s\) 2: these ranks have not reached it"
    else
      launch 3 "$prog" unchecked; expect="waiting on rank\(s\) [01], 2: arrival is not tracked"
    fi
    start=$(now_ms)
    await_end "$start" 30000
    [ "$rc" -ne 0 ] || fail "the job exited 0 although rank 2 skipped barrier #2"
    grep -q "rank 0: all_reduce #1 gave 3" "$out" || fail "all_reduce #1 (rank 2 late within the timeout) did not complete"
    grep -Eq "mpi watchdog: rank [01]: barrier #2 made no progress for 1000 ms \(timeout_ms\); $expect" "$err" \
      || fail "no watchdog message naming barrier #2 and: $expect"
    grep -q "all_reduce #1 made no progress" "$err" && fail "the late arrival at all_reduce #1 tripped the watchdog"
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
echo "stall ended after $((elapsed_ms / 1000)).$(printf %03d $((elapsed_ms % 1000))) s (exit status $rc)"
