#!/bin/sh
# CTest's python_mpirun_np*: the mxddp.torch pytest suite, one rank per process under mpirun.
# usage: run_pytest.sh VENV MPIEXEC NP TEST_FILE...
set -eu
venv=$1 mpiexec=$2 np=$3
shift 3
if ! "$venv/bin/python" -c "import torch, transformers, pytest, mxddp.torch" 2>/dev/null; then
  echo "SKIP: $venv has no torch, transformers, pytest or mxddp (scripts/setup.sh installs the first three from PyPI; CTest's python_package_install the package)"
  exit 77
fi
# MXDDP_TEST_COLLECTIVE_DELAY_US (conftest.py) reaches every rank.
exec "$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np "$np" \
  ${MXDDP_TEST_COLLECTIVE_DELAY_US:+-x MXDDP_TEST_COLLECTIVE_DELAY_US} \
  "$venv/bin/python" -m pytest -p no:cacheprovider --color=no -q "$@"
