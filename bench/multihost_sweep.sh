#!/bin/sh
# Collectives and training over simulated hosts at link settings (issue 27 point 3; a benchmark,
# not a test). For each link latency and rate, on 2 hosts x 1 rank (every byte a collective moves
# crosses the link) through scripts/multihost:
#   - bench/multihost_rtt.sh: the link's measured UDP round trip;
#   - comm_bench --backend mpi: all_reduce, reduce_scatter, all_gather at 16 MiB (busbw, median of
#     3 runs);
#   - mxddp train --report: DDP + distributed optimizer, FSDP (optim_grads_params) with
#     fine-grained param gather off and on, all overlapped; the median exposed communication share
#     of the step over iterations 3 and later.
# Writes DIR/rtt_TAG.txt, DIR/comm_TAG.json, DIR/train_TAG_CASE.json and .out (TAG: RATE_LATENCY),
# then bench/multihost_plot.py draws and tabulates them against the ring model of the link.
#
#   multihost_sweep.sh BUILD_DIR OUT_DIR [RATES] [LATENCIES] [LOSS]
#     RATES: space-separated tc rates, "none" for an unshaped link (default "1gbit 2500mbit 5gbit
#     10gbit 25gbit none"); LATENCIES: "veth" for the harness's veth links (no latency added), or
#     a one-way host-to-host latency in microseconds through the harness's delaying wires
#     (--latency-us); default "veth". LOSS: the share of packets each link drops, each direction,
#     in percent (the harness's --loss), for comm_bench and mxddp train at every setting; default 0.
#     The file names do not carry it: one OUT_DIR per loss.
set -eu
build=$1 out=$2
rates=${3:-1gbit 2500mbit 5gbit 10gbit 25gbit none}
latencies=${4:-veth}
loss=${5:-0}
here=$(cd "$(dirname "$0")" && pwd)
harness=$here/../scripts/multihost/multihost.sh
mkdir -p "$out"
# --compute-threads 1: the simulated hosts share this machine's cores, and a rank alone on its
# "host" would otherwise take all of them (its OpenMP threads then fight the other host's rank and
# both progress threads, and steps varied 15x: 54 to 850 ms).
# 1.84M params; 512 tokens a rank a step (micro-batch 8), so that the step's compute (about 60 ms
# here) can cover its communication from about 1 Gbit/s up. DDP buckets of 250k elements (8
# buckets; Megatron's default, 40M, would make one bucket of this model, and nothing overlaps);
# FSDP's buckets are its units (one per layer).
model="--num-layers 4 --hidden-size 192 --num-attention-heads 4 --seq-length 64 --micro-batch-size 8
       --global-batch-size 16 --corpus-bytes 1048576 --eval-iters 0 --train-iters 8 --log-interval 1
       --compute-threads 1"
for lat in $latencies; do
  links=
  [ "$lat" = veth ] || links="--latency-us $lat"
  for rate in $rates; do
    tag=${rate}_$lat
    echo "== link $rate, latency $lat, loss $loss%"
    # The round trip without loss: udp_rtt.py gives up on a lost datagram, and loss adds no latency.
    # shellcheck disable=SC2086
    "$harness" --hosts 2 --ranks-per-host 1 --rate "$rate" $links -- sh "$here/multihost_rtt.sh" > "$out/rtt_$tag.txt" 2>&1
    # shellcheck disable=SC2086
    "$harness" --hosts 2 --ranks-per-host 1 --rate "$rate" --loss "$loss" $links -- \
      "$build/bench/comm_bench" --backend mpi --ops all_reduce,reduce_scatter,all_gather \
      --min-bytes 16777216 --max-bytes 16777216 --runs 3 --json "$out/comm_$tag.json" > "$out/comm_$tag.out" 2>&1
    for c in ddp fsdp_coarse fsdp_fine; do
      case $c in
        ddp) flags="--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 250000" ;;
        fsdp_coarse) flags="--use-megatron-fsdp --overlap-grad-reduce --overlap-param-gather --no-megatron-fsdp-enable-fine-grained-param-gather" ;;
        fsdp_fine) flags="--use-megatron-fsdp --overlap-grad-reduce --overlap-param-gather --megatron-fsdp-enable-fine-grained-param-gather" ;;
      esac
      # shellcheck disable=SC2086
      "$harness" --hosts 2 --ranks-per-host 1 --rate "$rate" --loss "$loss" $links -- \
        "$build/mxddp" train --backend mpi $model $flags --report "$out/train_${tag}_$c.json" > "$out/train_${tag}_$c.out" 2>&1
    done
  done
done
# Debian's python3 has matplotlib (python3-matplotlib); PYTHON overrides.
"${PYTHON:-/usr/bin/python3}" "$here/multihost_plot.py" "$out"
