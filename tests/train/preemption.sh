#!/bin/sh
# --exit-signal-handler under preemption (issue 40 item 1): a --model small job (iterations of a
# second or more) signalled mid-iteration the documented way exits 0 with a checkpoint of the
# iteration it was in, which `mxddp ckpt inspect` accepts and `mxddp train --load` resumes from.
#   mpirun: 2 ranks under mpirun, SIGUSR1 to mpirun (it forwards SIGUSR1; after a SIGTERM it kills
#           the ranks 1 s later and exits 1 whatever they do).
#   local:  --ranks 2 in one process, SIGUSR1 to it during the iteration after a validation: the
#           evaluation due after that iteration is skipped, so that the save comes at once.
# Exits 0 when every check holds; otherwise prints what failed and the run's output, exits 1.
# usage: preemption.sh MXDDP WORKDIR mpirun|local [MPIEXEC (default: mpirun)]
set -u
mxddp=$1
work=$2
mode=$3
mpiexec=${4:-mpirun}
rm -rf "$work" && mkdir -p "$work" || exit 1
model="--model small --global-batch-size 8 --micro-batch-size 4"
case $mode in
  mpirun)
    launch="$mpiexec --allow-run-as-root --oversubscribe --bind-to none -np 2"
    run="--eval-iters 0"
    wait_for='"type":"iteration"' ;;
  local)
    launch=""
    run="--ranks 2 --eval-interval 1 --eval-iters 1"
    wait_for='"type":"validation"' ;;
  *) echo "usage: preemption.sh MXDDP WORKDIR mpirun|local" >&2; exit 2 ;;
esac
fail() {
  echo "FAIL ($mode): $*"
  echo "---- output"; cat "$work/out.txt"; exit 1
}

# shellcheck disable=SC2086
$launch "$mxddp" train $model $run --train-iters 50 --exit-signal-handler --save "$work/ck" \
  --metrics-file "$work/metrics.jsonl" > "$work/out.txt" 2>&1 &
pid=$!
# The signal goes as soon as the first such line is in the metrics file: early in the next iteration.
n=0
until grep -q "$wait_for" "$work/metrics.jsonl" 2>/dev/null; do
  [ $n -lt 1800 ] || { kill -KILL $pid; fail "no $wait_for line in the metrics file after 180 s"; }
  sleep 0.1
  n=$((n + 1))
done
before=$(grep -c '"type":"iteration"' "$work/metrics.jsonl")
kill -USR1 $pid
wait $pid
rc=$?
[ $rc -eq 0 ] || fail "exit status $rc, not 0 (a SIGUSR1 that is not caught kills the ranks)"
grep -q "received SIGUSR1: every rank stops after the current iteration and saves it to '$work/ck'" "$work/out.txt" ||
  fail "no rank said it received SIGUSR1"
stopped=$(sed -n 's/^stopped after iteration \([0-9]*\) of 50: a stop was requested (--exit-signal-handler: SIGUSR1); the checkpoint is saved$/\1/p' "$work/out.txt")
[ -n "$stopped" ] || fail "no 'stopped after iteration N of 50: ... SIGUSR1 ...; the checkpoint is saved' line"
# The iteration in progress when the signal came: the one after the $before finished ones (or the
# last of those, had the signal beaten that iteration's stop decision).
[ "$stopped" -eq $((before + 1)) ] || [ "$stopped" -eq "$before" ] ||
  fail "stopped after iteration $stopped; the signal came after iteration $before"
last=$(grep '"type":"iteration"' "$work/metrics.jsonl" | tail -n 1 | sed 's/.*"iteration":\([0-9]*\).*/\1/')
[ "$last" = "$stopped" ] || fail "the metrics file's last iteration is $last, the stop was after $stopped"
tracker=$(cat "$work/ck/latest_checkpointed_iteration.txt" 2>/dev/null)
[ "$tracker" = "$stopped" ] || fail "the tracker names '$tracker', not iteration $stopped"
if [ "$mode" = local ]; then
  grep -q "warning: a stop was requested (--exit-signal-handler: SIGUSR1): the evaluation due after iteration $stopped is skipped, to save at once" "$work/out.txt" ||
    fail "no warning that the evaluation after iteration $stopped was skipped"
  ! grep -q "\"iteration\":$stopped,\"lm_loss\":[^,]*,\"type\":\"validation\"" "$work/metrics.jsonl" ||
    fail "iteration $stopped was evaluated before its save"
fi
"$mxddp" ckpt inspect "$work/ck" > "$work/inspect.txt" 2>&1 || { cat "$work/inspect.txt"; fail "ckpt inspect refused the save"; }
grep -q "^all files intact" "$work/inspect.txt" || { cat "$work/inspect.txt"; fail "ckpt inspect did not find all files intact"; }
# shellcheck disable=SC2086
$launch "$mxddp" train $model $run --eval-iters 0 --train-iters $((stopped + 1)) --load "$work/ck" \
  > "$work/resume.txt" 2>&1 || { cat "$work/resume.txt"; fail "the resume failed"; }
grep -q "^trained iterations $((stopped + 1))\.\.$((stopped + 1)):" "$work/resume.txt" ||
  { cat "$work/resume.txt"; fail "the resume did not train iteration $((stopped + 1)) alone"; }
echo "PASS ($mode): SIGUSR1 after iteration $before; stopped after $stopped, exit 0, checkpoint iter $stopped inspected and resumed"
