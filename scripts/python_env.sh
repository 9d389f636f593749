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
