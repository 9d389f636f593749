# The multihost harness's library (POSIX sh, sourced): hosts simulated by network namespaces on
# this machine, joined by veth pairs to a bridge in a namespace of its own, shaped by tc, and
# mpirun spreading ranks over them on OpenMPI's TCP transport. See docs/multihost.md.
#
# Everything it makes is named mh<pid>... (the pid of the shell that sourced it), so runs in
# parallel never collide, and everything lives in those namespaces: the hosts' addresses
# (10.77.0.<index + 1>/24) exist only there, and the root namespace gets nothing (no interface, no
# address, no route). mh_teardown removes it all; callers trap EXIT, INT and TERM to it.
#
#   mh_check_capable            exits 77 (CTest's skip) naming why this machine cannot run it
#   mh_setup HOSTS [LATENCY_US] the namespaces, links and bridge (sets MH_HOSTS, MH_DIR); links
#                               are veth pairs, or with LATENCY_US (a whole number of microseconds,
#                               0 to 1000000) delaying wires that add that one-way latency between
#                               any two hosts (mxddp_link_wire, at MH_WIRE)
#   mh_shape INDEX RATE LOSS    shapes host INDEX's link both ways (RATE: tc's, e.g. 10gbit, or
#                               "none"; LOSS: percent, 0 to 100)
#   mh_link_down INDEX          takes host INDEX's link down from inside its namespace
#   mh_mpirun RANKS_PER_HOST PROGRAM ARGS...
#                               mpirun in host 0's namespace, ranks filled host by host, on every
#                               host (or those of MH_HOSTFILE, e.g. mh_hostfile 0 > FILE)
#   mh_hostfile INDEX...        prints a hostfile of those hosts
#   mh_teardown                 kills what still runs in the namespaces, deletes them
#   mh_leftovers                prints every namespace or link of this run still present
#
# Settings from the environment: MH_KEEPALIVE_S, MH_KEEPALIVE_INTVL_S, MH_KEEPALIVE_PROBES (the
# runtime's TCP keepalive; 5, 1, 3), MH_TCP_RETRIES2 (4), MH_SLOTS (64 per host),
# MH_LAUNCH_TIMEOUT_S (mh_mpirun's limit; none), MH_WIRE (the delaying link's program; the
# release build's build/release/mxddp_link_wire).

MH_SELF_DIR=${MH_SELF_DIR:-$(cd "$(dirname "$0")" && pwd)}
MH_PREFIX=mh$$
MH_HOSTS=0
MH_DIR=
MH_COLL_RULES=

mh_host() { echo "${MH_PREFIX}h$1"; }
mh_bridge_ns() { echo "${MH_PREFIX}br"; }
mh_addr() { echo "10.77.0.$(($1 + 1))"; }

mh_check_capable() {
  if [ "$(id -u)" != 0 ]; then echo "SKIP: network namespaces need root (uid $(id -u))"; exit 77; fi
  for tool in ip tc mpirun orted unshare setsid; do
    command -v "$tool" >/dev/null 2>&1 || { echo "SKIP: $tool is not installed (iproute2, OpenMPI, util-linux)"; exit 77; }
  done
  probe=${MH_PREFIX}probe
  if ! ip netns add "$probe" 2>/dev/null; then echo "SKIP: 'ip netns add' is not permitted here (no CAP_SYS_ADMIN or no netns support)"; exit 77; fi
  ok=1
  ip -n "$probe" link add eth0 type veth peer name eth1 2>/dev/null || ok=0
  ip netns del "$probe" 2>/dev/null
  [ "$ok" = 1 ] || { echo "SKIP: the kernel cannot make veth pairs (CONFIG_VETH)"; exit 77; }
}

mh_fail() { echo "multihost: $*" >&2; return 1; }

mh_wire() { echo "${MH_WIRE:-$MH_SELF_DIR/../../build/release/mxddp_link_wire}"; }

# Waits until device $2 exists in namespace $1 (the wire makes its devices after it starts).
mh_wait_device() {
  tries=0
  until ip -n "$1" link show "$2" >/dev/null 2>&1; do
    tries=$((tries + 1)); [ "$tries" -gt 50 ] && return 1
    sleep 0.1
  done
}

mh_setup() {
  n=$1 mh_latency_us=${2:-}
  case $n in ''|*[!0-9]*) mh_fail "host count '$n' is not a number"; return 1 ;; esac
  [ "$n" -ge 1 ] && [ "$n" -le 200 ] || { mh_fail "host count $n: 1 to 200"; return 1; }
  if [ -n "$mh_latency_us" ]; then
    case $mh_latency_us in *[!0-9]*) mh_fail "latency '$mh_latency_us' is not a whole number of microseconds"; return 1 ;; esac
    [ "${#mh_latency_us}" -le 7 ] && [ "$mh_latency_us" -le 1000000 ] \
      || { mh_fail "latency $mh_latency_us us: 0 to 1000000 (1 s)"; return 1; }
    [ -x "$(mh_wire)" ] || { mh_fail "link latency needs mxddp_link_wire, not found at $(mh_wire) (build the release preset, or set MH_WIRE)"; return 1; }
  fi
  MH_DIR=$(mktemp -d "${TMPDIR:-/tmp}/${MH_PREFIX}.XXXXXX") || return 1
  if [ -n "$mh_latency_us" ]; then
    # Over the wires: coll_rules.conf's rules with coll_rules_wire.conf's all-gather rule ahead of
    # them (OpenMPI reads the collectives in ascending id order; all-gather's is 0).
    mh_rules=$(grep -v '^#' "$MH_SELF_DIR/coll_rules.conf")
    { echo "$(($(echo "$mh_rules" | head -1 | cut -d' ' -f1) + 1))            # collectives below"
      grep -v '^#' "$MH_SELF_DIR/coll_rules_wire.conf"
      echo "$mh_rules" | tail -n +2; } > "$MH_DIR/coll_rules.conf" || return 1
    MH_COLL_RULES=$MH_DIR/coll_rules.conf
  fi
  br=$(mh_bridge_ns)
  ip netns add "$br" || return 1
  ip -n "$br" link add br0 type bridge || return 1
  ip -n "$br" link set br0 up || return 1
  : > "$MH_DIR/hostfile"
  i=0
  while [ "$i" -lt "$n" ]; do
    h=$(mh_host "$i")
    ip netns add "$h" || return 1
    MH_HOSTS=$((i + 1))
    if [ -z "$mh_latency_us" ]; then
      # Both ends are made inside the namespaces: nothing passes through the root namespace.
      ip -n "$h" link add eth0 type veth peer name "p$i" netns "$br" || return 1
    else
      # The wire makes both ends itself, as TAP devices inside the two namespaces, and carries
      # frames between them half the latency later each way: a host-to-host path crosses two
      # wires. It lives in the bridge's namespace, so the teardown ends it with the rest.
      "$(mh_wire)" --host-netns "$h" --host-dev eth0 --switch-netns "$br" --switch-dev "p$i" \
        --delay-ns $((mh_latency_us * 500)) 2>> "$MH_DIR/wire$i.log" &
      { mh_wait_device "$h" eth0 && mh_wait_device "$br" "p$i"; } \
        || { mh_fail "host $i's wire did not make its devices: $(cat "$MH_DIR/wire$i.log")"; return 1; }
    fi
    ip -n "$br" link set "p$i" master br0 up || return 1
    ip -n "$h" addr add "$(mh_addr "$i")/24" dev eth0 || return 1
    ip -n "$h" link set lo up || return 1
    ip -n "$h" link set eth0 up || return 1
    # How long TCP data that is never acknowledged is retransmitted before the connection fails
    # (per namespace): 4 retries, about 6 s, not Linux's default 15 (about 15 minutes). mpirun's
    # kill order to a daemon behind a dead link is such data, and while it is unacknowledged TCP
    # sends no keepalive. On real hosts this is the same sysctl: see docs/multihost.md, Faults.
    ip netns exec "$h" sysctl -q -w net.ipv4.tcp_retries2="${MH_TCP_RETRIES2:-4}" || return 1
    echo "$h slots=${MH_SLOTS:-64}" >> "$MH_DIR/hostfile"
    i=$((i + 1))
  done
  # Wait until every host reaches every other (the bridge learns, the links come up).
  i=0
  while [ "$i" -lt "$n" ]; do
    tries=0
    until ip -n "$(mh_host "$i")" link show eth0 | grep -q "[<,]LOWER_UP[,>]"; do
      tries=$((tries + 1)); [ "$tries" -gt 50 ] && { mh_fail "host $i's link did not come up"; return 1; }
      sleep 0.1
    done
    i=$((i + 1))
  done
}

# tc on one end of a link: an HTB class at RATE for all traffic; with LOSS, a classic-BPF
# classifier sends that share of packets (by the kernel's random number) to a class whose queue
# holds nothing, so they are dropped.
mh_shape_dev() {
  ns=$1 dev=$2 rate=$3 loss=$4
  tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null
  [ "$rate" = none ] && rate=100gbit
  tc -n "$ns" qdisc add dev "$dev" root handle 1: htb default 1 r2q 100000 || return 1
  # A 1 MB burst: HTB's default (a few packets at the rate) held TCP over a 10gbit class to 2.5 of
  # the 3.5 Gbit/s the veth carried unshaped; with it, 3.5 (on this machine).
  tc -n "$ns" class add dev "$dev" parent 1: classid 1:1 htb rate "$rate" ceil "$rate" burst 1m cburst 1m || return 1
  [ "$loss" = 0 ] && return 0
  tc -n "$ns" class add dev "$dev" parent 1: classid 1:2 htb rate 1mbit quantum 1514 || return 1
  tc -n "$ns" qdisc add dev "$dev" parent 1:2 handle 2: pfifo limit 0 || return 1
  # threshold = (1 - loss / 100) * 2^32: a random u32 at or above it is dropped.
  keep=$(awk -v l="$loss" 'BEGIN { printf "%.0f", (1 - l / 100) * 4294967296 }')
  if [ "$keep" -le 0 ]; then
    prog="1,6 0 0 65538"  # return 1:2: every packet
  else
    # A = random; if A >= keep goto drop; else return 1:1
    prog="4,32 0 0 4294963256,53 1 0 $keep,6 0 0 65537,6 0 0 65538"
  fi
  tc -n "$ns" filter add dev "$dev" parent 1: prio 1 bpf bytecode "$prog" || return 1
}

mh_shape() {
  i=$1 rate=$2 loss=$3
  case $loss in ''|*[!0-9.]*) mh_fail "loss '$loss' is not a percentage"; return 1 ;; esac
  awk -v l="$loss" 'BEGIN { exit !(l >= 0 && l <= 100) }' || { mh_fail "loss $loss: 0 to 100 (percent)"; return 1; }
  # Each direction of the link is shaped where it leaves: the host's eth0 and the bridge's port.
  mh_shape_dev "$(mh_host "$i")" eth0 "$rate" "$loss" || return 1
  mh_shape_dev "$(mh_bridge_ns)" "p$i" "$rate" "$loss"
}

mh_hostfile() { for i in "$@"; do echo "$(mh_host "$i") slots=${MH_SLOTS:-64}"; done; }

mh_link_down() { ip -n "$(mh_host "$1")" link set eth0 down; }

# The launch flags, one place (documented in docs/multihost.md).
mh_mpirun_flags() {
  echo "--allow-run-as-root --oversubscribe --bind-to none --hostfile ${MH_HOSTFILE:-$MH_DIR/hostfile}"
  # The launcher reaches each host through the agent; no tree spawn (each daemon from mpirun).
  echo "--mca plm_rsh_agent $MH_SELF_DIR/netns_agent.sh --mca plm_rsh_no_tree_spawn 1 --mca routed direct"
  # TCP between all ranks (no shared memory, even between ranks of one host), on the hosts' links only.
  echo "--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24"
  # mpirun and its daemons notice an idle connection whose peer went silent: TCP keepalive on the
  # runtime's connections (OpenMPI's defaults, 300 s + 9 x 20 s, leave a cut-off job hanging for 8
  # minutes). A live peer's kernel answers the probes, so a busy host never trips them.
  echo "--mca oob_tcp_keepalive_time ${MH_KEEPALIVE_S:-5} --mca oob_tcp_keepalive_intvl ${MH_KEEPALIVE_INTVL_S:-1}"
  echo "--mca oob_tcp_keepalive_probes ${MH_KEEPALIVE_PROBES:-3}"
  mh_coll_flags
}

# OpenMPI's collective algorithms for bandwidth over TCP links (coll_rules.conf says which and why;
# over the delaying wires with coll_rules_wire.conf's all-gather rule added, see mh_setup). A run compared
# bitwise with these hosts' runs passes them too: the algorithm fixes the reduction order.
mh_coll_flags() {
  echo "--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_dynamic_rules_filename ${MH_COLL_RULES:-$MH_SELF_DIR/coll_rules.conf}"
}

mh_mpirun() {
  per_host=$1; shift
  np=$((per_host * $(grep -c . "${MH_HOSTFILE:-$MH_DIR/hostfile}")))
  # With MH_LAUNCH_TIMEOUT_S, a job still running that long is killed (exit 124): a test's bound,
  # so that it fails and tears down instead of being killed from outside with its namespaces.
  limit=
  [ -n "${MH_LAUNCH_TIMEOUT_S:-}" ] && limit="timeout --kill-after=5 $MH_LAUNCH_TIMEOUT_S"
  # shellcheck disable=SC2046,SC2086
  $limit ip netns exec "$(mh_host 0)" mpirun $(mh_mpirun_flags) -np "$np" --map-by "ppr:$per_host:node" "$@"
}

mh_our_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | while read -r ns; do
    case $ns in "$MH_PREFIX"h[0-9]*|"$MH_PREFIX"br) echo "$ns" ;; esac
  done
}

mh_teardown() {
  trap '' INT TERM HUP  # a second Ctrl-C must not cut the teardown short
  # Whatever still runs in one of our namespaces is ours (mpirun, its daemons, ranks): asked to
  # end (mpirun passes SIGTERM on to its ranks), then killed after 3 s.
  namespaces=$(mh_our_namespaces)
  pids=$(for ns in $namespaces; do ip netns pids "$ns" 2>/dev/null; done)
  if [ -n "$pids" ]; then
    for p in $pids; do kill -TERM "$p" 2>/dev/null; done
    tries=0
    while [ "$tries" -lt 30 ]; do
      alive=
      for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ -z "$alive" ] && break
      sleep 0.1; tries=$((tries + 1))
    done
    for ns in $namespaces; do
      for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
    done
  fi
  for ns in $namespaces; do ip netns del "$ns" 2>/dev/null; done
  # The daemons' session directories, named after our hosts (see netns_agent.sh): a killed daemon
  # leaves its own behind.
  rm -rf "${TMPDIR:-/tmp}/ompi.$MH_PREFIX"h[0-9]*
  [ -n "$MH_DIR" ] && rm -rf "$MH_DIR"
  MH_DIR=
  MH_HOSTS=0
  MH_COLL_RULES=
  return 0
}

mh_leftovers() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep "^$MH_PREFIX" || true
  ip -o link show 2>/dev/null | grep "$MH_PREFIX" || true
}
