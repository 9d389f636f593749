"""A rank that raises in backward under torchrun (run_torchrun.sh raise): rank 1's hook raises before
its grads are reported, so rank 0 waits in finish_grad_sync for a reduce-scatter rank 1 never issues.
The job must end at once with rank 1's error (its process ends; torchrun, or gloo's closed
connection, ends rank 0), not hang until the 60 s timeout."""
import torch

import mxddp.torch as mxt

rank, world = mxt.init(timeout_s=60)
torch.set_num_threads(1)
torch.manual_seed(0)
module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
    overlap_grad_reduce=True, use_distributed_optimizer=True))
if rank == 1:
    def fail(grad):
        raise RuntimeError("rank 1 fails in backward on purpose")
    module[0].bias.register_hook(fail)  # the bias: a fused weight's gradient never reaches a hook
model(torch.ones(4, 16)).sum().backward()
model.finish_grad_sync()
print(f"rank {rank} finished the grad sync", flush=True)
