#!/bin/sh
# --exit-signal-handler under a storm of stop signals: 2 ranks under mpirun, each sent SIGUSR1
# every few milliseconds from its second iteration until the run says it stopped. A signal handled
# on a thread inside oneDNN's generated GEMM kernels corrupts the heap (they point the stack
# pointer into it; oneDNN issue 4845), so before the stop signals were received on a thread of
# their own this crashed a rank within a few dozen signals. Now every rank must finish the
# iteration, save it and exit 0, with a checkpoint `mxddp ckpt inspect` finds intact.
# The signals go to the ranks themselves (as srun and Kubernetes deliver them), not to mpirun: a
# signal mpirun gets while it shuts down would end mpirun, not test the ranks.
# Exits 0 when every check holds; otherwise prints what failed and the run's output, exits 1.
# usage: signal_storm.sh MXDDP WORKDIR [MPIEXEC (default: mpirun)]
set -u
mxddp=$1
work=$2
mpiexec=${3:-mpirun}
rm -rf "$work" && mkdir -p "$work" || exit 1
fail() {
  echo "FAIL: $*"
  echo "---- output (the ranks' 'received' lines left out)"; grep -v "received SIGUSR1" "$work/out.txt"; exit 1
}

$mpiexec --allow-run-as-root --oversubscribe --bind-to none -np 2 "$mxddp" train --model small \
  --global-batch-size 8 --micro-batch-size 4 --eval-iters 0 --train-iters 50 --exit-signal-handler \
  --save "$work/ck" --metrics-file "$work/metrics.jsonl" > "$work/out.txt" 2>&1 &
pid=$!
n=0
until grep -q '"type":"iteration"' "$work/metrics.jsonl" 2>/dev/null; do
  [ $n -lt 1800 ] || { kill -KILL $pid; fail "no iteration line in the metrics file after 180 s"; }
  sleep 0.1
  n=$((n + 1))
done
ranks=$(pgrep -P $pid -f "train --model small")
[ "$(echo "$ranks" | wc -w)" -eq 2 ] || { kill -KILL $pid; fail "found rank pids '$ranks' under mpirun $pid, not 2"; }
sent=0
while [ $sent -lt 3000 ] && ! grep -q "^stopped after" "$work/out.txt"; do
  # shellcheck disable=SC2086
  kill -USR1 $ranks 2>/dev/null || break  # a rank that has exited ends the storm
  sent=$((sent + 1))
  sleep 0.002
done
wait $pid
rc=$?
[ $rc -eq 0 ] || fail "exit status $rc, not 0, after $sent rounds of SIGUSR1"
[ $sent -ge 20 ] || fail "only $sent rounds of SIGUSR1 were sent before the stop: the storm did not happen"
grep -q "^stopped after iteration [0-9]* of 50: a stop was requested (--exit-signal-handler: SIGUSR1); the checkpoint is saved$" \
  "$work/out.txt" || fail "no 'stopped after iteration N of 50: ... SIGUSR1 ...; the checkpoint is saved' line"
"$mxddp" ckpt inspect "$work/ck" > "$work/inspect.txt" 2>&1 || { cat "$work/inspect.txt"; fail "ckpt inspect refused the save"; }
grep -q "^all files intact" "$work/inspect.txt" || { cat "$work/inspect.txt"; fail "ckpt inspect did not find all files intact"; }
echo "PASS: $sent rounds of SIGUSR1 to both ranks; exit 0, checkpoint inspected"
