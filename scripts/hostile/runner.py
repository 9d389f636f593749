# Running one mxddp invocation under the campaign's rules and reading what it left behind.
#
# Every invocation runs in its own process group with a wall-clock limit (a timeout kills the whole
# group, so the rank threads and any mpirun singleton go with it), stdin from /dev/null and a
# working directory inside the campaign's sandbox, so a relative path the fuzzer makes up can only
# land there. A crash is a signal, an exit status >= 128 or a sanitizer report anywhere in the
# output (ASan and UBSan keep running or exit 1 after some reports, so the status alone misses
# them).
import hashlib
import os
import re
import resource
import signal
import stat
import subprocess
import time

# Sanitizer reports (ASan, LSan, UBSan with file:line, TSan).
SANITIZER_RE = re.compile(r"ERROR: (Address|Leak|Memory|Thread)Sanitizer|WARNING: ThreadSanitizer|"
                          r"\.\w+:\d+(:\d+)?: runtime error: |SUMMARY: UndefinedBehaviorSanitizer")
ERROR_LINE_RE = re.compile(r"^mxddp: error: .*$", re.M)

# Output kept per stream in the JSON: the head says what failed, the tail how it ended.
KEEP_CHARS = 4000


def is_sanitized(binary):
    """True when the binary links a sanitizer runtime (its memory limit must then stay off:
    ASan reserves terabytes of address space)."""
    with open(binary, "rb") as f:
        data = f.read()
    return b"__asan_init" in data or b"__tsan_init" in data or b"__ubsan_handle" in data


def child_env():
    env = dict(os.environ)
    # OpenMPI refuses to start as root without these; `--backend mpi` outside mpirun is a singleton.
    # Leak checking is off as in the project's asan preset: OpenMPI's own allocations show as leaks.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               ASAN_OPTIONS="detect_leaks=0:hard_rss_limit_mb=6144:allocator_may_return_null=1",
               UBSAN_OPTIONS="print_stacktrace=1", TSAN_OPTIONS="halt_on_error=0")
    env.pop("MXDDP_FAIL_AT", None)
    return env


def limits(mem_limit_bytes):
    """The preexec_fn that applies the campaign's rlimits to a child (also for callers that start
    the process themselves)."""
    def apply():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files from deliberate crashes
        if mem_limit_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (mem_limit_bytes, mem_limit_bytes))
    return apply


def _clip(text):
    if len(text) <= 2 * KEEP_CHARS:
        return text
    return text[:KEEP_CHARS] + f"\n[... {len(text) - 2 * KEEP_CHARS} chars ...]\n" + text[-KEEP_CHARS:]


def run(argv, cwd, timeout_s, mem_limit_bytes=0):
    """Runs argv; returns a dict with rc (negative: signal), timed_out, wall_s, the clipped
    output, the first error line and whether it crashed (signal, rc >= 128, sanitizer report)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=child_env(), start_new_session=True,
                            preexec_fn=limits(mem_limit_bytes))
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_session(proc.pid)
        out, err = proc.communicate()
    return result(argv, proc.returncode, timed_out, time.monotonic() - start, out, err)


def kill_session(sid):
    """SIGKILLs every process of the session a child started with start_new_session=True leads:
    its process group, and the ranks mpirun puts in process groups of their own (a kill of
    mpirun's group alone leaves them running)."""
    for pid in [sid] + _session_members(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _session_members(sid):
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == sid:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)", which may hold spaces
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            members.append(int(name))
    return members


def result(argv, rc, timed_out, wall_s, out, err):
    """The record of one finished invocation (out and err as bytes), as run returns it; for callers
    that start the process themselves (e.g. to act on it while it runs)."""
    out = out.decode("utf-8", "replace")
    err = err.decode("utf-8", "replace")
    text = err + "\n" + out
    sanitizer = SANITIZER_RE.search(text)
    crashed = (not timed_out) and (rc < 0 or rc >= 128 or sanitizer is not None)
    return {
        "argv": argv,
        "rc": rc,
        "signal": signal.Signals(-rc).name if rc < 0 and -rc in signal.valid_signals() else None,
        "timed_out": timed_out,
        "crashed": crashed,
        "sanitizer": sanitizer.group(0) if sanitizer else None,
        "wall_s": round(wall_s, 3),
        "error_line": first_error_line(err, out),
        "has_mxddp_error": bool(ERROR_LINE_RE.search(err)),
        "stderr": _clip(err),
        "stdout": _clip(out),
    }


def first_error_line(err, out):
    """The line a user would read as the reason: the first `mxddp: error:` line, else the first
    non-empty stderr line, else the last stdout line."""
    m = ERROR_LINE_RE.search(err)
    if m:
        return m.group(0)[:500]
    for line in err.splitlines():
        if line.strip():
            return line.strip()[:500]
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[-1].strip()[:500] if lines else ""


def snapshot(root):
    """What a tree holds, without following symbolic links or opening anything but regular files
    (a FIFO would block): {relative path: (kind, sha256 or link target or device number)}."""
    result = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                result[rel] = ("file", h.hexdigest())
            elif stat.S_ISLNK(st.st_mode):
                result[rel] = ("symlink", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                result[rel] = ("dir", "")
            elif stat.S_ISFIFO(st.st_mode):
                result[rel] = ("fifo", "")
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                result[rel] = ("device", str(st.st_rdev))
            else:
                result[rel] = ("other", "")
    return result


def snapshot_diff(before, after):
    """The paths that appeared, vanished or changed, as short strings."""
    diff = []
    for rel in sorted(set(before) | set(after)):
        if rel not in after:
            diff.append(f"removed {rel}")
        elif rel not in before:
            diff.append(f"created {rel}")
        elif before[rel] != after[rel]:
            diff.append(f"changed {rel}")
    return diff


def make_device(path, major, minor, fallback_target):
    """A character device node inside the sandbox (a copy of /dev/zero or /dev/full that mxddp may
    destroy without harm); a symbolic link to the real one where mknod is not allowed."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        return "device"
    except (PermissionError, OSError):
        os.symlink(fallback_target, path)
        return "symlink"
