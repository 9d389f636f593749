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
forward under ``torch.no_grad`` builds no graph and reports nothing. The token, the forward
replacement and the accumulation are gradient accumulation fusion's (``grad_fusion.py``).

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
               dtype: torch.dtype) -> torch.Tensor:
    """Param ``index``'s MXFP8 values in one orientation ('row' or 'col'), as a new [M, N] tensor."""
    out = torch.empty(shape, dtype=dtype)
    cpp.dequantize_param(index, axis, out)
    return out


def stand_in(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """What the torch Parameter of an MXFP8 weight holds: one NaN broadcast to its shape."""
    return torch.full((1,) * len(shape), float("nan"), dtype=dtype).expand(shape)


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


class _Mxfp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with W [out, in] read from MXFP8 storage (row-wise forward, column-wise dgrad)."""

    @staticmethod
    def forward(ctx, x, ready_token, bias, cpp, index, linear):
        # The module is passed, not its weight: a tensor argument would be an autograd input, and
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


class _Mxfp8Conv1DFunction(torch.autograd.Function):
    """HF's Conv1D, y = b + x W with W [in, out] read from MXFP8 storage (column-wise forward,
    row-wise dgrad)."""

    @staticmethod
    def forward(ctx, x, ready_token, bias, cpp, index, conv):
        weight = conv.weight
        in_features, out_features = weight.shape
        w_col = dequantize(cpp, index, "col", weight.shape, weight.dtype)  # [in, out]
        xs = x.reshape(-1, in_features)  # [tokens, in]
        y = torch.mm(xs, w_col) if bias is None else torch.addmm(bias, xs, w_col)
        ctx.save_for_backward(x)
        ctx.cpp, ctx.index, ctx.weight = cpp, index, weight
        ctx.has_bias = bias is not None
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        in_features, out_features = weight.shape
        dy = grad_y.reshape(-1, out_features)  # [tokens, out]
        grad_x = None
        if ctx.needs_input_grad[0]:
            w_row = dequantize(ctx.cpp, ctx.index, "row", weight.shape, weight.dtype)  # [in, out]
            grad_x = dy.mm(w_row.t()).view(x.shape)
        # main_grad: [in, out], F32 or the params' dtype (FSDP: transient)
        grad_fusion.accumulate_product_(ctx.cpp.main_grad(ctx.index), x.reshape(-1, in_features).t(), dy)
        grad_bias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_fusion.token_grad(), grad_bias, None, None, None


def install(module: torch.nn.Module, cpp: "_C.DataParallel", index: int,
            ready_token: torch.Tensor) -> Callable:
    """Replaces the forward of ``module`` (a plain nn.Linear or HF Conv1D owning MXFP8 param
    ``index``; an instance attribute over the class's method) with its MXFP8 Function; returns it.
    ``grad_fusion.restore_forward`` restores the class's forward."""
    # The argument names are the classes' own (Linear: input, Conv1D: x), so a call by keyword works.
    kind = weight_kind(module.weight, [module])
    if kind == "linear":
        def forward(input: torch.Tensor) -> torch.Tensor:  # noqa: A002
            return _Mxfp8LinearFunction.apply(input, ready_token, module.bias, cpp, index, module)
    elif kind == "conv1d":
        def forward(x: torch.Tensor) -> torch.Tensor:
            return _Mxfp8Conv1DFunction.apply(x, ready_token, module.bias, cpp, index, module)
    else:
        raise TypeError(f"{type(module).__name__} does not read MXFP8 weights")
    return grad_fusion.replace_forward(module, forward)
