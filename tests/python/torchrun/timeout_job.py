"""A peer that never comes, under torchrun (run_torchrun.sh timeout): with mxt.init(timeout_s=3),
rank 0's all-reduce fails after about 3 s with an mxddp Error that carries gloo's timeout message,
while rank 1 sleeps; rank 0 reports it and exits, and rank 1's late collective fails too."""
import sys
import time

import torch

import mxddp.torch as mxt
from mxddp import _C

rank, world = mxt.init(timeout_s=3)
if rank == 1:
    time.sleep(10)
t0 = time.monotonic()
try:
    mxt.all_reduce(torch.ones(4))
except _C.Error as e:
    print(f"rank {rank} failed after {time.monotonic() - t0:.1f} s: {e}", flush=True)
    sys.exit(0)
print(f"rank {rank}: the all-reduce completed", flush=True)
sys.exit(1)
