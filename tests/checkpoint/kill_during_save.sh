#!/bin/sh
# Crash consistency of `mxddp train --save` (issue 15, point 3): a run that resumes from a
# checkpoint and saves over it every iteration is killed (SIGKILL, every rank: ranks are threads of
# the one process) at the n-th call of each file-system step a save makes (rename, unlinkat, rmdir,
# mkdir, fsync), for every n until the run gets through, using strace's fault injection. After each
# kill the checkpoint must read back intact (`ckpt inspect`: the previous or a newer iteration),
# and a later run must resume from it and save, so no run deletes the only intact copy.
# usage: kill_during_save.sh MXDDP WORKDIR
set -u
mxddp=$1
work=$2
common="--ranks 2 --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2
        --global-batch-size 4 --corpus-bytes 8192 --eval-iters 0"
strace -f -o /dev/null true || { echo "strace cannot trace processes here"; exit 1; }
rm -rf "$work" && mkdir -p "$work" || exit 1
"$mxddp" train $common --train-iters 2 --save "$work/base" >/dev/null || { echo "baseline save failed"; exit 1; }

kills=0
intact=0
for call in rename unlinkat rmdir mkdir fsync; do
  n=1
  while :; do
    rm -rf "$work/ck" "$work/ck.partial" "$work/ck.old" && cp -r "$work/base" "$work/ck"
    strace -f -o /dev/null -e trace="$call" -e inject="$call":signal=KILL:when="$n" \
      "$mxddp" train $common --load "$work/ck" --train-iters 5 --save "$work/ck" --save-interval 1 >/dev/null 2>&1
    status=$?
    [ "$status" -eq 0 ] && break  # fewer than n such calls: nothing was killed
    [ "$n" -gt 500 ] && { echo "$call: still killed at call #$n; giving up"; exit 1; }
    kills=$((kills + 1))
    step=$("$mxddp" ckpt inspect "$work/ck" 2>&1 | sed -n 's/^checkpoint .*: step \([0-9]*\),.*/\1/p')
    if [ -n "$step" ] && [ "$step" -ge 2 ] && [ "$step" -le 5 ] &&
       "$mxddp" train $common --load "$work/ck" --train-iters 6 --save "$work/ck" >/dev/null 2>&1 &&
       "$mxddp" ckpt inspect "$work/ck" 2>&1 | grep -q "^checkpoint .*: step 6,"; then
      intact=$((intact + 1))
    else
      echo "killed at $call #$n: checkpoint step '${step}' after the kill; state: $(ls "$work")"
    fi
    n=$((n + 1))
  done
done
rm -rf "$work"
echo "kill points intact: $intact/$kills"
[ "$kills" -gt 0 ] && [ "$intact" -eq "$kills" ]
