#!/bin/sh
# CTest's data_changed_under_run_*: `mxddp train --data-path P` while P.bin is changed under it
# after two iterations (issue 40, item 4): truncated to half, rewritten in place with ids past the
# vocabulary, or rewritten in place with valid ids at the same size. Passes when the run ends with
# exit status 1 and an error naming P.bin; a crash (SIGBUS 135, SIGSEGV 139), a run that trains on
# (still running 20 s after the change, or exit status 0) or a hang fails.
# usage: data_changed_under_run.sh SOURCE_DIR MODE COMMAND...
#   MODE: truncate | ids | same-size; COMMAND: the launch up to and including `train`, e.g.
#   `mxddp train --ranks 2` or `mpirun -np 2 mxddp train --backend mpi`.
set -u
src=$1 mode=$2
shift 2
d=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$d"' EXIT
python3 "$src/scripts/make_indexed_dataset.py" "$src/README.md" "$d/p" > /dev/null || exit 2

: > "$d/log"
"$@" --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2 \
  --global-batch-size 8 --lr 1e-3 --train-iters 1000000 --log-interval 1 --eval-interval 0 \
  --data-path "$d/p" --vocab-size 257 > "$d/log" 2>&1 &
pid=$!

# Until iteration 2 is logged (at most 30 s), then the change.
waited=0
until grep -q "iteration *2/" "$d/log"; do
  if ! kill -0 "$pid" 2>/dev/null || [ "$waited" -ge 300 ]; then
    echo "FAIL: the run did not reach iteration 2:"; tail -5 "$d/log"; exit 1
  fi
  sleep 0.1
  waited=$((waited + 1))
done
case $mode in
  truncate) truncate -s "$(($(wc -c < "$d/p.bin") / 2))" "$d/p.bin" ;;
  # In place (the same inode), every uint16 token 4112 (the vocabulary is 257) or every id + 1 (still
  # in range: only the change itself can be seen).
  ids) python3 -c "import sys; f = open(sys.argv[1], 'r+b'); n = len(f.read()); f.seek(0); f.write(b'\x10\x10' * (n // 2))" "$d/p.bin" ;;
  same-size) python3 -c "import sys; f = open(sys.argv[1], 'r+b'); b = bytearray(f.read()); b[0::2] = bytes((x + 1) % 256 for x in b[0::2]); f.seek(0); f.write(b)" "$d/p.bin" ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
echo "changed $d/p.bin ($mode) after iteration 2"

# The run must end by itself within 20 s of the change.
waited=0
while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 200 ]; do
  sleep 0.1
  waited=$((waited + 1))
done
if kill -0 "$pid" 2>/dev/null; then
  echo "FAIL: still training 20 s after $d/p.bin changed:"; tail -3 "$d/log"; exit 1
fi
wait "$pid"
rc=$?
pid=
grep -m 2 "error" "$d/log"
echo "iterations logged: $(grep -c "^ iteration" "$d/log")"
echo "exit=$rc"
