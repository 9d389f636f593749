#!/bin/sh
# Runs an MPI program over simulated hosts: N network namespaces on a bridge, each link shaped by
# tc, ranks spread over them by mpirun on OpenMPI's TCP transport. Everything it makes is removed
# when it ends, however it ends (exit, error, Ctrl-C, SIGTERM). Needs root and iproute2.
#
#   multihost.sh [--hosts N] [--ranks-per-host R] [--rate RATE] [--loss PCT] [--latency-us US]
#                [--mpirun-flags] -- PROGRAM [ARGS...]
#
#   --hosts N            hosts (namespaces), default 2
#   --ranks-per-host R   ranks on each host, filled host by host (ranks 0..R-1 on host 0), default 2
#   --rate RATE          each link's bandwidth in tc's units (1gbit, 25gbit), both directions;
#                        default: unshaped
#   --loss PCT           share of packets each link drops, each direction (0 to 100), default 0
#   --latency-us US      one-way latency added between any two hosts, 0 to 1000000 us: each
#                        link becomes a delaying wire (mxddp_link_wire from the release build, or
#                        MH_WIRE) carrying frames half of it later each way; default: veth links
#   --mpirun-flags       print the launch flags the harness passes to mpirun, and exit
#
# Exits with mpirun's status. Example:
#   scripts/multihost/multihost.sh --hosts 2 --rate 10gbit -- build/release/mxddp train --backend mpi
set -u
MH_SELF_DIR=$(cd "$(dirname "$0")" && pwd)
. "$MH_SELF_DIR/netns_lib.sh"

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
hosts=2 per_host=2 rate=none loss=0 latency_us= print_flags=0
while [ $# -gt 0 ]; do
  case $1 in
    --hosts) hosts=${2:?--hosts needs a value}; shift 2 ;;
    --ranks-per-host) per_host=${2:?--ranks-per-host needs a value}; shift 2 ;;
    --rate) rate=${2:?--rate needs a value}; shift 2 ;;
    --loss) loss=${2:?--loss needs a value}; shift 2 ;;
    --latency-us) latency_us=${2:?--latency-us needs a value}; shift 2 ;;
    --mpirun-flags) print_flags=1; shift ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "multihost.sh: unknown argument '$1' (the program goes after --)" >&2; exit 2 ;;
  esac
done
case $per_host in ''|*[!0-9]*|0) echo "multihost.sh: --ranks-per-host '$per_host': a whole number from 1" >&2; exit 2 ;; esac
if [ "$print_flags" = 1 ]; then MH_DIR='$DIR'; mh_mpirun_flags; exit 0; fi
[ $# -ge 1 ] || { echo "multihost.sh: no program given (after --)" >&2; exit 2; }

mh_check_capable
trap 'mh_teardown' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mh_setup "$hosts" "$latency_us" || exit 1
if [ "$rate" != none ] || [ "$loss" != 0 ]; then
  i=0
  while [ "$i" -lt "$hosts" ]; do mh_shape "$i" "$rate" "$loss" || exit 1; i=$((i + 1)); done
fi
# In the background and waited for, so that a signal to this script runs its trap at once.
mh_mpirun "$per_host" "$@" &
mpirun_pid=$!
wait "$mpirun_pid"
exit $?
