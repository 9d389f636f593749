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
import torch
import torch.distributed as dist

from mxddp.torch.config import (AdamOptimizerConfig, DistributedDataParallelConfig, OptimizerConfig,
                                SGDOptimizerConfig)
from mxddp.torch.ddp import DistributedDataParallel
from mxddp.torch.fsdp import FullyShardedDataParallel
from mxddp.torch.launch import init, is_initialized, rank, shutdown, world_size
from mxddp.torch.optimizer import DistributedOptimizer, SkippedStepWarning
from mxddp.torch.plan import MemoryPlan, plan
from mxddp.torch.checkpoint import load_checkpoint, save_checkpoint
from mxddp.torch.megatron import get_megatron_optimizer
from mxddp.torch import dcp, torch_clip, torch_grads
from mxddp import _C

torch_clip.install()  # torch.nn.utils.clip_grad_norm_ sees mxddp's gradients (torch_clip.py)
torch_grads.install()  # a torch optimizer that would step no gradient of a mxddp model is refused (torch_grads.py)


def memory_usage(place: str | None = None) -> dict[str, tuple[int, int]]:
    """This rank's bytes held by mxddp per category: {name: (live_bytes, peak_bytes)}. place: None
    for every place together, "host" or "device" for one (each place's peak is its own)."""
    return _C.memory_usage(place)


def _comm(process_group):
    from mxddp.torch.process_group import communicator_for
    return None if process_group is None else communicator_for(process_group)


_COLLECTIVE_DTYPES = ("float32", "bfloat16", "float64", "int64", "int32", "uint8", "bool")


def _collective_tensor(tensor, what: str):
    """The tensor, checked before the binding sees it: nanobind would hand a non-contiguous one over
    as a contiguous copy, and the collective's result would land in that copy."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: tensor must be a torch.Tensor; got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what}: the tensor is on {tensor.device}; valid: a CPU tensor (torch.distributed's "
                         "collectives take device tensors)")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: the tensor is not contiguous (shape {list(tensor.shape)}, strides "
                         f"{list(tensor.stride())}), as torch.distributed's collectives refuse; valid: a contiguous "
                         "tensor (t.contiguous(), then copy the result back)")
    if str(tensor.dtype).removeprefix("torch.") not in _COLLECTIVE_DTYPES:
        raise TypeError(f"{what}: dtype {tensor.dtype} is not taken; valid: "
                        + ", ".join(f"torch.{d}" for d in _COLLECTIVE_DTYPES))
    return tensor


def _reduce_op(op, dtype) -> str:
    """op as the binding's name: "sum", "avg", "max", or torch.distributed.ReduceOp's SUM, AVG, MAX."""
    name = op if isinstance(op, str) else None
    if name is None and dist.is_available():
        name = next((n for n in ("sum", "avg", "max") if op == getattr(dist.ReduceOp, n.upper())), None)
    if name not in ("sum", "avg", "max"):
        raise ValueError(f"all_reduce: op={op!r} is not taken; valid: 'sum', 'avg', 'max' (or "
                         "torch.distributed.ReduceOp.SUM, AVG, MAX)")
    if name == "avg" and not dtype.is_floating_point:
        raise ValueError(f"all_reduce: op 'avg' is for floating-point tensors; this one is {dtype} (torch refuses "
                         "it too); sum, then divide")
    return name


def all_reduce(tensor, op="sum", process_group=None) -> None:
    """In place across every rank (of process_group, a torch.distributed group; None: the world): a
    contiguous CPU tensor of float32, bfloat16, float64, int64, int32, uint8 or bool. op: sum, avg or
    max (or torch.distributed.ReduceOp's). avg is for floats only (torch refuses it for integers too);
    integer sums wrap; bool's sum and max are a logical or (a flag set on any rank)."""
    _collective_tensor(tensor, "all_reduce")
    _C.all_reduce(tensor, _reduce_op(op, tensor.dtype), _comm(process_group))


def broadcast(tensor, root: int = 0, process_group=None) -> None:
    """In place from root (its rank in process_group) to every rank: a contiguous CPU tensor of any
    dtype all_reduce takes."""
    _C.broadcast(_collective_tensor(tensor, "broadcast"), root, _comm(process_group))


__all__ = ["init", "is_initialized", "rank", "world_size", "shutdown", "DistributedDataParallelConfig",
           "DistributedDataParallel", "OptimizerConfig", "DistributedOptimizer", "memory_usage", "all_reduce",
           "broadcast", "save_checkpoint", "load_checkpoint"]
__all__ += ["plan", "MemoryPlan", "FullyShardedDataParallel", "SkippedStepWarning"]
__all__ += ["AdamOptimizerConfig", "SGDOptimizerConfig", "get_megatron_optimizer", "dcp"]
