#!/bin/sh
# OpenMPI's remote-launch agent for hosts simulated by network namespaces (plm_rsh_agent).
#
# mpirun's rsh launcher runs "AGENT HOST COMMAND..." where COMMAND is written for the remote
# login shell (it sets PATH and LD_LIBRARY_PATH before starting orted). Here HOST is the name of a
# network namespace made by netns_lib.sh, and "logging in" is entering it: the command runs on
# this machine, inside that namespace, with only that namespace's interfaces.
set -eu
[ $# -ge 2 ] || { echo "netns_agent.sh: usage: netns_agent.sh NAMESPACE COMMAND..." >&2; exit 2; }
host=$1
shift
# Only namespaces of this harness (mh<pid>h<index>): a hostfile naming anything else is a mistake,
# and this agent must never enter a namespace it did not make.
case $host in
  mh[0-9]*h[0-9]*) ;;
  *) echo "netns_agent.sh: '$host' is not a namespace of the multihost harness (mh<pid>h<index>)" >&2; exit 2 ;;
esac
# The daemon runs in a session of its own (setsid -f), detached from mpirun's process tree, as on a
# real remote host: mpirun (or its end) cannot signal it, so a daemon cut off from mpirun must end
# by itself, which is what the fault tests check. The agent exits 0 at once, which OpenMPI's rsh
# launcher accepts (the daemon reports back over TCP).
#
# It also gets a hostname of its own (a private UTS namespace named after the host): OpenMPI names
# each daemon's session directory (/tmp/ompi.HOSTNAME.UID/...) after it, and two daemons of one
# job under the same name race to create the same directories; one of them then fails orte_init
# ("File exists") and mpirun waits forever (seen in 1 launch of 15 before this).
exec ip netns exec "$host" unshare --uts setsid -f sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
