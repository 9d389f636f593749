"""Resharding across dp for tests/python/test_checkpoint.py: a small F32 MLP trained on a fixed
global batch per step (each rank its contiguous share of it), whose per-step loss is the global
batch's mean, so a run at any dp computes the same losses up to the reduction order.

Imported by the test (the uninterrupted run and the save, at the test's dp) and run as a script
at another dp (alone for dp 1, under `mpirun -np 4` for dp 4):
`python checkpoint_reshard.py resume DIR KIND OUT.json` loads the checkpoint, trains to STEPS and
writes the losses of the steps after it, with the iteration the load returned;
`python checkpoint_reshard.py save DIR KIND OUT.json` trains SAVE_AT steps, saves into DIR and
writes those steps' losses.
"""
import json
import sys

import torch

import mxddp.torch as mxt

STEPS = 6          # the uninterrupted run's steps
SAVE_AT = 3        # the interrupted run saves after this many
GLOBAL_BATCH = 8   # divisible by 1, 2 and 4
LR, WD, BETAS, EPS = 3e-3, 0.1, (0.9, 0.95), 1e-8


def make_model(rank, world, bucket_size):
    """bucket_size: DDP's (None or elements), or "fsdp:<strategy>" for FSDP with a unit per Linear."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.LayerNorm(48),
                                 torch.nn.Linear(48, 5))
    if isinstance(bucket_size, str) and bucket_size.startswith("fsdp:"):
        model = mxt.FullyShardedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True, overlap_grad_reduce=True,
            overlap_param_gather=True, data_parallel_sharding_strategy=bucket_size[len("fsdp:"):]),
            fsdp_unit_modules=[torch.nn.Linear])
    else:
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, average_in_collective=True,
            bucket_size=bucket_size))
    # clip_grad 0: no clipping, so the update does not depend on how the grad norm's f64 sum is split
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD,
                                                              adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                                                              adam_eps=EPS, clip_grad=0.0))
    return model, opt


def batch(step, rank, world):
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)
    share = GLOBAL_BATCH // world
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def train_steps(model, opt, first, last, rank, world):
    """Steps [first, last); returns each step's loss over the global batch."""
    losses = []
    for step in range(first, last):
        opt.zero_grad()
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        model.finish_grad_sync()
        update_successful, _, _ = opt.step()
        assert update_successful
        total = loss.detach().clone().reshape(1)
        mxt.all_reduce(total, "avg")
        losses.append(total.item())
    return losses


def resume(load_dir, bucket_size, out):
    rank, world = mxt.init(timeout_s=120)
    model, opt = make_model(rank, world, bucket_size)
    iteration, _ = mxt.load_checkpoint(load_dir, model, opt)
    losses = train_steps(model, opt, iteration, STEPS, rank, world)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "iteration": iteration, "step_count": opt.step_count, "losses": losses}, f)
    opt.close()
    model.close()


def save(save_dir, bucket_size, out):
    rank, world = mxt.init(timeout_s=120)
    model, opt = make_model(rank, world, bucket_size)
    losses = train_steps(model, opt, 0, SAVE_AT, rank, world)
    mxt.save_checkpoint(save_dir, model, opt, SAVE_AT)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "losses": losses}, f)
    opt.close()
    model.close()


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] not in ("resume", "save"):
        sys.exit("usage: checkpoint_reshard.py resume|save DIR BUCKET_SIZE|none|fsdp:STRATEGY OUT.json")
    kind = sys.argv[3]
    kind = None if kind == "none" else kind if kind.startswith("fsdp:") else int(kind)
    (resume if sys.argv[1] == "resume" else save)(sys.argv[2], kind, sys.argv[4])
