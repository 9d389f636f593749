#!/usr/bin/env python3
"""Exposed communication of mxddp.torch with 2 MPI ranks sharing one GPU (issue 42, Performance).

Not a test: a benchmark for the GPU machine (scripts/gpu_check.sh --run-bench). Run under
`mpirun -np 2` on one GPU: the ranks' collectives are staged through page-locked host memory
(mxddp's "staged" engine, docs/python.md "GPUs"). HF GPT-2 (6 layers, hidden 384, sequence --seq,
--batch sequences per rank) under mxt.DistributedDataParallel + DistributedOptimizer, F32, buckets
of --bucket-size elements, with overlap_grad_reduce on and off. Per step, on each rank (host clock,
the device synchronized at each mark):

  compute_ms   zero_grad to the end of backward, the GPU drained (forward, backward and whatever
               communication ran beside them)
  exposed_ms   from there to the end of finish_grad_sync(): the gradient reduction left to wait for
  step_ms      the whole step, optimizer included

and the timeline of one step (the last) per bucket group: when its reduction was issued, relative to
the start of the backward (the return of the param report after which the group was issued).
Medians over --steps timed steps after 3 warm-up steps, the slower rank's.

    mpirun -np 2 python bench/torch_cuda_exposed.py [--steps 10] [--batch 4] [--seq 512]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def run(overlap: bool, args, rank: int, world: int, device) -> dict:
    import torch
    import transformers

    import mxddp.torch as mxt

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=384, n_head=6, n_positions=args.seq, attn_pdrop=0.0,
                                     embd_pdrop=0.0, resid_pdrop=0.0)
    module = transformers.GPT2LMHeadModel(config).to(device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=overlap, bucket_size=args.bucket_size))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-4, clip_grad=0.0))
    # The timeline: the reports (DDP's hooks all end in model._on_grad) after which a bucket group's
    # reduction had been issued, in seconds since the backward started.
    issued: list[float] = []
    backward_start = [0.0]
    on_grad = model._on_grad
    cpp = model._cpp

    def timed_on_grad(index: int) -> None:
        group = cpp.group_of_param(index)
        before = cpp.bucket_group_issued(group)
        on_grad(index)
        if not before and cpp.bucket_group_issued(group):
            issued.append(time.perf_counter() - backward_start[0])

    data = torch.Generator().manual_seed(1 + rank)
    compute, exposed, step = [], [], []
    for i in range(3 + args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=data).to(device)
        synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        last = i == 2 + args.steps
        if last:
            issued.clear()
            model._on_grad = timed_on_grad
            backward_start[0] = time.perf_counter()
        loss.backward()
        synchronize()
        t1 = time.perf_counter()
        model.finish_grad_sync()
        synchronize()
        t2 = time.perf_counter()
        opt.step()
        synchronize()
        t3 = time.perf_counter()
        if last:
            del model._on_grad  # the class's method again
        if i >= 3:
            compute.append(t1 - t0)
            exposed.append(t2 - t1)
            step.append(t3 - t0)
    medians = torch.tensor([statistics.median(compute), statistics.median(exposed), statistics.median(step)],
                           dtype=torch.float64)
    mxt.all_reduce(medians, "max")
    return {"compute_ms": 1e3 * medians[0].item(), "exposed_ms": 1e3 * medians[1].item(),
            "step_ms": 1e3 * medians[2].item(), "buckets": model.num_buckets, "timeline_ms": [1e3 * t for t in issued],
            "backward_ms": 1e3 * (t1 - backward_start[0])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--bucket-size", type=int, default=2_000_000, help="elements per bucket")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the ranks on the CPU (this script's own check)")
    args = parser.parse_args()
    if min(args.steps, args.batch, args.seq, args.bucket_size) < 1:
        parser.error("--steps, --batch, --seq and --bucket-size must be >= 1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: torch sees no usable GPU")
        return 77
    import mxddp.torch as mxt

    rank, world = mxt.init()
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device, where = torch.device("cuda", torch.cuda.current_device()), \
            f"{torch.cuda.get_device_name()}, {world} ranks on {torch.cuda.device_count()} GPU(s)"
    else:
        torch.set_num_threads(1)
        device, where = torch.device("cpu"), f"the CPU (the script's own check), {world} ranks"
    results = {overlap: run(overlap, args, rank, world, device) for overlap in (True, False)}
    if rank == 0:
        print(f"# {where}, GPT-2 6x384, "
              f"batch {args.batch} x seq {args.seq} per rank, buckets of {args.bucket_size} elements", flush=True)
        for overlap, r in results.items():
            print(f"overlap_grad_reduce={overlap!s:5}  compute {r['compute_ms']:7.1f} ms  exposed {r['exposed_ms']:7.1f} ms"
                  f"  step {r['step_ms']:7.1f} ms  ({r['buckets']} buckets)", flush=True)
        r = results[True]
        marks = ", ".join(f"{t:.1f}" for t in r["timeline_ms"])
        print(f"timeline of the last overlapped step (ms after backward started; backward took {r['backward_ms']:.1f} "
              f"ms with the GPU drained): reductions issued at {marks or 'none recorded'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
