#!/bin/sh
# HSDP across simulated hosts (issue 43 item 5): mxddp.torch's FullyShardedDataParallel with a
# (replicate, shard) DeviceMesh over 2 hosts x 2 ranks (network namespaces, OpenMPI over TCP,
# scripts/multihost), the shard group inside each host, so that the reduce-scatters and gathers stay
# on a host and only the replica all-reduce crosses the link; its losses equal DDP's over the 4
# ranks within 1e-5 (tests/multihost/hsdp_job.py).
#
#   hsdp.sh PYTHON PYTHONPATH DIR
#       PYTHON: the interpreter with torch; PYTHONPATH: where mxddp's package is (a build's python_pkg)
#
# Exits 77 (skipped) where network namespaces cannot be made, or the package has no HSDP, saying why.
set -u
python=$1 pkg=$2 dir=$3
MH_SELF_DIR=$(cd "$(dirname "$0")/../../scripts/multihost" && pwd)
. "$MH_SELF_DIR/netns_lib.sh"
mh_check_capable
trap 'mh_teardown' EXIT
trap 'exit 1' INT TERM HUP
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MH_LAUNCH_TIMEOUT_S=240
rm -rf "$dir" && mkdir -p "$dir" || exit 1
mh_setup 2 || { echo "FAIL: could not make the simulated hosts"; exit 1; }
# gloo (torch.distributed and mxddp's communicators over its groups) binds to each host's eth0;
# rank 0's store listens at host 0's address.
# Rank 0 writes its verdict to HSDP_VERDICT: the log's lines from different ranks can interleave.
export PYTHONPATH="$pkg" GLOO_SOCKET_IFNAME=eth0 HSDP_MASTER_ADDR="$(mh_addr 0)" HSDP_VERDICT="$dir/verdict"
mh_mpirun 2 -x PYTHONPATH -x GLOO_SOCKET_IFNAME -x HSDP_MASTER_ADDR -x HSDP_VERDICT \
  "$python" "$(dirname "$0")/hsdp_job.py" > "$dir/hsdp.log" 2>&1
rc=$?
cat "$dir/hsdp.log"
verdict=$(cat "$dir/verdict" 2>/dev/null)
case $verdict in SKIP:*) exit 77 ;; esac
[ "$rc" = 0 ] && [ "$verdict" = ok ] || { echo "FAIL: the HSDP job exited $rc with verdict '${verdict:-none}'"; exit 1; }
echo "same: HSDP 2 hosts x 2 ranks within 1e-5 of DDP over 4"
