#!/usr/bin/env python3
"""mxddp.torch on one GPU against torch DDP + fused AdamW and megatron-fsdp (issue 42, Performance).

Not a test: a benchmark for the GPU machine (scripts/gpu_check.sh --run-bench). HF GPT-2 124M
(12 layers, hidden 768, vocabulary 50257, tied embedding, dropout 0), sequence --seq, --batch
sequences per step, random tokens from one seed, world 1 (a one-rank torch.distributed group, NCCL),
forward under torch.autocast(bf16), lr 1e-4, betas (0.9, 0.95), weight decay 0.1, no clipping.
Each configuration runs in a process of its own, so that its peak memory is its own:

  torch_ddp        torch DDP + torch.optim.AdamW(fused=True), F32 params            (the yardstick)
  mxddp_ddp        mxt.DistributedDataParallel + DistributedOptimizer, F32 params
  mxddp_bf16       the same with BF16 params (F32 main params in the optimizer), grads reduced in F32
  mxddp_mxfp8      mxddp_bf16 with fp8_param_gather and reuse_grad_buf_for_mxfp8_param_ag (seed 000:
                   the MXFP8 gather staged in the grad buffer, no separate param buffer)
  mxddp_fsdp       mxt.FullyShardedDataParallel(optim_grads_params), units GPT2Block, BF16 params,
                   grads reduced and kept in F32 (grad_reduce_in_fp32)
  mxddp_fsdp_bf16grads  the same with BF16 grads (grad_reduce_in_fp32=False, Megatron's default)
  megatron_fsdp    megatron_fsdp.fully_shard_model(zero_dp_strategy=3, units GPT2Block, BF16 params,
                   F32 main params, main grads in the params' dtype: BF16, its default) +
                   fully_shard_optimizer(torch.optim.AdamW) (PyPI megatron-fsdp; skipped, saying so,
                   where it is not importable)
  megatron_fsdp_f32grads  the same with F32 main grads (main_grads_dtype=torch.float32)

Each FSDP is compared with the other project's run that keeps its grads in the same dtype: mxddp_fsdp
with megatron_fsdp_f32grads, mxddp_fsdp_bf16grads with megatron_fsdp. (Until 2026-11-30 mxddp_fsdp,
with F32 grads, was compared with megatron_fsdp, with BF16 ones: 237 MiB of grads apart.)

Measured: step_ms, the median over --steps timed steps (after 3 warm-up steps) of zero_grad to the
end of the optimizer step, the device synchronized at both ends; peak_mib, torch's
max_memory_allocated over the timed steps (mxddp's buffers come from torch's caching allocator, so
they count); steady_mib, memory_allocated at the start of the last timed step (what lives from step
to step: params, grads, optimizer state), so that peak - steady is what a step adds (activations,
the loss's logits, temporaries), the same model's in every configuration; with --profile, one more
step after the timed ones under torch.profiler, and its device kernels with the most time; for
mxddp, its tracked bytes per category where its buffers are (mxt.memory_usage("device"); "host"
with --device cpu). The report gives each against its yardstick (YARDSTICK: torch_ddp for the
DDPs, the megatron-fsdp run with the same grad dtype for each FSDP), and the bytes mxddp_mxfp8 saves
against mxddp_bf16 in its params category.

    python bench/torch_cuda_compare.py [--steps 10] [--batch 8] [--seq 1024] [--only NAME ...] [--profile]

(--layers and --hidden give a smaller GPT-2 for the script's own check on the CPU.)
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

CONFIGS = ("torch_ddp", "mxddp_ddp", "mxddp_bf16", "mxddp_mxfp8", "mxddp_fsdp", "mxddp_fsdp_bf16grads",
           "megatron_fsdp", "megatron_fsdp_f32grads")
YARDSTICK = {"mxddp_ddp": "torch_ddp", "mxddp_bf16": "torch_ddp", "mxddp_mxfp8": "torch_ddp",
             "mxddp_fsdp": "megatron_fsdp_f32grads", "mxddp_fsdp_bf16grads": "megatron_fsdp"}
GPU_ONLY = ("megatron_fsdp", "megatron_fsdp_f32grads")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(name: str, args, device):
    """(the model to call, the optimizer, finish: what ends a step's backward) for configuration name."""
    import torch
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=args.seq, n_layer=args.layers, n_embd=args.hidden,
                                     n_head=args.hidden // 64, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    module = transformers.GPT2LMHeadModel(config).to(device)
    lr, betas, wd = 1e-4, (0.9, 0.95), 0.1
    if name == "torch_ddp":
        model = torch.nn.parallel.DistributedDataParallel(module)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=wd, fused=device.type == "cuda")
        return model, opt, lambda: None
    if name.startswith("megatron_fsdp"):
        from megatron_fsdp import MixedPrecisionPolicy, fully_shard_model, fully_shard_optimizer

        grads = torch.float32 if name == "megatron_fsdp_f32grads" else None  # None: the params' dtype
        policy = MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=grads)
        model = fully_shard_model(module.to(torch.bfloat16), fsdp_unit_modules=[GPT2Block], zero_dp_strategy=3,
                                  mixed_precision_policy=policy)
        opt = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=wd))
        return model, opt, lambda: None
    import mxddp.torch as mxt

    mxt.init()
    if name != "mxddp_ddp":
        module = module.to(torch.bfloat16)
    if name.startswith("mxddp_fsdp"):
        model = mxt.FullyShardedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=name == "mxddp_fsdp"),
            fsdp_unit_modules=[GPT2Block])
    else:
        mxfp8 = name == "mxddp_mxfp8"
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
            grad_reduce_in_fp32=True, fp8_param_gather=mxfp8, reuse_grad_buf_for_mxfp8_param_ag=mxfp8))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=lr, adam_beta1=betas[0], adam_beta2=betas[1],
                                                             weight_decay=wd, clip_grad=0.0))
    return model, opt, model.finish_grad_sync


def profile_step(one_step, gpu: bool, synchronize, top: int = 12) -> list:
    """One step under torch.profiler: its kernels (device ones on the GPU, operators on the CPU)
    with the most self time, as [name, calls, total ms], and a last row with every kernel's total."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        one_step()
        synchronize()
    self_us = (lambda e: e.self_device_time_total) if gpu else (lambda e: e.self_cpu_time_total)
    rows = sorted((e for e in prof.key_averages() if self_us(e) > 0), key=self_us, reverse=True)
    table = [[e.key[:70], e.count, self_us(e) / 1e3] for e in rows[:top]]
    return table + [["(all kernels)", sum(e.count for e in rows), sum(self_us(e) for e in rows) / 1e3]]


def run_one(name: str, args) -> dict:
    """One configuration in this process (a one-rank torch.distributed group): its figures. On
    --device cpu, the script's own check, no memory figures."""
    import torch
    import torch.distributed as dist

    gpu = args.device == "cuda"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    synchronize = torch.cuda.synchronize if gpu else (lambda: None)
    model, opt, finish = build(name, args, device)
    data = torch.Generator().manual_seed(1)
    times = []
    steady_mib = 0.0

    def one_step():
        ids = torch.randint(0, 50257, (args.batch, args.seq), generator=data).to(device)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        finish()
        opt.step()
        return loss

    for step in range(args.warmup + args.steps):
        if step == args.warmup and gpu:
            torch.cuda.reset_peak_memory_stats()
        synchronize()
        if gpu:
            steady_mib = torch.cuda.memory_allocated() / 2**20
        start = time.perf_counter()
        loss = one_step()
        synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    out = {"config": name, "step_ms": 1e3 * statistics.median(times),
           "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if gpu else 0.0, "steady_mib": steady_mib,
           "loss": float(loss)}
    if args.profile:
        out["kernels"] = profile_step(one_step, gpu, synchronize)
    if name.startswith("mxddp"):
        import mxddp.torch as mxt

        # The place the buffers are on: the GPU's bytes (the host's on the CPU check).
        out["buffer_bytes"] = {k: v[0] for k, v in mxt.memory_usage("device" if gpu else "host").items() if v[0]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--layers", type=int, default=12, help="GPT-2's blocks (12: 124M)")
    parser.add_argument("--hidden", type=int, default=768, help="GPT-2's width, a multiple of 64 (heads of 64)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--only", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--timeout-s", type=int, default=120, help="per configuration")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: run the configurations on the CPU (this script's own check; no memory figures, "
                             "no megatron_fsdp)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, one more under torch.profiler: each configuration's kernels "
                             "with the most time")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # a child's configuration
    args = parser.parse_args()
    if min(args.steps, args.batch, args.seq, args.layers) < 1 or args.warmup < 0:
        parser.error(f"--steps, --batch, --seq and --layers must be >= 1 and --warmup >= 0; got {args.steps}, "
                     f"{args.batch}, {args.seq}, {args.layers}, {args.warmup}")
    if args.hidden < 64 or args.hidden % 64:
        parser.error(f"--hidden {args.hidden}: a positive multiple of 64 (heads of 64)")
    if args.one:
        print(json.dumps(run_one(args.one, args)), flush=True)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: torch sees no usable GPU")
        return 77
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "the CPU (the script's own check)"
    model = "GPT-2 124M" if (args.layers, args.hidden) == (12, 768) else f"GPT-2 {args.layers}x{args.hidden}"
    print(f"# {where}, torch {torch.__version__}, {model}, batch {args.batch} x seq {args.seq}, {args.warmup} "
          f"warm-up and {args.steps} timed steps, bf16 autocast", flush=True)
    names = [n for n in args.only if args.device == "cuda" or n not in GPU_ONLY]
    results = {}
    for name in names:
        cmd = [sys.executable, __file__, "--one", name, "--device", args.device]
        cmd += [f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "batch", "seq", "layers", "hidden")]
        cmd += ["--profile"] if args.profile else []
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            print(f"{name}: timed out after {args.timeout_s} s", flush=True)
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"{name}: exit {done.returncode}: {tail}", flush=True)
            continue
        results[name] = json.loads(lines[-1])
        r = results[name]
        print(f"{name:14s} step {r['step_ms']:8.1f} ms  peak {r['peak_mib']:8.0f} MiB  steady {r['steady_mib']:8.0f} MiB"
              f"  loss {r['loss']:.4f}" + (f"  buffers {r['buffer_bytes']}" if "buffer_bytes" in r else ""), flush=True)
        for kernel, calls, ms in r.get("kernels", []):
            print(f"    {ms:9.3f} ms {calls:6d} x  {kernel}", flush=True)
    for name, base in YARDSTICK.items():
        if name in results and base in results:
            a, b = results[name], results[base]
            memory = (f", peak memory {a['peak_mib'] / b['peak_mib']:.2f}x (steady {a['steady_mib']:.0f} against "
                      f"{b['steady_mib']:.0f} MiB; a step's own {a['peak_mib'] - a['steady_mib']:.0f} against "
                      f"{b['peak_mib'] - b['steady_mib']:.0f} MiB)") if b["peak_mib"] > 0 else ""
            print(f"{name} / {base}: step {a['step_ms'] / b['step_ms']:.2f}x{memory}", flush=True)
    if "mxddp_bf16" in results and "mxddp_mxfp8" in results:
        bf16, mx = results["mxddp_bf16"]["buffer_bytes"], results["mxddp_mxfp8"]["buffer_bytes"]
        print(f"fp8_param_gather + reuse: params {bf16.get('params', 0)} -> {mx.get('params', 0)} bytes (the separate "
              f"param buffer saved: {bf16.get('params', 0) - mx.get('params', 0)}), MXFP8 copies {mx.get('mxfp8', 0)}, "
              f"all buffer bytes {sum(bf16.values())} -> {sum(mx.values())}", flush=True)
    return 0 if len(results) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
