"""mxddp for PyTorch modules, with Megatron-core's API::

    import mxddp.torch as mxt
    rank, world = mxt.init()                      # under `mpirun -np N python script.py`
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-3))
    mxt.save_checkpoint("ckpt", model, opt, iteration)     # mxddp train's history layout
    iteration, metadata = mxt.load_checkpoint("ckpt", model, opt)

See docs/python.md for what is supported and what is not yet.
"""
from mxddp.torch.config import DistributedDataParallelConfig, OptimizerConfig
from mxddp.torch.ddp import DistributedDataParallel
from mxddp.torch.fsdp import FullyShardedDataParallel
from mxddp.torch.launch import init, is_initialized, rank, shutdown, world_size
from mxddp.torch.optimizer import DistributedOptimizer, SkippedStepWarning
from mxddp.torch.plan import MemoryPlan, plan
from mxddp.torch.checkpoint import load_checkpoint, save_checkpoint
from mxddp import _C


def memory_usage() -> dict[str, tuple[int, int]]:
    """This rank's bytes held by mxddp per category: {name: (live_bytes, peak_bytes)}."""
    return _C.memory_usage()


def all_reduce(tensor, op: str = "sum") -> None:
    """In place across every rank: a contiguous CPU float32 or bfloat16 tensor; op sum, avg or max."""
    _C.all_reduce(tensor, op)


def broadcast(tensor, root: int = 0) -> None:
    """In place from root to every rank: a contiguous CPU float32 or bfloat16 tensor."""
    _C.broadcast(tensor, root)


__all__ = ["init", "is_initialized", "rank", "world_size", "shutdown", "DistributedDataParallelConfig",
           "DistributedDataParallel", "OptimizerConfig", "DistributedOptimizer", "memory_usage", "all_reduce",
           "broadcast", "save_checkpoint", "load_checkpoint"]
__all__ += ["plan", "MemoryPlan", "FullyShardedDataParallel", "SkippedStepWarning"]
