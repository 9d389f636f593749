#!/bin/sh
# Issue 40 item 10: a write past the file-size limit (ulimit -f) is an error naming the file and the
# limit, never a silent death by SIGXFSZ (rc 153), and leaves what a full disk would: no temporary
# (.tmp, .partial) anywhere, the previous checkpoint loadable, nothing of an export.
# usage: resource_file_size_limit.sh MXDDP WORKDIR local|mpirun [MPIEXEC (default: mpirun)]
#   local:  `mxddp train --ranks 2` resuming from a checkpoint and saving past the limit, then
#           `ckpt export` (safetensors into a fresh directory, and --format hf) past it.
#   mpirun: the same save with 2 ranks under mpirun, each rank under the limit.
set -u
mxddp=$1 dir=$2 mode=$3 mpiexec=${4:-mpirun}
model="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 --global-batch-size 16 --corpus-bytes 65536 --eval-iters 0"
limit_blocks=200  # 100 KiB in sh's 512-byte blocks: a rank file here is about 850 KB

fail() { echo "resource_file_size_limit ($mode): $*"; exit 1; }

# rc of a command that must fail with a message: non-zero, and not a signal's death (>= 128).
expect_error_exit() {
  rc=$1 log=$2
  [ "$rc" -ne 0 ] || { cat "$log"; fail "exit 0 under the file-size limit"; }
  [ "$rc" -lt 128 ] || { cat "$log"; fail "killed by signal $((rc - 128)) (rc $rc; SIGXFSZ is 25)"; }
}

expect_limit_named() {
  log=$1 file=$2
  grep -q "'$file[^']*' failed.*File too large: past the file size limit (ulimit -f) of [0-9]* bytes" "$log" ||
    { cat "$log"; fail "the error does not name a file under $file and the file-size limit"; }
}

# No temporary anywhere under $1.
expect_no_temporaries() {
  left=$(find "$1" -name '*.tmp' -o -name '*.partial' -o -name '.*.partial' -o -name '.*.tmp')
  [ -z "$left" ] || fail "temporaries left behind: $left"
}

rm -rf "$dir" && mkdir -p "$dir" || exit 1
case $mode in
  local) launch="" ranks="--ranks 2" ;;
  mpirun) launch="$mpiexec --allow-run-as-root --oversubscribe --bind-to none -np 2" ranks="" ;;
  *) echo "usage: resource_file_size_limit.sh MXDDP WORKDIR local|mpirun [MPIEXEC]" >&2; exit 2 ;;
esac

# A checkpoint at iteration 2, saved without a limit.
$launch "$mxddp" train $ranks $model --train-iters 2 --save "$dir/D" >"$dir/first.log" 2>&1 ||
  { cat "$dir/first.log"; fail "the first save failed"; }

# Resume and save iteration 4 past the limit: every rank's write is refused.
$launch sh -c "ulimit -f $limit_blocks; exec \"$mxddp\" train $ranks $model --train-iters 4 --load \"$dir/D\" --save \"$dir/D\"" \
  >"$dir/save.log" 2>&1
expect_error_exit $? "$dir/save.log"
expect_limit_named "$dir/save.log" "$dir/D/iter_0000004"
expect_no_temporaries "$dir/D"
"$mxddp" ckpt inspect "$dir/D" >"$dir/inspect.log" 2>&1 || { cat "$dir/inspect.log"; fail "the earlier checkpoint no longer loads"; }
grep -q "iter_0000002" "$dir/inspect.log" && grep -q "all files intact" "$dir/inspect.log" ||
  { cat "$dir/inspect.log"; fail "inspect does not find the earlier checkpoint, iter_0000002, intact"; }
[ ! -e "$dir/D/iter_0000004" ] || fail "iter_0000004 was published though its save failed"

if [ "$mode" = local ]; then
  # Export into a fresh directory: nothing of it may stay, not even the directories it made.
  sh -c "ulimit -f $limit_blocks; exec \"$mxddp\" ckpt export \"$dir/D\" --out \"$dir/fresh/sub/model.safetensors\"" \
    >"$dir/export.log" 2>&1
  expect_error_exit $? "$dir/export.log"
  expect_limit_named "$dir/export.log" "$dir/fresh/sub/.model.safetensors"
  [ ! -e "$dir/fresh" ] || fail "the export left $(find "$dir/fresh")"
  sh -c "ulimit -f $limit_blocks; exec \"$mxddp\" ckpt export \"$dir/D\" --format hf --out \"$dir/hf\"" \
    >"$dir/export_hf.log" 2>&1
  expect_error_exit $? "$dir/export_hf.log"
  expect_limit_named "$dir/export_hf.log" "$dir/hf.partial/.model.safetensors"
  for left in "$dir/hf" "$dir/hf.partial" "$dir/hf.old"; do [ ! -e "$left" ] || fail "the hf export left $left"; done
fi
expect_no_temporaries "$dir"
echo "resource_file_size_limit ($mode): ok"
