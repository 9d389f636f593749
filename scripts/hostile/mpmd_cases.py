# Part 3 of the hostile campaign (issue 29): mpirun MPMD launches whose ranks were given different
# flags (`mpirun -np K mxddp train A : -np 1 mxddp train B`). Every case must be refused at
# startup, on every rank, with the message naming the flag (its line "  --flag: 'a' on ranks ...;
# 'b' on rank K"), well before the watchdog's --timeout-ms; a run that exits 0 trained a silent
# wrong model ("missed"), one the watchdog ends ("watchdog") or that never ends ("hang") did not.
import os
import shutil

import runner

# (class, flag, value on the first ranks, value on the last rank, flags both sides add).
MISMATCHES = [
    ("learning rate", "--lr", "1e-3", "5e-3", []),
    ("schedule", "--lr-warmup-iters", "1", "2", []),
    ("schedule", "--train-iters", "3", "5", []),
    ("clipping", "--clip-grad", "1.0", "0.01", []),
    ("optimizer", "--adam-beta2", "0.999", "0.95", []),
    ("seed", "--seed", "1", "2", []),
    ("model shape", "--seq-length", "32", "64", []),
    ("model shape", "--hidden-size", "32", "64", []),
    ("batch", "--global-batch-size", "8", "16", []),
    ("batch", "--micro-batch-size", "2", "1", []),
    ("DDP", "--overlap-grad-reduce", None, "", []),
    ("FSDP", "--data-parallel-sharding-strategy", "optim", "optim_grads_params", ["--use-megatron-fsdp"]),
    ("FSDP or DDP", "--use-megatron-fsdp", None, "", []),
    ("precision", "--bf16", None, "", []),
    ("recompute", "--recompute-granularity", "full", "selective", []),
    ("data", "--corpus-bytes", "65536", "131072", []),
    ("checks", "--check-weight-hash-across-dp-replicas-interval", "1", "0", []),
]
# Everything but the flag under test: train_flags minus the flag's own entry.
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--corpus-bytes", "65536", "--eval-iters", "0",
        "--train-iters", "3", "--timeout-ms", "60000"]


def base_without(flag):
    out, i = [], 0
    while i < len(BASE):
        if BASE[i] == flag:
            i += 2
            continue
        out.append(BASE[i])
        i += 1
    return out


def side(mxddp, flag, value, extra):
    """One side of the MPMD line: the flag with its value, a switch (value ""), or neither (None)."""
    args = [mxddp, "train", "--backend", "mpi", *base_without(flag), *extra]
    if value is None:
        return args
    return args + ([flag] if value == "" else [flag, value])


def cases():
    out = []
    for ranks in (2, 4):
        for cls, flag, a, b, extra in MISMATCHES:
            out.append(dict(id=len(out), ranks=ranks, cls=cls, flag=flag, a=a, b=b, extra=extra))
    return out


def run_case(mxddp, mpirun, root, case, timeout_s, keep_all):
    work = os.path.join(root, f"{case['id']:04d}")
    os.makedirs(work, exist_ok=True)
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
            "-np", str(case["ranks"] - 1), *side(mxddp, case["flag"], case["a"], case["extra"]), ":",
            "-np", "1", *side(mxddp, case["flag"], case["b"], case["extra"])]
    r = runner.run(argv, work, timeout_s)
    text = r["stderr"] + r["stdout"]
    named = f"\n  {case['flag']}:" in text and f"on rank {case['ranks'] - 1}" in text
    if r["timed_out"]:
        cls = "hang"
    elif r["crashed"]:
        cls = "crash"
    elif r["rc"] == 0:
        cls = "missed"
    elif "not launched with the same job" in text and named:
        cls = "refused-naming-flag"
    elif "has not reached" in text or "watchdog" in text:
        cls = "watchdog"
    else:
        cls = "refused-other"
    if cls == "refused-naming-flag" and not keep_all:
        shutil.rmtree(work, ignore_errors=True)
    return dict(case, argv=argv, rc=r["rc"], wall_s=r["wall_s"], classification=cls, error_line=r["error_line"],
                stderr=r["stderr"])
