#!/bin/sh
# What a checkpoint history's users meet after crashes and edits (issue 40 item 15): a resume with
# --keep-last clears the iter_N.partial directories that saves killed earlier left (they were never
# loaded, and nothing removed them); the tracker file's text is quoted with control characters
# escaped and its length bounded (a raw escape sequence reached the terminal); `ckpt inspect` of a
# history that has no save yet says what the directory holds and what is valid (it suggested a
# 'DIR.partial' that does not exist).
#
# usage: history_leftovers.sh MXDDP WORKDIR
# Prints "ok NAME" or "FAIL NAME" with the output per check, then a summary; exits 1 on any FAIL.
set -u
m=$1
work=$2
rm -rf "$work" && mkdir -p "$work" || exit 1
model="--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2
       --global-batch-size 8 --corpus-bytes 65536 --eval-iters 0"
checks=0 failed=0
pass() { checks=$((checks + 1)); echo "ok $1"; }
fail() { checks=$((checks + 1)); failed=$((failed + 1)); echo "FAIL $1: $2"; sed 's/^/    /' "$work/out"; }

# ---- a resume with --keep-last clears what killed saves left
h=$work/h
# shellcheck disable=SC2086
"$m" train --ranks 2 $model --train-iters 4 --save-interval 2 --save "$h" > "$work/out" 2>&1 ||
  fail fixture "the first run failed"
# A save of iteration 3 killed half-way (an earlier run saved every iteration), and one of 5 by a
# run that went further than the tracker says.
mkdir "$h/iter_0000003.partial" "$h/iter_0000005.partial"
echo half > "$h/iter_0000003.partial/rank_00000.safetensors"
echo half > "$h/iter_0000005.partial/.rank_00001.safetensors.tmp"
# shellcheck disable=SC2086
"$m" train --ranks 2 $model --train-iters 8 --save-interval 2 --keep-last 2 --load "$h" --save "$h" \
  > "$work/out" 2>&1
rc=$?
left=$(ls -A "$h" | tr '\n' ' ')
if [ "$rc" -ne 0 ]; then fail resume-clears-stale-partials "the resume failed (exit status $rc)"
elif [ "$left" != "iter_0000006 iter_0000008 latest_checkpointed_iteration.txt " ]
then echo "$left" >> "$work/out"; fail resume-clears-stale-partials "the history holds: $left"
else pass resume-clears-stale-partials; fi

# ---- the tracker's text is escaped and bounded in errors
esc=$(printf '\033')
printf '1\033]0;pwned\007\033[31m\n' > "$h/latest_checkpointed_iteration.txt"
for reader in inspect load; do
  if [ "$reader" = inspect ]; then "$m" ckpt inspect "$h" > "$work/out" 2>&1
  # shellcheck disable=SC2086
  else "$m" train --ranks 2 $model --train-iters 8 --load "$h" > "$work/out" 2>&1; fi
  rc=$?
  if [ "$rc" -eq 0 ]; then fail "tracker-escaped-$reader" "exit status 0"
  elif grep -q "$esc" "$work/out"; then fail "tracker-escaped-$reader" "a raw escape character reached the output"
  elif ! grep -Fq "holds '1\\x1b]0;pwned\\x07\\x1b[31m'; expected the iteration" "$work/out"
  then fail "tracker-escaped-$reader" "the tracker's text is not quoted escaped"
  else pass "tracker-escaped-$reader"; fi
done
printf '7%.0s' $(seq 60) > "$h/latest_checkpointed_iteration.txt"
"$m" ckpt inspect "$h" > "$work/out" 2>&1
if grep -Fq "holds '77777777777777777777777777777777... (60 bytes)'" "$work/out"; then pass tracker-bounded
else fail tracker-bounded "the tracker's text is not cut at 32 bytes"; fi

# ---- a history without a save yet: what it holds, what is valid, no DIR.partial invented
mkdir "$work/empty" "$work/unsaved" && : > "$work/unsaved/mxddp.lock"  # a run's lock, killed before its first save
for dir in empty unsaved; do
  "$m" ckpt inspect "$work/$dir" > "$work/out" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then fail "no-saves-$dir" "exit status 0"
  elif grep -q "$dir.partial" "$work/out"; then fail "no-saves-$dir" "it names $dir.partial, which does not exist"
  elif ! grep -q "a --save history holds latest_checkpointed_iteration.txt" "$work/out"; then fail "no-saves-$dir" "it does not say what is valid"
  elif [ "$dir" = empty ] && ! grep -q "'$work/empty' is not a checkpoint: no manifest.json; it is empty" "$work/out"
  then fail "no-saves-$dir" "it does not say the directory is empty"
  elif [ "$dir" = unsaved ] && ! grep -q "it holds mxddp.lock: a --save history with no completed save yet" "$work/out"
  then fail "no-saves-$dir" "it does not say what the directory holds"
  else pass "no-saves-$dir"; fi
done

echo "$((checks - failed)) of $checks checks passed"
[ "$failed" -eq 0 ]
