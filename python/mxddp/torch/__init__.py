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
from mxddp.torch.config import (AdamOptimizerConfig, DistributedDataParallelConfig, OptimizerConfig,
                                SGDOptimizerConfig)
from mxddp.torch.ddp import DistributedDataParallel
from mxddp.torch.fsdp import FullyShardedDataParallel
from mxddp.torch.launch import init, is_initialized, rank, shutdown, world_size
from mxddp.torch.optimizer import DistributedOptimizer, SkippedStepWarning
from mxddp.torch.plan import MemoryPlan, plan
from mxddp.torch.checkpoint import load_checkpoint, save_checkpoint
from mxddp.torch.megatron import get_megatron_optimizer
from mxddp.torch import dcp
from mxddp import _C


def memory_usage(place: str | None = None) -> dict[str, tuple[int, int]]:
    """This rank's bytes held by mxddp per category: {name: (live_bytes, peak_bytes)}. place: None
    for every place together, "host" or "device" for one (each place's peak is its own)."""
    return _C.memory_usage(place)


def _comm(process_group):
    from mxddp.torch.process_group import communicator_for
    return None if process_group is None else communicator_for(process_group)


def all_reduce(tensor, op: str = "sum", process_group=None) -> None:
    """In place across every rank (of process_group, a torch.distributed group; None: the world): a
    contiguous CPU tensor of float32, bfloat16, float64, int64, int32, uint8 or bool. op: sum, avg or
    max. avg is for floats only (torch refuses it for integers too); integer sums wrap; bool's sum and
    max are a logical or (a flag set on any rank)."""
    _C.all_reduce(tensor, op, _comm(process_group))


def broadcast(tensor, root: int = 0, process_group=None) -> None:
    """In place from root (its rank in process_group) to every rank: a contiguous CPU tensor of any
    dtype all_reduce takes."""
    _C.broadcast(tensor, root, _comm(process_group))


__all__ = ["init", "is_initialized", "rank", "world_size", "shutdown", "DistributedDataParallelConfig",
           "DistributedDataParallel", "OptimizerConfig", "DistributedOptimizer", "memory_usage", "all_reduce",
           "broadcast", "save_checkpoint", "load_checkpoint"]
__all__ += ["plan", "MemoryPlan", "FullyShardedDataParallel", "SkippedStepWarning"]
__all__ += ["AdamOptimizerConfig", "SGDOptimizerConfig", "get_megatron_optimizer", "dcp"]
