"""torch DDP's ``param.grad`` on mxddp's ``DistributedDataParallel``, so that any torch optimizer
(Adagrad, RMSprop, HF's Adafactor, a third party's) steps a wrapped model as it steps a torch DDP.

mxddp keeps a gradient in ``main_grad`` (a view of its grad buffer) and frees ``param.grad`` in its
hook, so a torch optimizer the script did not hand to ``mxt.DistributedOptimizer`` found no
gradient, stepped nothing and said nothing. torch DDP, with ``gradient_as_bucket_view=True``, leaves
``.grad`` a view of its bucket after every backward. So here, where that view is a param's whole
synchronized gradient (torch's form, whose grads are all-reduced in the params' dtype, with no
``DistributedOptimizer`` open on the model):

- **Exposed.** At the end of each backward every param that has a gradient in torch's terms gets
  ``param.grad = param.main_grad`` (the same memory: nothing allocated): after a synchronized
  backward the params some rank used (every param without ``find_unused_parameters``), after a
  ``no_sync`` one those this rank used; and in either case those whose ``.grad`` the script kept
  (not set to None) from before. A script's in-place work on ``.grad`` (``GradScaler.unscale_``,
  ``clip_grad_norm_``, ``zero_grad(set_to_none=False)``) is work on ``main_grad``.
- **Taken back** before the next backward puts anything into ``main_grad``: at the first of its
  events, whichever comes first (a gradient reaching the wrapper's output, or any registered
  param, through a tensor hook that runs before torch accumulates into ``.grad``, or a fused
  module's backward asking for ``main_grad``: ``MainGrads``). A ``.grad`` set to None means that
  gradient was dropped, and its ``main_grad`` is zeroed (as torch's next backward starts it from
  nothing); a ``.grad`` still the view is kept, so the backward adds into it (torch's accumulation
  when nothing zeroes); any other tensor the script put there is copied in. ``.grad`` is then None
  through the backward, as mxddp's hooks need.

Where the gradients are not given to ``.grad`` (Megatron's form, FSDP, a ``DistributedOptimizer``
open), a torch optimizer whose step would find no gradient of a wrapped model's params there is
refused, saying why and what to use (``check_step``, a global torch step pre-hook
``import mxddp.torch`` installs), instead of stepping nothing.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mxddp.torch import torch_clip


def why_not_exposed(model) -> Optional[str]:
    """None where ``model``'s grads are given to ``.grad`` (see the module's docstring); else why not.
    torch's form always fits: its config all-reduces, in the params' dtype, with no MXFP8 weights."""
    if not hasattr(model, "_sync_at_backward_end"):
        return ("FullyShardedDataParallel keeps each param's gradient in its unit's grad buffer or a shard of it, "
                "which a torch optimizer cannot step")
    if not model._sync_at_backward_end:
        return ("this model was built in Megatron's form (a DistributedDataParallelConfig given), whose gradients live "
                "in main_grad only, as Megatron's; step it with mxt.DistributedOptimizer or mxt.get_megatron_optimizer")
    if model._open_optimizers():
        return ("a mxt.DistributedOptimizer is open on it, which reads the gradients from main_grad and steps the "
                "params itself")
    return None


def expose(model, synced: bool) -> None:
    """At the end of a backward: ``.grad`` is ``main_grad`` for every param that has a gradient in
    torch's terms (see the module's docstring). ``synced``: the backward synchronized the grads."""
    if why_not_exposed(model) is not None:
        return
    kept = model._torch_grads_kept
    unused = set(model._unused_params) if synced and model.find_unused_parameters else set()
    for i, p in enumerate(model._params):
        has_grad = (i not in unused) if synced else model._used[i]
        if has_grad or i in kept:
            view = p.main_grad
            p.grad = view
            model._torch_grads[i] = view


def take_back(model) -> None:
    """Before a backward adds anything: the exposed ``.grad``s go back into ``main_grad`` (see the
    module's docstring) and are set to None."""
    exposed, model._torch_grads = model._torch_grads, {}
    kept: set[int] = set()
    with torch.no_grad():
        dropped = [i for i, _ in exposed.items() if model._params[i].grad is None]
        if len(dropped) == len(model._params):
            model._cpp.grad_buffer().zero_()  # the usual zero_grad(): one pass, not one per param
        for i, view in exposed.items():
            p = model._params[i]
            g = p.grad
            if g is None:
                if len(dropped) != len(model._params):
                    p.main_grad.zero_()  # dropped: this backward starts it from nothing, as torch's
                model._used[i] = False
                continue
            if g is not view:
                p.main_grad.copy_(g)  # a tensor the script put there
            kept.add(i)
            p.grad = None
    model._torch_grads_kept = kept


def take_back_hook(model):
    """A tensor hook for each registered param: it runs when the param's gradient arrives, before
    torch accumulates it into ``.grad``, so the take-back comes first. Holds the model weakly (a
    hook on a tensor: wrapper.py, "Lifetime")."""
    live = weakref.ref(model)

    def hook(grad: torch.Tensor) -> None:
        owner = live()
        if owner is not None and owner._torch_grads:
            take_back(owner)

    return hook


class MainGrads:
    """What the fused modules' backward asks for a param's ``main_grad`` (grad_fusion.py, in place
    of the C++ DDP): the C++ DDP's, after the take-back, since they add into it directly."""

    def __init__(self, model):
        self._model = weakref.ref(model)
        self._cpp = model._cpp

    def main_grad(self, index: int) -> torch.Tensor:
        model = self._model()
        if model is not None and model._torch_grads:
            take_back(model)
        return self._cpp.main_grad(index)


def keep_own(p: torch.nn.Parameter) -> None:
    """At close() (or when a dropped wrapper is collected): ``p.grad`` in storage of its own where it
    views mxddp's grad buffer (``main_grad``'s storage), so it outlives the buffer, as a param's
    gradient outlives torch DDP."""
    main_grad, g = vars(p).get("main_grad"), p.grad
    if main_grad is not None and g is not None and \
            g.untyped_storage().data_ptr() == main_grad.untyped_storage().data_ptr():
        g.data = g.data.clone()  # the same tensor object: a reference the script holds stays valid


def check_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    """torch's global optimizer step pre-hook: a step of any optimizer but mxddp's own over the params
    of an open mxddp model whose gradients are not in ``.grad`` is refused, naming why."""
    if not torch_clip.any_held():
        return
    from mxddp.torch.optimizer import DistributedOptimizer
    if isinstance(optimizer, DistributedOptimizer):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for model in torch_clip.open_models(params):
        why = why_not_exposed(model)
        held = {id(p) for p in model._params}
        # A script that puts gradients into .grad itself (p.grad = p.main_grad) steps what it put there.
        if why is not None and all(p.grad is None for p in params if id(p) in held):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() on the params of a mxddp.torch {type(model).__name__}: their "
                f"gradients are not in .grad, so it would step nothing: {why}. Hand the optimizer to mxddp "
                "(optimizer = mxt.DistributedOptimizer(model, optimizer): torch's AdamW, Adam and SGD with their "
                "param groups), or, for another optimizer class, wrap with torch's form, "
                "mxt.DistributedDataParallel(module), and open no DistributedOptimizer on it (then .grad holds each "
                "synchronized gradient, as torch DDP's)")


_installed = False


def install() -> None:
    """Registers ``check_step`` with torch (once per process)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(check_step)
        _installed = True
