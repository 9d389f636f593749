#!/usr/bin/env python3
"""mxddp.torch.FullyShardedDataParallel against PyTorch's FSDP2 on the same HF GPT-2 (issue 26, Performance).

Not a test: a benchmark, run by hand. Two ways to train the same `transformers.GPT2LMHeadModel`
(random init from one seed, tied embedding, dropout 0, vocabulary 50257), one process per rank under
mpirun, one intra-op thread per rank (torch.set_num_threads(1)), each in its own mpirun job so that
one's memory never counts against the other's:

  mxddp   mxddp.torch.FullyShardedDataParallel (use_megatron_fsdp, optim_grads_params,
          overlap_grad_reduce, overlap_param_gather, grad_reduce_in_fp32, fsdp_unit_modules=[GPT2Block])
          + mxddp.torch.DistributedOptimizer (AdamW in C++, global-norm clip)
  fsdp2   torch.distributed.fsdp.fully_shard on every GPT2Block and then on the root
          (reshard_after_forward=True, a 1-D CPU DeviceMesh, gloo) + torch.optim.AdamW (foreach)
          + torch.nn.utils.clip_grad_norm_

Both are full shard (params, grads and optimizer state sharded; a block's params gathered for its
forward, released after it, gathered again for its backward). Precisions:

  f32     F32 params, F32 grads, F32 reduction on both sides.
  bf16    FSDP2: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32) (F32 sharded params, BF16
          gathered ones); mxddp: the module in BF16 (BF16 sharded params, F32 main params in the
          optimizer) with grad_reduce_in_fp32=True.

lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.1 on params of two or more dimensions only (as
mxddp and Megatron), clip 1.0, a fresh random micro-batch per step (seeded by rank, the same for both
implementations, so their F32 losses can be compared step by step). Optional: HF's activation
checkpointing (use_reentrant=False) and, for mxddp, the fine-grained
param gather (megatron_fsdp_enable_fine_grained_param_gather=True: every Conv1D/LayerNorm inside a
block is a unit of its own).

Measured, per configuration (as bench/torch_ddp_compare.py measures):
  step_s   median over the timed steps (after the warm-up steps) of the slowest rank's step, from
           zero_grad to the end of opt.step() (mxddp: + finish_grad_sync), the ranks' step times
           all-reduced with max;
  peak     per rank, the resident high-water mark (VmHWM in /proc/self/status) over the timed steps
           (reset through /proc/self/clear_refs "5" after the warm-up), less the RSS after the
           imports and the launch (before the model is built); the largest rank's is reported.
  mxddp also reports its tracked bytes per category (mxt.memory_usage() peaks over the timed
  steps) and model.peak_gathered_bytes() (values, rowwise, colwise) over them; FSDP2 the bytes of its
  sharded params, grads and AdamW state counted from the local tensors.

    python bench/torch_fsdp_compare.py                              # the sweep (see --help)
    python bench/torch_fsdp_compare.py --models small --dp 2 --precisions f32 --repeats 1 --no-fine
    mpirun -np 2 python bench/torch_fsdp_compare.py --worker fsdp2 --model small --precision bf16  # one job
    /usr/bin/python3 bench/torch_fsdp_compare.py --plot results.json --png docs/torch_fsdp_fine_grained.png
    python bench/torch_fsdp_compare.py --smoke                      # tiny model, one step each (CTest)

Figures: docs/python.md, "FSDP against PyTorch's FSDP2".
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
import tempfile
import time

from proc_stats import cpu_model, loadavg_1m, reset_hwm, status_kib  # this folder
from gpt2_model import gpt2_lm_head_model  # this folder

MODELS = {  # name: (layers, hidden, heads, seq, micro-batch per rank, vocabulary)
    "tiny": (2, 64, 2, 32, 1, 256),          # the CTest smoke case only
    "small": (4, 256, 4, 128, 2, 50257),
    "gpt2-124m": (12, 768, 12, 128, 1, 50257),
}
IMPLS = ("mxddp", "fsdp2")
PRECISIONS = ("f32", "bf16")
# What every worker's RESULT line holds, and what each implementation adds (the smoke case checks).
RESULT_FIELDS = ("impl", "world", "model", "precision", "fine_grained", "recompute", "params", "step_s",
                 "steps_s", "losses", "peak_above_baseline_bytes", "loadavg_1m", "torch")
IMPL_FIELDS = {"mxddp": ("tracked_peak_bytes", "peak_gathered_bytes"), "fsdp2": ("model_state_bytes",)}


def _mpi_rank_world() -> tuple[int, int]:
    """This process's rank and the job's size from OpenMPI's environment (a plain python is 1 rank)."""
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)), int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))


def _local_bytes(t) -> int:
    """Bytes this rank holds for a tensor or a DTensor (its local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def worker(args) -> None:
    import torch
    import transformers  # noqa: F401 (loaded before the baseline RSS: the peak counts no library code)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.set_num_threads(1)
    if args.worker == "mxddp":
        import mxddp.torch as mxt
        rank, world = mxt.init(timeout_s=600)

        def all_max(t):
            mxt.all_reduce(t, "max")
    else:
        # FSDP2 needs torch.distributed; no MPI is started in this process, so nothing of mxddp's
        # (its progress thread, its staging) runs beside FSDP2. Rendezvous through a file all ranks see.
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        rank, world = _mpi_rank_world()
        rendezvous = args.rendezvous or os.path.join(tempfile.gettempdir(), f"torch_fsdp_compare.{os.getppid()}.rdv")
        dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))

        def all_max(t):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    baseline_kib = status_kib("VmRSS")

    layers, hidden, heads, seq, micro_batch, vocab = MODELS[args.model]
    micro_batch = args.micro_batch or micro_batch
    module = gpt2_lm_head_model(layers, hidden, seq, heads=heads, vocab=vocab)
    n_params = sum(p.numel() for p in module.parameters())
    if args.recompute:  # by the name transformers has (renamed after 5.17, the old one deprecated)
        if hasattr(module, "activation_checkpointing_enable"):
            module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    bf16 = args.precision == "bf16"

    if args.worker == "mxddp":
        if bf16:
            module.to(torch.bfloat16)
        model = mxt.FullyShardedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True,
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True, overlap_param_gather=True,
            megatron_fsdp_enable_fine_grained_param_gather=True if args.fine_grained else None,
            grad_reduce_in_fp32=True), fsdp_unit_modules=[GPT2Block])
        opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(
            lr=1e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0))
    else:
        if args.fine_grained:
            sys.exit("--fine-grained is mxddp's (FSDP2 has no fine-grained gather)")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for block in module.transformer.h:
            fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        model = module
        params = list(module.parameters())  # the DTensor shards now
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.999), eps=1e-8)

    gen = torch.Generator().manual_seed(1 + rank)
    step_s, losses = [], []
    phases: dict[str, list[float]] = {}
    slowest = torch.zeros(1)
    profiler = None
    for step in range(args.warmup + args.steps + (1 if args.profile else 0)):
        if step == args.warmup:
            reset_hwm()
            if args.worker == "mxddp":
                mxt._C.reset_memory_peaks()
                model.reset_peak_gathered_bytes()
        if step == args.warmup + args.steps:  # one more step, profiled, after the measured ones
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        ids = torch.randint(0, vocab, (micro_batch, seq), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if args.worker == "mxddp":
            model.finish_grad_sync()
        else:
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        t3 = time.perf_counter()
        opt.step()
        slowest[0] = time.perf_counter() - t0
        if args.warmup <= step < args.warmup + args.steps:  # this rank's phases (zero_grad counts as forward)
            for name, s in (("forward", t1 - t0), ("backward", t2 - t1), ("sync_or_clip", t3 - t2),
                            ("optimizer", t0 + float(slowest[0]) - t3)):
                phases.setdefault(name, []).append(s)
        all_max(slowest)
        losses.append(float(loss.detach().float()))
        if args.warmup <= step < args.warmup + args.steps:
            step_s.append(float(slowest[0]))
    if profiler is not None:
        profiler.__exit__(None, None, None)
        if rank == 0:
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile)
            print("\n".join("PROFILE " + line for line in table.splitlines()), flush=True)
    peak = torch.tensor([float(status_kib("VmHWM") - baseline_kib)])
    all_max(peak)

    result = {"impl": args.worker, "world": world, "model": args.model, "layers": layers, "hidden": hidden,
              "seq": seq, "micro_batch": micro_batch, "vocab": vocab, "precision": args.precision,
              "fine_grained": bool(args.fine_grained), "recompute": bool(args.recompute), "params": n_params,
              "step_s": statistics.median(step_s), "steps_s": step_s,
              "phases_s": {k: statistics.median(v) for k, v in phases.items()}, "losses": losses,
              "peak_above_baseline_bytes": int(peak.item()) * 1024, "loadavg_1m": loadavg_1m(),
              "torch": torch.__version__}
    if args.worker == "mxddp":
        result["tracked_peak_bytes"] = {k: v[1] for k, v in mxt.memory_usage().items()}
        result["peak_gathered_bytes"] = dict(model.peak_gathered_bytes())
    else:
        state = sum(_local_bytes(t) for s in opt.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        result["model_state_bytes"] = {
            "params": sum(_local_bytes(p) for p in module.parameters()),  # the F32 shards
            "grads": sum(_local_bytes(p.grad) for p in module.parameters() if p.grad is not None),
            "optimizer_state": state}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    if args.worker == "mxddp":
        opt.close()
        model.close()
    else:
        dist.destroy_process_group()
        # Skip the interpreter's finalization: torch's gloo runloop thread drops the last collective's
        # tensors after wait() has returned, and if the interpreter is finalizing by then their decref
        # exits that thread inside a destructor, which aborts the process ("terminate called without an
        # active exception", about one job in ten here; torch's, seen in pytorch PR 179291). No MPI
        # and nothing of mxddp's runs in this process, and its result is printed and flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _machine() -> dict:
    cpu = cpu_model()
    return {"cpu": cpu, "cores": os.cpu_count(), "arch": platform.machine(), "kernel": platform.release(),
            "threads_per_rank": 1}


def _non_unit_param_bytes(model: str, precision: str) -> int:
    """Bytes of the params outside every GPT2Block (the tied embedding, the position embedding and
    the final LayerNorm): FSDP's non-unit params, gathered at their first use and kept until the
    grads are synchronized, so every variant's peak gathered bytes hold them."""
    layers, hidden, heads, seq, micro_batch, vocab = MODELS[model]
    return ((vocab + seq) * hidden + 2 * hidden) * (2 if precision == "bf16" else 4)


def _key(impl: str, model: str, precision: str, dp: int, fine: bool, recompute: bool) -> str:
    return f"{impl}|{model}|{precision}|{dp}|{int(fine)}|{int(recompute)}"


def _run_one(args, env, impl, model, precision, dp, fine, recompute, steps, warmup) -> dict:
    mpirun = shutil.which("mpirun") or "mpirun"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(dp), sys.executable, __file__,
               "--worker", impl, "--model", model, "--precision", precision, "--steps", str(steps),
               "--warmup", str(warmup), "--rendezvous", os.path.join(tmp, "rdv")]
        if args.micro_batch:
            cmd += ["--micro-batch", str(args.micro_batch)]
        cmd += ["--fine-grained"] if fine else []
        cmd += ["--recompute"] if recompute else []
        load_before = loadavg_1m()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    r = json.loads(line[len("RESULT "):])
    r["loadavg_1m_before"] = load_before
    return r


def _check_fields(r: dict) -> None:
    missing = [f for f in RESULT_FIELDS + IMPL_FIELDS[r["impl"]] if f not in r]
    if missing:
        sys.exit(f"{r['impl']} result lacks {missing}: {r}")
    if not (r["step_s"] > 0 and r["peak_above_baseline_bytes"] >= 0 and len(r["losses"]) >= 1):
        sys.exit(f"{r['impl']} result has impossible values: {r}")
    if r["impl"] == "mxddp" and not r["peak_gathered_bytes"].get("values", 0) > 0:
        sys.exit(f"mxddp gathered nothing (peak_gathered_bytes {r['peak_gathered_bytes']})")


def sweep(args) -> None:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    machine = _machine()
    print(f"# {machine['cpu']}, {machine['cores']} cores ({machine['arch']}), kernel {machine['kernel']}; "
          f"one thread per rank; {sys.executable}; load average {loadavg_1m():.2f}", flush=True)
    # Each configuration once per repeat; the compare part (both impls, coarse, no recompute) and the
    # fine part (mxddp coarse/fine x recompute off/on, FSDP2 with recompute for reference) share runs.
    wanted: list[tuple] = []
    for model in args.models:
        for precision in args.precisions:
            for dp in args.dp:
                for impl in args.impls:
                    wanted.append((impl, model, precision, dp, False, False))
    if args.fine:
        for dp in args.dp:
            for recompute in (False, True):
                for impl, fine in (("mxddp", False), ("mxddp", True), ("fsdp2", False)):
                    if impl in args.impls and (impl == "mxddp" or recompute):
                        cfg = (impl, args.fine_model, args.fine_precision, dp, fine, recompute)
                        if cfg not in wanted:
                            wanted.append(cfg)
    runs: dict[str, list[dict]] = {}
    if args.reuse:  # runs kept from an earlier sweep count towards --repeats (a sweep resumed or split)
        with open(args.reuse) as f:
            runs = json.load(f)["runs"]

    def save() -> None:  # after every run, atomically, so an interrupted sweep keeps what it measured
        if not args.json_out:
            return
        doc = {"machine": machine, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
               "fine_model": args.fine_model, "fine_precision": args.fine_precision, "runs": runs}
        tmp = args.json_out + ".partial"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, args.json_out)

    for rep in range(args.repeats):
        for cfg in wanted:  # all configurations in each repeat, so a busy spell on the machine hits each alike
            if len(runs.get(_key(*cfg), [])) > rep:
                continue
            r = _run_one(args, env, *cfg, steps=args.steps, warmup=args.warmup)
            if args.smoke:
                _check_fields(r)
            runs.setdefault(_key(*cfg), []).append(r)
            save()
            impl, model, precision, dp, fine, recompute = cfg
            extra = ""
            if impl == "mxddp":
                extra = f"  gathered {r['peak_gathered_bytes'].get('values', 0) / 2**20:.1f} MiB"
            print(f"  run {rep + 1} {impl:5} {model:9} {precision:4} dp {dp} fine {int(fine)} recompute "
                  f"{int(recompute)}: step {r['step_s']:.3f} s  peak +{r['peak_above_baseline_bytes'] / 2**20:.0f} MiB"
                  f"{extra}  loss {r['losses'][0]:.5f}  load {r['loadavg_1m_before']:.2f}", flush=True)

    save()  # also where every run was reused: the file then says this sweep's --repeats

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[key])

    print(f"\nmedians of {args.repeats} runs (each: the median of {args.steps} steps after {args.warmup} warm-up)")
    print(f"{'model':9} {'prec':4} {'dp':>2} {'fsdp2 step':>10} {'peak MiB':>8} {'mxddp step':>10} {'peak MiB':>8} "
          f"{'step x':>6} {'peak x':>6}")
    for model in args.models:
        for precision in args.precisions:
            for dp in args.dp:
                f, m = _key("fsdp2", model, precision, dp, False, False), _key("mxddp", model, precision, dp, False, False)
                if f in runs and m in runs:
                    fs, fp, ms, mp = med(f, "step_s"), med(f, "peak_above_baseline_bytes"), \
                        med(m, "step_s"), med(m, "peak_above_baseline_bytes")
                    print(f"{model:9} {precision:4} {dp:2d} {fs:10.3f} {fp / 2**20:8.0f} {ms:10.3f} {mp / 2**20:8.0f} "
                          f"{ms / fs:6.2f} {mp / fp:6.2f}")
                    t = runs[m][-1]["tracked_peak_bytes"]
                    print(f"{'':18} mxddp tracked peaks (MiB): " +
                          ", ".join(f"{k} {v / 2**20:.1f}" for k, v in t.items() if v))
                    s = runs[f][-1]["model_state_bytes"]
                    print(f"{'':18} fsdp2 model state (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in s.items()))
                    for impl, k in (("fsdp2", f), ("mxddp", m)):
                        with_phases = [r["phases_s"] for r in runs[k] if "phases_s" in r]
                        if with_phases:  # rank 0's phases, the median over the runs of each run's median
                            print(f"{'':18} {impl} phases (s): " + ", ".join(
                                f"{p} {statistics.median(ph[p] for ph in with_phases):.3f}" for p in with_phases[0]))
    if args.fine:
        non_unit = _non_unit_param_bytes(args.fine_model, args.fine_precision)
        print(f"\nfine-grained param gather, {args.fine_model} {args.fine_precision} (gathered: the peak gathered "
              f"param bytes per rank; less the non-unit params' {non_unit / 2**20:.2f} MiB: the units' part)")
        print(f"{'dp':>2} {'impl':5} {'fine':>4} {'recomp':>6} {'gathered MiB':>12} {'units MiB':>9} {'step s':>7} "
              f"{'peak MiB':>8}")
        for dp in args.dp:
            for recompute in (False, True):
                for impl, fine in (("mxddp", False), ("mxddp", True), ("fsdp2", False)):
                    k = _key(impl, args.fine_model, args.fine_precision, dp, fine, recompute)
                    if k not in runs:
                        continue
                    g = runs[k][-1].get("peak_gathered_bytes", {}).get("values")
                    gathered = f"{g / 2**20:12.2f} {(g - non_unit) / 2**20:9.2f}" if g is not None \
                        else f"{'-':>12} {'-':>9}"
                    print(f"{dp:2d} {impl:5} {int(fine):4d} {int(recompute):6d} {gathered} {med(k, 'step_s'):7.3f} "
                          f"{med(k, 'peak_above_baseline_bytes') / 2**20:8.0f}")
    if args.json_out:
        print(f"wrote {args.json_out}")
    if args.smoke:
        print("smoke: every result has its fields")


def plot(args) -> None:
    """The fine-grained gather's table as a figure: peak gathered MiB and step time per dp, coarse and
    fine, recompute off and on (mxddp), FSDP2's step time beside them. Needs only matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.plot) as f:
        doc = json.load(f)
    runs, model, precision = doc["runs"], doc["fine_model"], doc["fine_precision"]
    dps = sorted({int(k.split("|")[3]) for k in runs if k.split("|")[1] == model and k.split("|")[2] == precision})
    variants = [("mxddp", False, False, "mxddp coarse"), ("mxddp", True, False, "mxddp fine"),
                ("mxddp", False, True, "mxddp coarse + recompute"), ("mxddp", True, True, "mxddp fine + recompute"),
                ("fsdp2", False, False, "FSDP2"), ("fsdp2", False, True, "FSDP2 + recompute")]
    non_unit = _non_unit_param_bytes(model, precision)
    n_runs = min(len(rs) for k, rs in runs.items() if k.split("|")[1] == model and k.split("|")[2] == precision)
    loads = [r["loadavg_1m_before"] for rs in runs.values() for r in rs if "loadavg_1m_before" in r] or [0.0]
    fig, (ax_g, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(variants)
    for i, (impl, fine, recompute, label) in enumerate(variants):
        gathered, step = [], []
        for dp in dps:
            rs = runs.get(_key(impl, model, precision, dp, fine, recompute), [])
            gathered.append((rs[-1]["peak_gathered_bytes"]["values"] - non_unit) / 2**20 if rs and impl == "mxddp"
                            else 0)
            step.append(statistics.median(r["step_s"] for r in rs) if rs else 0)
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(dps))]
        if impl == "mxddp":
            ax_g.bar(xs, gathered, width, label=label)
        ax_t.bar(xs, step, width, label=label)
    for ax, title in ((ax_g, f"peak gathered unit params per rank (MiB)\n"
                             f"(+ the non-unit params' {non_unit / 2**20:.1f} MiB in every case)"),
                      (ax_t, "step time (s, median)")):
        ax.set_xticks(range(len(dps)), [f"dp {dp}" for dp in dps])
        ax.set_title(title, fontsize=10)
    ax_t.legend(fontsize=7)
    m = doc["machine"]
    fig.suptitle(f"GPT-2 {model} {precision}: fine-grained param gather, with and without recompute\n"
                 f"{m['cpu']}, {m['cores']} cores, {m['threads_per_rank']} thread per rank, "
                 f"median of {n_runs} runs x {doc['steps']} steps; 1-min load average {min(loads):.0f} to "
                 f"{max(loads):.0f} during the runs", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=IMPLS, help="run one job's rank (under mpirun)")
    p.add_argument("--model", choices=list(MODELS), default="small", help="the worker's model")
    p.add_argument("--precision", choices=PRECISIONS, default="f32", help="the worker's precision")
    p.add_argument("--fine-grained", action="store_true", help="worker: mxddp's fine-grained param gather")
    p.add_argument("--recompute", action="store_true", help="worker: HF activation recompute")
    p.add_argument("--rendezvous", help="worker (fsdp2): the file torch.distributed meets in")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="worker: profile one more step and print the top ROWS ops by self CPU time")
    p.add_argument("--micro-batch", type=int, default=0, help="per rank (0: the model's default in MODELS)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing")
    p.add_argument("--models", nargs="+", default=["small", "gpt2-124m"], choices=list(MODELS))
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--dp", nargs="+", type=int, default=[2, 4])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-fine", dest="fine", action="store_false", help="skip the fine-grained gather's runs")
    p.add_argument("--fine-model", choices=list(MODELS), default="small")
    p.add_argument("--fine-precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--json-out", help="write every run's results here (the input of --plot)")
    p.add_argument("--reuse", metavar="JSON", help="start from the runs of an earlier --json-out file")
    p.add_argument("--plot", metavar="JSON", help="draw the fine-grained table from a --json-out file")
    p.add_argument("--png", default="docs/torch_fsdp_fine_grained.png")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, dp 2, F32, one step each of mxddp and FSDP2, their fields checked")
    args = p.parse_args()
    if args.plot:
        plot(args)
    elif args.worker:
        worker(args)
    else:
        if args.smoke:
            import importlib.util
            absent = [m for m in ("torch", "transformers", "mxddp") if importlib.util.find_spec(m) is None]
            if absent or shutil.which("mpirun") is None:
                print(f"SKIP: {sys.executable} lacks {absent or 'mpirun on PATH'} (scripts/setup.sh, then CTest's "
                      "python_package_install)")
                sys.exit(77)
            args.models, args.precisions, args.dp, args.repeats = ["tiny"], ["f32"], [2], 1
            args.steps, args.warmup, args.fine = 1, 0, False
        sweep(args)


if __name__ == "__main__":
    main()
