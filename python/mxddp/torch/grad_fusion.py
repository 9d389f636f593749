"""Gradient accumulation fusion (Megatron's ``TransformerConfig.gradient_accumulation_fusion``): the
weight gradient of ``nn.Linear``, HF ``Conv1D`` and ``nn.Embedding`` is accumulated straight into
the param's ``main_grad`` (a view of mxddp's grad buffer) by the module's own backward, so no dW
tensor is ever allocated and no separate add pass runs.

The module's ``forward`` is replaced (an instance attribute over the class's method) by an autograd
Function that takes the module, not its weight: a tensor argument would be an autograd input, and
the weight must stay out of the graph. Backward then adds ``dy^T x`` (Linear), ``x^T dy`` (Conv1D)
or the rows of ``dy`` at the looked-up ids (Embedding) into ``main_grad``.

Reporting a param ready once per backward, however many modules and calls use it: each fused param
has a 0-dim leaf tensor (its *ready token*) that every use takes as an input. Autograd sums the
token's gradient over all uses and runs its AccumulateGrad once, after every use's backward has
added its part; the wrapper's hook on the token then reports the param (ddp.py; with a multi-grad
hook that also waits for the Parameter's own gradient where code reads the weight outside these
modules). A forward under ``torch.no_grad`` builds no graph and reports nothing. The MXFP8 Linear and
Conv1D weights (``mxfp8.py``) use the same token, Functions and accumulation, with a weight reader
that dequantizes.

A param is fused only when every module that owns it is one of these kinds with the plain class
(a subclass may read its weight outside forward), so a tied embedding / LM head is fused through
both its ``nn.Embedding`` and its ``nn.Linear``; anything else keeps the post-accumulate-grad hook.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mxddp import _C


# param -> the ids of the gradient hooks mxddp itself put on it (register_ready_hooks): any other
# is the user's.
_OWN_HOOK_IDS = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise


def has_user_grad_hooks(param: torch.Tensor) -> bool:
    """Whether ``param`` has a gradient hook that is not mxddp's: ``register_hook`` (a tensor hook, run
    on the gradient before it is accumulated) or ``register_post_accumulate_grad_hook``. A fused
    weight's dW goes into main_grad without passing through either. (Each fused forward asks: no list
    is built.)"""
    own = _OWN_HOOK_IDS.get(param, ())
    return any(key not in own for hooks in (param._backward_hooks, getattr(param, "_post_accumulate_grad_hooks", None))
               if hooks for key in hooks)


def param_owners(module: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """id(param) -> the modules that own it directly (recurse=False), over the whole tree."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(sub)
    return owners


def new_ready_token(device: torch.device) -> torch.Tensor:
    """A param's ready token: a 0-dim leaf on the param's device every use of the param takes as an
    input. On the param's device, so that autograd runs the token's hooks on the same thread as the
    param's other backward work (it queues each node by its gradient's device: a CPU token of a GPU
    param would report it from another thread than the one running the rest of the backward)."""
    return torch.zeros((), device=device, requires_grad=True)


def token_grad(like: torch.Tensor) -> torch.Tensor:
    """The gradient a use returns for the token (on the device of ``like``, the use's output
    gradient): it only carries "this use is done". A fresh tensor each time: autograd may keep it
    as the token's .grad and accumulate the next use's into it."""
    return torch.zeros((), dtype=torch.float32, device=like.device)


def register_ready_hooks(token: torch.Tensor, param: torch.nn.Parameter, main_grad: Callable[[], torch.Tensor],
                         report: Callable[[], None]) -> list:
    """A fused param is ready once every use in this backward has added its dW into main_grad: the
    fused modules' uses through its ready ``token``, and a read of the weight anywhere else in the
    graph (``x @ lin.weight.t()``, a tied table read by hand) through the Parameter's own gradient,
    which is added into ``main_grad()`` as the hook path adds it. register_multi_grad_hook (mode
    "all") waits for both where both take part in this backward and for the one that does
    otherwise, then ``report()`` runs, once either way. Returns the hook handles."""

    def ready(grads) -> None:
        direct = grads[1]
        if direct is not None:
            main_grad().add_(direct)
        report()

    def drop_grad(leaf: torch.Tensor) -> None:
        # Autograd stores the gradient after the multi-grad hook ran: the token's carries nothing,
        # the Parameter's is in main_grad by then.
        leaf.grad = None

    handles = [torch.autograd.graph.register_multi_grad_hook((token, param), ready, mode="all"),
               token.register_post_accumulate_grad_hook(drop_grad),
               param.register_post_accumulate_grad_hook(drop_grad)]
    own_hooks(param, list(handles[0].handles) + [handles[2]])
    return handles


def own_hooks(param: torch.nn.Parameter, handles: list) -> None:
    """Records hooks on ``param`` as mxddp's, which ``has_user_grad_hooks`` does not count."""
    _OWN_HOOK_IDS[param] = set(_OWN_HOOK_IDS.get(param, ())) | {h.id for h in handles}


def accumulate_product_(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        compute_dtype: Optional[torch.dtype] = None) -> None:
    """main_grad += a @ b. Without autocast (``compute_dtype`` None): in one GEMM (beta 1) in
    main_grad's dtype (the operands are cast when they differ, as TransformerEngine's fused wgrad
    into an F32 main_grad). Under autocast: the product in the autocast dtype, rounded to it, then
    added into main_grad: the gradient torch's own module computes there (its weight's autocast
    copy gets the low-precision dW, which the cast's backward widens into the weight's grad)."""
    if compute_dtype is not None:
        main_grad.add_(torch.mm(a.to(compute_dtype), b.to(compute_dtype)))
        return
    if a.dtype != main_grad.dtype or b.dtype != main_grad.dtype:
        a, b = a.to(main_grad.dtype), b.to(main_grad.dtype)
    main_grad.addmm_(a, b)


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype torch.autocast computes a GEMM on ``x`` in, where autocast is on for its device and
    ``x`` is a floating tensor it would cast (not float64, which autocast leaves); None otherwise."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(device)


def _cast(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    return t if t is None or dtype is None else t.to(dtype)


def replace_forward(module: torch.nn.Module, forward: Callable) -> Callable:
    """Sets ``module.forward`` (an instance attribute: Module.__call__ and its hooks still run); a
    copy of the module leaves it out (module_copies.py)."""
    module.forward = forward
    return forward


def restore_forward(module: torch.nn.Module) -> None:
    """Gives the module its class's forward back."""
    if "forward" in vars(module):
        del module.forward


def _hf_conv1d_type() -> Optional[type]:
    # Without transformers imported there is no Conv1D to find, and importing it here would cost
    # seconds for nothing.
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None)


def fusable_kind(module: torch.nn.Module, param: torch.nn.Parameter) -> Optional[str]:
    """'linear', 'conv1d' or 'embedding' when ``param`` is the weight of that plain module and its
    backward can be fused; None otherwise."""
    if getattr(module, "weight", None) is not param:
        return None
    kind = type(module)
    if kind is torch.nn.Linear:
        return "linear"
    conv1d = _hf_conv1d_type()
    if conv1d is not None and kind is conv1d:
        return "conv1d"
    if kind is torch.nn.Embedding:
        # These change the gradient (padding row, frequency scaling), sparsity its layout, and
        # max_norm rewrites the weight in place in forward: torch's own path for those.
        plain = (module.padding_idx is None and module.max_norm is None and not module.scale_grad_by_freq
                 and not module.sparse)
        return "embedding" if plain else None
    return None


def is_fusable(param: torch.nn.Parameter, owners: list[torch.nn.Module], main_grad_dtype: torch.dtype) -> bool:
    """Whether every module owning ``param`` fuses its weight gradient (and some module does). With
    main_grad in another dtype than the param (BF16 params, F32 grad buffer) only embeddings are:
    the GEMMs would need dy and x cast to F32 first, which costs more than BF16's dW and the hook's
    add, while the embedding's row scatter still beats torch's dense [num, dim] gradient
    (bench/grad_fusion_kernels.py, docs/python.md). A param with gradient hooks of the user's keeps
    the hook path, where they run as torch runs them."""
    if has_user_grad_hooks(param):
        return False
    kinds = [fusable_kind(m, param) for m in owners]
    if not kinds or None in kinds:
        return False
    return main_grad_dtype == param.dtype or all(k == "embedding" for k in kinds)


# What a fused Function reads the weight through: ("forward" or "dgrad") -> the weight in its module's
# layout. Gradient accumulation fusion reads the param itself for both; an MXFP8 weight dequantizes
# the copy each product reduces along (mxfp8.py).
WeightReader = Callable[[str], torch.Tensor]


def param_reader(module: torch.nn.Module) -> WeightReader:
    """The module's own weight, for both products (outside autograd: the Function stands in for it)."""
    return lambda _product: module.weight.detach()


class _FusedLinear(torch.autograd.Function):
    """y = x W^T + b with W [out, in]; backward adds dW = dy^T x into main_grad. Under autocast,
    x, W and b are cast to the autocast dtype as torch's Linear has them cast, the products run
    in it, and each input's gradient is returned in that input's own dtype."""

    @staticmethod
    def forward(ctx, x, ready_token, bias, cpp, index, read_weight):
        # The weight comes through read_weight, not as an argument: a tensor argument would be an
        # autograd input, and the weight must stay out of the graph (its ready token stands in).
        dtype = autocast_dtype(x)
        xc = _cast(x, dtype)
        ctx.save_for_backward(xc)
        ctx.cpp, ctx.index, ctx.read_weight, ctx.dtype, ctx.x_dtype = cpp, index, read_weight, dtype, x.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return torch.nn.functional.linear(xc, _cast(read_weight("forward"), dtype), _cast(bias, dtype))

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        out_features, in_features = grad_y.shape[-1], x.shape[-1]
        grad_y = _cast(grad_y, ctx.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_y.matmul(_cast(ctx.read_weight("dgrad"), ctx.dtype)).to(ctx.x_dtype)
        dy = grad_y.reshape(-1, out_features)  # [tokens, out]
        if ctx.needs_input_grad[1]:  # the weight trains (install's token())
            main_grad = ctx.cpp.main_grad(ctx.index)  # [out, in], F32 or the params' dtype (FSDP: transient)
            accumulate_product_(main_grad, dy.t(), x.reshape(-1, in_features), ctx.dtype)
        grad_bias = dy.sum(0).to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, token_grad(grad_y), grad_bias, None, None, None


class _FusedConv1D(torch.autograd.Function):
    """HF's Conv1D: y = b + x W with W [in, out]; backward adds dW = x^T dy into main_grad. Under
    autocast as _FusedLinear (HF's addmm is cast by autocast the same way)."""

    @staticmethod
    def forward(ctx, x, ready_token, bias, cpp, index, read_weight):
        dtype = autocast_dtype(x)
        weight = _cast(read_weight("forward"), dtype)  # [in, out]
        xs = _cast(x, dtype).reshape(-1, x.shape[-1])  # [tokens, in]
        y = torch.mm(xs, weight) if bias is None else torch.addmm(_cast(bias, dtype), xs, weight)
        ctx.save_for_backward(_cast(x, dtype))
        ctx.cpp, ctx.index, ctx.read_weight, ctx.dtype, ctx.x_dtype = cpp, index, read_weight, dtype, x.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], weight.shape[1])

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        in_features, out_features = x.shape[-1], grad_y.shape[-1]
        dy = _cast(grad_y, ctx.dtype).reshape(-1, out_features)  # [tokens, out]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = dy.mm(_cast(ctx.read_weight("dgrad"), ctx.dtype).t()).view(x.shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # the weight trains (install's token())
            main_grad = ctx.cpp.main_grad(ctx.index)  # [in, out], F32 or the params' dtype (FSDP: transient)
            accumulate_product_(main_grad, x.reshape(-1, in_features).t(), dy, ctx.dtype)
        grad_bias = dy.sum(0).to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, token_grad(grad_y), grad_bias, None, None, None


class _FusedEmbedding(torch.autograd.Function):
    """y = W[ids]; backward adds the rows of dy into main_grad at ids (no dense [num, dim] dW)."""

    @staticmethod
    def forward(ctx, ids, ready_token, cpp, index, embedding):
        weight = embedding.weight.detach()  # [num_embeddings, embedding_dim]
        ctx.save_for_backward(ids)
        ctx.cpp, ctx.index = cpp, index
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_y):
        (ids,) = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            main_grad = ctx.cpp.main_grad(ctx.index)
            rows = grad_y.reshape(-1, main_grad.shape[1])  # [tokens, dim]
            main_grad.index_add_(0, ids.reshape(-1), rows.to(main_grad.dtype))
        return None, token_grad(grad_y), None, None, None


def install(module: torch.nn.Module, cpp: "_C.DataParallel", index: int, ready_token: torch.Tensor,
            read_weight: Optional[WeightReader] = None) -> Callable:
    """Replaces the forward of ``module`` (a fusable owner of param ``index``) with its fused
    Function, reading the weight through ``read_weight`` (default: the param itself; Linear and
    Conv1D only); ``restore_forward`` undoes it."""
    # The argument names are the classes' own (Linear and Embedding: input, Conv1D: x), so a call
    # by keyword still works.
    param = module.weight
    kind = fusable_kind(module, param)
    read = param_reader(module) if read_weight is None else read_weight
    plain_forward = type(module).forward

    def run(x: torch.Tensor, fused: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        # torch's own forward where the weight is no longer this param (torch.func.functional_call
        # swaps in other tensors, or the user assigned a new one). A frozen weight
        # (requires_grad_(False) mid-run) gets a token outside the graph: its Function adds no dW
        # and nothing reports it, as torch computes no gradient for it.
        if module.weight is not param:
            return plain_forward(module, x)
        # (An MXFP8 weight's Parameter carries mxddp's own guard instead; the wrap refused the user's.)
        if read_weight is None and param.requires_grad and has_user_grad_hooks(param):
            raise RuntimeError(
                f"{type(module).__name__}.weight got a gradient hook (register_hook or "
                "register_post_accumulate_grad_hook) after wrapping: with gradient accumulation fusion its dW goes "
                "into main_grad without passing through the hook. Register it before wrapping (the param then "
                "keeps the hook path), set param.gradient_accumulation_fusion = False before wrapping, or pass "
                "gradient_accumulation_fusion=False")
        return fused(ready_token if param.requires_grad else ready_token.detach())

    if kind == "linear":
        def forward(input: torch.Tensor) -> torch.Tensor:  # noqa: A002
            return run(input, lambda t: _FusedLinear.apply(input, t, module.bias, cpp, index, read))
    elif kind == "conv1d":
        def forward(x: torch.Tensor) -> torch.Tensor:
            return run(x, lambda t: _FusedConv1D.apply(x, t, module.bias, cpp, index, read))
    elif kind == "embedding" and read_weight is None:
        def forward(input: torch.Tensor) -> torch.Tensor:  # noqa: A002
            return run(input, lambda t: _FusedEmbedding.apply(input, t, cpp, index, module))
    else:
        raise TypeError(f"{type(module).__name__} does not fuse its weight gradient"
                        + (" read through a reader" if read_weight is not None else ""))
    return replace_forward(module, forward)
