#!/bin/sh
# cli_train_save_dir_locked: usage save_dir_lock.sh MXDDP DIR. A long run holds DIR's lock; a
# second `mxddp train --save DIR` must be refused naming the holder's pid, without writing; after
# the holder is killed with SIGKILL, a third run takes the lock over and saves.
set -u
mxddp=$1 dir=$2
small="--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --corpus-bytes 65536 --eval-iters 0 --ranks 2"
rm -rf "$dir" && mkdir -p "$dir"
"$mxddp" train $small --train-iters 100000 --save "$dir/h" --save-interval 100000 >"$dir/first.log" 2>&1 &
first=$!
trap 'kill -9 $first 2>/dev/null' EXIT
i=0
until grep -q "pid $first" "$dir/h/mxddp.lock" 2>/dev/null; do
  i=$((i + 1)); [ $i -gt 300 ] && { echo "save_dir_lock: the first run never took the lock"; cat "$dir/first.log"; exit 1; }
  sleep 0.1
done
if "$mxddp" train $small --train-iters 1 --save "$dir/h" >"$dir/second.log" 2>&1; then
  echo "save_dir_lock: a second writer was let in"; exit 1
fi
grep -q "is being written by another live run (pid $first" "$dir/second.log" ||
  { echo "save_dir_lock: the refusal does not name pid $first:"; cat "$dir/second.log"; exit 1; }
kill -9 $first; wait $first 2>/dev/null
"$mxddp" train $small --train-iters 1 --save "$dir/h" >"$dir/third.log" 2>&1 ||
  { echo "save_dir_lock: the killed run's lock was not taken over:"; cat "$dir/third.log"; exit 1; }
[ -d "$dir/h/iter_0000001" ] || { echo "save_dir_lock: the third run saved nothing"; exit 1; }
echo "save_dir_lock: ok"
