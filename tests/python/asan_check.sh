#!/bin/sh
# The C++ side of the Python bindings under AddressSanitizer + UndefinedBehaviorSanitizer, with the
# pytest suite at 2 ranks: builds mxddp._C with MXDDP_SANITIZE=address,undefined in
# build/python-asan (about 6 minutes the first time on 2 cores), stages it beside the package's
# Python sources, and runs tests/python with the sanitizer runtimes preloaded into the
# interpreter (torch and Python are not instrumented: leak checks off, as the asan preset has them).
# Not part of CTest (the extra build is long); docs/python.md gives the last result.
# usage: tests/python/asan_check.sh   (from the repository root, after scripts/setup.sh)
set -eu
venv=build/pyvenv-torch
out=build/python-asan
cmake -S . -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMXDDP_SANITIZE=address,undefined \
  -DMXDDP_BUILD_PYTHON=ON -DMXDDP_BUILD_TESTS=OFF -DMXDDP_BUILD_BENCH=OFF \
  -DPython_EXECUTABLE="$PWD/$venv/bin/python" >/dev/null
cmake --build "$out" --target _C -j2
rm -rf "$out/pkg" && mkdir -p "$out/pkg"
cp -r python/mxddp "$out/pkg/" && cp "$out"/python_pkg/mxddp/_C*.so "$out/pkg/mxddp/"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 \
  -x LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
  -x ASAN_OPTIONS=detect_leaks=0:detect_odr_violation=0:alloc_dealloc_mismatch=0:abort_on_error=1 \
  -x UBSAN_OPTIONS=print_stacktrace=1 -x PYTHONPATH="$PWD/$out/pkg" \
  "$venv/bin/python" -c "import sys, pytest, mxddp._C as C; assert '$out/pkg' in C.__file__, C.__file__; sys.exit(pytest.main(['-p', 'no:cacheprovider', '--color=no', '-q', 'tests/python']))"
