#!/bin/sh
# Where `mxddp ckpt export` may write (issue 40 item 3) and what a failed export leaves (item 10).
# An export never writes into a checkpoint history or checkpoint (any one, reached by name, a link
# or '..'), never replaces a file or directory it did not write, replaces a previous export of its
# own only with --overwrite, and a write that fails (a file-size limit) leaves no partial output
# and the previous export as it was.
#
# usage: export_targets.sh MXDDP WORKDIR
# Prints "ok NAME" or "FAIL NAME" with the command's output per check, then a summary; exits 1 on
# any FAIL.
set -u
m=$1
work=$2
rm -rf "$work" && mkdir -p "$work" || exit 1
model="--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2
       --global-batch-size 8 --corpus-bytes 65536 --eval-iters 0"
h=$work/h          # a history with iterations 2 and 4: the one written into
o=$work/other      # another history: the one exported
# shellcheck disable=SC2086
"$m" train --ranks 2 $model --train-iters 4 --save-interval 2 --save "$h" > "$work/train.log" 2>&1 &&
  "$m" train --ranks 2 $model --train-iters 2 --save "$o" >> "$work/train.log" 2>&1 ||
  { echo "FAIL fixture: the training runs failed"; cat "$work/train.log"; exit 1; }

checks=0 failed=0
fingerprint() { (cd "$1" && find . -type f | sort | xargs cksum); }
pass() { checks=$((checks + 1)); echo "ok $1"; }
fail() { checks=$((checks + 1)); failed=$((failed + 1)); echo "FAIL $1: $2"; sed 's/^/    /' "$work/out"; }

# refused NAME REGEX COMMAND...: COMMAND exits non-zero, says REGEX, and leaves the history as it was.
refused() {
  name=$1 regex=$2
  shift 2
  fingerprint "$h" > "$work/before"
  "$@" > "$work/out" 2>&1
  rc=$?
  fingerprint "$h" > "$work/after"
  if [ "$rc" -eq 0 ]; then fail "$name" "exit status 0"
  elif ! grep -Eq -e "$regex" "$work/out"; then fail "$name" "the error does not say: $regex"
  elif ! cmp -s "$work/before" "$work/after"; then fail "$name" "the history changed"
  else pass "$name"; fi
}

# ---- item 3: never inside a checkpoint history or checkpoint
refused into-a-checkpoints-manifest "error: .*--out '$h/iter_0000002/manifest.json' is inside the checkpoint '.*/h/iter_0000002'" \
  "$m" ckpt export "$o" --out "$h/iter_0000002/manifest.json"
refused into-the-exported-historys-older-rank-file "is inside the checkpoint '.*/h/iter_0000002'" \
  "$m" ckpt export "$h" --out "$h/iter_0000002/rank_00001.safetensors"
refused over-another-historys-tracker "is inside the checkpoint history '.*/h'" \
  "$m" ckpt export "$o" --out "$h/latest_checkpointed_iteration.txt"
ln -s "$h/iter_0000004" "$work/link"
refused through-a-link "is inside the checkpoint '.*/h/iter_0000004' \(links and '..' resolved\)" \
  "$m" ckpt export "$o" --out "$work/link/model.safetensors"
refused through-a-missing-directory-and-dotdot "is inside the checkpoint '.*/h/iter_0000004'" \
  "$m" ckpt export "$o" --out "$work/missing/../h/iter_0000004/model.safetensors"
refused hf-onto-the-history "error: .*--out '$h' is the checkpoint history '.*/h'" \
  "$m" ckpt export "$o" --format hf --out "$h"
refused hf-into-a-checkpoint "is the checkpoint '.*/h/iter_0000002'" \
  "$m" ckpt export "$o" --format hf --out "$h/iter_0000002" --overwrite

# ---- item 3: never over what it did not write; its own only with --overwrite
mkdir -p "$work/hf_theirs" && echo '{"mine": 1}' > "$work/hf_theirs/config.json"
echo theirs > "$work/theirs.safetensors"
for flag in "" --overwrite; do
  refused "hf-over-someone-elses-config$flag" "--out '.*/hf_theirs' is not a previous export of .*it holds config.json but no model.safetensors" \
    "$m" ckpt export "$o" --format hf --out "$work/hf_theirs" $flag
  grep -q '"mine"' "$work/hf_theirs/config.json" && pass "hf-their-config-kept$flag" ||
    fail "hf-their-config-kept$flag" "config.json was replaced"
  refused "over-a-file-it-did-not-write$flag" "--out '.*/theirs.safetensors' exists and is not a file .mxddp ckpt export. wrote" \
    "$m" ckpt export "$o" --out "$work/theirs.safetensors" $flag
  [ "$(cat "$work/theirs.safetensors")" = theirs ] && pass "their-file-kept$flag" ||
    fail "their-file-kept$flag" "the file was replaced"
done

"$m" ckpt export "$o" --out "$work/mine.safetensors" > "$work/out" 2>&1 || fail first-export "exit status $?"
refused a-previous-export-without-overwrite "holds a previous export .*: pass --overwrite to replace it" \
  "$m" ckpt export "$o" --out "$work/mine.safetensors" --dtype bf16
if "$m" ckpt export "$o" --out "$work/mine.safetensors" --dtype bf16 --overwrite > "$work/out" 2>&1 &&
   grep -q '"mxddp_dtype":"bf16"' "$work/mine.safetensors"; then pass a-previous-export-with-overwrite
else fail a-previous-export-with-overwrite "not replaced"; fi

"$m" ckpt export "$o" --format hf --out "$work/hf_mine" > "$work/out" 2>&1 || fail first-hf-export "exit status $?"
refused hf-previous-export-without-overwrite "--out '.*/hf_mine' holds a previous export .*: pass --overwrite" \
  "$m" ckpt export "$o" --format hf --out "$work/hf_mine" --eos-token-id 10
if "$m" ckpt export "$o" --format hf --out "$work/hf_mine" --eos-token-id 10 --overwrite > "$work/out" 2>&1 &&
   grep -q '"eos_token_id": 10' "$work/hf_mine/config.json"; then pass hf-previous-export-with-overwrite
else fail hf-previous-export-with-overwrite "not replaced"; fi
cp -r "$work/hf_mine" "$work/hf_edited" && echo ' ' >> "$work/hf_edited/config.json"
refused hf-edited-config-is-not-the-exports "its config.json is not the one the export wrote" \
  "$m" ckpt export "$o" --format hf --out "$work/hf_edited" --overwrite

# ---- item 10: a write that fails (a file-size limit, 100 blocks: less than model.safetensors)
# leaves no partial output and the previous export as it was. No `trap '' XFSZ` here: mxddp itself
# must turn the limit into an error.
limited() { (ulimit -f 100; "$@") > "$work/out" 2>&1; }
cp -r "$work/hf_mine" "$work/hf_before" && cp "$work/mine.safetensors" "$work/mine_before"
for target in hf_new hf_mine; do
  flag=$([ "$target" = hf_mine ] && echo --overwrite)
  limited "$m" ckpt export "$o" --format hf --out "$work/$target" $flag
  rc=$?
  if [ "$rc" -ne 1 ] || ! grep -q "File too large" "$work/out"; then fail "hf-file-size-limit-$target" "exit status $rc"
  elif [ -e "$work/$target.partial" ] || [ -e "$work/$target.old" ] || { [ "$target" = hf_new ] && [ -e "$work/hf_new" ]; }
  then fail "hf-file-size-limit-$target" "partial output left: $(ls -d "$work/$target"*)"
  elif [ "$target" = hf_mine ] && ! diff -r "$work/hf_before" "$work/hf_mine" > /dev/null
  then fail "hf-file-size-limit-$target" "the previous export changed"
  else pass "hf-file-size-limit-$target"; fi
done
for target in new.safetensors mine.safetensors; do
  flag=$([ "$target" = mine.safetensors ] && echo --overwrite)
  limited "$m" ckpt export "$o" --out "$work/$target" $flag
  rc=$?
  if [ "$rc" -ne 1 ] || ! grep -q "File too large" "$work/out"; then fail "file-size-limit-$target" "exit status $rc"
  elif [ -n "$(find "$work" -maxdepth 1 -name "*$target.partial")" ] || { [ "$target" = new.safetensors ] && [ -e "$work/$target" ]; }
  then fail "file-size-limit-$target" "partial output left: $(ls -a "$work")"
  elif [ "$target" = mine.safetensors ] && ! cmp -s "$work/mine_before" "$work/mine.safetensors"
  then fail "file-size-limit-$target" "the previous export changed"
  else pass "file-size-limit-$target"; fi
done

echo "$((checks - failed)) of $checks checks passed"
[ "$failed" -eq 0 ]
