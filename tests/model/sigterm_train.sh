#!/bin/sh
# --exit-signal-handler (issue 14 point 5): a training sent SIGTERM mid-run finishes its iteration,
# saves, and exits 0; its tracker names the iteration it stopped after, and a run resumes from it.
# usage: sigterm_train.sh MXDDP WORKDIR "TRAIN FLAGS"
set -u
mxddp=$1
work=$2
flags=$3
rm -rf "$work" && mkdir -p "$work" || exit 1
# shellcheck disable=SC2086
"$mxddp" train --ranks 2 $flags --train-iters 1000000 --eval-interval 0 --exit-signal-handler --save "$work/ck" \
  --metrics-file "$work/metrics.jsonl" > "$work/out.txt" 2>&1 &
pid=$!
n=0
while [ "$(cat "$work/metrics.jsonl" 2>/dev/null | wc -l)" -lt 3 ] && [ $n -lt 1200 ]; do sleep 0.1; n=$((n + 1)); done
kill -TERM $pid
wait $pid
echo "exit=$?"
grep "^stopped after" "$work/out.txt"
echo "tracker $(cat "$work/ck/latest_checkpointed_iteration.txt")"
stopped=$(cat "$work/ck/latest_checkpointed_iteration.txt")
# shellcheck disable=SC2086
"$mxddp" train --ranks 2 $flags --train-iters $((stopped + 2)) --train-iters 1000000 --exit-interval $((stopped + 2)) \
  --eval-interval 0 --load "$work/ck" 2>&1 | sed -n 's/^trained/resumed: trained/p'
