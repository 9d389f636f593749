#!/bin/sh
# Issue 40 item 11: a memory limit set on a cgroup above the process's own (as systemd-run, Slurm and
# Kubernetes set them: never at the root) refuses a run that cannot fit, naming the limit's file,
# instead of letting the kernel kill it (137). Makes a cgroup under this process's own memory cgroup
# (v1's memory controller, else v2) with the limit, a child of it without one, and runs
# `mxddp train --model small --ranks 2` (about 270 MiB at least) in the child under a 256 MiB limit.
# Both cgroups are removed on every exit; the test skips (77) where cgroups cannot be made.
# usage: resource_cgroup_limit.sh MXDDP WORKDIR
set -u
mxddp=$1 dir=$2
limit_bytes=268435456
skip() { echo "resource_cgroup_limit: skipped: $*"; exit 77; }
fail() { echo "resource_cgroup_limit: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || skip "making a cgroup needs root"
# The process's memory cgroup and where its hierarchy is mounted (mountinfo: root, mount point,
# then after " - " the type and the super options).
own=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ { print $3; exit }' /proc/self/cgroup)
if [ -n "$own" ]; then
  version=1 limit_file=memory.limit_in_bytes
  mount=$(awk '{ for (i = 7; i <= NF; i++) if ($i == "-") break;
                 if ($(i + 1) == "cgroup" && $(i + 3) ~ /(^|,)memory(,|$)/ && $4 == "/") { print $5; exit } }' /proc/self/mountinfo)
else
  version=2 limit_file=memory.max
  own=$(awk -F: '$1 == "0" && $2 == "" { print $3; exit }' /proc/self/cgroup)
  mount=$(awk '{ for (i = 7; i <= NF; i++) if ($i == "-") break;
                 if ($(i + 1) == "cgroup2" && $4 == "/") { print $5; exit } }' /proc/self/mountinfo)
fi
[ -n "$own" ] && [ -n "$mount" ] || skip "no memory cgroup mounted from its root (v1 memory controller or cgroup2)"
parent="$mount${own%/}"
# Cgroups a killed earlier run left (empty ones only: rmdir refuses any that holds a process).
for stale in "$parent"/mxddp_resource_test_*; do
  [ -d "$stale" ] && { rmdir "$stale/inner" 2>/dev/null; rmdir "$stale" 2>/dev/null; }
done
outer="$parent/mxddp_resource_test_$$" inner="$parent/mxddp_resource_test_$$/inner"
child=""
cleanup() {
  [ -n "$child" ] && kill -9 "$child" 2>/dev/null && wait "$child" 2>/dev/null
  rmdir "$inner" 2>/dev/null
  rmdir "$outer" 2>/dev/null
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP
mkdir "$outer" 2>/dev/null || skip "cannot make a cgroup under $parent"
[ -f "$outer/$limit_file" ] || skip "the memory controller is not enabled for cgroups under $parent (cgroup v$version)"
echo $limit_bytes >"$outer/$limit_file" 2>/dev/null || skip "cannot set $outer/$limit_file"
mkdir "$inner" || fail "cannot make $inner"

rm -rf "$dir" && mkdir -p "$dir" || exit 1
# The run joins the inner cgroup, then becomes mxddp.
timeout 120 sh -c 'echo $$ >"$1/cgroup.procs" && exec "$2" train --model small --ranks 2 --train-iters 2 --eval-iters 0' \
  sh "$inner" "$mxddp" >"$dir/train.log" 2>&1 &
child=$!
wait $child
rc=$?
child=""
[ $rc -ne 0 ] || { cat "$dir/train.log"; fail "the run was let in under a $limit_bytes-byte cgroup limit"; }
[ $rc -lt 128 ] || { tail -5 "$dir/train.log"; fail "the run was killed (rc $rc: signal $((rc - 128))) instead of refused"; }
grep -q "this run cannot fit in this machine's memory: 2 ranks here need at least .* is available (the cgroup memory limit in '$outer/$limit_file': 256 MiB" "$dir/train.log" ||
  { cat "$dir/train.log"; fail "the refusal does not name the limit's file, $outer/$limit_file"; }
echo "resource_cgroup_limit (cgroup v$version): ok"
