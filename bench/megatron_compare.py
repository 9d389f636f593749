#!/usr/bin/env python3
"""mxddp.torch against the real megatron-core on the same HF GPT-2, on the CPU (issue 44, items 2 and 3).

Not a test: a benchmark, run by hand. Two ways to train the same `transformers.GPT2LMHeadModel`
(random init, tied embedding, dropout 0), each written against megatron-core's API (the loop of
tests/python/test_megatron_api.py: zero_grad_buffer, forward, backward, finish_grad_sync, step):

  megatron  megatron.core's DistributedDataParallel + get_megatron_optimizer (its
            DistributedOptimizer over torch's fused-less AdamW), on the CPU through
            tests/python/megatron_on_cpu.py (its CUDA placements sent to the CPU, nothing else)
  mxddp     mxddp.torch's DistributedDataParallel + get_megatron_optimizer, same configs

Both: DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
grad_reduce_in_fp32=True, bucket_size=None: Megatron's default), OptimizerConfig(adam, lr 1e-4,
weight_decay 0.1, clip_grad 1.0), F32, one intra-op thread per rank, under torchrun (both on gloo) or
mpirun (mxddp on MPI, Megatron on a gloo group of the same ranks). Each impl
runs in its own job; the impls alternate, --repeats times.

Measured per job (the slowest or largest rank):
  step_s    median of the timed steps' times, from zero_grad_buffer to the end of step();
  cpu_s     median of the same steps' process CPU time (user + system, every thread);
  peak      VmHWM over the timed steps (reset after the warm-up) less the RSS before the model is
            built: what the model, its training state and the step's activations hold at their peak;
  state     the bytes each holds of model state by category: mxddp's tracker
            (mxt.memory_usage() peaks); Megatron's counted from its tensors (its param and grad
            buffers, the optimizer's main-param shards that are not views of the param buffer,
            the AdamW moments);
  rss_before_step  the RSS after backward and finish_grad_sync, before step(), less the same
            baseline (what is held while the optimizer starts).

    torchrun --nproc_per_node 2 bench/megatron_compare.py --worker mxddp     # one job
    python bench/megatron_compare.py --repeats 5                             # the comparison
    python bench/megatron_compare.py --repeats 3 --hog                       # with a CPU hog beside

--fixed-mmap-threshold takes glibc's retention of freed blocks out of the peak (see its help).
mxddp's optimizer hands the heap's free pages back after each step (release_heap_after_step, its
default); --mxddp-keep-heap turns that off, to see what it saves and costs.

--hog runs a busy loop process beside the ranks (issue 44 item 2: a shared node) and reports
wall/CPU per step: how much of its wall time a rank spends waiting rather than computing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings

from gloo_beside_mpi import init_gloo_beside_mpi  # this folder
from proc_stats import cpu_model, loadavg_1m, reset_hwm, status_kib  # this folder
from gpt2_model import gpt2_lm_head_model  # this folder

HERE = os.path.dirname(os.path.abspath(__file__))
IMPLS = ("megatron", "mxddp")


def _megatron_state_bytes(model, optimizer) -> dict[str, int]:
    """Megatron's model-state bytes by mxddp's tracker categories, counted from its tensors."""
    def nbytes(t):
        return t.numel() * t.element_size()
    params = sum(nbytes(b.param_data) for b in model.buffers if b.param_data is not None)
    grads = sum(nbytes(b.grad_data) for b in model.buffers)
    param_ptrs = [(b.param_data.data_ptr(), b.param_data.data_ptr() + nbytes(b.param_data))
                  for b in model.buffers if b.param_data is not None]
    inner = optimizer.optimizer
    main = 0
    for g in inner.param_groups:
        for p in g["params"]:
            if not any(lo <= p.data_ptr() < hi for lo, hi in param_ptrs):
                main += nbytes(p)  # a copy (bf16 params' F32 main shard), not a view of the param buffer
    state = sum(nbytes(t) for s in inner.state.values() for t in s.values()
                if hasattr(t, "numel") and t.dim() > 0)
    return {"params": params, "grads": grads, "main_params": main, "optimizer_state": state}


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401 (loaded before the baseline RSS: the peak counts no library code)

    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    torch.set_num_threads(1)
    if "OMPI_COMM_WORLD_SIZE" in os.environ:  # mpirun: mxddp on MPI, torch's gloo group for Megatron beside it
        import mxddp.torch as mxt
        rank, world = mxt.init(timeout_s=600)
        init_gloo_beside_mpi(rank, world)
    else:  # torchrun: both on torch.distributed's gloo
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.transformer import TransformerConfig
        parallel_state.initialize_model_parallel()
        if args.worker == "megatron":
            import megatron.core.distributed as api_ddp
            import megatron.core.optimizer as api_opt
            from megatron_on_cpu import megatron_on_cpu
            place = megatron_on_cpu
            get_optimizer = api_opt.get_megatron_optimizer
        else:
            import contextlib

            import mxddp.torch as api_ddp
            import mxddp.torch as api_opt
            from mxddp.torch.megatron import get_megatron_optimizer as get_optimizer
            if args.mxddp_keep_heap:  # the same optimizer, without handing the heap's free pages back
                def get_optimizer(config, chunks):
                    return api_opt.DistributedOptimizer(chunks[0], config, release_heap_after_step=False)
            place = contextlib.nullcontext
    # After the impl's imports: the peak counts the model, its training state and the step, not
    # the code either library loads.
    baseline_kib = status_kib("VmRSS")

    module = gpt2_lm_head_model(args.layers, args.hidden, args.seq)
    transformer_config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden,
                                           num_attention_heads=args.hidden // 64)
    with place(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp_config = api_ddp.DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                           grad_reduce_in_fp32=True)
        model = api_ddp.DistributedDataParallel(transformer_config, ddp_config, module)
        opt_config = api_opt.OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.1, clip_grad=1.0,
                                             use_distributed_optimizer=True)
        optimizer = get_optimizer(opt_config, [model])

        gen = torch.Generator().manual_seed(1 + rank)
        step_s, cpu_s, losses = [], [], []
        before_step_kib = 0
        slowest = torch.zeros(2, dtype=torch.float64)
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                reset_hwm()
                if args.worker == "mxddp":
                    api_ddp._C.reset_memory_peaks()
            ids = torch.randint(0, module.config.vocab_size, (args.micro_batch, args.seq), generator=gen)
            t0, c0 = time.perf_counter(), time.process_time()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.finish_grad_sync()
            if step == args.warmup:
                before_step_kib = status_kib("VmRSS") - baseline_kib
            ok, grad_norm, _ = optimizer.step()
            assert ok, f"step {step} skipped (grad norm {grad_norm})"
            slowest[0], slowest[1] = time.perf_counter() - t0, time.process_time() - c0
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            losses.append(float(loss.detach()))
            if step >= args.warmup:
                step_s.append(float(slowest[0]))
                cpu_s.append(float(slowest[1]))
        peak = torch.tensor([float(status_kib("VmHWM") - baseline_kib), float(before_step_kib)])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if args.worker == "mxddp":
            state = {k: v[1] for k, v in api_ddp.memory_usage().items() if v[1]}
        else:
            state = _megatron_state_bytes(model, optimizer)
    result = {"impl": args.worker, "world": world, "step_s": statistics.median(step_s),
              "cpu_s": statistics.median(cpu_s), "wall_per_cpu": statistics.median(w / c for w, c in zip(step_s, cpu_s)),
              "peak_above_baseline_bytes": int(peak[0].item()) * 1024,
              "rss_before_step_bytes": int(peak[1].item()) * 1024, "state_bytes": state, "losses": losses}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    if args.worker == "mxddp":
        optimizer.close()
        model.close()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _hog() -> subprocess.Popen:
    """A process that keeps one core busy: the neighbour on a shared node."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def sweep(args) -> None:
    py = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if args.fixed_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    print(f"# {cpu_model()}, {os.cpu_count()} cores; {os.uname().release}; one thread per rank; "
          f"{'a busy-loop process beside the ranks' if args.hog else 'quiet'}; launcher {args.launcher}"
          f"{'; MALLOC_MMAP_THRESHOLD_=131072' if args.fixed_mmap_threshold else ''}"
          f"{'; mxddp keeps the heap (release_heap_after_step=False)' if args.mxddp_keep_heap else ''}")
    per_impl: dict[str, list[dict]] = {i: [] for i in args.impls}
    hog = _hog() if args.hog else None
    try:
        for rep in range(args.repeats):
            for impl in args.impls:
                launch = ([py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.dp)]
                          if args.launcher == "torchrun" else
                          [shutil.which("mpirun") or "mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(args.dp), py])
                cmd = launch + [__file__, "--worker", impl, "--layers", str(args.layers), "--hidden", str(args.hidden), "--seq",
                       str(args.seq), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
                       "--warmup", str(args.warmup)] + (["--mxddp-keep-heap"] if args.mxddp_keep_heap else [])
                out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
                if out.returncode != 0 or line is None:
                    sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
                r = json.loads(line[len("RESULT "):])
                per_impl[impl].append(r)
                print(f"  run {rep + 1} {impl:9} step {r['step_s']:.3f} s  cpu {r['cpu_s']:.3f} s  "
                      f"wall/cpu {r['wall_per_cpu']:.2f}  peak +{r['peak_above_baseline_bytes'] / 2**20:.0f} MiB  "
                      f"load {loadavg_1m():.1f}", flush=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    print(f"\nGPT-2 {args.layers}/{args.hidden}/seq {args.seq}, micro-batch {args.micro_batch}, dp {args.dp}; "
          f"medians of {args.repeats} runs (each: median of {args.steps} steps after {args.warmup} warm-up)")
    print(f"{'impl':9} {'step_s':>7} {'cpu_s':>7} {'wall/cpu':>8} {'peak_MiB':>9} {'pre-step':>9}")
    med = {}
    for impl, rs in per_impl.items():
        med[impl] = {k: statistics.median(r[k] for r in rs)
                     for k in ("step_s", "cpu_s", "wall_per_cpu", "peak_above_baseline_bytes", "rss_before_step_bytes")}
        m = med[impl]
        print(f"{impl:9} {m['step_s']:7.3f} {m['cpu_s']:7.3f} {m['wall_per_cpu']:8.2f} "
              f"{m['peak_above_baseline_bytes'] / 2**20:9.0f} {m['rss_before_step_bytes'] / 2**20:9.0f}")
        print(f"{'':9} state (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in rs[-1]["state_bytes"].items()))
    if set(IMPLS) <= set(med):
        a, b = med["mxddp"], med["megatron"]
        print(f"mxddp/megatron: step {a['step_s'] / b['step_s']:.2f}, peak "
              f"{a['peak_above_baseline_bytes'] / b['peak_above_baseline_bytes']:.3f}, wall/cpu "
              f"{a['wall_per_cpu'] / b['wall_per_cpu']:.2f}")
        la, lb = per_impl["mxddp"][-1]["losses"], per_impl["megatron"][-1]["losses"]
        print(f"largest loss difference over {len(la)} steps: {max(abs(x - y) for x, y in zip(la, lb)):.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=IMPLS, help="run one job's rank (under torchrun)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hog", action="store_true", help="a busy-loop process beside the ranks")
    p.add_argument("--fixed-mmap-threshold", action="store_true",
                   help="run the jobs with MALLOC_MMAP_THRESHOLD_=131072: glibc then returns every freed block of "
                        "128 KiB or more to the system at once, so the peak is the live bytes' high-water mark, "
                        "not also what the allocator kept (which varies from run to run by +-100 MiB here)")
    p.add_argument("--mxddp-keep-heap", action="store_true",
                   help="build mxddp's optimizer with release_heap_after_step=False: glibc then keeps the heap's "
                        "free pages resident between steps, as it does for Megatron")
    p.add_argument("--launcher", choices=("torchrun", "mpirun"), default="torchrun",
                   help="torchrun (both on torch.distributed's gloo) or mpirun (mxddp on MPI, Megatron on a gloo "
                        "group of the same ranks)")
    args = p.parse_args()
    if args.worker:
        worker(args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
