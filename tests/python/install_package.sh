#!/bin/sh
# CTest's python_package_install: `pip install .` of the mxddp package (docs/python.md) into the
# test venv, so the Python tests run the package built from this tree. scikit-build-core keeps its
# build folder (build/python/), so a reinstall rebuilds only what changed.
# usage: install_package.sh SOURCE_DIR VENV
set -eu
src=$1 venv=$2
if ! "$venv/bin/python" -c "import torch, transformers, pytest, nanobind, scikit_build_core" 2>/dev/null; then
  echo "SKIP: $venv lacks torch, transformers, pytest, nanobind or scikit-build-core (scripts/setup.sh installs them from PyPI; see $venv.log)"
  exit 77
fi
cd "$src"
CMAKE_BUILD_PARALLEL_LEVEL=2 "$venv/bin/pip" install -q --no-build-isolation --disable-pip-version-check .
"$venv/bin/python" -c "import mxddp.torch, mxddp; print('installed mxddp', mxddp.__version__, 'from', mxddp.__file__)"
