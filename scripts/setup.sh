#!/usr/bin/env bash
# Installs what mxddp needs (Debian packages), only when something is missing, then configures and
# builds the given CMake preset (default: release). Sourced by run.sh and test.sh.
# usage: source scripts/setup.sh [PRESET] [--tests]
#   without --tests (the main job): the build's packages and the `mxddp` command only;
#   with --tests (the suite): also the test tools, the Python venvs (PyPI) and every target,
#   the Python extension mxddp._C included (built from this tree, no second compile by pip).
set -euo pipefail

preset="${1:-release}"
with_tests=0
[ "${2:-}" = "--tests" ] && with_tests=1

build_packages=(g++ cmake ninja-build pkg-config libopenmpi-dev openmpi-bin libfmt-dev libcli11-dev libgtest-dev nlohmann-json3-dev zlib1g-dev libopenblas-dev libdnnl-dev)
# strace: the kill-during-save test; clang: the fuzz targets; matplotlib: the plotting test;
# venv and dev headers: the Python package and its tests.
test_packages=(strace clang libclang-rt-dev python3-matplotlib python3-numpy python3-venv python3-dev)
packages=("${build_packages[@]}")
[ "$with_tests" -eq 1 ] && packages+=("${test_packages[@]}")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# OpenMPI refuses to start as root unless told; these machines run everything as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$with_tests" -eq 0 ]; then
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" --target mxddp_cli
  return 0 2>/dev/null || exit 0
fi

# The checkpoint-export tests read mxddp's safetensors files with the Python safetensors package
# too (PyPI; Debian 12 has none): a venv beside the builds that sees Debian's numpy. Without
# PyPI those tests skip and say why.
venv=build/pyvenv
if ! "$venv/bin/python" -c "import numpy, safetensors.numpy" 2>/dev/null; then
  { /usr/bin/python3 -m venv --system-site-packages "$venv" &&
    "$venv/bin/pip" install -q --disable-pip-version-check safetensors; } >/dev/null 2>&1 ||
    echo "setup: could not install the Python safetensors package into $venv (its tests will skip)"
fi

# The Python package's tests (tests/python) run in a venv of their own with torch.
source scripts/python_env.sh
# Its extension is built here with the venv's interpreter and nanobind (not in the sanitizer
# builds: tests/python/asan_check.sh covers those); without the venv, OFF and the tests skip.
python_flags=(-DMXDDP_BUILD_PYTHON=OFF)
if [[ "$preset" != asan && "$preset" != tsan && "$preset" != fuzz ]] &&
   "$torch_venv/bin/python" -c "import torch, nanobind" 2>/dev/null; then
  python_flags=(-DMXDDP_BUILD_PYTHON=ON "-DPython_EXECUTABLE=$PWD/$torch_venv/bin/python")
fi
# The CUDA layer compiles with the venv's nvcc where python_env.sh found one (not in the sanitizer
# and fuzz builds, which CMakeLists.txt keeps host-only); elsewhere CMake looks for nvcc itself.
cuda_flags=()
if [[ -n "$torch_nvcc" && "$preset" != asan && "$preset" != tsan && "$preset" != fuzz ]]; then
  cuda_flags=("-DCMAKE_CUDA_COMPILER=$torch_nvcc")
  [ -n "$torch_nccl" ] && cuda_flags+=("-DMXDDP_NCCL_ROOT=$torch_nccl")
fi
cmake --preset "$preset" "${python_flags[@]}" "${cuda_flags[@]}" >/dev/null
cmake --build --preset "$preset"
