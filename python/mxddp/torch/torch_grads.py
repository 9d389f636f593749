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
- **Taken back** when the next backward begins (its first gradient, which reaches the wrapper's
  output first): a ``.grad`` set to None means that gradient was dropped, and its ``main_grad`` is
  zeroed (as torch's next backward starts it from nothing); a ``.grad`` still the view is kept, so
  the backward adds into it (torch's accumulation when nothing zeroes); any other tensor the
  script put there is copied in. ``.grad`` is then None through the backward, as mxddp's hooks need.

Any other optimizer on a wrapped model's params is refused when it steps, saying why and what to
use (``check_step``, a global torch step pre-hook ``import mxddp.torch`` installs), instead of
stepping on gradients that are not there.
"""
from __future__ import annotations

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


def take_back(model, arrived: Optional[int] = None) -> bool:
    """When a backward begins: the exposed ``.grad``s go back into ``main_grad`` (see the module's
    docstring) and are set to None. ``arrived``: the param whose gradient began it (its hook runs
    after torch's accumulation into ``.grad``, which therefore holds the sum already). Returns
    whether ``arrived``'s gradient is in its ``main_grad`` now (the hook adds nothing)."""
    exposed, model._torch_grads = model._torch_grads, {}
    kept: set[int] = set()
    absorbed = False
    with torch.no_grad():
        for i, view in exposed.items():
            p = model._params[i]
            g = p.grad
            if i == arrived:
                # torch added this backward's part into .grad: in place where .grad was the view,
                # into a new tensor where it was None or replaced (or the backward builds a graph).
                if g is not None and g is not view:
                    p.main_grad.copy_(g)
                absorbed = True
            elif g is None:
                p.main_grad.zero_()  # dropped: this backward starts it from nothing, as torch's
                model._used[i] = False
                continue
            elif g is not view:
                p.main_grad.copy_(g)  # a tensor the script put there
            kept.add(i)
            p.grad = None
    model._torch_grads_kept = kept
    return absorbed


def check_fused_first(model, index: int) -> None:
    """A fused weight (gradient_accumulation_fusion) reports before the take-back: its module's
    backward added into ``main_grad`` already, so a ``.grad`` the script dropped or replaced can no
    longer be told from this backward's part. Raises then, naming the weight, rather than lose it."""
    changed = [model._names[i] for i, view in model._torch_grads.items()
               if model.fused_params[i] and model._params[i].grad is not view]
    if changed:
        raise RuntimeError(
            f"the backward reached the fused weight '{model._names[index]}' before the output of "
            f"{type(model).__name__}'s forward, while the .grad of {changed} had been set to None or replaced "
            "since the last backward: their modules' backward adds straight into the gradients the script let go "
            "(torch_grads.py). Compute the loss from the wrapper's output (model(x), not model.module(x)), as torch "
            "DDP requires too, or zero the gradients with model.zero_grad()")


def keep_own(p: torch.nn.Parameter) -> None:
    """At close() (or when a dropped wrapper is collected): ``p.grad`` in storage of its own where it
    views mxddp's grad buffer (``main_grad``'s storage), so it outlives the buffer, as a param's
    gradient outlives torch DDP."""
    main_grad, g = vars(p).get("main_grad"), p.grad
    if main_grad is not None and g is not None and \
            g.untyped_storage().data_ptr() == main_grad.untyped_storage().data_ptr():
        p.grad = g.clone()


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
        if why is not None:
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
