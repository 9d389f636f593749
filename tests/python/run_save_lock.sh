#!/bin/sh
# CTest's python_save_lock_two_jobs: two mpirun jobs of save_lock_job.py saving into one history.
# Job A saves iteration 1 and waits; job B's save there must be refused on both ranks, naming the
# directory and A's rank 0 (its pid); A then saves 2 and 3 and ends, which releases the lock (the
# file is gone); job C loads A's iteration 3 (A's values, bit for bit) and saves 4 there.
# usage: run_save_lock.sh VENV MPIEXEC SCRIPT
set -u
venv=$1 mpiexec=$2 script=$3
if ! "$venv/bin/python" -c "import torch, mxddp.torch" 2>/dev/null; then
  echo "SKIP: $venv has no torch or mxddp (scripts/setup.sh, then CTest's python_package_install)"
  exit 77
fi
dir=$(mktemp -d) || exit 1
a_pid=
cleanup() {
  [ -z "$a_pid" ] || kill "$a_pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  for log in "$dir"/*.log; do echo "--- $log"; cat "$log"; done
  echo "FAIL: $1"
  exit 1
}
job() { timeout 150 "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np 2 "$venv/bin/python" "$script" "$@"; }
hist=$dir/history

job hold "$hist" "$dir/ready" "$dir/go" "$dir/a_params.pt" > "$dir/a.log" 2>&1 &
a_pid=$!
n=0
while [ ! -s "$dir/ready" ] && [ $n -lt 1200 ] && kill -0 "$a_pid" 2>/dev/null; do sleep 0.1; n=$((n + 1)); done
[ -s "$dir/ready" ] || fail "job A did not save its first checkpoint"
holder=$(cat "$dir/ready")

job intrude "$hist" > "$dir/b.log" 2>&1
b_rc=$?
touch "$dir/go"
wait "$a_pid"
a_rc=$?
a_pid=
[ "$b_rc" -eq 0 ] || fail "job B exited $b_rc: its save was not refused on every rank"
for r in 0 1; do
  # Not anchored at a line start: mpirun may still splice the two ranks' lines together.
  grep -q "rank $r refused: .*save directory '$hist' is being written by another live run (pid $holder on host" \
    "$dir/b.log" || fail "rank $r of job B was not refused naming '$hist' and job A's pid $holder"
done
[ "$a_rc" -eq 0 ] || fail "job A exited $a_rc"
[ ! -e "$hist/mxddp.lock" ] || fail "job A ended but left $hist/mxddp.lock"
listing=$(ls "$hist" | tr '\n' ' ')
[ "$listing" = "iter_0000001 iter_0000002 iter_0000003 latest_checkpointed_iteration.txt " ] ||
  fail "the history holds '$listing', not job A's three saves alone"

job resume "$hist" "$dir/a_params.pt" > "$dir/c.log" 2>&1 || fail "job C could not resume job A's save and save there"
[ "$(cat "$hist/latest_checkpointed_iteration.txt")" = 4 ] || fail "job C's save is not the newest"
cat "$dir/b.log"
echo "PASS: job B refused on both ranks naming the holder; job A's saves intact; the lock released for job C"
