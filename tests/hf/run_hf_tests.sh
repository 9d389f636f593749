#!/bin/sh
# CTest's hf_gpt2: tests/hf's pytest suite (mxddp's GPT to and from Hugging Face GPT-2) with the
# venv's torch and transformers, against this build's mxddp command. Skipped (77) without them.
# usage: run_hf_tests.sh VENV MXDDP_CLI TEST_DIR
set -eu
venv=$1 cli=$2 tests=$3
if ! "$venv/bin/python" -c "import torch, transformers, safetensors, pytest" 2>/dev/null; then
  echo "SKIP: $venv has no torch, transformers, safetensors or pytest (scripts/setup.sh installs them from PyPI)"
  exit 77
fi
MXDDP_CLI=$cli OMP_NUM_THREADS=1 exec "$venv/bin/python" -m pytest -p no:cacheprovider --color=no -q "$tests"
