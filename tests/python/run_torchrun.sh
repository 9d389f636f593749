#!/bin/sh
# CTest's python_torchrun_*: mxddp on torch.distributed's ranks (torchrun, gloo). Modes:
#   basics  tests/python/torchrun/torchrun_basics.py at 2 ranks (pytest under torchrun)
#   suite   the parity files of the user's optimizer, lr schedulers, GradScaler, torch DDP's
#           semantics, unused params, DCP, collective dtypes and unwrapped torch optimizers
#           (test_torch_grads.py) at 2 ranks (pytest under torchrun)
#   groups  tests/python/torchrun/torchrun_groups.py at 4 ranks
#   parity  parity_job.py under mpirun and under torchrun, f32 and bf16: the same losses,
#           bitwise (2 ranks: every sum has two terms, and both backends reduce bf16 in f32)
#   no_init parity_job.py --no-init under torchrun (the script's own init_process_group, no
#           mxt.init(): the first DistributedDataParallel starts mxddp): mpirun's losses
#   srun    parity_job.py as srun without MPI starts it (SLURM_PROCID, SLURM_NTASKS, MASTER_ADDR,
#           MASTER_PORT; two plain processes here): mpirun's losses; and without MASTER_ADDR,
#           mxt.init() refuses naming it
#   timeout timeout_job.py: a peer late past mxt.init(timeout_s=3): rank 0's collective fails in
#           about 3 s with gloo's timeout message in an mxddp Error, and the job ends
#   raise   raise_job.py: rank 1 raises in backward; the job must end non-zero with its error
#           within 50 s (the script's timeout is 60 s)
# usage: run_torchrun.sh VENV MPIEXEC MODE
# Exits 77 (CTest's skip) without torch or the package.
set -u
venv=$1 mpiexec=$2 mode=$3
here=$(cd "$(dirname "$0")" && pwd)
if ! "$venv/bin/python" -c "import torch.distributed, mxddp.torch" 2>/dev/null; then
  echo "SKIP: $venv has no torch or mxddp (scripts/setup.sh, then CTest's python_package_install)"
  exit 77
fi
port() { "$venv/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
torchrun() {  # NPROC ARGS...: one torchrun job on this host, at a free port
  np=$1; shift
  timeout 300 "$venv/bin/torchrun" --nproc_per_node "$np" --master_addr 127.0.0.1 --master_port "$(port)" "$@"
}
same() {  # MPI_JSON TORCH_JSON: the runs' backends and identical losses
  "$venv/bin/python" - "$1" "$2" <<'PY'
import json, sys
mpi, other = (json.load(open(p)) for p in sys.argv[1:3])
assert (mpi["backend"], other["backend"]) == ("mpi", "torch"), (mpi, other)
assert other["losses"] == mpi["losses"], f"{sys.argv[2]}: {other['losses']} vs mpirun's {mpi['losses']}"
print(f"PASS: the same {len(mpi['losses'])} losses under mpirun and {sys.argv[2].rsplit('/', 1)[-1]}: {mpi['losses']}")
PY
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
case $mode in
  basics) torchrun 2 -m pytest -p no:cacheprovider --color=no -q "$here/torchrun/torchrun_basics.py" ;;
  suite)  # issue 43's parity files, as the mpirun suite runs them, under torchrun (conftest.py's ranks)
    torchrun 2 -m pytest -p no:cacheprovider --color=no -q "$here/test_user_optimizer.py" \
      "$here/test_lr_schedulers.py" "$here/test_grad_scaler.py" "$here/test_ddp_semantics.py" \
      "$here/test_unused_params.py" "$here/test_dcp.py" "$here/test_collective_dtypes.py" \
      "$here/test_torch_grads.py" ;;
  groups) torchrun 4 -m pytest -p no:cacheprovider --color=no -q "$here/torchrun/torchrun_groups.py" ;;
  parity)
    for dtype in "" --bf16; do
      "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np 2 "$venv/bin/python" \
        "$here/torchrun/parity_job.py" "$tmp/mpi$dtype.json" $dtype || exit 1
      torchrun 2 "$here/torchrun/parity_job.py" "$tmp/torch$dtype.json" $dtype || exit 1
    done
    same "$tmp/mpi.json" "$tmp/torch.json" && same "$tmp/mpi--bf16.json" "$tmp/torch--bf16.json" ;;
  no_init)
    "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np 2 "$venv/bin/python" \
      "$here/torchrun/parity_job.py" "$tmp/mpi.json" || exit 1
    torchrun 2 "$here/torchrun/parity_job.py" "$tmp/torch.json" --no-init || exit 1
    same "$tmp/mpi.json" "$tmp/torch.json" ;;
  srun)
    "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np 2 "$venv/bin/python" \
      "$here/torchrun/parity_job.py" "$tmp/mpi.json" || exit 1
    p=$(port)
    for r in 0 1; do
      env -u RANK -u WORLD_SIZE SLURM_PROCID=$r SLURM_NTASKS=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$p \
        timeout 120 "$venv/bin/python" "$here/torchrun/parity_job.py" "$tmp/srun.json" > "$tmp/srun$r.log" 2>&1 &
    done
    wait || true
    cat "$tmp/srun0.log" "$tmp/srun1.log"
    same "$tmp/mpi.json" "$tmp/srun.json" || exit 1
    err=$(env -u MASTER_ADDR -u MASTER_PORT SLURM_PROCID=0 SLURM_NTASKS=2 timeout 60 "$venv/bin/python" \
      -c "import mxddp.torch as mxt; mxt.init()" 2>&1)
    printf '%s\n' "$err" | grep -q "started by srun with SLURM_NTASKS=2 but MASTER_ADDR, MASTER_PORT not set" ||
      { printf '%s\n' "$err"; echo "FAIL: srun without MASTER_ADDR was not refused by name"; exit 1; }
    echo "PASS: srun without MASTER_ADDR is refused by name" ;;
  timeout)
    out=$(timeout 60 "$venv/bin/torchrun" --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$(port)" \
      "$here/torchrun/timeout_job.py" 2>&1)
    rc=$?
    printf '%s\n' "$out" | grep "^rank"
    [ "$rc" -eq 0 ] || { printf '%s\n' "$out" | tail -30; echo "FAIL: the job exited $rc"; exit 1; }
    printf '%s\n' "$out" | grep -Eq "^rank 0 failed after [3-9]\.[0-9] s: all_reduce #1 failed in torch.distributed on rank 0 of 2: .*Timed out" ||
      { echo "FAIL: rank 0 did not fail with gloo's timeout after about 3 s"; exit 1; }
    echo "PASS: the late peer's collective timed out with torch's message" ;;
  raise)
    out=$(timeout 50 "$venv/bin/torchrun" --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$(port)" \
      "$here/torchrun/raise_job.py" 2>&1)
    rc=$?
    printf '%s\n' "$out" | tail -40
    [ "$rc" -ne 0 ] || { echo "FAIL: the job exited 0"; exit 1; }
    [ "$rc" -ne 124 ] || { echo "FAIL: the job was still running after 50 s"; exit 1; }
    printf '%s\n' "$out" | grep -q "rank 1 fails in backward on purpose" || { echo "FAIL: no error from rank 1"; exit 1; }
    printf '%s\n' "$out" | grep -q "mxddp: rank 1 raised RuntimeError; ending this process" || { echo "FAIL: no notice"; exit 1; }
    if printf '%s\n' "$out" | grep -q "rank 0 finished the grad sync"; then echo "FAIL: rank 0 went on"; exit 1; fi
    echo "PASS: the job ended with rank 1's error (exit $rc)" ;;
  *) echo "run_torchrun.sh: mode '$mode' is not one of basics, groups, parity, no_init, srun, timeout, raise"; exit 2 ;;
esac
