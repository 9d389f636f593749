#!/usr/bin/env python3
# A reproducible hostile-user campaign against mxddp (issue 15): damaged and crafted checkpoints
# (part 1, ckpt_cases.py), fuzzed command lines (part 2, cli_fuzz.py), mpirun MPMD launches whose
# ranks disagree (part 3, mpmd_cases.py) and the faults clusters produce: preemption, file-size and
# address-space limits, data changed under a run (part 4, fault_cases.py). Python 3 standard
# library only.
#
# Usage:
#   scripts/hostile/campaign.py --mxddp build/release/mxddp --out /tmp/campaign [--seed 1]
#       [--invocations 1000] [--jobs 2] [--timeout 30] [--long-timeout 10] [--parts ckpt,fuzz,mpmd,faults]
#       [--fault-cases 40] [--mem-limit-gib 6] [--keep-all]
#
# Prints a summary table per part and the list of every missed / crashed / hung / silently
# accepted / unclear case, deduplicated by pattern; writes OUT/results.json (every case: command,
# exit status, classification, first error line) and OUT/summary.txt. The same seed and binary
# give the same cases. Case directories of cases that went as expected are removed unless
# --keep-all; the others stay under OUT for reproduction. See scripts/hostile/README.md.
import argparse
import collections
import concurrent.futures
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_cases  # noqa: E402
import cli_fuzz  # noqa: E402
import fault_cases  # noqa: E402
import mpmd_cases  # noqa: E402
import runner  # noqa: E402

CKPT_BAD = ("missed", "crash", "hang", "unclear-error", "control-failed", "harness-error")
FUZZ_BAD = ("crash", "hang", "silently-accepted-nonsense", "other-error")
MPMD_BAD = ("missed", "watchdog", "refused-other", "crash", "hang")
FAULTS_BAD = fault_cases.BAD


def progress(done, total, start, what):
    if done % 100 == 0 or done == total:
        print(f"  {what}: {done}/{total} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)


def parallel(jobs, fn, items, what):
    results = [None] * len(items)
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(fn, i, item): i for i, item in enumerate(items)}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            results[futures[future]] = future.result()
            progress(done, len(items), start, what)
    return results


def normalize(line):
    """An error line with its numbers, quoted values and paths blurred, for grouping."""
    line = re.sub(r"'[^']*'", "'S'", line)
    line = re.sub(r"/[\w./+-]+", "PATH", line)
    line = re.sub(r"\b[0-9a-f]{8}\b", "HEX", line)
    line = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", line)
    line = re.sub(r"\w+\.cc:N: ", "", line)
    return line[:160]


def short_argv(argv, limit=60):
    return " ".join(shlex.quote(a if len(a) <= limit else a[:limit] + f"...[{len(a)} chars]") for a in argv)


def table(rows, cols, counts, title):
    width = max([len(title)] + [len(r) for r in rows]) + 2
    colw = [max(len(c), 5) + 2 for c in cols]
    lines = [title.ljust(width) + "".join(c.rjust(w) for c, w in zip(cols, colw)) + "total".rjust(7)]
    for r in rows:
        cells = [counts.get((r, c), 0) for c in cols]
        lines.append(r.ljust(width) + "".join(str(n).rjust(w) for n, w in zip(cells, colw)) + str(sum(cells)).rjust(7))
    totals = [sum(counts.get((r, c), 0) for r in rows) for c in cols]
    lines.append("total".ljust(width) + "".join(str(n).rjust(w) for n, w in zip(totals, colw)) +
                 str(sum(totals)).rjust(7))
    return lines


# ---- part 1 ----

def run_ckpt_part(args, out, mem_limit):
    root = os.path.join(out, "ckpt")
    os.makedirs(root, exist_ok=True)
    sources = ckpt_cases.make_sources(args.mxddp, root, args.timeout, mem_limit)
    cases = ckpt_cases.generate(sources, random.Random(args.seed))
    records = parallel(args.jobs, lambda i, case: ckpt_cases.run_case(
        args.mxddp, root, sources, i, case, args.timeout, mem_limit, args.keep_all), cases, "checkpoint cases")
    return sources, records


def ckpt_report(records):
    lines = []
    simple = lambda c: "missed" if c.startswith("missed") else c
    cats = sorted({r["category"] for r in records})
    cols = ["detected", "control-ok", "accepted-allowed", "missed", "unclear-error", "crash", "hang",
            "control-failed", "harness-error"]
    counts = collections.Counter((r["category"], simple(r["classification"])) for r in records)
    lines += table(cats, cols, counts, "checkpoint category")
    expected = [r for r in records if r["expect_train"] != "ok"]
    detected = sum(1 for r in expected if r["classification"] == "detected")
    allowed = sum(1 for r in expected if r["classification"] == "accepted-allowed")
    lines.append("")
    lines.append(f"corruptions and crafted edits detected: {detected}/{len(expected) - allowed} "
                 f"(and {allowed} accepted where acceptance is allowed: resealed records of the saving run's "
                 f"settings, a reachable step, a BOM)")
    controls = [r for r in records if r["expect_train"] == "ok"]
    lines.append(f"controls loaded: {sum(r['classification'] == 'control-ok' for r in controls)}/{len(controls)}")
    unchanged = sum(1 for r in records if not r["files_changed"])
    lines.append(f"load attempts that left every file byte-identical: {unchanged}/{len(records)}")
    bad = [r for r in records if simple(r["classification"]) in CKPT_BAD or r["files_changed"]]
    if bad:
        lines.append("")
        lines.append("cases not detected cleanly (category / classification / case / what the run said):")
        groups = collections.defaultdict(list)
        for r in bad:
            if r["train"] is None:
                groups[(r["category"], r["classification"], r["error"])].append(r)
                continue
            said = r["train"]["error_line"] if r["train"]["rc"] != 0 else r["inspect"]["error_line"]
            groups[(r["category"], r["classification"], normalize(said) if r["train"]["rc"] else "")].append(r)
        for (cat, cls, _), rs in sorted(groups.items()):
            names = "; ".join(r["name"] for r in rs[:6]) + (f"; ... ({len(rs)} cases)" if len(rs) > 6 else "")
            r = rs[0]
            changed = f" FILES CHANGED: {r['files_changed'][:3]}" if r["files_changed"] else ""
            if r["train"] is None:
                said = "harness: " + r["error"]
            else:
                said = r["train"]["error_line"] if r["train"]["rc"] else f"train rc 0, inspect rc {r['inspect']['rc']}"
            lines.append(f"  [{cat}] {cls} x{len(rs)}: {names}{changed}")
            lines.append(f"      e.g. case {r['id']}: {said[:200]}")
    return lines


# ---- part 2 ----

def run_fuzz_part(args, out, sources, mem_limit):
    root = os.path.join(out, "fuzz")
    os.makedirs(root, exist_ok=True)
    if sources is None:
        sources = {"base": os.path.join(root, "source-ckpt")}
        argv = [args.mxddp, "train", "--ranks", "2", "--train-iters", "2", *ckpt_cases.MODEL_FLAGS,
                "--save", sources["base"]]
        result = runner.run(argv, root, 120, mem_limit)
        if result["rc"] != 0:
            raise SystemExit(f"making the good checkpoint failed: {result['stderr']}")
    fx = cli_fuzz.Fixtures(os.path.join(root, "fixtures"), sources["base"])
    options_by_sub = {}
    for sub in cli_fuzz.SUBCOMMANDS:
        text = subprocess.run([args.mxddp, *sub, "--help"], capture_output=True, text=True).stdout
        options_by_sub[" ".join(sub)] = cli_fuzz.parse_help(text)
    rng = random.Random(args.seed * 1000003 + 7)
    subcommands = None
    if args.subcommands:
        subcommands = [tuple(s.split()) for s in args.subcommands.split(",")]
        unknown = [" ".join(s) for s in subcommands if s not in cli_fuzz.SUBCOMMANDS]
        if unknown:
            raise SystemExit(f"--subcommands: {', '.join(unknown)} not fuzzed; valid: "
                             f"{', '.join(' '.join(s) for s in cli_fuzz.SUBCOMMANDS)}")
    invocations = [cli_fuzz.generate_invocation(i, rng, options_by_sub, fx, subcommands)
                   for i in range(args.invocations)]
    records = parallel(args.jobs, lambda i, inv: cli_fuzz.run_invocation(
        args.mxddp, root, inv, options_by_sub, args.timeout, args.long_timeout, mem_limit, args.keep_all),
        invocations, "fuzzed invocations")
    return options_by_sub, records


def fuzz_report(records):
    lines = []
    rows = ["rejected-with-clear-error", "accepted-valid", "accepted-ambiguous", "valid-long-killed",
            "silently-accepted-nonsense", "other-error", "crash", "hang"]
    cols = ["nonsense", "ambiguous", "long", "valid"]
    counts = collections.Counter((r["classification"], r["expect"]) for r in records)
    lines += table(rows, cols, counts, "outcome \\ judged value")
    by_sub = collections.Counter((r["sub"], r["classification"]) for r in records)
    lines.append("")
    lines += table(sorted({r["sub"] for r in records}), rows, by_sub, "subcommand")
    c = collections.Counter(r["classification"] for r in records)
    lines.append("")
    lines.append(f"fuzzed invocations: {len(records)}; crashes {c['crash']}, hangs {c['hang']}, silently accepted "
                 f"nonsense {c['silently-accepted-nonsense']}, other-error {c['other-error']}")
    for cls in FUZZ_BAD + ("accepted-ambiguous",):
        rs = [r for r in records if r["classification"] == cls]
        if not rs:
            continue
        lines.append("")
        lines.append(f"{cls} ({len(rs)}), by pattern:")
        groups = collections.defaultdict(list)
        for r in rs:
            if cls in ("silently-accepted-nonsense", "accepted-ambiguous"):
                key = tuple(sorted({(m["flag"], m["label"]) for m in r["mutations"]
                                    if m["verdict"] in ("nonsense", "ambiguous")}))
            else:
                key = normalize(r["error_line"]) + (r["signal"] or "") + (r["sanitizer"] or "")
            groups[(r["sub"], key)].append(r)
        for (sub, key), rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            r = rs[0]
            muts = ", ".join(f"{m['flag']}={m['value']!r:.40} ({m['label']}, {m['verdict']})" for m in r["mutations"])
            lines.append(f"  {sub} x{len(rs)}: {muts}")
            lines.append(f"      e.g. #{r['id']} rc {r['rc']}{' ' + r['signal'] if r['signal'] else ''}: "
                         f"{short_argv(r['argv'][1:])}")
            if r["error_line"]:
                lines.append(f"      said: {r['error_line'][:200]}")
    return lines


def run_mpmd_part(args, out):
    root = os.path.join(out, "mpmd")
    os.makedirs(root, exist_ok=True)
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("part 3 needs mpirun (Debian's openmpi-bin)")
    # One case at a time: each already runs 2 or 4 processes on the machine's cores.
    return parallel(1, lambda i, case: mpmd_cases.run_case(args.mxddp, mpirun, root, case, args.mpmd_timeout,
                                                           args.keep_all), mpmd_cases.cases(), "MPMD launches")


def mpmd_report(records):
    lines = []
    rows = ["refused-naming-flag"] + list(MPMD_BAD)
    counts = collections.Counter((r["classification"], f"np {r['ranks']}") for r in records)
    lines += table(rows, ["np 2", "np 4"], counts, "outcome \\ ranks")
    slowest = max((r["wall_s"] for r in records), default=0)
    lines.append("")
    lines.append(f"MPMD launches: {len(records)}; refused naming the flag "
                 f"{sum(r['classification'] == 'refused-naming-flag' for r in records)}; slowest {slowest:.1f} s")
    for r in records:
        if r["classification"] in MPMD_BAD:
            lines.append(f"  {r['classification']}: np {r['ranks']} {r['flag']} {r['a']!r} vs {r['b']!r}: "
                         f"rc {r['rc']}, {r['wall_s']:.1f} s: {r['error_line'][:200]}")
    return lines


# ---- part 4 ----

def run_faults_part(args, out, mem_limit):
    root = os.path.join(out, "faults")
    os.makedirs(root, exist_ok=True)
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("part 4 needs mpirun (Debian's openmpi-bin)")
    ctx = fault_cases.Context(args.mxddp, mpirun, root, args.timeout, mem_limit)
    fault_cases.make_fixtures(ctx)
    cases = fault_cases.generate(random.Random(args.seed * 1000003 + 4), args.fault_cases)
    if runner.is_sanitized(args.mxddp):
        # A sanitizer's shadow memory needs terabytes of address space: every limit would refuse it.
        cases = [c for c in cases if c["kind"] != "address-space"]
    run = lambda i, case: fault_cases.run_case(ctx, case, args.keep_all)
    # In-process cases side by side; mpirun cases one at a time, as part 3 (each runs 2 ranks, and
    # a preempted one must not be slowed past its grace time by another).
    local = [c for c in cases if c["launcher"] == "local"]
    launched = [c for c in cases if c["launcher"] == "mpirun"]
    records = parallel(args.jobs, run, local, "fault cases in one process") + \
        parallel(1, run, launched, "fault cases under mpirun")
    return sorted(records, key=lambda r: r["id"])


def faults_report(records):
    lines = []
    rows = sorted({r["row"] for r in records})
    counts = collections.Counter((r["row"], r["classification"]) for r in records)
    lines += table(rows, list(fault_cases.CLASSES), counts, "fault \\ outcome")
    c = collections.Counter(r["classification"] for r in records)
    slowest = max(records, key=lambda r: r["wall_s"] or 0, default=None)
    lines.append("")
    others = "".join(f", {cls} {c[cls]}" for cls in FAULTS_BAD if c[cls])
    lines.append(f"fault cases: {len(records)}; expected {c['expected']}{others}" +
                 (f"; slowest run {slowest['wall_s']:.1f} s (case {slowest['id']})" if slowest else ""))
    bad = [r for r in records if r["classification"] in FAULTS_BAD]
    if bad:
        lines.append("")
        lines.append("cases not as expected (row / classification: what happened; e.g. the case and its command):")
        groups = collections.defaultdict(list)
        for r in bad:
            groups[(r["row"], r["classification"], normalize(r["detail"]))].append(r)
        for (row, cls, _), rs in sorted(groups.items()):
            r = rs[0]
            ids = ", ".join(str(x["id"]) for x in rs[:8]) + (", ..." if len(rs) > 8 else "")
            lines.append(f"  [{row}] {cls} x{len(rs)} (cases {ids}): {r['detail'][:240]}")
            lines.append(f"      e.g. {r['describe']}")
            if r["argv"]:
                lines.append(f"      {short_argv(r['argv'])[:400]}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mxddp", required=True, help="the mxddp binary")
    parser.add_argument("--out", required=True, help="directory for the sandbox, results.json and summary.txt")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--invocations", type=int, default=1000, help="fuzzed command lines (part 2)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=30, help="seconds per invocation before it counts as a hang")
    parser.add_argument("--long-timeout", type=float, default=10,
                        help="seconds for a valid but expensive invocation (a timeout is then not a hang)")
    parser.add_argument("--parts", default="ckpt,fuzz,mpmd,faults",
                        help="a comma-separated subset of ckpt, fuzz, mpmd, faults")
    parser.add_argument("--mpmd-timeout", type=float, default=45,
                        help="seconds per MPMD launch before it counts as a hang (the ranks' watchdog is 60 s)")
    parser.add_argument("--fault-cases", type=int, default=40,
                        help="part 4: how many fault cases to draw (preemption, ulimit -f, ulimit -v, data changed)")
    parser.add_argument("--mem-limit-gib", type=float, default=6,
                        help="address-space limit per invocation (0: none; never applied to a sanitized binary)")
    parser.add_argument("--keep-all", action="store_true", help="keep every case directory")
    parser.add_argument("--subcommands", default="",
                        help="part 2 only: fuzz these, comma-separated (e.g. 'ckpt export,layout'); default all")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "bin"), exist_ok=True)
    # Run a private copy: the build directory may be rebuilt while the campaign runs.
    original = os.path.abspath(args.mxddp)
    args.mxddp = os.path.join(out, "bin", "mxddp")
    shutil.copy2(original, args.mxddp)
    with open(args.mxddp, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    sanitized = runner.is_sanitized(args.mxddp)
    mem_limit = 0 if sanitized or not args.mem_limit_gib else int(args.mem_limit_gib * (1 << 30))
    parts = set(args.parts.split(","))
    if parts - {"ckpt", "fuzz", "mpmd", "faults"}:
        raise SystemExit(f"--parts: {', '.join(sorted(parts - {'ckpt', 'fuzz', 'mpmd', 'faults'}))} unknown; "
                         "valid: ckpt, fuzz, mpmd, faults")
    start = time.monotonic()
    st = os.stat(args.mxddp)
    meta = dict(mxddp=original, sha256=digest, mtime=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.st_mtime)),
                sanitized=sanitized, seed=args.seed, invocations=args.invocations, fault_cases=args.fault_cases,
                jobs=args.jobs, timeout_s=args.timeout, long_timeout_s=args.long_timeout, mem_limit_bytes=mem_limit)
    lines = [f"mxddp hostile campaign: {original} (mtime {meta['mtime']}, sha256 {digest[:12]}"
             f"{', sanitized' if sanitized else ''}), seed {args.seed}, jobs {args.jobs}, timeout {args.timeout:g} s"]
    results = dict(meta=meta)
    def save():
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(out, "summary.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    sources = None
    if "ckpt" in parts:
        t0 = time.monotonic()
        sources, records = run_ckpt_part(args, out, mem_limit)
        results["ckpt"] = records
        lines += ["", f"== part 1: checkpoint corruptions and crafted edits ({len(records)} cases, "
                  f"{time.monotonic() - t0:.0f} s) =="] + ckpt_report(records)
        save()  # part 1 is kept even if part 2 fails
    if "fuzz" in parts:
        t0 = time.monotonic()
        _, records = run_fuzz_part(args, out, sources, mem_limit)
        results["fuzz"] = records
        lines += ["", f"== part 2: fuzzed invocations ({len(records)}, {time.monotonic() - t0:.0f} s) =="] + \
            fuzz_report(records)
    if "mpmd" in parts:
        t0 = time.monotonic()
        records = run_mpmd_part(args, out)
        results["mpmd"] = records
        lines += ["", f"== part 3: MPMD launches whose ranks disagree ({len(records)}, "
                  f"{time.monotonic() - t0:.0f} s) =="] + mpmd_report(records)
        save()
    if "faults" in parts:
        t0 = time.monotonic()
        records = run_faults_part(args, out, mem_limit)
        results["faults"] = records
        lines += ["", f"== part 4: faults real clusters produce ({len(records)} cases, "
                  f"{time.monotonic() - t0:.0f} s) =="] + faults_report(records)
    lines += ["", f"total run time {time.monotonic() - start:.0f} s"]
    results["summary"] = lines
    save()
    print("\n".join(lines))
    print(f"\nwrote {os.path.join(out, 'results.json')} and summary.txt", file=sys.stderr)


if __name__ == "__main__":
    main()
