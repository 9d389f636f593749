#!/usr/bin/env bash
# The Python half of the device checks (issue 42), run by `scripts/gpu_check.sh --run-python DIR OUT`
# on the GPU machine, with OpenMPI's and the libraries' environment set there: builds mxddp._C for
# that machine's Python from what --prepare carried (scripts/gpu_python), then trains HF GPT-2 on
# the GPU under mxddp against torch (tests/python/cuda_job.py) as DDP and as FSDP, at world 1 (the
# NCCL engine) and at 2 MPI ranks sharing the GPU (the staged engine), each with a checkpoint saved
# on the GPU, loaded on the CPU and back; then MXFP8 weights against the same job on the CPU. At
# most 8.5 minutes (the build 180 s, six jobs 60 s each); OUT/python.txt is the summary, the logs
# are beside it.
# With --bench instead (`gpu_check.sh --run-bench`), a call of its own too: the same build (kept
# from --run-python when the machine is still the same one), then bench/torch_cuda_compare.py
# (GPT-2 124M against torch DDP + fused AdamW and megatron-fsdp; DDP's two again at batch 2) and
# bench/torch_cuda_exposed.py (2 MPI ranks sharing the GPU: exposed communication, with and without
# overlap); OUT/bench.txt.
# usage: gpu_check_python.sh DIR OUT OMPI NCCL_LIB_DIR [--bench]
set -uo pipefail
dir=$1 out=$2 ompi=$3 nccl_lib=$4 what=${5:-}
summary="$out/python.txt"
[ "$what" = --bench ] && summary="$out/bench.txt"
build=/tmp/mxddp_gpu_python
python=$(command -v python3)
{
  echo "# gpu_check ${what:---run-python} $(date -u +%FT%TZ) on $(hostname)"
  "$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>&1
  echo "mxddp built against NCCL's header $(cat "$dir/python/nccl_header.txt" 2>/dev/null)"
} >"$summary"
build_status=0
if [ "$what" = --bench ] && ls "$build"/mxddp/_C.*.so >/dev/null 2>&1; then
  echo "build of mxddp._C: kept from --run-python" >>"$summary"
else
  timeout 180 bash -c "cmake -S scripts/gpu_python -B $build -DCMAKE_BUILD_TYPE=Release -DCARRY=$PWD/$dir \
    -DPython_EXECUTABLE=$python -DNCCL_LIBRARY=$nccl_lib/libnccl.so.2 && cmake --build $build -j 16" \
    >"$out/python_build.log" 2>&1 || build_status=$?
  echo "build of mxddp._C: exit $build_status" >>"$summary"
fi
[ "$build_status" -eq 0 ] || { tail -30 "$out/python_build.log" >>"$summary"; cat "$summary"; exit 1; }
if [ "$what" = --bench ]; then
  # megatron-fsdp's wheel (pure Python, carried by --prepare) beside the extension.
  rc=0
  PYTHONPATH="$build:$PWD/$dir/python/megatron_fsdp" timeout 360 "$python" bench/torch_cuda_compare.py --profile \
    --timeout-s 60 >>"$summary" 2>"$out/bench.err" || rc=$?
  echo "torch_cuda_compare: exit $rc" >>"$summary"
  # DDP's two again at batch 2: at batch 8 the activations (~11 GiB) hide what the runtimes hold
  # (params, grads, buckets, optimizer state: ~2 GiB), at batch 2 they weigh about as much.
  small=0
  PYTHONPATH="$build" timeout 120 "$python" bench/torch_cuda_compare.py --batch 2 --only torch_ddp mxddp_ddp \
    --timeout-s 50 >>"$summary" 2>>"$out/bench.err" || small=$?
  echo "torch_cuda_compare --batch 2: exit $small" >>"$summary"
  # Two MPI ranks sharing the GPU (the staged engine): exposed communication and its timeline.
  exposed=0
  timeout 120 "$ompi/usr/bin/orterun" --allow-run-as-root --oversubscribe --bind-to none -np 2 \
    -x PYTHONPATH="$build" -x LD_LIBRARY_PATH -x OPAL_PREFIX -x PMIX_INSTALL_PREFIX \
    "$python" bench/torch_cuda_exposed.py >>"$summary" 2>>"$out/bench.err" || exposed=$?
  echo "torch_cuda_exposed (mpirun -np 2, one GPU): exit $exposed" >>"$summary"
  cat "$summary"
  [ "$rc" -eq 0 ] && [ "$small" -eq 0 ] && [ "$exposed" -eq 0 ]
  exit $?
fi
status=0
# label, ranks, cuda_job's arguments: F32 against torch with the checkpoint round trip, then MXFP8
# against the CPU run of the same job.
jobs=("ddp 1 --wrap ddp --checkpoint /tmp/mxddp_ck/ddp1" "fsdp 1 --wrap fsdp --checkpoint /tmp/mxddp_ck/fsdp1"
      "ddp 2 --wrap ddp --checkpoint /tmp/mxddp_ck/ddp2" "fsdp 2 --wrap fsdp --checkpoint /tmp/mxddp_ck/fsdp2"
      "ddp_mxfp8 1 --wrap ddp --mxfp8 --steps 10" "fsdp_mxfp8 2 --wrap fsdp --mxfp8 --steps 10")
rm -rf /tmp/mxddp_ck
for job in "${jobs[@]}"; do
  read -r label np job_args <<<"$job"
  rc=0
  # shellcheck disable=SC2086  # job_args is a word list
  timeout 60 "$ompi/usr/bin/orterun" --allow-run-as-root --oversubscribe --bind-to none -np "$np" \
    -x PYTHONPATH="$build" -x LD_LIBRARY_PATH -x OPAL_PREFIX -x PMIX_INSTALL_PREFIX \
    "$python" tests/python/cuda_job.py $job_args >"$out/cuda_${label}_np$np.log" 2>&1 || rc=$?
  echo "cuda_job $job_args, mpirun -np $np: exit $rc" >>"$summary"
  grep -E '^cuda_job|^step +(1|10|20) |Error|error' "$out/cuda_${label}_np$np.log" | head -8 >>"$summary"
  [ "$rc" -eq 0 ] || status=1
done
cat "$summary"
exit "$status"
