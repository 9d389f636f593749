#!/bin/sh
# The harness leaves nothing behind (issue 27 point 1): scripts/multihost/multihost.sh run to its
# end, to an error (the program fails; a bad flag after the hosts exist), and stopped by SIGTERM
# (with delaying wires for links) and by SIGINT (Ctrl-C) mid-run; after each, no namespace, link
# or process of that run (a wire's among them) remains.
# It also checks the ranks ran where the harness says: 2 per host, each in its own host's
# namespace, and the root namespace got no interface.
#
#   teardown.sh MXDDP DIR
#
# Exits 77 (skipped) where network namespaces cannot be made, saying why.
set -u
mxddp=$1 dir=$2
here=$(cd "$(dirname "$0")" && pwd)
harness=$here/../../scripts/multihost/multihost.sh
MH_SELF_DIR=$(cd "$here/../../scripts/multihost" && pwd)
. "$MH_SELF_DIR/netns_lib.sh"
mh_check_capable
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
rm -rf "$dir" && mkdir -p "$dir" || exit 1
root_links_before=$(ip -o link show | wc -l)
harness_pid=
cleanup() { [ -n "$harness_pid" ] && kill -KILL "$harness_pid" 2>/dev/null; return 0; }
trap cleanup EXIT
trap 'exit 1' INT TERM HUP
fail() { echo "FAIL: $*"; for f in "$dir"/*.out; do echo "--- $f"; tail -c 1500 "$f"; done; exit 1; }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

# Nothing of run PID remains: namespaces, links, processes in them.
check_gone() {
  what=$1 pid=$2
  left=$(ip netns list | awk '{print $1}' | grep "^mh${pid}[hb]")
  [ -z "$left" ] || fail "$what: namespaces left behind: $left"
  left=$(ip -o link show | grep "mh${pid}")
  [ -z "$left" ] || fail "$what: links left behind: $left"
  [ -z "$(ls -d "${TMPDIR:-/tmp}/mh${pid}."* 2>/dev/null)" ] || fail "$what: its temporary directory is left behind"
  [ "$(ip -o link show | wc -l)" -eq "$root_links_before" ] || fail "$what: the root namespace's links changed"
  left=$(pgrep -af -- "--switch-netns mh${pid}br")
  [ -z "$left" ] || fail "$what: a link wire is left running: $left"
}

# Where each rank ran: its host's namespace (by the network namespace's inode).
placement=$dir/placement.sh
cat > "$placement" <<'INNER'
#!/bin/sh
echo "rank $OMPI_COMM_WORLD_RANK net $(readlink /proc/self/ns/net)"
INNER
chmod +x "$placement"
"$harness" --hosts 2 --ranks-per-host 2 -- "$placement" > "$dir/exit.out" 2>&1 &
harness_pid=$!
# The namespaces' inodes, while the run exists.
t0=$(now_ms)
until ip netns list | grep -q "^mh${harness_pid}h1" || ! kill -0 "$harness_pid" 2>/dev/null; do sleep 0.05; done
ns0=$(ip netns exec "mh${harness_pid}h0" readlink /proc/self/ns/net 2>/dev/null)
ns1=$(ip netns exec "mh${harness_pid}h1" readlink /proc/self/ns/net 2>/dev/null)
wait "$harness_pid"; rc=$?
[ "$rc" -eq 0 ] || fail "exit: the harness exited $rc"
check_gone exit "$harness_pid"
for r in 0 1; do grep -Fqx "rank $r net $ns0" "$dir/exit.out" || fail "rank $r did not run in host 0's namespace ($ns0)"; done
for r in 2 3; do grep -Fqx "rank $r net $ns1" "$dir/exit.out" || fail "rank $r did not run in host 1's namespace ($ns1)"; done
echo "exit: ranks 0, 1 in host 0's namespace, 2, 3 in host 1's; nothing left"

"$harness" --hosts 2 -- sh -c 'exit 5' > "$dir/error.out" 2>&1 &
harness_pid=$!
wait "$harness_pid"; rc=$?
[ "$rc" -ne 0 ] || fail "error: the harness exited 0 although the program exited 5"
check_gone error "$harness_pid"
"$harness" --hosts 2 --loss 101 -- true > "$dir/bad_flag.out" 2>&1 &
harness_pid=$!
wait "$harness_pid"; rc=$?
[ "$rc" -ne 0 ] || fail "bad flag: the harness exited 0 with --loss 101"
grep -q "loss 101: 0 to 100" "$dir/bad_flag.out" || fail "bad flag: no message naming --loss 101 and the valid range"
check_gone "bad flag" "$harness_pid"
echo "error: exit $rc and nothing left; --loss 101 refused, nothing left"

# SIGTERM with delaying wires for links (--latency-us; their processes must go too), SIGINT with veth.
for sig in TERM INT; do
  links=
  [ "$sig" = TERM ] && links="--latency-us 100"
  # env --default-signal: a background job of a script starts with SIGINT ignored, as Ctrl-C
  # from a terminal would not find it; the harness must see it as a user's Ctrl-C reaches it.
  # shellcheck disable=SC2086
  env --default-signal=INT "$harness" --hosts 2 $links -- "$mxddp" train --backend mpi --train-iters 100000 \
    --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2 \
    --global-batch-size 8 --corpus-bytes 65536 --eval-iters 0 --log-interval 1 > "$dir/$sig.out" 2>&1 &
  harness_pid=$!
  t0=$(now_ms)
  until grep -q "lm loss: [0-9]" "$dir/$sig.out"; do
    kill -0 "$harness_pid" 2>/dev/null || fail "SIG$sig: the run ended before training started"
    [ $(( $(now_ms) - t0 )) -gt 60000 ] && fail "SIG$sig: training did not start within 60 s"
    sleep 0.1
  done
  kill -"$sig" "$harness_pid"
  wait "$harness_pid"; rc=$?
  [ "$rc" -ne 0 ] || fail "SIG$sig: the harness exited 0"
  check_gone "SIG$sig" "$harness_pid"
  echo "SIG$sig mid-run: exit $rc and nothing left"
done
harness_pid=
