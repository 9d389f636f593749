#!/bin/sh
# CTest's setup_main_job_installs_only_what_it_runs: `scripts/setup.sh release` as run.sh sources it
# (the main job) must not install or run the Python venvs (torch, transformers: gigabytes the
# training never uses) and must build only the `mxddp` command. Traced with strace, with cmake,
# apt-get and dpkg-query replaced by recorders so nothing is configured, built or installed.
# usage: main_job_installs.sh SOURCE_DIR WORK_DIR
set -eu
src=$1 work=$2
command -v strace >/dev/null || { echo "SKIP: strace is not installed"; exit 77; }
rm -rf "$work" && mkdir -p "$work/bin"
for tool in cmake apt-get; do
  printf '#!/bin/sh\necho "%s $*" >> %s/calls\n' "$tool" "$work" > "$work/bin/$tool"
done
printf '#!/bin/sh\nprintf "install ok installed"\n' > "$work/bin/dpkg-query"
chmod +x "$work/bin/"*
PATH="$work/bin:$PATH" strace -f -qq -e trace=execve -o "$work/trace" \
  bash -c "source '$src/scripts/setup.sh' release" > "$work/out" 2>&1 || { cat "$work/out"; exit 1; }
if grep -E 'pyvenv|/pip"|"pip|python' "$work/trace" | grep -v ENOENT; then
  echo "FAIL: the main job's set-up ran the Python tooling above"; exit 1
fi
grep -q -- "--build --preset release --target mxddp_cli" "$work/calls" ||
  { echo "FAIL: the set-up did not build only mxddp_cli:"; cat "$work/calls"; exit 1; }
echo "PASS: no Python venv touched; cmake calls:"; cat "$work/calls"
