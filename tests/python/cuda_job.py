"""HF GPT-2 on a GPU under mxddp against torch: issue 42's device check (scripts/gpu_check.sh).

Each rank trains its slice of every step's batch under mxt.DistributedDataParallel (distributed
optimizer) or FullyShardedDataParallel(optim_grads_params), and beside it the same model on the
same GPU as torch trains it at world 1 on the whole batch (each rank's slice a micro-batch of its
own, the gradients averaged) with torch.optim.AdamW(fused=True) in Megatron's groups (no decay on
biases and 1-D params): the mean of the ranks' losses must stay within --tolerance of the
reference's at every step. F32, no TF32, no clipping.

  mpirun -np N python cuda_job.py --wrap ddp|fsdp        (MPI; N ranks share the GPUs round robin)
  torchrun --nproc-per-node N cuda_job.py --wrap ddp|fsdp (NCCL at world 1, gloo for N > 1 on one GPU)

Prints one line per step on rank 0 and a summary line (engine, peak memory, ms per step); exits 0
when every step agreed, 1 when one did not, 77 without a usable GPU.
"""
import argparse
import copy
import os
import sys
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrap", choices=["ddp", "fsdp"], required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: torch sees no usable GPU")
        return 77
    # This job is the check that lets the GPU path out (mxddp/torch/device.py).
    os.environ.setdefault("MXDDP_TORCH_CUDA_UNVERIFIED", "1")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        import transformers
    except ImportError:
        print("SKIP: no transformers in this Python")
        return 77

    import mxddp.torch as mxt

    if "TORCHELASTIC_RUN_ID" in os.environ:
        import torch.distributed as dist

        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local % torch.cuda.device_count())
        # NCCL refuses two ranks on one GPU: beyond one rank per GPU the default group is gloo's.
        dist.init_process_group("nccl" if world <= torch.cuda.device_count() else "gloo")
        rank, world = mxt.init()
    else:
        rank, world = mxt.init()
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=384, n_head=6, n_positions=args.seq,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    module = transformers.GPT2LMHeadModel(config).to(device)
    reference = copy.deepcopy(module)
    lr, wd, betas, eps = 1e-3, 0.1, (0.9, 0.95), 1e-8
    if args.wrap == "fsdp":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        model = mxt.FullyShardedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True, overlap_param_gather=True), fsdp_unit_modules=[GPT2Block])
    else:
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=lr, weight_decay=wd, adam_beta1=betas[0],
                                                             adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0))
    # Megatron's groups, as mxt.OptimizerConfig's: no weight decay on biases and 1-D params.
    decay = [p for n, p in reference.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in reference.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
    ref_opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas,
                                eps=eps, weight_decay=wd, fused=True)
    data = torch.Generator().manual_seed(1)
    worst, step_s = 0.0, []
    for step in range(1, args.steps + 1):
        batch = torch.randint(0, config.vocab_size, (world * args.batch, args.seq), generator=data).to(device)
        mine = batch[rank * args.batch:(rank + 1) * args.batch]
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad()
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        model.finish_grad_sync()
        opt.step()
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - start)
        mean = loss.detach().reshape(1).cpu()
        mxt.all_reduce(mean, "avg")
        # The reference runs each rank's slice as its own micro-batch (the same GEMM shapes as the
        # ranks'), its gradient the mean over the slices: DDP's average at world 1.
        ref_opt.zero_grad()
        ref_loss = torch.zeros((), device=device)
        for r in range(world):
            part = batch[r * args.batch:(r + 1) * args.batch]
            slice_loss = reference(input_ids=part, labels=part).loss / world
            slice_loss.backward()
            ref_loss += slice_loss.detach()
        ref_opt.step()
        diff = abs(mean.item() - ref_loss.item())
        worst = max(worst, diff)
        if rank == 0:
            print(f"step {step:3d}  mxddp {mean.item():.7f}  torch {ref_loss.item():.7f}  |diff| {diff:.2e}", flush=True)
    if rank == 0:
        step_s.sort()
        print(f"cuda_job {args.wrap} world {world} engine {model._buffers_comm.backend}: "
              f"max |loss diff| {worst:.2e} (tolerance {args.tolerance:.0e}), median step {1e3 * step_s[len(step_s) // 2]:.1f} ms "
              f"(both models on the GPU: the reference's memory counts too), peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB",
              flush=True)
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
