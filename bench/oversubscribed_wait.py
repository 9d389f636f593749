#!/usr/bin/env python3
"""Waiting that sleeps instead of spinning (issue 44, item 2): mxddp.torch and torch DDP over gloo
on a machine whose cores are shared, by ranks and by a CPU hog.

Not a test: a benchmark, run by hand. Each job is 2 ranks under mpirun (one intra-op thread per
rank, as bench/torch_ddp_compare.py) training the same small HF GPT-2 (random init, dropout 0,
F32), mxddp with overlap_grad_reduce and the distributed optimizer, torch with DDP (gloo) and AdamW.
Every job runs twice: quiet (nothing else started) and loaded (a pure-Python spin loop, pinned
nowhere, runs beside the ranks for the whole job).

Per rank and timed step it records the wall time and the process's CPU time (all its threads:
the compute thread, mxddp's progress and watchdog threads, MPI's, gloo's), and reports, as the
median over --repeats jobs of the ranks' mean over steps:
  step_s      wall seconds per step (the slowest rank's);
  wall_cpu    wall / CPU per step: 1 when the rank computes the whole step; above 1 when it waits
              (blocked, or runnable but not given a core); a rank that spins while it waits burns
              CPU its peer and the hog needed, which shows as the peer's and its own steps
              stretching while their CPU stays the same.
It also prints, for the last loaded mxddp job, the CPU seconds of each thread of rank 0 (from
/proc/self/task/*/stat), so it shows which thread spends the CPU.

    python bench/oversubscribed_wait.py                       # quiet and loaded, mxddp and ddp, 3 runs each
    PYTHONPATH=build/k/python_pkg python bench/oversubscribed_wait.py --repeats 5 --steps 8
    PYTHONPATH=build/new/python_pkg python bench/oversubscribed_wait.py --baseline build/old/python_pkg
    mpirun -np 2 python bench/oversubscribed_wait.py --worker mxddp  # one job's ranks
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

from gloo_beside_mpi import init_gloo_beside_mpi  # this folder
from proc_stats import cpu_model  # this folder

IMPLS = ("mxddp", "ddp")


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, keyed 'name/tid'."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended while we listed
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name}/{tid}"] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    import mxddp.torch as mxt

    torch.set_num_threads(1)
    rank, world = mxt.init(timeout_s=600)
    use_mxddp = args.worker == "mxddp"
    if not use_mxddp:
        init_gloo_beside_mpi(rank, world)

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64,
                                     n_positions=args.seq, vocab_size=args.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     tie_word_embeddings=True)
    module = transformers.GPT2LMHeadModel(config)
    if use_mxddp:
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=True, grad_reduce_in_fp32=True,
            bucket_size=args.bucket_numel))
        opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0))
        reduce_max = lambda t: mxt.all_reduce(t, "max")  # noqa: E731
    else:
        model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=args.bucket_numel * 4 / 2**20)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        reduce_max = lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX)  # noqa: E731

    gen = torch.Generator().manual_seed(1 + rank)
    walls, cpus, slowest = [], [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq), generator=gen)
        w0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if use_mxddp:
            model.finish_grad_sync()
        else:
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        t = torch.tensor([wall], dtype=torch.float32)
        reduce_max(t)  # outside the timed span: the slowest rank's step
        if step >= args.warmup:
            walls.append(wall)
            cpus.append(cpu)
            slowest.append(float(t[0]))
    mine = torch.tensor([sum(walls) / sum(cpus)], dtype=torch.float32)
    ratios = [torch.zeros(1) for _ in range(world)]
    if use_mxddp:
        both = torch.zeros(world)
        both[rank] = mine[0]
        mxt.all_reduce(both, "sum")
        ratios = both.tolist()
    else:
        dist.all_gather(ratios, mine)
        ratios = [float(r[0]) for r in ratios]
    if rank == 0:
        print("RESULT " + json.dumps({"impl": args.worker, "step_s": statistics.median(slowest),
                                      "wall_cpu": statistics.mean(ratios), "wall_cpu_per_rank": ratios,
                                      "threads_cpu_s": thread_cpu_s()}), flush=True)
    if not use_mxddp:
        dist.destroy_process_group()


def run_job(args, impl: str, loaded: bool) -> dict:
    """One 2-rank job; impl "mxddp-base" is mxddp from the package at --baseline."""
    py = sys.executable
    mpirun = shutil.which("mpirun") or "mpirun"
    worker = "mxddp" if impl == "mxddp-base" else impl
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", py, __file__, "--worker", worker,
           "--layers", str(args.layers), "--hidden", str(args.hidden), "--seq", str(args.seq),
           "--micro-batch", str(args.micro_batch), "--vocab", str(args.vocab), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--bucket-numel", str(args.bucket_numel)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if impl == "mxddp-base":
        env["PYTHONPATH"] = os.pathsep.join([args.baseline] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    hog = subprocess.Popen([py, "-c", "while True: pass"]) if loaded else None
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} ({'loaded' if loaded else 'quiet'}) failed (exit {out.returncode}):\n"
                           f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=IMPLS, help="run one job's rank (under mpirun)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (GPT-2's 50257 makes the LM head most of a step)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-numel", type=int, default=1 << 20, help="gradient bucket size, f32 elements")
    p.add_argument("--baseline", help="also run mxddp from this package dir (a python_pkg of today's build), "
                   "as mxddp-base, interleaved with the others: the before of a change")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    uname = platform.uname()
    print(f"# {cpu_model()}, {os.cpu_count()} cores; kernel {uname.release}; python {platform.python_version()}")
    print(f"# GPT-2 {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}, "
          f"micro-batch {args.micro_batch}; "
          f"2 ranks; {args.steps} timed steps after {args.warmup}; median of {args.repeats} jobs")
    impls = IMPLS + (("mxddp-base",) if args.baseline else ())
    results: dict[tuple[str, bool], list[dict]] = {}
    for _ in range(args.repeats):  # alternated, so drifting load hits every configuration alike
        for loaded in (False, True):
            for impl in impls:
                results.setdefault((impl, loaded), []).append(run_job(args, impl, loaded))
    print(f"{'load':8}{'impl':12}{'step_s':>10}{'wall/cpu':>10}")
    summary = {}
    for (impl, loaded), rs in results.items():
        step = statistics.median(r["step_s"] for r in rs)
        ratio = statistics.median(r["wall_cpu"] for r in rs)
        summary[(impl, loaded)] = (step, ratio)
        print(f"{'loaded' if loaded else 'quiet':8}{impl:12}{step:10.3f}{ratio:10.2f}")
    for loaded in (False, True):
        for impl in impls[:1] + impls[2:]:
            (ms, mr), (ds, dr) = summary[(impl, loaded)], summary[("ddp", loaded)]
            print(f"# {'loaded' if loaded else 'quiet'}: {impl}/ddp step {ms / ds:.2f}x, wall/cpu {mr / dr:.2f}x")
    for impl in impls[:1] + impls[2:]:
        threads = results[(impl, True)][-1]["threads_cpu_s"]
        print(f"# {impl} rank 0's threads, CPU s (last loaded job): " +
              ", ".join(f"{k} {v:.2f}" for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0))


if __name__ == "__main__":
    main()
