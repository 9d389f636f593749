#!/usr/bin/env python3
"""mxddp's step time under torchrun (its collectives on a torch.distributed gloo group, the torch
backend) against mpirun (the MPI backend), on the same model and the same launch size (issue 43,
item 1: within 5%).

Not a test: a benchmark, run by hand. The model is an HF GPT-2 (random init, tied embedding,
dropout 0), F32, one intra-op thread per rank, trained with mxddp.torch.DistributedDataParallel
(overlap_grad_reduce, use_distributed_optimizer, grad_reduce_in_fp32, Megatron's form) and
mxddp.torch.DistributedOptimizer (AdamW, clip 1.0). Each job: warm-up steps, then timed steps; a
step is zero_grad_buffer .. opt.step(), the slowest rank's (max-reduced), and the job's figure is
their median. Jobs alternate mpirun / torchrun, --repeats times each; the table gives each
launcher's median over its jobs and the ratio torchrun / mpirun. Each job also times the raw
collective of one gradient bucket (an all-reduce of --bucket f32 elements through mxt.all_reduce,
median of 5), to tell the engine's speed apart from the step's.

    python bench/launch_compare.py                              # 2 ranks, 3 jobs per launcher
    python bench/launch_compare.py --np 2 --layers 4 --hidden 256 --seq 128 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args) -> None:
    import torch
    import transformers

    import mxddp.torch as mxt

    torch.set_num_threads(1)
    rank, world = mxt.init(timeout_s=600)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                                     n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     tie_word_embeddings=True)
    module = transformers.GPT2LMHeadModel(config)
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, grad_reduce_in_fp32=True,
        bucket_size=args.bucket))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0))
    gen = torch.Generator().manual_seed(1 + rank)
    step_s = []
    slowest = torch.zeros(1)
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq), generator=gen)
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.finish_grad_sync()
        opt.step()
        slowest[0] = time.perf_counter() - t0
        mxt.all_reduce(slowest, "max")
        if step >= args.warmup:
            step_s.append(slowest.item())
    bucket = torch.ones(args.bucket)
    collective_s = []
    for _ in range(6):
        mxt._C.barrier()
        t0 = time.perf_counter()
        mxt.all_reduce(bucket)
        collective_s.append(time.perf_counter() - t0)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"backend": mxt.launch.backend(), "world": world, "step_s": statistics.median(step_s),
                       "all_reduce_s": statistics.median(collective_s[1:]),
                       "params": sum(p.numel() for p in module.parameters())}, f)
    opt.close()
    model.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(launcher: str, args, out: str) -> dict:
    me = [os.path.abspath(__file__), "--worker", "--out", out] + [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("layers", "hidden", "seq", "micro_batch", "bucket", "warmup", "steps")]
    bindir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if launcher == "mpirun":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(args.np),
               sys.executable] + me
    else:
        cmd = [os.path.join(bindir, "torchrun"), "--nproc_per_node", str(args.np), "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port())] + me
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def _machine() -> str:
    model = "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, Linux {platform.release()}"


def compare(args) -> None:
    runs: dict[str, list[dict]] = {"mpirun": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for launcher in ("mpirun", "torchrun"):
                r = _job(launcher, args, os.path.join(tmp, f"{launcher}{i}.json"))
                runs[launcher].append(r)
                print(f"  {launcher:8} job {i + 1}: {r['backend']:5} step {r['step_s']:.4f} s  "
                      f"all_reduce({args.bucket}) {r['all_reduce_s'] * 1e3:.2f} ms", flush=True)
    med = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
    coll = {k: statistics.median(r["all_reduce_s"] for r in v) for k, v in runs.items()}
    print(f"\n{_machine()}")
    print(f"GPT-2 {args.layers}/{args.hidden}/seq {args.seq}, micro-batch {args.micro_batch}, "
          f"{runs['mpirun'][0]['params']} params, {args.np} ranks, bucket {args.bucket}; "
          f"medians of {args.repeats} jobs x {args.steps} steps")
    print(f"{'launcher':10} {'backend':8} {'step_s':>8} {'all_reduce_ms':>14}")
    for k in ("mpirun", "torchrun"):
        print(f"{k:10} {runs[k][0]['backend']:8} {med[k]:8.4f} {coll[k] * 1e3:14.2f}")
    ratio = med["torchrun"] / med["mpirun"]
    print(f"torchrun / mpirun step: {ratio:.3f} (target <= 1.05)  all_reduce: {coll['torchrun'] / coll['mpirun']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help="one rank of a job (the driver starts these)")
    p.add_argument("--out", help="where the worker's rank 0 writes its figures")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--bucket", type=int, default=6_553_600, help="bucket_size in elements (torch's 25 MB of f32)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.worker:
        worker(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
