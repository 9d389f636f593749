#!/usr/bin/env python3
"""gradient_accumulation_fusion on against off in the same processes, alternating (not a test).

On a shared machine the load changes from one mpirun job to the next by more than fusion changes a
step, so torch_ddp_compare.py's separate jobs cannot resolve it. Here each rank wraps the same HF
GPT2LMHeadModel (torch_ddp_compare.py's models and training setup) with fusion on, trains --steps
steps, closes, wraps it with fusion off, trains --steps steps, and so on for --rounds rounds: the
two see the same load within seconds. Per mode: the median over all timed steps of the slowest
rank's step (zero_grad to the end of opt.step(), the first step of each phase left out as warm-up),
and the largest rank's high-water resident set over its phases (VmHWM, reset with
/proc/self/clear_refs before each phase's timed steps) less the RSS before the model was built.

    mpirun -np 2 python bench/grad_fusion_ab.py --model small --rounds 4 --steps 4
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from proc_stats import cpu_model, loadavg_1m, reset_hwm, status_kib  # this folder
from torch_ddp_compare import BUCKET_NUMEL, MODELS  # this folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="small")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="per phase, the first one a warm-up")
    args = p.parse_args()
    if args.steps < 2:
        raise SystemExit(f"--steps must be >= 2 (the first of each phase is a warm-up); got {args.steps}")

    import torch
    import transformers

    import mxddp.torch as mxt

    torch.set_num_threads(1)
    rank, world = mxt.init(timeout_s=600)
    baseline_kib = status_kib("VmRSS")
    layers, hidden, heads, seq, micro_batch = MODELS[args.model]
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    module = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(1 + rank)
    step_s = {True: [], False: []}
    peak_kib = {True: 0, False: 0}
    slowest = torch.zeros(1)
    for _ in range(args.rounds):
        for fusion in (True, False):
            model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
                overlap_grad_reduce=True, use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                bucket_size=BUCKET_NUMEL), gradient_accumulation_fusion=fusion)
            opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0))
            for step in range(args.steps):
                if step == 1:
                    reset_hwm()
                ids = torch.randint(0, config.vocab_size, (micro_batch, seq), generator=gen)
                t0 = time.perf_counter()
                opt.zero_grad()
                model(input_ids=ids, labels=ids).loss.backward()
                model.finish_grad_sync()
                opt.step()
                slowest[0] = time.perf_counter() - t0
                mxt.all_reduce(slowest, "max")
                if step >= 1:
                    step_s[fusion].append(float(slowest[0]))
            peak_kib[fusion] = max(peak_kib[fusion], status_kib("VmHWM") - baseline_kib)
            opt.close()
            model.close()
    peaks = {}
    for fusion in (True, False):
        t = torch.tensor([float(peak_kib[fusion])])
        mxt.all_reduce(t, "max")
        peaks[fusion] = t.item() / 1024
    if rank == 0:
        print(f"# {cpu_model()}, {os.cpu_count()} cores, kernel {platform.release()}, torch {torch.__version__}, "
              f"1 thread per rank, dp {world}, load {loadavg_1m():.1f} at the end")
        print(f"# {args.model} {MODELS[args.model]}, {args.rounds} rounds x {args.steps - 1} timed steps per mode")
        for fusion in (True, False):
            s = step_s[fusion]
            print(f"fusion {'on ' if fusion else 'off'}  step median {statistics.median(s):.3f} s  "
                  f"min {min(s):.3f} s  peak +{peaks[fusion]:.0f} MiB  ({len(s)} steps)")
        print(f"on/off: step {statistics.median(step_s[True]) / statistics.median(step_s[False]):.3f}  "
              f"peak {peaks[True] / peaks[False]:.3f}")


if __name__ == "__main__":
    main()
