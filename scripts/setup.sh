#!/usr/bin/env bash
# Installs what mxddp needs to build (Debian packages), only when something is missing, then
# configures and builds the given CMake preset (default: release). Sourced by run.sh and test.sh.
set -euo pipefail

packages=(g++ cmake ninja-build pkg-config libopenmpi-dev openmpi-bin libfmt-dev libcli11-dev libgtest-dev nlohmann-json3-dev zlib1g-dev libopenblas-dev libdnnl-dev strace clang libclang-rt-dev python3-matplotlib python3-numpy python3-venv python3-dev)
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

preset="${1:-release}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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

cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset"
