#!/bin/sh
# Readers of a checkpoint history while another run saves into it with --keep-last (issue 40
# item 9): each save removes the checkpoint the tracker named a moment before, so a reader that
# resolved it meets files that are gone. Every `mxddp ckpt inspect` and `mxddp train --load` run
# here must read an intact checkpoint (or, at worst, say the history is being written); none may
# report damage or a missing checkpoint.
#
# usage: readers_during_save.sh MXDDP WORKDIR [SECONDS]
# Exits 1 naming each bad run; 0 with the counts otherwise.
set -u
m=$1
work=$2
seconds=${3:-20}
rm -rf "$work" && mkdir -p "$work" || exit 1
hist=$work/history
model="--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2
       --global-batch-size 8 --corpus-bytes 65536 --train-iters 1000000"

# The writer: a save every iteration, only the newest kept, until it is stopped.
# shellcheck disable=SC2086
"$m" train --ranks 2 $model --eval-iters 0 --save-interval 1 --keep-last 1 --save "$hist" \
  > "$work/writer.log" 2>&1 &
writer=$!
trap 'kill "$writer" 2>/dev/null; wait "$writer" 2>/dev/null' EXIT

waited=0
while [ ! -f "$hist/latest_checkpointed_iteration.txt" ]; do
  if ! kill -0 "$writer" 2>/dev/null || [ "$waited" -ge 300 ]; then
    echo "the writer made no save:"; cat "$work/writer.log"; exit 1
  fi
  sleep 0.1
  waited=$((waited + 1))
done
first=$(cat "$hist/latest_checkpointed_iteration.txt")

# What a reader must never say about an intact history.
damage='DAMAGED|is missing|holds no checkpoint|is not a checkpoint|is damaged|does not exist|names iteration'
end=$(( $(date +%s) + seconds ))
runs=0 bad=0 busy=0
while [ "$(date +%s)" -lt "$end" ]; do
  runs=$((runs + 1))
  if [ $((runs % 4)) -eq 0 ]; then
    # A resume that loads what the tracker names and evaluates it (one batch), training nothing.
    # shellcheck disable=SC2086
    "$m" train --ranks 2 $model --eval-iters 1 --load "$hist" --skip-train > "$work/out" 2>&1
  else
    "$m" ckpt inspect "$hist" > "$work/out" 2>&1
  fi
  rc=$?
  if grep -Eq "$damage" "$work/out"; then
    bad=$((bad + 1))
    echo "run $runs (rc $rc) reported damage:"; grep -E "$damage|error" "$work/out" | head -3
  elif grep -q "is being written" "$work/out"; then
    busy=$((busy + 1))
  elif [ "$rc" -ne 0 ]; then
    bad=$((bad + 1))
    echo "run $runs failed (rc $rc):"; tail -3 "$work/out"
  fi
done
last=$(cat "$hist/latest_checkpointed_iteration.txt")
kill -0 "$writer" 2>/dev/null || { echo "the writer stopped early:"; tail -5 "$work/writer.log"; exit 1; }
echo "$runs reads while the writer saved iterations $first..$last: $bad reported damage or failed, $busy said the history is being written"
# A reader that never overlapped a save proves nothing.
[ "$last" -gt "$first" ] || { echo "the writer saved nothing during the reads"; exit 1; }
[ "$bad" -eq 0 ]
