#!/bin/sh
# Link latency between simulated hosts (issue 27 points 1 and 3; scripts/multihost's delaying wire,
# mxddp_link_wire): UDP round trips between 2 hosts, one datagram at a time.
#   - on plain veth links the round trip is under LATENCY_US (the reference: no added delay);
#   - over wires made with --latency-us LATENCY_US (one way) it is at least 2 x LATENCY_US, and at
#     most that plus BOUND_US of scheduling and Python (a loaded CI machine's margin);
#   - training over the wires (2 hosts x 2 ranks, DDP + distributed optimizer; same_results.sh)
#     gives bitwise the losses of 4 ranks on one host: frames (TCP's 64 KiB segments, through the
#     wires' offloads) arrive whole and in order.
#
#   latency.sh MXDDP DIR
#
# Exits 77 (skipped) where network namespaces or TAP devices cannot be made, saying why.
set -u
mxddp=$1 dir=$2
here=$(cd "$(dirname "$0")" && pwd)
MH_SELF_DIR=$(cd "$here/../../scripts/multihost" && pwd)
. "$MH_SELF_DIR/netns_lib.sh"
mh_check_capable
[ -c /dev/net/tun ] || { echo "SKIP: no /dev/net/tun (CONFIG_TUN): the delaying wire needs TAP devices"; exit 77; }
# The wire beside the mxddp under test (both are the build tree's top-level programs).
export MH_WIRE=${MH_WIRE:-$(dirname "$mxddp")/mxddp_link_wire}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MH_LAUNCH_TIMEOUT_S=120
trap 'mh_teardown' EXIT
trap 'exit 1' INT TERM HUP
rm -rf "$dir" && mkdir -p "$dir" || exit 1
latency_us=3000
bound_us=3000
python=/usr/bin/python3
fail() { echo "FAIL: $*"; exit 1; }

# The median UDP round trip from host 0 to host 1, in microseconds.
round_trip_us() {
  ip netns exec "$(mh_host 1)" "$python" "$here/udp_rtt.py" echo 9700 30 &
  echo_pid=$!
  sleep 0.5
  rtt=$(ip netns exec "$(mh_host 0)" "$python" "$here/udp_rtt.py" ping "$(mh_addr 1)" 9700 30) || rtt=
  kill "$echo_pid" 2>/dev/null; wait "$echo_pid" 2>/dev/null
  echo "$rtt"
}

mh_setup 2 || fail "could not make the simulated hosts (veth)"
veth_us=$(round_trip_us)
[ -n "$veth_us" ] || fail "no round trip over veth links"
[ "$veth_us" -lt "$latency_us" ] || fail "veth round trip $veth_us us: not under $latency_us us (the reference)"
mh_teardown

mh_setup 2 "$latency_us" || fail "could not make the simulated hosts (wires, $latency_us us)"
wire_us=$(round_trip_us)
[ -n "$wire_us" ] || fail "no round trip over the wires"
low=$((2 * latency_us)) high=$((2 * latency_us + bound_us))
[ "$wire_us" -ge "$low" ] && [ "$wire_us" -le "$high" ] \
  || fail "round trip over wires of $latency_us us one way: $wire_us us, outside [$low, $high]"
echo "round trip: veth $veth_us us; wires of $latency_us us one way $wire_us us (bounds $low..$high)"

# Training over the wires against one host, bitwise (same_results.sh's DDP case, with wires).
mh_teardown
sh "$here/same_results.sh" "$mxddp" "$dir/training" --latency-us "$latency_us" ddp \
  || fail "training over the wires of $latency_us us"
