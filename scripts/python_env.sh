#!/usr/bin/env bash
# The venv the Python package's tests run in (docs/python.md): build/pyvenv-torch, made with
# Debian's python3 when missing, with torch, transformers, pytest, numpy and the package's build
# requirements (nanobind, scikit-build-core) from PyPI. Installed once and reused (torch is large:
# a first install takes a few minutes). Without PyPI it says so and the Python tests skip.
# Sourced by setup.sh; `pip install .` of the package itself is CTest's python_package_install.
torch_venv=build/pyvenv-torch
python_test_packages=(torch transformers pytest numpy nanobind scikit-build-core)
if ! "$torch_venv/bin/python" -c "import torch, transformers, pytest, numpy, nanobind, scikit_build_core" 2>/dev/null; then
  echo "setup: installing ${python_test_packages[*]} into $torch_venv (PyPI; once)"
  mkdir -p build
  if ! { /usr/bin/python3 -m venv "$torch_venv" &&
         "$torch_venv/bin/pip" install -q --disable-pip-version-check "${python_test_packages[@]}"; } >"$torch_venv.log" 2>&1; then
    echo "setup: could not install the Python test packages into $torch_venv (see $torch_venv.log); the mxddp.torch tests will skip"
  fi
fi
# megatron-core: the reference test_megatron_api.py runs a Megatron loop against (a 2.5 MiB wheel whose
# dependencies, torch, numpy and packaging, are already there). Optional: those comparisons skip without it.
if [ -x "$torch_venv/bin/python" ] && ! "$torch_venv/bin/python" -c "import megatron.core" 2>/dev/null; then
  if ! "$torch_venv/bin/pip" install -q --disable-pip-version-check "megatron-core==0.16.1" >>"$torch_venv.log" 2>&1; then
    echo "setup: could not install megatron-core into $torch_venv (see $torch_venv.log); test_megatron_api.py's comparisons will skip"
  fi
fi
# The CUDA compiler (issue 41): nvcc and NVVM's wheels at the version of the CUDA runtime that torch's
# wheel brought (about 110 MB), so that every build of the suite compiles and links the .cu files
# (scripts/setup.sh hands this nvcc to CMake). Optional: without them MXDDP_CUDA stays off and the
# CPU build is unchanged.
torch_nvcc=""
torch_nccl=""
if [ -x "$torch_venv/bin/python" ]; then
  cuda_runtime=$("$torch_venv/bin/python" -c "import importlib.metadata as m; print(m.version('nvidia-cuda-runtime'))" 2>/dev/null || true)
  if [ -n "$cuda_runtime" ]; then
    site=$("$torch_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    candidate="$site/nvidia/cu${cuda_runtime%%.*}/bin/nvcc"
    if [ ! -x "$candidate" ] || [ ! -x "$site/nvidia/cu${cuda_runtime%%.*}/nvvm/bin/cicc" ]; then
      if ! "$torch_venv/bin/pip" install -q --disable-pip-version-check "nvidia-cuda-nvcc==$cuda_runtime" \
           "nvidia-nvvm==$cuda_runtime" >>"$torch_venv.log" 2>&1; then
        echo "setup: could not install nvcc $cuda_runtime into $torch_venv (see $torch_venv.log); the CUDA build is off"
      fi
    fi
    [ -x "$candidate" ] && torch_nvcc="$candidate"
  fi
  # NCCL's header and library come with torch's CUDA wheel (nvidia-nccl): the NCCL communicator
  # (include/mxddp/nccl.h) builds against them.
  torch_nccl=$("$torch_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/nvidia/nccl
  [ -f "$torch_nccl/include/nccl.h" ] && [ -f "$torch_nccl/lib/libnccl.so.2" ] || torch_nccl=""
fi
