"""MXFP8 weights of ``nn.Linear`` and HF ``Conv1D`` modules (``fp8_param_gather``): the module's
forward replaced by an autograd Function that reads the weight from mxddp's MXFP8 storage.

With ``fp8_param_gather`` the C++ DDP keeps each marked weight only as MXFP8, row-wise (1x32
blocks along its last dimension) and column-wise (32x1 blocks along its first), quantized from the
gathered BF16 after every param all-gather; there is no BF16 copy of it anywhere. Each product
reads the copy whose blocks run along its reduction dimension, as the C++ GPT and
TransformerEngine do, dequantized exactly into a transient BF16 tensor of the weight's shape:

- ``nn.Linear``, W [out, in]: the forward ``y = x W^T + b`` reduces over ``in`` (row-wise), the
  data gradient ``dx = dy W`` over ``out`` (column-wise);
- HF ``Conv1D`` (GPT-2's attention and MLP), W [in, out]: the forward ``y = b + x W`` reduces over
  ``in`` (column-wise), ``dx = dy W^T`` over ``out`` (row-wise).

The weight gradient (``dy^T x``, ``x^T dy``) is accumulated straight into ``main_grad`` (in F32 when
the grad buffer is F32, as TransformerEngine's fused wgrad accumulation) and the param is reported
ready.

Reporting ready once per backward, however many times the module ran: each MXFP8 param has a
0-dim leaf tensor (its *ready token*) that every use of the weight takes as an input. Autograd
sums the token's gradient over all uses and runs its AccumulateGrad once, after every use's
backward has added its dW; the token's post-accumulate-grad hook then calls ``grad_ready``. A
forward under ``torch.no_grad`` builds no graph and reports nothing. The Functions, the token, the
forward replacement and the accumulation are gradient accumulation fusion's (``grad_fusion.py``),
with a weight reader (``reader``) that dequantizes instead of reading the param.

The torch Parameter of an MXFP8 weight keeps its shape, dtype and device, but its values are a
single NaN broadcast to its shape (2 bytes): code that reads the weight outside the module's
forward sees NaN instead of silently stale numbers, and a gradient reaching the Parameter itself
is an error (see ``DistributedDataParallel``). ``DistributedDataParallel.dequantized_param`` gives
the values.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from mxddp import _C
from mxddp.torch import grad_fusion


def dequantize(cpp: "_C.DataParallel", index: int, axis: str, shape: torch.Size,
               dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Param ``index``'s MXFP8 values in one orientation ('row' or 'col'), as a new [M, N] tensor on
    the param's device (on a GPU, written on torch's current stream)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    cpp.dequantize_param(index, axis, out, stream)
    return out


def stand_in(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What the torch Parameter of an MXFP8 weight holds: one NaN on its device broadcast to its shape."""
    return torch.full((1,) * len(shape), float("nan"), dtype=dtype, device=device).expand(shape)


KINDS = {"linear": "nn.Linear", "conv1d": "Conv1D"}  # what fp8_param_gather keeps as MXFP8


def weight_kind(param: torch.nn.Parameter, owners: list[torch.nn.Module]) -> Optional[str]:
    """'linear' or 'conv1d' when ``param`` is the weight of plain modules of that one kind only;
    None otherwise. A subclass (such as nn.MultiheadAttention's out_proj) or another owner (a tied
    nn.Embedding) may read the weight outside the forward that the Function replaces."""
    kinds = {grad_fusion.fusable_kind(m, param) for m in owners}
    return kinds.pop() if len(kinds) == 1 and kinds <= set(KINDS) else None


def forward_axis(kind: str) -> str:
    """The MXFP8 copy the forward product reads (blocks along ``in``): the values the model computes
    with, which a state dict or ``close()`` hands back."""
    return "row" if kind == "linear" else "col"


def reader(module: torch.nn.Module, kind: str, cpp: "_C.DataParallel", index: int) -> grad_fusion.WeightReader:
    """The weight of MXFP8 param ``index`` (the weight of ``module``, a plain module of ``kind``) for
    each product: the copy blocked along that product's reduction dimension, dequantized into a
    transient tensor of the weight's shape."""
    forward = forward_axis(kind)
    dgrad = "col" if forward == "row" else "row"
    shape, dtype, device = module.weight.shape, module.weight.dtype, module.weight.device
    return lambda product: dequantize(cpp, index, forward if product == "forward" else dgrad, shape, dtype, device)


def install(module: torch.nn.Module, cpp: "_C.DataParallel", index: int,
            ready_token: torch.Tensor) -> Callable:
    """Replaces the forward of ``module`` (a plain nn.Linear or HF Conv1D owning MXFP8 param
    ``index``; an instance attribute over the class's method) with gradient accumulation fusion's
    Function reading the MXFP8 copies; returns it. ``grad_fusion.restore_forward`` restores the
    class's forward."""
    kind = weight_kind(module.weight, [module])
    if kind is None:
        raise TypeError(f"{type(module).__name__} does not read MXFP8 weights")
    return grad_fusion.install(module, cpp, index, ready_token, reader(module, kind, cpp, index))
