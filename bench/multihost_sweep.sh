#!/bin/sh
# Collectives and training over simulated hosts at link settings (issue 27 point 3; a benchmark,
# not a test). For each link rate, on 2 hosts x 1 rank (every byte a collective moves crosses the
# link) through scripts/multihost:
#   - comm_bench --backend mpi: all_reduce, reduce_scatter, all_gather at 16 MiB (busbw);
#   - mxddp train --report: DDP + distributed optimizer, FSDP (optim_grads_params) with
#     fine-grained param gather off and on, all overlapped; the median exposed communication share
#     of the step over iterations 3 and later.
# Writes DIR/comm_RATE.json, DIR/train_RATE_CASE.json and .out, then bench/multihost_plot.py draws
# and tabulates them against the ring model of the link.
#
#   multihost_sweep.sh BUILD_DIR OUT_DIR [RATES] [LATENCIES_US]
#     RATES: space-separated tc rates, "none" for the unshaped veth (default "1gbit 2500mbit 5gbit
#     10gbit 25gbit none"); LATENCIES_US (default "0"): needs netem in the kernel.
set -eu
build=$1 out=$2
rates=${3:-1gbit 2500mbit 5gbit 10gbit 25gbit none}
latencies=${4:-0}
here=$(cd "$(dirname "$0")" && pwd)
harness=$here/../scripts/multihost/multihost.sh
mkdir -p "$out"
model="--num-layers 4 --hidden-size 192 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2
       --global-batch-size 4 --corpus-bytes 1048576 --eval-iters 0 --train-iters 6 --log-interval 1"
for lat in $latencies; do
  for rate in $rates; do
    tag=${rate}_${lat}us
    echo "== link $rate, latency ${lat} us"
    "$harness" --hosts 2 --ranks-per-host 1 --rate "$rate" --latency-us "$lat" -- \
      "$build/bench/comm_bench" --backend mpi --ops all_reduce,reduce_scatter,all_gather \
      --min-bytes 16777216 --max-bytes 16777216 --runs 1 --json "$out/comm_$tag.json" > "$out/comm_$tag.out" 2>&1
    for c in ddp fsdp_coarse fsdp_fine; do
      case $c in
        ddp) flags="--overlap-grad-reduce --overlap-param-gather" ;;
        fsdp_coarse) flags="--use-megatron-fsdp --overlap-grad-reduce --overlap-param-gather --no-megatron-fsdp-enable-fine-grained-param-gather" ;;
        fsdp_fine) flags="--use-megatron-fsdp --overlap-grad-reduce --overlap-param-gather --megatron-fsdp-enable-fine-grained-param-gather" ;;
      esac
      # shellcheck disable=SC2086
      "$harness" --hosts 2 --ranks-per-host 1 --rate "$rate" --latency-us "$lat" -- \
        "$build/mxddp" train --backend mpi $model $flags --report "$out/train_${tag}_$c.json" > "$out/train_${tag}_$c.out" 2>&1
    done
  done
done
# Debian's python3 has matplotlib (python3-matplotlib); PYTHON overrides.
"${PYTHON:-/usr/bin/python3}" "$here/multihost_plot.py" "$out"
