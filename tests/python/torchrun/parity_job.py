"""A few training steps of one model, the same under mpirun and torchrun (run_torchrun.sh parity):
mxddp's DDP with overlapped reduce-scatter and its DistributedOptimizer, the losses (averaged over
the ranks) written by rank 0 as JSON to the file argv[1]. With --no-init the script does what a
torch DDP script does, torch.distributed.init_process_group("gloo"), and never calls mxt.init():
the first DistributedDataParallel starts mxddp on the default group."""
import json
import sys

import torch

import mxddp.torch as mxt

out_path = sys.argv[1]
no_init = "--no-init" in sys.argv
bf16 = "--bf16" in sys.argv
torch.set_num_threads(1)
if no_init:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
else:
    rank, _ = mxt.init(timeout_s=60)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                          torch.nn.Linear(64, 8))
if bf16:
    net = net.to(torch.bfloat16)
model = mxt.DistributedDataParallel(net, mxt.DistributedDataParallelConfig(
    overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=2000,
    overlap_param_gather=True))  # a param gather in flight when the script ends: drained at exit
assert mxt.is_initialized() and (not no_init or mxt.launch.backend() == "torch")
opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0))
losses = []
for step in range(8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g).to(net[0].weight.dtype)
    y = torch.randn(16, 8, generator=g).to(net[0].weight.dtype)
    model.zero_grad_buffer()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    model.finish_grad_sync()
    opt.step()
    mean = loss.detach().float().reshape(1).clone()
    mxt.all_reduce(mean, "avg")
    losses.append(mean.item())
if rank == 0:
    with open(out_path, "w") as f:
        json.dump({"backend": mxt.launch.backend(), "losses": losses}, f)
print(f"rank {rank}: {mxt.launch.backend()} losses {losses}", flush=True)
if mxt.launch.backend() == "torch":
    import torch.distributed as dist

    dist.destroy_process_group()  # as torch DDP scripts end; mxddp's own groups are drained at exit after it
