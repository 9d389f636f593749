#!/bin/sh
# Network faults between simulated hosts (issue 27 point 4), 2 hosts x 2 ranks of mxddp train over
# scripts/multihost:
#
#   link_fault.sh MXDDP DIR down      host 1's link is taken down (ip link set down, inside its
#   link_fault.sh MXDDP DIR loss100   namespace) or drops every packet (tc), mid-run, after a save
#       The whole job ends within --timeout-ms + 20 s: mpirun exits non-zero, and no process is left
#       in either host's namespace (ranks and OpenMPI's daemons, which run detached from mpirun as
#       on remote hosts). A reachable rank's watchdog message names the collective and the ranks.
#       The last checkpoint is intact: resumed on the healthy host alone (4 ranks on host 0), the
#       iterations after it have bitwise the losses of an uninterrupted run.
#   link_fault.sh MXDDP DIR loss1     1% packet loss on every link, both ways: the same losses,
#                                     bitwise, as the run without loss (the slow-down is not
#                                     measured here: docs/multihost.md, Faults, gives it and the
#                                     harness command that measured it)
#
# Exits 77 (skipped) where network namespaces cannot be made, saying why.
set -u
mxddp=$1 dir=$2 mode=$3
MH_SELF_DIR=$(cd "$(dirname "$0")/../../scripts/multihost" && pwd)
. "$MH_SELF_DIR/netns_lib.sh"
mh_check_capable
# Keepalive slower than the watchdog's timeout (5 s), so that the watchdog speaks first: it is the
# only one that names the collective. Its MPI_Abort then reaches the cut-off host's daemon through
# TCP's retransmission limit (tcp_retries2 4, about 6 s). With the harness's default keepalive (5
# s) OpenMPI alone may end the job first, naming the lost host instead.
export MH_KEEPALIVE_S=${MH_KEEPALIVE_S:-10} MH_KEEPALIVE_INTVL_S=${MH_KEEPALIVE_INTVL_S:-3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MH_LAUNCH_TIMEOUT_S=120  # each job's bound (ends it as a failure, torn down, not a CTest kill)
timeout_ms=5000
bound_ms=$((timeout_ms + 20000))
mpirun_pid=
trap 'mh_teardown' EXIT
trap 'exit 1' INT TERM HUP
rm -rf "$dir" && mkdir -p "$dir" || exit 1

fail() {
  echo "FAIL: $*"
  for f in "$dir"/*.err; do [ -s "$f" ] && { echo "--- $f"; tail -c 3000 "$f"; }; done
  exit 1
}
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
# The losses of a metrics file from iteration $2 on, one "type iteration loss" a line.
losses() {
  sed -n 's/.*"iteration":\([0-9]*\).*"lm_loss":\([^,}]*\).*"type":"\([a-z]*\)".*/\3 \1 \2/p' "$1" \
    | awk -v from="${2:-1}" '$2 >= from'
}
last_iteration() { losses "$1" | awk '$1 == "iteration" { n = $2 } END { print n + 0 }'; }

# A constant learning rate after a warm-up of 2: iteration k's update does not depend on
# --train-iters, so a run of any length is the same run.
job="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2
     --global-batch-size 8 --corpus-bytes 65536 --eval-iters 0 --lr-warmup-iters 2 --lr-decay-style constant
     --timeout-ms $timeout_ms"

mh_setup 2 || fail "could not make the simulated hosts"

case $mode in
  loss1)
    # shellcheck disable=SC2086
    mh_mpirun 2 "$mxddp" train --backend mpi $job --train-iters 6 --metrics-file "$dir/clean.jsonl" \
      > "$dir/clean.out" 2> "$dir/clean.err" || fail "the run without loss exited $?"
    mh_shape 0 none 1 && mh_shape 1 none 1 || fail "could not shape the links"
    # shellcheck disable=SC2086
    mh_mpirun 2 "$mxddp" train --backend mpi $job --train-iters 6 --metrics-file "$dir/lossy.jsonl" \
      > "$dir/lossy.out" 2> "$dir/lossy.err" || fail "the run with 1% loss exited $?"
    dropped=$(tc -n "$(mh_host 1)" -s qdisc show dev eth0 | awk '/parent 1:2/ { getline; for (i = 1; i < NF; ++i) if ($i == "(dropped") print $(i + 1) }' | tr -d ,)
    [ "${dropped:-0}" -gt 0 ] || fail "host 1's link dropped no packet: the loss was not applied"
    losses "$dir/clean.jsonl" > "$dir/clean.losses"
    losses "$dir/lossy.jsonl" > "$dir/lossy.losses"
    [ "$(grep -c . "$dir/clean.losses")" -eq 6 ] || fail "the run without loss logged no 6 losses"
    cmp -s "$dir/clean.losses" "$dir/lossy.losses" || { paste "$dir/clean.losses" "$dir/lossy.losses"; fail "1% loss changed the losses"; }
    echo "1% loss: 6 losses bitwise the same; host 1's link dropped $dropped packets"
    exit 0
    ;;
  down|loss100) ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac

# The faulted run: saves every 2 iterations, cut once a save is done and training went on past it.
ckpt=$dir/ckpt
# shellcheck disable=SC2086
mh_mpirun 2 "$mxddp" train --backend mpi $job --train-iters 100000 --save "$ckpt" --save-interval 2 \
  --metrics-file "$dir/faulted.jsonl" > "$dir/faulted.out" 2> "$dir/faulted.err" &
mpirun_pid=$!
t0=$(now_ms)
until [ -s "$ckpt/latest_checkpointed_iteration.txt" ] &&
      [ "$(last_iteration "$dir/faulted.jsonl")" -gt "$(cat "$ckpt/latest_checkpointed_iteration.txt")" ]; do
  kill -0 "$mpirun_pid" 2>/dev/null || fail "the run ended before its first save"
  [ $(( $(now_ms) - t0 )) -gt 120000 ] && fail "no save within 120 s"
  sleep 0.1
done
ranks_h1=$(ip netns pids "$(mh_host 1)" | wc -l)
[ "$ranks_h1" -ge 3 ] || fail "host 1's namespace holds $ranks_h1 processes (its daemon and 2 ranks expected)"
if [ "$mode" = down ]; then
  mh_link_down 1 || fail "could not take host 1's link down"
else
  mh_shape 1 none 100 || fail "could not shape host 1's link"
fi
start=$(now_ms)
cut_at=$(last_iteration "$dir/faulted.jsonl")
while kill -0 "$mpirun_pid" 2>/dev/null; do
  [ $(( $(now_ms) - start )) -gt "$bound_ms" ] && fail "mpirun still runs $((bound_ms / 1000)) s after the link failed"
  sleep 0.1
done
wait "$mpirun_pid"; rc=$?
mpirun_pid=
mpirun_ms=$(( $(now_ms) - start ))
[ "$rc" -ne 0 ] || fail "mpirun exited 0 after the link failed"
# Every process of the job, on both hosts, is gone (the cut-off host's daemon and ranks end by
# themselves: nothing here or in mpirun can signal them).
for i in 0 1; do
  while [ -n "$(ip netns pids "$(mh_host "$i")")" ]; do
    [ $(( $(now_ms) - start )) -gt "$bound_ms" ] \
      && fail "host $i still runs $(ip netns pids "$(mh_host "$i")" | xargs ps -o comm= -p | tr '\n' ' ')$((bound_ms / 1000)) s after the link failed"
    sleep 0.1
  done
done
all_ms=$(( $(now_ms) - start ))
grep -Eq "mpi watchdog: rank [01]: [a-z_]+ #[0-9]+ made no progress for $timeout_ms ms \(timeout_ms\); waiting on rank\(s\) [0-9, ]*[23]" "$dir/faulted.err" \
  || fail "no watchdog message from a rank of host 0 naming the collective and ranks 2 or 3 of host 1"

# The checkpoint: resumed on host 0 alone, with the 4 ranks it had on 2 hosts, to 6 iterations past
# the cut (how far the run got before the cut depends on the machine's speed).
saved=$(cat "$ckpt/latest_checkpointed_iteration.txt")
end=$((cut_at + 6))
mh_hostfile 0 > "$dir/healthy_hosts"
# The reference: an uninterrupted run to $end, on host 0's 4 ranks (2 hosts x 2 ranks train bitwise as
# 4 ranks on one host: multihost_same_results).
# shellcheck disable=SC2086
MH_HOSTFILE=$dir/healthy_hosts mh_mpirun 4 "$mxddp" train --backend mpi $job --train-iters "$end" \
  --metrics-file "$dir/reference.jsonl" > "$dir/reference.out" 2> "$dir/reference.err" || fail "the reference run exited $?"
# shellcheck disable=SC2086
MH_HOSTFILE=$dir/healthy_hosts mh_mpirun 4 "$mxddp" train --backend mpi $job --train-iters "$end" --load "$ckpt" \
  --metrics-file "$dir/resumed.jsonl" > "$dir/resumed.out" 2> "$dir/resumed.err" || fail "the resume exited $?"
grep -q "resuming from" "$dir/resumed.out" || fail "the resume did not say it resumed"
losses "$dir/reference.jsonl" $((saved + 1)) > "$dir/reference.after"
losses "$dir/resumed.jsonl" $((saved + 1)) > "$dir/resumed.after"
[ "$(grep -c . "$dir/resumed.after")" -eq $((end - saved)) ] || fail "the resume logged no iterations $((saved + 1))..$end"
cmp -s "$dir/reference.after" "$dir/resumed.after" \
  || { paste "$dir/reference.after" "$dir/resumed.after"; fail "the resume from iteration $saved differs from the uninterrupted run"; }
# The faulted run itself was the same run up to the cut.
losses "$dir/reference.jsonl" | awk -v to="$cut_at" '$2 <= to' > "$dir/reference.before"
losses "$dir/faulted.jsonl" | awk -v to="$cut_at" '$2 <= to' > "$dir/faulted.before"
cmp -s "$dir/reference.before" "$dir/faulted.before" || fail "the faulted run differed from the reference before the cut"
echo "link $mode at iteration $cut_at (saved $saved): mpirun exited $rc after $((mpirun_ms / 1000)).$(printf %03d $((mpirun_ms % 1000))) s, every process of both hosts gone after $((all_ms / 1000)).$(printf %03d $((all_ms % 1000))) s (bound $((bound_ms / 1000)) s); resumed on host 0 from iteration $saved: iterations $((saved + 1))..$end bitwise as the uninterrupted run"
