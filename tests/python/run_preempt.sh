#!/bin/sh
# CTest's python_preemption_sigusr1_mpirun: docs/python.md's preemption recipe under mpirun.
# A job of preempt_job.py trains under `mpirun -np 2`; once it has done an iteration, mpirun gets
# SIGUSR1 (which it forwards to the ranks without killing them). mpirun must exit 0, both ranks
# must say they stopped after the same iteration N, the history's tracker must name N, and a
# second job must load N (the params at the stop) and continue to N + 1.
# usage: run_preempt.sh VENV MPIEXEC SCRIPT
set -u
venv=$1 mpiexec=$2 script=$3
if ! "$venv/bin/python" -c "import torch, mxddp.torch" 2>/dev/null; then
  echo "SKIP: $venv has no torch or mxddp (scripts/setup.sh, then CTest's python_package_install)"
  exit 77
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
dir=$(mktemp -d) || exit 1
job_pid=
cleanup() {
  [ -z "$job_pid" ] || kill -KILL "$job_pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  for log in "$dir"/*.log; do [ -e "$log" ] && { echo "--- $log"; cat "$log"; }; done
  echo "FAIL: $1"
  exit 1
}
hist=$dir/history params=$dir/params.pt
mpirun_np2() { "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np 2 "$venv/bin/python" "$script" "$@"; }

# exec in the background subshell (no `timeout` in front), so that $! is mpirun's own pid.
(exec "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np 2 "$venv/bin/python" "$script" \
  train "$hist" "$params" > "$dir/train.log" 2>&1) &
job_pid=$!
n=0
while ! grep -qs 'iteration 1 done' "$dir/train.log" && [ $n -lt 600 ] && kill -0 "$job_pid" 2>/dev/null; do
  sleep 0.1; n=$((n + 1))
done
grep -q 'iteration 1 done' "$dir/train.log" || fail "the job did not finish its first iteration within 60 s"
kill -USR1 "$job_pid"
n=0
while kill -0 "$job_pid" 2>/dev/null && [ $n -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
kill -0 "$job_pid" 2>/dev/null && fail "mpirun was still running 30 s after SIGUSR1"
wait "$job_pid"
rc=$?
job_pid=
[ "$rc" -eq 0 ] || fail "mpirun exited $rc after SIGUSR1 (the ranks did not stop cleanly)"

# Unanchored: mpirun can put one rank's line before another's newline.
stopped=$(grep -o 'rank 0 stopped after iteration [0-9]* (SIGUSR1) and saved it' "$dir/train.log" |
          sed 's/^rank 0 stopped after iteration \([0-9]*\) .*/\1/' | head -n 1)
[ -n "$stopped" ] || fail "rank 0 did not print that it stopped after an iteration on SIGUSR1"
grep -q "rank 1 stopped after iteration $stopped (SIGUSR1) and saved it" "$dir/train.log" ||
  fail "rank 1 did not stop after iteration $stopped on SIGUSR1 as rank 0 did"
tracker=$(cat "$hist/latest_checkpointed_iteration.txt" 2>/dev/null)
[ "$tracker" = "$stopped" ] || fail "the history's tracker names '$tracker', not the stop's iteration $stopped"

mpirun_np2 resume "$hist" "$params" > "$dir/resume.log" 2>&1 || fail "the second job could not resume the save"
for r in 0 1; do
  grep -qE "rank $r loaded iteration $stopped([^0-9]|\$)" "$dir/resume.log" ||
    fail "rank $r of the second job did not load iteration $stopped"
done
next=$((stopped + 1))
[ "$(cat "$hist/latest_checkpointed_iteration.txt")" = "$next" ] || fail "the second job did not save iteration $next"
grep 'stopped after\|loaded iteration' "$dir/train.log" "$dir/resume.log"
echo "PASS: SIGUSR1 to mpirun: both ranks stopped after iteration $stopped, saved it, mpirun exited 0; resumed to $next"
