#!/usr/bin/env python3
"""mxddp.torch against PyTorch's own data parallelism on the same HF GPT-2 (issue 24, Performance).

Not a test: a benchmark, run by hand. Three ways to train the same `transformers.GPT2LMHeadModel`
(random init, tied embedding, dropout 0, vocabulary 50257), one process per rank under mpirun, one
intra-op thread per rank (torch.set_num_threads(1)), F32:

  mxddp   mxddp.torch.DistributedDataParallel (overlap_grad_reduce, use_distributed_optimizer,
          grad_reduce_in_fp32) + mxddp.torch.DistributedOptimizer (AdamW in C++, global-norm clip)
  mxddp-nofusion  the same with gradient_accumulation_fusion=False (every grad through the hook)
  mxddp-torchopt  mxddp as above with the user's torch.optim.AdamW (the same two param groups as ddp's)
          handed to mxt.DistributedOptimizer, clipped with model.clip_grad_norm_ (issue 43's torch way)
  mxddp-torchgrads  the ddp script below with only its wrap line changed: mxddp.torch's
          DistributedDataParallel(module, bucket_cap_mb=25) (torch's form) and the script's own
          torch.optim.AdamW, unwrapped, on .grad (torch_grads.py), clipped by torch's function
  ddp     torch.nn.parallel.DistributedDataParallel (gloo, defaults) + torch.optim.AdamW
          (foreach, the default) + torch.nn.utils.clip_grad_norm_
  zero    the same DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)

Each uses the same buckets (torch's default bucket_cap_mb=25, i.e. 6,553,600 f32 elements; mxddp's
bucket_size set to that), lr 1e-4, weight decay 0.1 on params of two or more dimensions only (as
mxddp and Megatron), clip 1.0, a fresh random micro-batch each step.

Measured, per configuration, each impl in its own job (mpirun, or torchrun with --launcher torchrun):
  step_s   median over the timed steps (after the warm-up steps) of the slowest rank's step, from
           zero_grad to the end of opt.step() (mxddp: + finish_grad_sync), the ranks' step times
           all-reduced with max;
  peak     per rank, the high-water resident set (VmHWM in /proc/self/status) over the timed steps
           (reset with /proc/self/clear_refs "5" after the warm-up, so it is the training steady
           state, not construction), minus the RSS after the imports and the launch (before the
           model is built): what the model, its training state and the step's activations hold at
           their peak. The largest rank's is reported. Also mxddp's tracked bytes per category
           (mxt.memory_usage() peaks) and torch's model-state bytes counted from its tensors
           (params, .grad, DDP's gradient buckets, optimizer state).

    python bench/torch_ddp_compare.py                      # the sweep: both models, dp 2 and 4, 3 runs each
    python bench/torch_ddp_compare.py --models small --dp 2 --repeats 1
    mpirun -np 2 python bench/torch_ddp_compare.py --worker mxddp --layers 6 --hidden 384 --seq 256  # one job

Figures (2026-11-25; docs/python.md, "Performance", says more). A 16-core Intel Xeon VM (lscpu:
"Intel(R) Xeon(R) Processor", 128 GiB, nothing else running but this benchmark; the two models'
sweeps ran side by side, at most 8 ranks busy), torch 2.11.0 (PyPI wheel; its MKL and oneDNN CPU
kernels), transformers 5.17, OpenMPI 4.1; one thread per rank; F32; medians of 3 runs, each the
median of 5 steps after 2 warm-up; this file's method (the worker run there was a compact copy of
worker(): same configs, same measurements). peak = VmHWM over the timed steps less the RSS before
the model, the largest rank's, MiB.

    model (micro-batch)          dp  torch DDP        ZeRO(AdamW)      mxddp            mxddp/DDP
                                     step_s  peak     step_s  peak     step_s  peak     step  peak
    GPT-2 6/384/seq 256 (2)       2  1.278   1251     1.264   1171     1.238   1252     0.97  1.00
    GPT-2 6/384/seq 256 (2)       4  1.457   1249     1.454   1171     1.363   1146     0.94  0.92
    GPT-2 12/768/seq 128 (1)      2  1.982   3102     1.865   2726     1.364   2773     0.69  0.89
    GPT-2 12/768/seq 128 (1)      4  2.286   3103     1.879   2574     1.810   2366     0.79  0.76

mxddp's tracked peaks (MiB), 6/384 at dp 2: params 114, grads 114, main_params 57, optimizer_state
114, comm 44 (dp 4: 114, 114, 28, 57, 22); 12/768 at dp 2: 472, 472, 236, 472, 73 (dp 4: 472, 472,
118, 236, 36). The goals (step <= 0.9x DDP's, peak <= 0.6x DDP's and <= ZeRO's) are met only in
part; docs/python.md says where the time and the bytes go.
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
from proc_stats import cpu_model, loadavg_1m, reset_hwm, status_kib  # this folder
from gpt2_model import gpt2_lm_head_model  # this folder

MODELS = {  # name: (layers, hidden, heads, seq, micro-batch)
    "small": (6, 384, 6, 256, 2),
    "gpt2-124m": (12, 768, 12, 128, 1),
}
BUCKET_NUMEL = 25 * 1024 * 1024 // 4  # torch DDP's default bucket_cap_mb=25, in f32 elements
IMPLS = ("mxddp", "mxddp-nofusion", "mxddp-torchopt", "mxddp-torchgrads", "ddp", "zero")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401 (loaded before the baseline RSS: the peak counts no library code)

    import mxddp.torch as mxt

    torch.set_num_threads(1)
    rank, world = mxt.init(timeout_s=600)  # under torchrun: torch.distributed (gloo) too
    mxddp_impl = args.worker.startswith("mxddp")
    if not mxddp_impl and not dist.is_initialized():
        init_gloo_beside_mpi(rank, world)
    baseline_kib = status_kib("VmRSS")

    module = gpt2_lm_head_model(args.layers, args.hidden, args.seq)
    n_params = sum(p.numel() for p in module.parameters())
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]

    torch_loop = not mxddp_impl or args.worker == "mxddp-torchgrads"  # the script's own optimizer and clip
    if args.worker == "mxddp-torchgrads":
        model = mxt.DistributedDataParallel(module, bucket_cap_mb=25)
        opt = torch.optim.AdamW(groups, lr=1e-4)
    elif mxddp_impl:
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=True, grad_reduce_in_fp32=True,
            bucket_size=BUCKET_NUMEL), gradient_accumulation_fusion=args.worker != "mxddp-nofusion")
        if args.worker == "mxddp-torchopt":  # the torch way: the user's AdamW and param groups, the model clips
            opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(groups, lr=1e-4))
        else:
            opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0))
    else:
        model = torch.nn.parallel.DistributedDataParallel(module)
        if args.worker == "ddp":
            opt = torch.optim.AdamW(groups, lr=1e-4)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(decay, optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.1)
            opt.add_param_group({"params": no_decay, "weight_decay": 0.0})

    gen = torch.Generator().manual_seed(1 + rank)
    step_s = []
    slowest = torch.zeros(1)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            reset_hwm()
            if mxddp_impl:
                mxt._C.reset_memory_peaks()
        ids = torch.randint(0, module.config.vocab_size, (args.micro_batch, args.seq), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if torch_loop:
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()
        else:
            model.finish_grad_sync()
            if args.worker == "mxddp-torchopt":
                model.clip_grad_norm_(1.0)
            opt.step()
        slowest[0] = time.perf_counter() - t0
        mxt.all_reduce(slowest, "max")
        if step >= args.warmup:
            step_s.append(float(slowest[0]))
    peak = torch.tensor([float(status_kib("VmHWM") - baseline_kib)])
    mxt.all_reduce(peak, "max")

    result = {"impl": args.worker, "world": world, "layers": args.layers, "hidden": args.hidden, "seq": args.seq,
              "micro_batch": args.micro_batch, "params": n_params, "step_s": statistics.median(step_s),
              "steps_s": step_s, "peak_above_baseline_bytes": int(peak.item()) * 1024,
              "torch": torch.__version__}
    if mxddp_impl:
        result["tracked_peak_bytes"] = {k: v[1] for k, v in mxt.memory_usage().items()}
    else:
        state = 0
        for s in (opt.optim.state if args.worker == "zero" else opt.state).values():
            state += sum(t.numel() * t.element_size() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
        result["model_state_bytes"] = {"params": n_params * 4, "grads": grads,
                                       # gradient_as_bucket_view=False (the default): the reducer's
                                       # flat buckets hold a second copy of every grad
                                       "ddp_buckets": n_params * 4,
                                       "optimizer_state": state}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    if not mxddp_impl:
        dist.destroy_process_group()


def _machine() -> str:
    cpu = cpu_model()
    return f"{cpu}, {os.cpu_count()} cores ({platform.machine()})"


def sweep(args) -> None:
    mpirun = shutil.which("mpirun") or "mpirun"
    print(f"# launcher: {args.launcher}")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    py = sys.executable
    print(f"# {_machine()}; one thread per rank; {py}")
    print(subprocess.run([py, "-c", "import torch; print('# torch', torch.__version__); "
                          "[print('#', l.strip()) for l in torch.__config__.show().splitlines() "
                          "if 'Math Kernel' in l or 'MKL-DNN' in l or 'CPU capability' in l]"],
                         capture_output=True, text=True).stdout, end="")
    rows = []
    for name in args.models:
        layers, hidden, heads, seq, mb = MODELS[name]
        mb = args.micro_batch or mb
        for dp in args.dp:
            per_impl: dict[str, list[dict]] = {i: [] for i in args.impls}
            for rep in range(args.repeats):
                for impl in args.impls:  # interleaved, so a busy spell on the machine hits each alike
                    launch = ([mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(dp), py] if args.launcher == "mpirun"
                              else [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(dp)])
                    cmd = launch + [__file__, "--worker", impl, "--layers", str(layers), "--hidden", str(hidden), "--seq", str(seq),
                           "--micro-batch", str(mb), "--steps", str(args.steps), "--warmup", str(args.warmup)]
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
                    if out.returncode != 0 or line is None:
                        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
                    r = json.loads(line[len("RESULT "):])
                    per_impl[impl].append(r)
                    print(f"  {name} dp {dp} run {rep + 1} {impl:14} step {r['step_s']:.3f} s  "
                          f"peak +{r['peak_above_baseline_bytes'] / 2**20:.0f} MiB  load {loadavg_1m():.1f}", flush=True)
            rows.append((name, dp, mb, per_impl))
    print()
    print(f"medians of {args.repeats} runs (each: median of {args.steps} steps after {args.warmup} warm-up)")
    print(f"{'model':10} {'dp':>2} {'mb':>2} {'impl':14} {'step_s':>7} {'peak_MiB':>9} {'step/ddp':>8} {'peak/ddp':>8}")
    for name, dp, mb, per_impl in rows:
        med = {i: (statistics.median(r["step_s"] for r in rs),
                   statistics.median(r["peak_above_baseline_bytes"] for r in rs)) for i, rs in per_impl.items()}
        base = med.get("ddp")
        for impl, (s, p) in med.items():
            ratio = f"{s / base[0]:8.2f} {p / base[1]:8.2f}" if base else ""
            print(f"{name:10} {dp:2d} {mb:2d} {impl:14} {s:7.3f} {p / 2**20:9.0f} {ratio}")
        for impl in ("mxddp", "mxddp-nofusion", "mxddp-torchgrads"):
            if impl in per_impl:
                t = per_impl[impl][-1]["tracked_peak_bytes"]
                print(f"{'':16} {impl} tracked peaks (MiB): " +
                      ", ".join(f"{k} {v / 2**20:.1f}" for k, v in t.items() if v))
        for impl in ("ddp", "zero"):
            if impl in per_impl:
                m = per_impl[impl][-1]["model_state_bytes"]
                print(f"{'':16} {impl} model state (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in m.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=IMPLS, help="run one job's rank (under mpirun)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=0, help="per rank (0: the model's default in MODELS)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--dp", nargs="+", type=int, default=[2, 4])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--launcher", choices=("mpirun", "torchrun"), default="mpirun",
                   help="what starts each job's ranks: mpirun (mxddp on MPI, torch on its own gloo group) or "
                        "torchrun (both on torch.distributed's gloo)")
    args = p.parse_args()
    if args.worker:
        if not args.micro_batch:
            args.micro_batch = 4
        worker(args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
