#!/bin/sh
# One rank per host, started by scripts/multihost/multihost.sh: the median UDP round trip between
# the first two hosts (tests/multihost/udp_rtt.py), 200 datagrams, printed by rank 0 as
# "rtt_us N". bench/multihost_sweep.sh runs it at each link setting: the latency a link really adds
# (the delaying wire's own cost included) is what the ring model is given.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
udp_rtt=$here/../tests/multihost/udp_rtt.py
case ${OMPI_COMM_WORLD_RANK:?run under mpirun} in
  1) exec /usr/bin/python3 "$udp_rtt" echo 9700 20 ;;
  0) sleep 0.5; echo "rtt_us $(/usr/bin/python3 "$udp_rtt" ping 10.77.0.2 9700 200)" ;;
  *) ;;
esac
