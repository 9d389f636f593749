#!/bin/sh
# Same results across hosts (issue 27 point 2): mxddp train over 2 simulated hosts x 2 ranks (network
# namespaces, OpenMPI over TCP, scripts/multihost) gives bitwise the same training and validation
# losses as 4 ranks under one mpirun on this host (shared memory), for DDP with the distributed
# optimizer, each FSDP sharding strategy and MXFP8 (DDP and FSDP). Both runs take the harness's
# collective algorithms (mh_coll_flags), which depend on the rank count and the message size only,
# so the reduction order is the same on both.
#
#   same_results.sh MXDDP DIR [--latency-us US] [CASE...]     (cases: all when none given)
#       --latency-us: the hosts' links are the harness's delaying wires (tests/multihost/latency.sh)
#
# Exits 77 (skipped) where network namespaces cannot be made, saying why.
set -u
mxddp=$1 dir=$2; shift 2
latency_us=
[ "${1:-}" = --latency-us ] && { latency_us=$2; shift 2; }
MH_SELF_DIR=$(cd "$(dirname "$0")/../../scripts/multihost" && pwd)
. "$MH_SELF_DIR/netns_lib.sh"
mh_check_capable
trap 'mh_teardown' EXIT
trap 'exit 1' INT TERM HUP
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MH_LAUNCH_TIMEOUT_S=120  # each job's bound (ends it as a failure, torn down, not a CTest kill)
rm -rf "$dir" && mkdir -p "$dir" || exit 1

small="--train-iters 4 --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2
       --global-batch-size 8 --corpus-bytes 65536 --eval-interval 2 --eval-iters 1 --timeout-ms 60000"
flags_of() {
  case $1 in
    ddp) echo "--overlap-grad-reduce --overlap-param-gather" ;;
    fsdp_no_shard|fsdp_optim|fsdp_optim_grads|fsdp_optim_grads_params)
      echo "--use-megatron-fsdp --data-parallel-sharding-strategy ${1#fsdp_} --overlap-grad-reduce --overlap-param-gather" ;;
    ddp_mxfp8) echo "--bf16 --fp8-param-gather --overlap-grad-reduce --overlap-param-gather" ;;
    fsdp_mxfp8) echo "--use-megatron-fsdp --bf16 --fp8-param-gather --overlap-grad-reduce --overlap-param-gather" ;;
    *) return 1 ;;
  esac
}
cases=${*:-ddp fsdp_no_shard fsdp_optim fsdp_optim_grads fsdp_optim_grads_params ddp_mxfp8 fsdp_mxfp8}

mh_setup 2 $latency_us || { echo "FAIL: could not make the simulated hosts"; exit 1; }
# The losses of a metrics file, one "type iteration loss" a line (the JSON's own round-trip text).
# (nlohmann::json writes the keys sorted: iteration, lm_loss, type.)
losses() { sed -n 's/.*"iteration":\([0-9]*\).*"lm_loss":\([^,}]*\).*"type":"\([a-z]*\)".*/\3 \1 \2/p' "$1"; }
failed=0
for c in $cases; do
  flags=$(flags_of "$c") || { echo "FAIL: unknown case $c"; exit 2; }
  # shellcheck disable=SC2086
  timeout --kill-after=5 120 mpirun --allow-run-as-root --oversubscribe --bind-to none $(mh_coll_flags) -np 4 "$mxddp" train --backend mpi $small $flags \
    --metrics-file "$dir/$c.one_host.jsonl" > "$dir/$c.one_host.log" 2>&1 \
    || { echo "FAIL: $c on one host exited $?"; tail -5 "$dir/$c.one_host.log"; failed=1; continue; }
  # shellcheck disable=SC2086
  mh_mpirun 2 "$mxddp" train --backend mpi $small $flags --metrics-file "$dir/$c.two_hosts.jsonl" \
    > "$dir/$c.two_hosts.log" 2>&1 \
    || { echo "FAIL: $c on 2 hosts x 2 ranks exited $?"; tail -5 "$dir/$c.two_hosts.log"; failed=1; continue; }
  losses "$dir/$c.one_host.jsonl" > "$dir/$c.one_host.losses"
  losses "$dir/$c.two_hosts.jsonl" > "$dir/$c.two_hosts.losses"
  n=$(grep -c . "$dir/$c.one_host.losses")
  if [ "$n" -lt 6 ]; then
    echo "FAIL: $c: $n losses in the one-host metrics (4 iterations and 2 validations expected)"; failed=1
  elif cmp -s "$dir/$c.one_host.losses" "$dir/$c.two_hosts.losses"; then
    echo "same: $c: $n losses bitwise ($(tail -1 "$dir/$c.one_host.losses"))"
  else
    echo "FAIL: $c: the losses differ (one host | two hosts):"; paste "$dir/$c.one_host.losses" "$dir/$c.two_hosts.losses"
    failed=1
  fi
done
exit $failed
