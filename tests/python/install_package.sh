#!/bin/sh
# CTest's python_package_install: the package as `pip install .` makes it, with the extension this
# CMake tree built (MXDDP_PYTHON_PREBUILT, so nothing is compiled twice), installed into a folder of
# its own and imported from there; then the package the other python_* tests import
# (<build>/python_pkg, on their PYTHONPATH) is checked to load this build's extension.
# usage: install_package.sh SOURCE_DIR VENV PREBUILT_EXTENSION OUT_DIR
set -eu
src=$1 venv=$2 prebuilt=$3 out=$4
if ! "$venv/bin/python" -c "import torch, transformers, pytest, nanobind, scikit_build_core" 2>/dev/null; then
  echo "SKIP: $venv lacks torch, transformers, pytest, nanobind or scikit-build-core (scripts/setup.sh installs them from PyPI; see $venv.log)"
  exit 77
fi
if [ -z "$prebuilt" ]; then
  echo "SKIP: this build has no mxddp._C (configure with -DMXDDP_BUILD_PYTHON=ON -DPython_EXECUTABLE=$venv/bin/python, as scripts/setup.sh does)"
  exit 77
fi
rm -rf "$out" && mkdir -p "$out"
cd "$src"
"$venv/bin/pip" install -q --no-deps --no-build-isolation --disable-pip-version-check --target "$out/site" \
  --config-settings=cmake.define.MXDDP_PYTHON_PREBUILT="$prebuilt" --config-settings=build-dir="$out/skbuild" .
PYTHONPATH="$out/site" "$venv/bin/python" -c "
import sys, mxddp, mxddp.torch, mxddp._C
assert mxddp.__file__.startswith(sys.argv[1]), mxddp.__file__
assert mxddp._C.__file__.startswith(sys.argv[1]), mxddp._C.__file__
print('installed mxddp', mxddp.__version__, 'from', mxddp.__file__)" "$out/site"
# The tests' own import: CTest puts <build>/python_pkg first on PYTHONPATH.
"$venv/bin/python" -c "
import os, sys, mxddp._C
assert os.path.samefile(mxddp._C.__file__, sys.argv[1]), (mxddp._C.__file__, sys.argv[1])
print('tests import', mxddp._C.__file__)" "$prebuilt"
