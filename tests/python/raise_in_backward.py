"""A rank that raises in backward (tests/python/run_failing_rank.sh): rank 1's hook raises before its
grads are reported, so rank 0 waits in finish_grad_sync for a reduce-scatter that rank 1 never
issues. The job must end at once with rank 1's error, not hang. With --torch-group the script also
builds its own gloo group after mxt.init() (as the pytest suite's conftest.py does), whose
init_process_group wraps the excepthook in one that buffers stderr: the error must still show."""
import sys

import torch

import mxddp.torch as mxt
from conftest import init_gloo_beside_mxddp

rank, world = mxt.init(timeout_s=60)
if "--torch-group" in sys.argv[1:]:
    init_gloo_beside_mxddp(rank, world)
torch.set_num_threads(1)
torch.manual_seed(0)
module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
    overlap_grad_reduce=True, use_distributed_optimizer=True))
if rank == 1:
    def fail(grad):
        raise RuntimeError("rank 1 fails in backward on purpose")
    # The bias: with gradient accumulation fusion (the default) the weight's gradient goes into
    # main_grad inside the Linear's backward and never reaches a hook on the Parameter.
    module[0].bias.register_hook(fail)
model(torch.ones(4, 16)).sum().backward()
model.finish_grad_sync()
print(f"rank {rank} finished the grad sync", flush=True)
