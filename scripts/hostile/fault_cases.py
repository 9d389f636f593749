# Part 4 of the hostile campaign (issue 40): the faults real clusters produce, drawn at random from
# the seed. A preemption signal at a random point of a run (in one process, or sent to mpirun as the
# documented recipe says, or SIGTERM to mpirun, which OpenMPI answers by killing the ranks); a
# file-size limit (ulimit -f) on a save and on an export; an address-space limit (ulimit -v) on the
# ranks; an indexed dataset's .bin truncated, overwritten or given ids past the vocabulary while a
# run reads it.
#
# Each case knows before it runs what must happen, and judges the run by its exit status, its own
# output and what it left on disk, never by timing alone: expected, missed (a fault that went
# unnoticed), crash (a signal's death, rc >= 128, a sanitizer report), hang (past a generous
# timeout), unclear-error (non-zero without an error that names the cause), leftovers (temporaries
# or directories of a failed write left behind), lost-checkpoint (a save that was announced, or was
# there before, no longer loads), harness-error (the case could not be set up or acted too late).
import math
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import runner

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--corpus-bytes", "65536"]
# About 1.3 s an iteration on the 2-core machine: longer than OpenMPI's 1 s between forwarding
# SIGTERM and killing the ranks, so a signal lands inside an iteration and its save takes a while.
SMALL = ["--model", "small", "--micro-batch-size", "2", "--global-batch-size", "8", "--corpus-bytes", "1048576"]
MPIRUN_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2"]
TRACKER = "latest_checkpointed_iteration.txt"
TRAIN_ITERS_FOREVER = "1000000"  # a run that only a fault ends

# Case kinds and how many of every 40 cases each gets.
KINDS = [("preempt-local", 7), ("preempt-mpirun-usr1", 3), ("preempt-mpirun-term", 2), ("fsize-train", 5),
         ("fsize-export", 6), ("address-space", 8), ("data-changed", 9)]
CLASSES = ("expected", "missed", "crash", "hang", "unclear-error", "leftovers", "lost-checkpoint", "harness-error")
BAD = CLASSES[1:]

# What a write in progress is named: a save's iter_N.partial and .NAME.tmp, an export's .NAME.partial,
# hf.partial and hf.old, the start-up probe beside an output.
LEFTOVER_RE = re.compile(r"(\.tmp|\.partial|\.probe|\.old)$")
FIRST_ITERATION_RE = re.compile(rb"^ *iteration +\d+/", re.M)
ITERATION_RE = re.compile(r"^ *iteration +(\d+)/", re.M)
STOPPED_RE = re.compile(r"stopped after iteration (\d+) of")
SAVED_RE = re.compile(r"saved checkpoint at iter (\d+)")
TRAINED_RE = re.compile(r"trained iterations (\d+)\.\.(\d+)")
MXDDP_ERROR_RE = re.compile(r"^(?:rank \d+: )?mxddp: error: .*$", re.M)
RANK_SIGNAL_RE = re.compile(r"exited on signal (\d+)")
UNWIND_ABORT = "libgcc_s.so.1 must be installed"
SIZE_RE = re.compile(r"\d+(\.\d+)? ?(B|bytes|KiB|MiB|GiB|TiB)\b")
OOM_RE = re.compile(r"memory|address space|allocat|RLIMIT_AS|ulimit -v", re.I)
FSIZE_RE = re.compile(r"file size limit|ulimit -f|RLIMIT_FSIZE", re.I)
QUOTED_PATH_RE = re.compile(r"'[^']*/[^']*'")
# Sizes near a limit the size of the biggest file may go either way (a manifest's digits differ).
FSIZE_MARGIN_BYTES = 4096
# A run still going this long after its .bin changed trained on (an fstat after each batch must see it).
DATA_SETTLE_S = 20

# Applies one rlimit (bytes) and execs the command: the same wrapper for a local run and for each
# rank under mpirun (a limit on mpirun itself would not be the ranks'). It stays in the argv, so a
# case reruns by hand from results.json. Python ignores SIGXFSZ and SIGPIPE and exec keeps ignored
# signals: they are set back to the default a shell's `ulimit -f; exec` would leave.
LIMIT_EXEC = ("import os, resource, signal, sys\n"
              "for s in (signal.SIGPIPE, signal.SIGXFSZ): signal.signal(s, signal.SIG_DFL)\n"
              "n = int(sys.argv[2]); resource.setrlimit(getattr(resource, sys.argv[1]), (n, n))\n"
              "os.execv(sys.argv[3], sys.argv[3:])")


class Context:
    """What every case shares: the binary, mpirun, the timeouts and the fixtures made once."""

    def __init__(self, mxddp, mpirun, root, timeout_s, mem_limit):
        self.mxddp, self.mpirun, self.root = mxddp, mpirun, root
        self.timeout_s, self.mem_limit = timeout_s, mem_limit
        self.fixtures = os.path.join(root, "fixtures")
        self.history = os.path.join(self.fixtures, "history")  # a checkpoint at iteration 2
        self.datasets = {}       # dtype -> prefix of an indexed dataset of README.md's bytes
        self.save_need = 0       # the biggest file of a save of BASE
        self.export_need = {}    # (format, dtype) -> the biggest file an export writes


# ---- fixtures ----

def make_fixtures(ctx):
    shutil.rmtree(ctx.fixtures, ignore_errors=True)  # a --save into an old history would resume it
    os.makedirs(ctx.fixtures)
    run_or_exit([ctx.mxddp, "train", "--ranks", "2", *BASE, "--train-iters", "2", "--save", ctx.history], ctx,
                "the previous checkpoint")
    ctx.save_need = biggest_file(ctx.history)
    for fmt, dtype in (("safetensors", "f32"), ("safetensors", "bf16"), ("hf", "model"), ("hf", "f32")):
        out = os.path.join(ctx.fixtures, f"export-{fmt}-{dtype}")
        target = out if fmt == "hf" else os.path.join(out, "model.safetensors")
        run_or_exit(export_argv(ctx.mxddp, ctx.history, target, fmt, dtype), ctx, f"the export {fmt} {dtype}")
        ctx.export_need[(fmt, dtype)] = biggest_file(out)
    source = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    for dtype in ("uint16", "uint8"):
        prefix = os.path.join(ctx.fixtures, f"data-{dtype}")
        result = subprocess.run([sys.executable, os.path.join(source, "scripts", "make_indexed_dataset.py"),
                                 os.path.join(source, "README.md"), prefix, "--dtype", dtype],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"making the indexed dataset {prefix} failed:\n{result.stderr}")
        ctx.datasets[dtype] = prefix


def run_or_exit(argv, ctx, what):
    result = run(argv, ctx.fixtures, max(ctx.timeout_s, 120), ctx.mem_limit)
    if result["rc"] != 0:
        raise SystemExit(f"making {what} failed: {' '.join(argv)}\n{result['stderr']}")


def biggest_file(root):
    return max(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def idx_dtype_bytes(prefix):
    """The token size the .idx declares (megatron-core's codes: 1 uint8, 8 uint16, 4 int32, ...)."""
    with open(prefix + ".idx", "rb") as f:
        code = f.read(18)[17]  # after the 9-byte magic and the 8-byte version
    return {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 8: 2}[code]


# ---- drawing cases ----

def generate(rng, count):
    """count cases, the kinds in KINDS's proportions (every kind at least once from 40 cases up).
    The classes the report counts by (signal, launcher, format, change, model) go round in turn
    from a seeded start, so a small campaign still meets each; delays and limits are drawn."""
    plan = [kind for kind, n in KINDS for _ in range(n)]
    kinds = [plan[i * len(plan) // count] for i in range(count)]
    start = {kind: rng.randrange(1 << 16) for kind, _ in KINDS}
    seen = dict.fromkeys(start, 0)
    cases = []
    for kind in kinds:
        case = dict(id=len(cases), kind=kind, launcher="local", small=False)
        DRAW[kind](case, rng, start[kind] + seen[kind])
        seen[kind] += 1
        case["row"] = row_of(case)
        cases.append(case)
    return cases


def turn(slot, options):
    return options[slot % len(options)]


def draw_preempt(case, rng, slot):
    kind = case["kind"]
    if kind == "preempt-local":
        case["signal"] = turn(slot, ["SIGTERM", "SIGUSR1"])
        case["small"] = slot % 7 == 0
    else:
        case["launcher"] = "mpirun"
        case["signal"] = "SIGUSR1" if kind == "preempt-mpirun-usr1" else "SIGTERM"
        case["small"] = slot % (3 if kind == "preempt-mpirun-usr1" else 2) == 0
    # A point in one of the next iterations or evaluations: the tiny model does about 500 a second,
    # the small one one in 1.3 s; evaluations come every few iterations.
    case["delay_s"] = round(rng.uniform(0, 3.0 if case["small"] else 1.5), 3)
    case["eval_interval"] = rng.choice([1, 2] if case["small"] else [1, 2, 3, 5, 10, 50])
    case["eval_iters"] = rng.randint(1, 2 if case["small"] else 3)
    # Earlier saves, so a signal can also land in a save and a lost stop leaves a history to check.
    case["save_interval"] = 0 if case["small"] else rng.choice([0, 0, 50, 200])


def draw_fsize_train(case, rng, slot):
    case["launcher"] = turn(slot, ["local", "local", "mpirun", "local"])
    case["limit_bytes"] = fsize_limit(rng, slot)
    case["keep_last"] = rng.random() < 0.4


def draw_fsize_export(case, rng, slot):
    case["format"] = turn(slot, ["safetensors", "hf"])
    case["dtype"] = rng.choice(["f32", "bf16"] if case["format"] == "safetensors" else ["model", "f32"])
    case["limit_bytes"] = fsize_limit(rng, slot // 2)
    # --out under directories that do not exist yet (safetensors only: --format hf wants the parent)
    case["nested"] = case["format"] == "safetensors" and rng.random() < 0.5


def fsize_limit(rng, slot):
    # Half below 256 KiB, half above: the biggest file of a save here is about 250 KB, of an export 72-143 KB.
    return log_uniform(rng, *turn(slot, [(4 << 10, 256 << 10), (256 << 10, 4 << 20)]))


def draw_address_space(case, rng, slot):
    case["launcher"] = turn(slot, ["local", "mpirun", "local"])
    case["small"] = slot % 4 == 1
    # Below and above what a tiny run needs here (its libraries alone map about 130 MiB).
    case["limit_bytes"] = log_uniform(rng, *turn(slot // 3, [(100 << 20, 450 << 20), (450 << 20, 2 << 30)]))


def draw_data_changed(case, rng, slot):
    case["launcher"] = turn(slot, ["local", "local", "mpirun", "local"])
    # uint8 holds no id past a 256-token vocabulary: only the change itself can be seen there.
    case["mode"], case["dtype"] = turn(slot, [("truncate", "uint16"), ("overwrite", "uint16"), ("ids", "uint16"),
                                              ("truncate", "uint8"), ("overwrite", "uint8"), ("ids", "uint16")])
    case["at_iteration"] = rng.randint(1, 12)
    case["delay_s"] = round(rng.uniform(0, 0.05), 3)
    case["eval_interval"] = rng.choice([0, 2, 3, 5])
    case["seed"] = rng.randrange(1 << 30)  # the new length, bytes or positions


DRAW = {"preempt-local": draw_preempt, "preempt-mpirun-usr1": draw_preempt, "preempt-mpirun-term": draw_preempt,
        "fsize-train": draw_fsize_train, "fsize-export": draw_fsize_export, "address-space": draw_address_space,
        "data-changed": draw_data_changed}


def log_uniform(rng, low, high):
    return int(low * math.exp(rng.uniform(0, math.log(high / low))))


def row_of(case):
    """The summary table's row: the fault and how the run was started."""
    kind, launcher = case["kind"], "mpirun" if case["launcher"] == "mpirun" else "in-process"
    if kind.startswith("preempt"):
        if kind == "preempt-mpirun-term":
            return "preempt: SIGTERM to mpirun (expected loss)"
        return f"preempt: {case['signal']} {'to mpirun' if launcher == 'mpirun' else 'in-process'}"
    if kind == "fsize-train":
        return f"ulimit -f: train --save, {launcher}"
    if kind == "fsize-export":
        return f"ulimit -f: ckpt export --format {case['format']}"
    if kind == "address-space":
        return f"ulimit -v: train, {launcher}"
    return f"data changed: {case['mode']}, {launcher}"


def describe(case):
    """One line naming the case's drawn parameters, for the report."""
    keys = [k for k in ("signal", "delay_s", "eval_interval", "save_interval", "limit_bytes", "keep_last", "format",
                        "dtype", "nested", "mode", "at_iteration") if k in case]
    model = " small" if case.get("small") else ""
    return f"{case['kind']} {case['launcher']}{model} " + " ".join(f"{k}={case[k]}" for k in keys)


# ---- running ----

def limited(rlimit, value_bytes, argv):
    return [sys.executable, "-c", LIMIT_EXEC, rlimit, str(value_bytes), *argv]


def train_argv(ctx, case, flags, rlimit=None):
    """`mxddp train FLAGS` as the case launches it: 2 ranks in one process, or under mpirun; with
    rlimit (name, bytes) every rank runs under that limit."""
    if case["launcher"] == "mpirun":
        cmd = [ctx.mxddp, "train", "--backend", "mpi", *flags]
        return [ctx.mpirun, *MPIRUN_FLAGS, *(limited(*rlimit, cmd) if rlimit else cmd)]
    cmd = [ctx.mxddp, "train", "--ranks", "2", *flags]
    return limited(*rlimit, cmd) if rlimit else cmd


def export_argv(mxddp, source, out, fmt, dtype):
    return [mxddp, "ckpt", "export", source, "--out", out, "--format", fmt, "--dtype", dtype]


def mem_limit_of(ctx, case):
    # The campaign's address-space limit bounds mxddp, never mpirun (which maps a lot for itself).
    return 0 if case["launcher"] == "mpirun" else ctx.mem_limit


def run(argv, work, timeout_s, mem_limit):
    return with_rank_errors(runner.run(argv, work, timeout_s, mem_limit))


def with_rank_errors(r):
    """runner takes `mxddp: error:` at a line's start for the error; under mpirun each rank's starts
    with 'rank K: ' after OpenMPI's own banner, so the error line is looked for again."""
    m = MXDDP_ERROR_RE.search(r.get("full_stderr") or r["stderr"])
    if m:
        r.update(error_line=m.group(0)[:500], has_mxddp_error=True)
    return r


def run_acting(argv, work, timeout_s, mem_limit, trigger_re, delay_s, act, settle_s=None):
    """Runs argv with its output in work/stdout.log and work/stderr.log; delay_s after its stdout
    first matches trigger_re, calls act(proc) (a signal, a change of a file) if the run is still
    going. With settle_s, a run still going settle_s after the act is stopped there. Returns
    runner's record plus acted, the stdout printed before the act, stopped_after_settle and the
    whole output (full_stdout, full_stderr: the record's copies are clipped)."""
    out_path, err_path = os.path.join(work, "stdout.log"), os.path.join(work, "stderr.log")
    start = time.monotonic()
    with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
        proc = subprocess.Popen(argv, cwd=work, stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f,
                                env=runner.child_env(), start_new_session=True, preexec_fn=runner.limits(mem_limit))
    seen, act_at, acted_at, before_act = b"", None, None, b""
    timed_out = settled = False
    try:
        with open(out_path, "rb") as tail:
            while proc.poll() is None:
                now = time.monotonic()
                if now - start > timeout_s:
                    timed_out = True
                    break
                if act_at is None:
                    seen += tail.read()
                    if trigger_re.search(seen):
                        act_at = now + delay_s
                elif acted_at is None and now >= act_at:
                    before_act = seen + tail.read()
                    act(proc)
                    acted_at = now
                elif settle_s is not None and acted_at is not None and now - acted_at > settle_s:
                    settled = True
                    break
                time.sleep(0.01)
    except BaseException:
        runner.kill_session(proc.pid)  # an act that failed must not leave the run going
        proc.wait()
        raise
    if timed_out or settled:
        runner.kill_session(proc.pid)
    proc.wait()
    wall_s = time.monotonic() - start
    with open(out_path, "rb") as f:
        out = f.read()
    with open(err_path, "rb") as f:
        err = f.read()
    record = runner.result(argv, proc.returncode, timed_out, wall_s, out, err)
    record.update(acted=acted_at is not None, stdout_before_act=before_act.decode("utf-8", "replace"),
                  stopped_after_settle=settled, act_after_s=round(acted_at - start, 3) if acted_at else None,
                  full_stdout=out.decode("utf-8", "replace"), full_stderr=err.decode("utf-8", "replace"))
    return with_rank_errors(record)


def crash_reason(r, allowed_rank_signals=()):
    """Why a finished run counts as a crash, or None: runner's verdict (a signal, rc >= 128, a
    sanitizer report), the unwinder's abort, or a rank that mpirun says died of a signal. With
    allowed_rank_signals (mpirun killing its ranks on purpose), ranks that died of those and
    mpirun's rc >= 128 that passes such a death on are not crashes; mpirun's own death is."""
    text = output_of(r)
    if UNWIND_ABORT in text:
        return f"'{UNWIND_ABORT}' (an abort while throwing)"
    if r["sanitizer"]:
        return r["sanitizer"]
    for m in RANK_SIGNAL_RE.finditer(text):
        if int(m.group(1)) not in allowed_rank_signals:
            return f"a rank {m.group(0)}"
    if r["crashed"] and (r["rc"] < 0 or not allowed_rank_signals):
        return f"killed by {r['signal']}" if r["signal"] else f"rc {r['rc']}"
    return None


def leftovers(root):
    """Paths under root that a write in progress is named (relative), or []."""
    found = []
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            if LEFTOVER_RE.search(name):
                found.append(os.path.relpath(os.path.join(d, name), root))
    return sorted(found)


def tracked(history):
    try:
        with open(os.path.join(history, TRACKER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def output_of(r):
    return r.get("full_stdout", r["stdout"]) + "\n" + r.get("full_stderr", r["stderr"])


def step(r, what):
    """The short record of a follow-up command (inspect, resume) kept with the case."""
    return dict(what=what, argv=r["argv"], rc=r["rc"], wall_s=r["wall_s"], error_line=r["error_line"])


def verdict(cls, detail, main, steps=()):
    return dict(classification=cls, detail=detail, main=main, steps=list(steps))


# ---- preemption ----

def preempt_flags(case, history):
    flags = [*(SMALL if case["small"] else BASE), "--exit-signal-handler", "--eval-interval",
             str(case["eval_interval"]), "--eval-iters", str(case["eval_iters"]), "--save", history]
    if case["save_interval"]:
        flags += ["--save-interval", str(case["save_interval"])]
    return flags


def run_preempt(ctx, case, work):
    history = os.path.join(work, "D")
    flags = preempt_flags(case, history)
    argv = train_argv(ctx, case, [*flags, "--train-iters", TRAIN_ITERS_FOREVER])
    sig = getattr(signal, case["signal"])
    timeout_s = ctx.timeout_s * (4 if case["small"] else 2)
    # The signal goes to the process that was started: mxddp itself, or mpirun (which forwards it).
    r = run_acting(argv, work, timeout_s, mem_limit_of(ctx, case), FIRST_ITERATION_RE, case["delay_s"],
                   lambda proc: proc.send_signal(sig))
    if case["kind"] == "preempt-mpirun-term":
        return judge_expected_loss(ctx, case, work, history, flags, r)
    return judge_preempt(ctx, case, work, history, flags, r)


def resume(ctx, case, work, history, flags, iteration):
    """inspect of the history, then a resume that trains iteration+1 with the same flags (saving
    it into the same history) and says it trained exactly that one."""
    inspect = run([ctx.mxddp, "ckpt", "inspect", history], work, ctx.timeout_s, ctx.mem_limit)
    steps = [step(inspect, "inspect")]
    if inspect["rc"] != 0:
        return steps, f"ckpt inspect refuses the history: {inspect['error_line']}"
    argv = train_argv(ctx, case, [*flags, "--load", history, "--train-iters", str(iteration + 1)])
    r = run(argv, work, ctx.timeout_s * (4 if case["small"] else 2), mem_limit_of(ctx, case))
    steps.append(step(r, "resume"))
    trained = TRAINED_RE.search(r["stdout"])
    if r["rc"] != 0 or crash_reason(r):
        return steps, f"the resume from iteration {iteration} failed (rc {r['rc']}): {r['error_line']}"
    if not trained or int(trained.group(1)) != iteration + 1:
        return steps, f"the resume did not train iteration {iteration + 1} after {iteration}: {r['error_line']}"
    return steps, None


def judge_preempt(ctx, case, work, history, flags, r):
    """A caught signal: exit 0, 'stopped after iteration N', the tracker naming N, the history
    loadable and resumable, nothing half-written left."""
    reason = crash_reason(r)
    if reason:
        return verdict("crash", reason, r)
    if r["timed_out"]:
        what = "of the signal" if r["acted"] else "of its start, no iteration line"
        return verdict("hang", f"still running {r['wall_s']:.0f} s after the start, {what}", r)
    if not r["acted"]:
        return verdict("harness-error", f"the run ended (rc {r['rc']}) before the signal: {r['error_line']}", r)
    stopped = STOPPED_RE.search(r["full_stdout"])
    if not stopped:
        cls = "missed" if r["rc"] == 0 else "lost-checkpoint"
        return verdict(cls, f"rc {r['rc']} without a 'stopped after iteration' line: {r['error_line']}", r)
    n = int(stopped.group(1))
    if tracked(history) != n:
        return verdict("lost-checkpoint", f"stopped after iteration {n} but the tracker names {tracked(history)}", r)
    if r["rc"] != 0:
        return verdict("unclear-error", f"saved iteration {n} but exited {r['rc']}: {r['error_line']}", r)
    left = leftovers(work)
    steps, lost = resume(ctx, case, work, history, flags, n)
    if lost:
        return verdict("lost-checkpoint", lost, r, steps)
    left_after = leftovers(work)
    if left or left_after:
        return verdict("leftovers", f"after the stop: {left[:4]}; after the resume: {left_after[:4]}", r, steps)
    return verdict("expected", f"stopped after iteration {n}, saved, resumed", r, steps)


def judge_expected_loss(ctx, case, work, history, flags, r):
    """SIGTERM to mpirun: OpenMPI kills the ranks and exits non-zero, so a save may be lost. What
    must hold: mpirun ends by itself, no rank dies of a signal but OpenMPI's SIGTERM and SIGKILL,
    every save the run announced (and a 'stopped after iteration N') is the tracker's or older
    than it, and whatever the history holds loads and resumes (clearing a killed save's partial)."""
    reason = crash_reason(r, allowed_rank_signals=(signal.SIGTERM, signal.SIGKILL))
    if reason:
        return verdict("crash", reason, r)
    if r["timed_out"]:
        return verdict("hang", f"mpirun still running {r['wall_s']:.0f} s after the start", r)
    if not r["acted"]:
        return verdict("harness-error", f"mpirun ended (rc {r['rc']}) before the signal: {r['error_line']}", r)
    announced = [int(k) for k in SAVED_RE.findall(r["full_stdout"])]
    stopped = STOPPED_RE.search(r["full_stdout"])
    if stopped:
        announced.append(int(stopped.group(1)))
    latest = tracked(history)
    if announced and (latest is None or latest < max(announced)):
        return verdict("lost-checkpoint", f"iteration {max(announced)} was announced saved but the tracker "
                       f"names {latest}", r)
    if latest is None:
        if os.path.exists(os.path.join(history, TRACKER)):
            return verdict("lost-checkpoint", "the tracker is unreadable", r)
        return verdict("expected", f"mpirun rc {r['rc']}: no save before the kill, none announced", r)
    steps, lost = resume(ctx, case, work, history, flags, latest)
    if lost:
        return verdict("lost-checkpoint", lost, r, steps)
    left = leftovers(work)
    if left:
        return verdict("leftovers", f"after the resume saved into the history: {left[:4]}", r, steps)
    saved = "the save of the stop" if stopped else "an earlier save"
    return verdict("expected", f"mpirun rc {r['rc']}: {saved}, iteration {latest}, loads and resumes", r, steps)


# ---- file-size limit ----

def fsize_expectation(limit_bytes, need_bytes):
    """'ok' when every file fits the limit, 'error' when the biggest does not, 'either' near it."""
    if limit_bytes >= need_bytes + FSIZE_MARGIN_BYTES:
        return "ok"
    if limit_bytes < need_bytes - FSIZE_MARGIN_BYTES:
        return "error"
    return "either"


def judge_fsize_error(r, expectation):
    """None when a refused write is reported as it must be, else (classification, detail)."""
    if expectation == "ok":
        return "unclear-error", f"failed though every file fits the limit: {r['error_line']}"
    line = r["error_line"]
    if r["rc"] != 1 or not r["has_mxddp_error"] or not FSIZE_RE.search(line) or not QUOTED_PATH_RE.search(line):
        return "unclear-error", f"rc {r['rc']} without an error naming the file and the limit: {line}"
    return None


def run_fsize_train(ctx, case, work):
    history = os.path.join(work, "D")
    shutil.copytree(ctx.history, history)
    before = runner.snapshot(history)
    flags = [*BASE, "--train-iters", "4", "--load", history, "--save", history]
    if case["keep_last"]:
        flags += ["--keep-last", "1"]
    argv = train_argv(ctx, case, flags, ("RLIMIT_FSIZE", case["limit_bytes"]))
    r = run(argv, work, ctx.timeout_s, mem_limit_of(ctx, case))
    expectation = fsize_expectation(case["limit_bytes"], ctx.save_need)
    reason = crash_reason(r)
    if reason:
        return verdict("crash", reason, r)
    if r["timed_out"]:
        return verdict("hang", f"still running after {r['wall_s']:.0f} s", r)
    inspect = run([ctx.mxddp, "ckpt", "inspect", history], work, ctx.timeout_s, ctx.mem_limit)
    steps = [step(inspect, "inspect")]
    if r["rc"] == 0:
        if expectation == "error":
            return verdict("missed", f"exit 0 though a {ctx.save_need}-byte file exceeds the limit", r, steps)
        if inspect["rc"] != 0 or tracked(history) != 4:
            return verdict("lost-checkpoint", f"saved with exit 0, but the tracker names {tracked(history)} and "
                           f"inspect says: {inspect['error_line']}", r, steps)
        return verdict("expected", "saved within the limit", r, steps)
    bad = judge_fsize_error(r, expectation)
    if bad:
        return verdict(*bad, r, steps)
    diff = runner.snapshot_diff(before, runner.snapshot(history))
    lost = [d for d in diff if not d.startswith("created")]
    if lost or inspect["rc"] != 0 or tracked(history) != 2:
        return verdict("lost-checkpoint", f"the previous checkpoint: {lost[:4]}, tracker {tracked(history)}, "
                       f"inspect: {inspect['error_line']}", r, steps)
    left = sorted(set(leftovers(work)) | {os.path.join("D", d[len("created "):]) for d in diff})
    if left:
        return verdict("leftovers", f"{left[:4]}", r, steps)
    return verdict("expected", "refused naming the file and the limit; the previous checkpoint intact", r, steps)


def run_fsize_export(ctx, case, work):
    source = os.path.join(work, "D")
    shutil.copytree(ctx.history, source)
    out = os.path.join(work, "out", "sub") if case["nested"] else work
    target = os.path.join(out, "hf" if case["format"] == "hf" else "model.safetensors")
    before = runner.snapshot(work)
    argv = limited("RLIMIT_FSIZE", case["limit_bytes"],
                   export_argv(ctx.mxddp, source, target, case["format"], case["dtype"]))
    r = run(argv, work, ctx.timeout_s, ctx.mem_limit)
    need = ctx.export_need[(case["format"], case["dtype"])]
    expectation = fsize_expectation(case["limit_bytes"], need)
    reason = crash_reason(r)
    if reason:
        return verdict("crash", reason, r)
    if r["timed_out"]:
        return verdict("hang", f"still running after {r['wall_s']:.0f} s", r)
    diff = runner.snapshot_diff(before, runner.snapshot(work))
    touched = [d for d in diff if not d.startswith("created")]
    if touched:
        return verdict("lost-checkpoint", f"the export changed its source: {touched[:4]}", r)
    if r["rc"] == 0:
        written = biggest_file(target) if os.path.isdir(target) else os.path.getsize(target)
        if expectation == "error" or written != need:
            return verdict("missed", f"exit 0 with a biggest file of {written} bytes (unlimited: {need}, "
                           f"limit {case['limit_bytes']})", r)
        return verdict("expected", "exported within the limit", r)
    bad = judge_fsize_error(r, expectation)
    if bad:
        return verdict(*bad, r)
    left = sorted(set(leftovers(work)) | {d[len("created "):] for d in diff})
    if left:
        return verdict("leftovers", f"{left[:4]}", r)
    return verdict("expected", "refused naming the file and the limit; nothing left", r)


# ---- address-space limit ----

def run_address_space(ctx, case, work):
    flags = [*(SMALL if case["small"] else BASE), "--train-iters", "3", "--eval-iters", "1"]
    argv = train_argv(ctx, case, flags, ("RLIMIT_AS", case["limit_bytes"]))
    r = run(argv, work, ctx.timeout_s * (3 if case["small"] else 1), mem_limit_of(ctx, case))
    reason = crash_reason(r)
    if reason:
        return verdict("crash", reason, r)
    if r["timed_out"]:
        said = f", after saying: {r['error_line'][:160]}" if r["error_line"] else ""
        return verdict("hang", f"still running after {r['wall_s']:.0f} s{said}", r)
    if r["rc"] == 0:
        trained = TRAINED_RE.search(r["stdout"])
        if not trained or trained.group(2) != "3":
            return verdict("missed", "exit 0 without training iterations 1..3", r)
        return verdict("expected", "trained within the limit", r)
    line = r["error_line"]
    if not r["has_mxddp_error"] or not OOM_RE.search(line) or not SIZE_RE.search(line):
        return verdict("unclear-error", f"rc {r['rc']} without an out-of-memory error naming a size: {line}", r)
    return verdict("expected", "refused naming the memory it needs", r)


# ---- data changed under the run ----

def change_data(case, bin_path, token_bytes):
    """Changes bin_path in place (the same inode, as an editor or a second preprocessing into the
    same name would): truncated to a shorter random length, overwritten with random bytes of the
    same size, or given ids past the 256-token vocabulary at random token positions."""
    rng = random.Random(case["seed"])  # the case's own, so a rerun makes the same change
    size = os.path.getsize(bin_path)
    if case["mode"] == "truncate":
        os.truncate(bin_path, rng.randrange(size))
        return
    with open(bin_path, "r+b") as f:
        if case["mode"] == "overwrite":
            f.write(rng.randbytes(size))
            return
        for _ in range(rng.randint(1, 64)):
            f.seek(rng.randrange(size // token_bytes) * token_bytes)
            f.write(struct.pack("<H", rng.randint(256, 65535)))


def run_data_changed(ctx, case, work):
    prefix = os.path.join(work, "p")
    for ext in (".bin", ".idx"):
        shutil.copyfile(ctx.datasets[case["dtype"]] + ext, prefix + ext)
    token_bytes = idx_dtype_bytes(prefix)
    flags = [*without(BASE, "--corpus-bytes"), "--data-path", prefix, "--vocab-size", "256",
             "--train-iters", TRAIN_ITERS_FOREVER, "--log-interval", "1",
             "--eval-interval", str(case["eval_interval"]), "--eval-iters", "2"]
    argv = train_argv(ctx, case, flags)
    trigger = re.compile(rb"^ *iteration +%d/" % case["at_iteration"], re.M)
    r = run_acting(argv, work, max(ctx.timeout_s, 2 * DATA_SETTLE_S), mem_limit_of(ctx, case), trigger,
                   case["delay_s"], lambda proc: change_data(case, prefix + ".bin", token_bytes), DATA_SETTLE_S)
    reason = crash_reason(r)
    if reason and not r["stopped_after_settle"]:
        return verdict("crash", reason, r)
    if r["timed_out"]:
        what = "after the change" if r["acted"] else f"before iteration {case['at_iteration']}"
        return verdict("hang", f"still running after {r['wall_s']:.0f} s, {what}", r)
    if not r["acted"]:
        return verdict("harness-error", f"the run ended (rc {r['rc']}) before the change: {r['error_line']}", r)
    # Iterations as logged: under mpirun the ranks' lines reach mpirun's output a while after they
    # are printed, so the ranks were further on at the change than the log says.
    before, last = last_iteration(r["stdout_before_act"]), last_iteration(r["full_stdout"])
    when = f"changed after iteration {before} was logged, the last logged is {last}"
    if r["stopped_after_settle"]:
        cls = "missed" if last > before else "hang"
        return verdict(cls, f"still running {DATA_SETTLE_S} s after the change: {when}", r)
    if r["rc"] == 0:
        return verdict("missed", f"exit 0 after the change: {when}", r)
    if r["rc"] != 1 or not r["has_mxddp_error"] or "p.bin" not in r["error_line"]:
        return verdict("unclear-error", f"rc {r['rc']} without an error naming p.bin: {r['error_line']}", r)
    return verdict("expected", f"refused naming p.bin: {when}", r)


def without(flags, flag):
    """flags less one flag and its value."""
    i = flags.index(flag)
    return flags[:i] + flags[i + 2:]


def last_iteration(text):
    found = ITERATION_RE.findall(text)
    return int(found[-1]) if found else 0


RUN = {"preempt-local": run_preempt, "preempt-mpirun-usr1": run_preempt, "preempt-mpirun-term": run_preempt,
       "fsize-train": run_fsize_train, "fsize-export": run_fsize_export, "address-space": run_address_space,
       "data-changed": run_data_changed}


def run_case(ctx, case, keep_all):
    """Runs one case in ctx.root/cases/NNNN; returns its record (the directory stays unless the
    case went as expected)."""
    work = os.path.join(ctx.root, "cases", f"{case['id']:04d}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        v = RUN[case["kind"]](ctx, case, work)
    except Exception as e:  # a case the harness could not set up or read back
        v = verdict("harness-error", f"{type(e).__name__}: {e}", None)
    main = v.pop("main")
    if v["classification"] == "expected" and not keep_all:
        shutil.rmtree(work, ignore_errors=True)
    fields = ("argv", "rc", "signal", "timed_out", "wall_s", "error_line", "stderr", "act_after_s")
    record = dict(case, describe=describe(case), work=work, **v)
    record.update({k: (main or {}).get(k) for k in fields})
    return record
