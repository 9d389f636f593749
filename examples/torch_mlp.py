"""A plain PyTorch MLP trained with mxddp's DDP and distributed optimizer (docs/python.md).

    mpirun --allow-run-as-root --oversubscribe -np 2 build/pyvenv-torch/bin/python examples/torch_mlp.py

Each rank draws its own batches of a fixed random regression problem (y = tanh(x W* / 8) + noise);
gradients are reduce-scattered in buckets during backward, each rank's AdamW updates its shard of
F32 main params, and the params are all-gathered back into the buffer the torch params view.
"""
import argparse
import contextlib

import torch

import mxddp.torch as mxt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--micro-batches", type=int, default=2, help="accumulated per step (no_sync)")
    parser.add_argument("--bucket-size", type=int, default=20000, help="elements per gradient bucket")
    args = parser.parse_args()

    rank, world = mxt.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every rank builds the same initial model (as in Megatron: no broadcast)
    true_weights = torch.randn(64, 16)
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                 torch.nn.GELU(), torch.nn.Linear(256, 16))
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=args.bucket_size,
        grad_reduce_in_fp32=True))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.01,
                                                              clip_grad=1.0))
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own samples

    for step in range(1, args.steps + 1):
        opt.zero_grad()
        loss_sum = torch.zeros(1)
        for micro in range(args.micro_batches):
            x = torch.randn(32, 64, generator=data)
            y = torch.tanh(x @ true_weights / 8) + 0.01 * torch.randn(32, 16, generator=data)
            last = micro == args.micro_batches - 1
            with _sync_scope(model, last):
                loss = torch.nn.functional.mse_loss(model(x), y) / args.micro_batches
                loss.backward()
            loss_sum += loss.detach()
        model.finish_grad_sync()
        update_successful, grad_norm, _ = opt.step()
        mxt.all_reduce(loss_sum, "avg")
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss_sum.item():.5f}  grad norm {grad_norm:.4f}"
                  f"{'' if update_successful else '  (skipped: non-finite grads)'}", flush=True)

    if rank == 0:
        usage = mxt.memory_usage()
        held = ", ".join(f"{name} {live / 1024:.1f} KiB" for name, (live, _) in usage.items() if live)
        print(f"dp {world}: {sum(p.numel() for p in module.parameters())} params; rank 0 holds {held}")


def _sync_scope(model, last_micro_batch):
    """no_sync for every micro-batch but the last, whose backward reduces the buckets."""
    return contextlib.nullcontext() if last_micro_batch else model.no_sync()


if __name__ == "__main__":
    main()
