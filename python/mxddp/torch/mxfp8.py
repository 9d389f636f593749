"""MXFP8 ``nn.Linear`` weights (``fp8_param_gather``): the Linear's forward replaced by an autograd
Function that reads the weight from mxddp's MXFP8 storage.

With ``fp8_param_gather`` the C++ DDP keeps each marked weight only as MXFP8, row-wise (1x32
blocks) and column-wise (32x1 blocks), quantized from the gathered BF16 after every param
all-gather; there is no BF16 copy of it anywhere. The Function dequantizes (exactly, into a
transient BF16 [out, in] tensor) the row-wise copy for the forward product ``y = x W^T + b`` and
the column-wise copy for backward's data gradient ``dx = dy W``, as the C++ GPT does. The weight
gradient ``dW = dy^T x`` is accumulated straight into ``main_grad`` (in F32 when the grad buffer
is F32, as TransformerEngine's fused wgrad accumulation) and the param is reported ready.

Reporting ready once per backward, however many times the Linear ran: each MXFP8 param has a
0-dim leaf tensor (its *ready token*) that every use of the weight takes as an input. Autograd
sums the token's gradient over all uses and runs its AccumulateGrad once, after every use's
backward has added its dW; the token's post-accumulate-grad hook then calls ``grad_ready``. A
forward under ``torch.no_grad`` builds no graph and reports nothing. The token, the forward
replacement and the accumulation are gradient accumulation fusion's (``grad_fusion.py``).

The torch Parameter of an MXFP8 weight keeps its shape, dtype and device, but its values are a
single NaN broadcast to [out, in] (2 bytes): code that reads the weight outside the Linear's
forward sees NaN instead of silently stale numbers, and a gradient reaching the Parameter itself
is an error (see ``DistributedDataParallel``). ``DistributedDataParallel.dequantized_param`` gives
the values.
"""
from __future__ import annotations

from typing import Callable

import torch

from mxddp import _C
from mxddp.torch import grad_fusion


def dequantize(cpp: "_C.DataParallel", index: int, axis: str, shape: torch.Size,
               dtype: torch.dtype) -> torch.Tensor:
    """Param ``index``'s MXFP8 values in one orientation ('row' or 'col'), as a new [M, N] tensor."""
    out = torch.empty(shape, dtype=dtype)
    cpp.dequantize_param(index, axis, out)
    return out


def stand_in(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """What the torch Parameter of an MXFP8 weight holds: one NaN broadcast to its shape."""
    return torch.full((1,) * len(shape), float("nan"), dtype=dtype).expand(shape)


class _Mxfp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with W read from MXFP8 storage (row-wise forward, column-wise dgrad)."""

    @staticmethod
    def forward(ctx, x, ready_token, bias, cpp, index, linear):
        # The Linear is passed, not its weight: a tensor argument would be an autograd input, and
        # the weight must stay out of the graph (its ready token stands in for it).
        weight = linear.weight
        w_row = dequantize(cpp, index, "row", weight.shape, weight.dtype)  # [out, in]
        y = torch.nn.functional.linear(x, w_row, bias)
        ctx.save_for_backward(x)
        ctx.cpp, ctx.index, ctx.weight = cpp, index, weight
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        out_features, in_features = weight.shape
        grad_x = None
        if ctx.needs_input_grad[0]:
            w_col = dequantize(ctx.cpp, ctx.index, "col", weight.shape, weight.dtype)  # [out, in]
            grad_x = grad_y.matmul(w_col)
        dy = grad_y.reshape(-1, out_features)  # [tokens, out]
        xs = x.reshape(-1, in_features)        # [tokens, in]
        # main_grad: [out, in], F32 or the params' dtype (FSDP: transient)
        grad_fusion.accumulate_product_(ctx.cpp.main_grad(ctx.index), dy.t(), xs)
        grad_bias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_fusion.token_grad(), grad_bias, None, None, None


def install(linear: torch.nn.Linear, cpp: "_C.DataParallel", index: int,
            ready_token: torch.Tensor) -> Callable:
    """Replaces ``linear.forward`` (an instance attribute over the class's method) with the MXFP8
    Function; returns it. ``grad_fusion.restore_forward`` restores the class's forward."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _Mxfp8LinearFunction.apply(x, ready_token, linear.bias, cpp, index, linear)

    return grad_fusion.replace_forward(linear, forward)


def is_linear_weight(param: torch.nn.Parameter, owners: list[torch.nn.Module]) -> bool:
    """Only a plain nn.Linear's weight, owned by plain nn.Linear modules only: a subclass (such as
    nn.MultiheadAttention's out_proj) or another owner (a tied nn.Embedding) may read the weight
    outside Linear.forward, which the Function replaces."""
    return bool(owners) and all(type(m) is torch.nn.Linear and m.weight is param for m in owners)
