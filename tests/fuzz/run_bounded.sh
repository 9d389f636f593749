#!/usr/bin/env bash
# The fuzz targets' bounded run in the test suite (CTest's fuzz_bounded; docs/fuzzing.md):
# configures and builds the fuzz preset with clang in BUILD_DIR, then runs each target for SECONDS
# on its seed corpus (tests/fuzz/corpus/<target>) plus what earlier runs in BUILD_DIR found.
# Fails on any crash, sanitizer report, unexpected exception, timeout or memory blow-up, printing
# the report and the command that reproduces it. Exits 77 (CTest's skip) only when clang or its
# libFuzzer runtime is not installed.
#
# usage: run_bounded.sh SOURCE_DIR BUILD_DIR [SECONDS]
set -euo pipefail
src=$(cd "$1" && pwd)
build=$2
seconds=${3:-20}
targets=(safetensors_header manifest cli_parsers)

probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
if ! command -v clang++ >/dev/null; then
  echo "SKIP: clang++ is not installed; install clang and libclang-rt-dev (scripts/setup.sh does)"
  exit 77
fi
printf '#include <cstddef>\n#include <cstdint>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n' \
  >"$probe/probe.cc"
if ! clang++ -fsanitize=fuzzer,address,undefined "$probe/probe.cc" -o "$probe/probe" 2>"$probe/err"; then
  echo "SKIP: clang++ cannot link a libFuzzer target; install libclang-rt-dev (scripts/setup.sh does):"
  cat "$probe/err"
  exit 77
fi

start_s=$(date +%s)
(cd "$src" && cmake --preset fuzz -B "$build" >"$probe/configure.log") || { cat "$probe/configure.log"; exit 1; }
cmake --build "$build" -j2 >"$probe/build.log" || { tail -n 100 "$probe/build.log"; exit 1; }
echo "fuzz build: $(($(date +%s) - start_s)) s"

status=0
for t in "${targets[@]}"; do
  corpus=$build/corpus/$t  # first: new inputs go here, so the seeds in the source tree stay as they are
  artifacts=$build/artifacts/$t
  scratch=$build/tmp/$t
  log=$build/logs/$t.log
  mkdir -p "$corpus" "$artifacts" "$scratch" "$(dirname "$log")"
  args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=8192 -print_final_stats=1
        -artifact_prefix="$artifacts/")
  [ -f "$src/tests/fuzz/$t.dict" ] && args+=(-dict="$src/tests/fuzz/$t.dict")
  cmd=("$build/tests/fuzz/fuzz_$t" "${args[@]}" "$corpus" "$src/tests/fuzz/corpus/$t")
  if TMPDIR=$scratch UBSAN_OPTIONS=print_stacktrace=1 "${cmd[@]}" >"$log" 2>&1; then
    echo "fuzz_$t: $(grep -E '^Done ' "$log" | tail -n 1); $(grep -E '^#[0-9]+' "$log" | tail -n 1 | grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [^ ]+')"
  else
    status=1
    echo "FAIL fuzz_$t (full log: $log):"
    tail -n 80 "$log"
    echo "reproduce: $build/tests/fuzz/fuzz_$t $artifacts/<crash-...>   (the file named above)"
  fi
done
exit $status
