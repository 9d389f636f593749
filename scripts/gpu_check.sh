#!/usr/bin/env bash
# The CUDA layer's device checks (issue 41), for the GPU machine of DEVELOPERS.md: its 15 minutes
# of device time allow one run of this (each step has a timeout; together at most 8 minutes, so
# that summary.txt is written within the device call's 10), and a rerun.
#
#   scripts/gpu_check.sh --prepare DIR   here: builds the release preset with the venv's nvcc for
#                                        sm_90 and puts what the device runs into DIR (the CUDA test
#                                        and bench binaries, and the shared libraries they load that
#                                        are not the C and C++ runtimes); carry DIR there
#   scripts/gpu_check.sh --run DIR OUT   there (issue 41): every CUDA kernel test, compute.h's conformance test
#                                        (CUDA's implementation against the CPU's), the local backend's
#                                        collectives on device memory (2 and 4 ranks on the GPU against
#                                        the host run; DDP, MXFP8 params and every FSDP strategy on
#                                        them), the kernels' throughput against the copy bandwidth,
#                                        torch's fused AdamW on the same shard, the grad buffer's
#                                        bucket-ready to collective-issued latency on the device, and
#                                        the NCCL communicator at world 1 (collectives, DDP, FSDP), and
#                                        two MPI processes sharing the GPU, staged through page-locked
#                                        host memory (collectives, DDP); the results go to OUT
#                                        (summary.txt and the logs)
#   scripts/gpu_check.sh --run-python DIR OUT
#                                        there (issue 42), a device call of its own: builds mxddp._C
#                                        for the machine's Python (scripts/gpu_python) and trains HF
#                                        GPT-2 on the GPU under mxddp against torch
#                                        (tests/python/cuda_job.py): DDP and FSDP at world 1 (NCCL)
#                                        and at 2 MPI ranks sharing the GPU (staged); OUT/python.txt
#   scripts/gpu_check.sh --run-bench DIR OUT
#                                        there (issue 42's figures), a call of its own: GPT-2 124M
#                                        under mxddp against torch DDP + fused AdamW and megatron-fsdp
#                                        (bench/torch_cuda_compare.py), and 2 MPI ranks sharing the
#                                        GPU: exposed communication and its timeline
#                                        (bench/torch_cuda_exposed.py); OUT/bench.txt
#
# The GPU machine has no network and none of this project's Debian libraries, so nothing is built
# there: the binaries link the CUDA runtime statically and find the rest (libfmt, libgomp, and
# OpenMPI's libraries, which the communication layer links though the local backend never starts
# MPI) beside them. NCCL's library (250 MB, over the carry's limit) is the machine's own: its torch
# wheel's nvidia-nccl. OpenMPI (mpirun, its plugins and help files: about 12 MB) travels in DIR/openmpi
# with its Debian paths under it, and runs from there relocated (OPAL_PREFIX).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode="${1:-}"
dir="${2:-}"
if [ "$mode" = --prepare ] && [ -n "$dir" ]; then
  source scripts/setup.sh release --tests >/dev/null
  binaries=(build/release/tests/cuda_kernels_test build/release/tests/compute_test
            build/release/tests/cuda_local_group_test build/release/bench/cuda_kernels_bench
            build/release/bench/bucket_issue_bench build/release/tests/nccl_device_test
            build/release/tests/cuda_staged_mpi_test)
  cmake --build --preset release --target cuda_kernels_test compute_test cuda_local_group_test cuda_kernels_bench \
    bucket_issue_bench nccl_device_test cuda_staged_mpi_test
  mkdir -p "$dir"
  cp "${binaries[@]}" bench/cuda_adamw_torch.py "$dir/"
  # Every library the binaries load but the C and C++ runtimes, which the machine has.
  ldd "${binaries[@]}" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux-x86-64|libnccl)\.so' |
    while read -r lib; do cp -L "$lib" "$dir/"; done
  # OpenMPI's runtime, its files at their Debian paths under DIR/openmpi (no headers, docs, compiler
  # wrappers, Fortran, Java or OpenSHMEM).
  rm -rf "$dir/openmpi"
  dpkg -L libopenmpi3 openmpi-bin openmpi-common libpmix2 libevent-core-2.1-7 libevent-pthreads-2.1-7 libhwloc15 |
    grep -Ev '/share/doc/|/man/|/include/|\.(h|mod|la|a)$|java|pkgconfig|oshmem|/bin/(shmem|osh)|fortran|mpif|wrapper' |
    while read -r f; do
      if [ -f "$f" ] || [ -L "$f" ]; then mkdir -p "$dir/openmpi$(dirname "$f")" && cp -a "$f" "$dir/openmpi$f"; fi
    done
  # The Python extension is compiled there, against the machine's Python (scripts/gpu_python): its
  # inputs go in DIR/python. The layers' static libraries as the extension here links them, the CUDA
  # runtime's static libraries, the link names of fmt, OpenMPI and zlib, fmt's and OpenMPI's headers,
  # and the nanobind the bindings were written against.
  cmake --build --preset release --target _C
  py="$dir/python"
  rm -rf "$py"
  mkdir -p "$py/lib" "$py/include" "$py/site"
  link=$(cd build/release && ninja -t commands _C | tail -1)
  for archive in $(printf '%s\n' $link | grep -E '^libmxddp_[a-z_]+\.a$'); do cp "build/release/$archive" "$py/lib/"; done
  cudart=$(readlink -f "$(printf '%s\n' $link | grep -E '/libcudart_static\.a$' | head -1)")
  cp "$cudart" "$(dirname "$cudart")/libcudadevrt.a" "$py/lib/"
  cp -L /usr/lib/x86_64-linux-gnu/libfmt.so /usr/lib/x86_64-linux-gnu/libz.so "$py/lib/"
  cp -L /usr/lib/x86_64-linux-gnu/openmpi/lib/libmpi.so /usr/lib/x86_64-linux-gnu/openmpi/lib/libmpi_cxx.so "$py/lib/"
  cp -r /usr/include/fmt "$py/include/"
  # Which NCCL the layers were compiled against (the machine links its own torch's library).
  grep -m1 -o 'NCCL_VERSION_CODE [0-9]*' \
    "$(awk -F= '/^NCCL_INCLUDE_DIR:/ {print $2}' build/release/CMakeCache.txt)/nccl.h" >"$py/nccl_header.txt"
  cp -r /usr/lib/x86_64-linux-gnu/openmpi/include "$py/mpi_include"
  cp -r "$("$torch_venv/bin/python" -c 'import nanobind, os; print(os.path.dirname(nanobind.__file__))')" "$py/site/"
  # megatron-fsdp from PyPI (pure Python, about 140 KB), for --run-bench's comparison, unpacked.
  "$torch_venv/bin/pip" download -q --no-deps megatron-fsdp==0.6.1 -d "$py/wheels"
  "$torch_venv/bin/python" -m zipfile -e "$py"/wheels/megatron_fsdp-*.whl "$py/megatron_fsdp"
  rm -rf "$py/wheels"
  # The device tool carries at most 64 MiB with the working tree (about 5 MB): refuse more here.
  carry_kib=$(du -sk "$dir" | cut -f1)
  if [ "$carry_kib" -gt $((56 * 1024)) ]; then
    echo "gpu_check: $dir holds ${carry_kib} KiB; the carry must stay under 56 MiB (64 with the tree)" >&2
    exit 1
  fi
  echo "gpu_check: prepared $dir ($(du -sh "$dir" | cut -f1)); on the GPU machine: scripts/gpu_check.sh --run $dir \$OUT"
  exit 0
fi
if { [ "$mode" != --run ] && [ "$mode" != --run-python ] && [ "$mode" != --run-bench ]; } || [ -z "$dir" ] ||
   [ -z "${3:-}" ]; then
  echo "usage: $0 --prepare DIR | --run DIR OUT | --run-python DIR OUT | --run-bench DIR OUT" >&2
  exit 2
fi
out="$3"
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL from the machine's torch (nvidia-nccl), for nccl_device_test.
nccl_lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null || true)
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl_lib"
# The carried OpenMPI, relocated; quiet about plugins whose libraries the machine lacks (InfiniBand,
# UCX), and copying through shared memory without the kernel's cross-process copy, which sandboxed
# kernels may refuse.
ompi="$PWD/$dir/openmpi"
export OPAL_PREFIX="$ompi/usr" PMIX_INSTALL_PREFIX="$ompi/usr/lib/x86_64-linux-gnu/pmix2"
export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$ompi/usr/lib/x86_64-linux-gnu:$ompi/usr/lib/x86_64-linux-gnu/openmpi/lib"
export OMPI_MCA_mca_base_component_show_load_errors=0 OMPI_MCA_btl_vader_single_copy_mechanism=none
if [ "$mode" = --run-python ]; then
  exec scripts/gpu_check_python.sh "$dir" "$out" "$ompi" "${nccl_lib:-}"
fi
if [ "$mode" = --run-bench ]; then
  exec scripts/gpu_check_python.sh "$dir" "$out" "$ompi" "${nccl_lib:-}" --bench
fi
summary="$out/summary.txt"
{
  echo "# gpu_check $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || true
} >"$summary"
status=0
timeout 80 "$dir/cuda_kernels_test" --gtest_brief=1 >"$out/kernels_test.log" 2>&1 || status=$?
echo "cuda_kernels_test: exit $status" >>"$summary"
grep -E '^SKIP|^\[  (PASSED|FAILED) |tests? ran' "$out/kernels_test.log" >>"$summary" || true
local_status=0
timeout 110 "$dir/cuda_local_group_test" --gtest_brief=1 >"$out/local_group_test.log" 2>&1 || local_status=$?
echo "cuda_local_group_test: exit $local_status" >>"$summary"
grep -E '^SKIP|^\[  (PASSED|FAILED) |tests? ran' "$out/local_group_test.log" >>"$summary" || true
compute_status=0
timeout 40 "$dir/compute_test" --gtest_brief=1 >"$out/compute_test.log" 2>&1 || compute_status=$?
echo "compute_test: exit $compute_status" >>"$summary"
grep -E '^\[  (PASSED|FAILED|SKIPPED) |tests? ran' "$out/compute_test.log" >>"$summary" || true
bench_status=0
timeout 80 "$dir/cuda_kernels_bench" --runs 10 >"$out/kernels_bench.log" 2>&1 || bench_status=$?
cat "$out/kernels_bench.log" >>"$summary"
torch_status=0
timeout 45 python3 "$dir/cuda_adamw_torch.py" --runs 10 >"$out/adamw_torch.log" 2>&1 || torch_status=$?
cat "$out/adamw_torch.log" >>"$summary"
issue_status=0
timeout 45 "$dir/bucket_issue_bench" --device cuda --runs 5 >"$out/bucket_issue_bench.log" 2>&1 || issue_status=$?
cat "$out/bucket_issue_bench.log" >>"$summary"
nccl_status=0
timeout 40 "$dir/nccl_device_test" --gtest_brief=1 >"$out/nccl_device_test.log" 2>&1 || nccl_status=$?
echo "nccl_device_test: exit $nccl_status (NCCL library: ${nccl_lib:-not found})" >>"$summary"
grep -E '^SKIP|^\[  (PASSED|FAILED) |tests? ran|error while loading' "$out/nccl_device_test.log" >>"$summary" || true
staged_status=0
timeout 40 "$ompi/usr/bin/orterun" --allow-run-as-root --oversubscribe --bind-to none -np 2 "$dir/cuda_staged_mpi_test" \
  --gtest_brief=1 >"$out/staged_mpi_test.log" 2>&1 || staged_status=$?
echo "cuda_staged_mpi_test (mpirun -np 2, one GPU): exit $staged_status" >>"$summary"
grep -E 'sees no|^\[  (PASSED|FAILED) |tests? ran|mpi suite|error' "$out/staged_mpi_test.log" | sort -u >>"$summary" || true
ours=$(awk '/^adamw_ms/ {print $2}' "$out/kernels_bench.log")
theirs=$(awk '/^torch_fused_adamw_ms/ {print $2}' "$out/adamw_torch.log")
if [ -n "$ours" ] && [ -n "$theirs" ]; then
  awk -v a="$ours" -v b="$theirs" 'BEGIN { printf "adamw: mxddp %.3f ms, torch fused %.3f ms: %.2fx torch'"'"'s time\n", a, b, a / b }' >>"$summary"
fi
echo "exit codes: kernels_test $status, local_group_test $local_status, compute_test $compute_status," \
  "kernels_bench $bench_status, torch $torch_status, bucket_issue_bench $issue_status, nccl_device_test $nccl_status," \
  "staged_mpi_test $staged_status" >>"$summary"
cat "$summary"
[ "$status" -eq 0 ] && [ "$local_status" -eq 0 ] && [ "$compute_status" -eq 0 ] && [ "$bench_status" -eq 0 ] &&
  [ "$torch_status" -eq 0 ] && [ "$issue_status" -eq 0 ] && [ "$nccl_status" -eq 0 ] && [ "$staged_status" -eq 0 ]
