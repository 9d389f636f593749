"""``torch.nn.utils.clip_grad_norm_`` on the params of a mxddp model: the global norm of mxddp's
synchronized gradients, not a silent 0.

A wrapped param's gradient lives in mxddp's grad buffer (``main_grad``, this rank's shard of it with
the distributed optimizer), and its ``.grad`` is None. torch's own ``clip_grad_norm_`` finds no
gradients there, returns a norm of 0 and clips nothing, without a word: nanoGPT's
``torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)`` would train unclipped. So
``import mxddp.torch`` puts a function in its place, in ``torch.nn.utils`` and in
``torch.nn.utils.clip_grad`` (so ``nn.utils.clip_grad_norm_``, the deprecated ``clip_grad_norm``, and a
``from torch.nn.utils import clip_grad_norm_`` run after the import find it; one run before the
import keeps torch's own, which no module can reach), that
calls torch's own for every call that names no param of an open mxddp model, and otherwise asks that
model's ``DistributedOptimizer`` (``clip_grad_norm_``, collective): the same return value and
arguments, but only norm_type 2. Given every param mxddp holds (``model.parameters()`` with frozen
ones or not), it clips them; a subset of them, or params of mxddp models and others with gradients
together, are refused, since the norm is the global one over every param mxddp holds.
``clip_grad_value_`` on a mxddp model's params is refused: the gradients it would clamp are still
scaled by a GradScaler whose unscale waits for the step. A model whose gradients are in ``.grad``
(torch's form with no ``DistributedOptimizer``: torch_grads.py) is left to torch's own functions,
which see its synchronized gradients there as they see a torch DDP's.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.utils.clip_grad
from torch.utils.weak import WeakIdKeyDictionary

# torch's own (a reload of this module finds this module's functions in place, which name them).
_TORCH_CLIP_GRAD_NORM = getattr(torch.nn.utils.clip_grad_norm_, "torch_original", torch.nn.utils.clip_grad_norm_)
_TORCH_CLIP_GRAD_VALUE = getattr(torch.nn.utils.clip_grad_value_, "torch_original", torch.nn.utils.clip_grad_value_)

# param -> the wrapper that holds it (a weak reference): kept beside the params, not on them, so that
# torch.save and deepcopy of the module (an EMA) carry no trace of it.
_HELD = WeakIdKeyDictionary()


def hold(model, params) -> None:
    """Marks `params` as held by `model` (a wrapper), for the functions below."""
    ref = weakref.ref(model)
    for p in params:
        _HELD[p] = ref


def open_holder(param: torch.Tensor):
    """The open mxddp wrapper holding ``param``; None if there is none."""
    ref = _HELD.get(param)
    model = ref() if ref is not None else None
    return model if model is not None and not model._cpp.closed else None


def any_held() -> bool:
    """Whether any param is marked held (a cheap test before looking params up)."""
    return len(_HELD) > 0


def open_models(params: list[torch.Tensor]) -> list:
    """The open mxddp wrappers holding any of `params`, each once."""
    models = {}
    for p in params:
        model = open_holder(p)
        if model is not None:
            models[id(model)] = model
    return list(models.values())


def _open_models_without_torch_grads(params: list[torch.Tensor]) -> list:
    """open_models(params) but those whose gradients are in .grad (torch_grads.py), where torch's own
    functions see them as they see a torch DDP's."""
    from mxddp.torch import torch_grads
    return [m for m in open_models(params) if torch_grads.why_not_exposed(m) is not None]


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_, for mxddp models' params too (see the module's docstring)."""
    params = _as_list(parameters)
    models = _open_models_without_torch_grads(params)
    if not models:
        return _TORCH_CLIP_GRAD_NORM(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if len(models) > 1:
        raise ValueError(f"clip_grad_norm_: the params given belong to {len(models)} mxddp models; each model's "
                         "gradients are clipped by their own global norm: call model.clip_grad_norm_(max_norm) on "
                         "each")
    model = models[0]
    given = {id(p) for p in params}
    missing = [name for name, p in zip(model._names, model._params) if id(p) not in given]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"clip_grad_norm_: the params given are {len(model._params) - len(missing)} of the "
                         f"{len(model._params)} this mxddp model holds (missing {shown}); mxddp clips by the global "
                         "norm of every param it holds: pass model.parameters(), or call model.clip_grad_norm_")
    held = {id(p) for p in model._params}
    others = [p for p in params if id(p) not in held and p.grad is not None]
    if others:
        raise ValueError(f"clip_grad_norm_: the params given mix this mxddp model's with {len(others)} others that "
                         "have gradients; mxddp's norm covers only its own: clip the others separately")
    return model.clip_grad_norm_(max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)


def clip_grad_value_(parameters, clip_value, foreach=None):
    """torch.nn.utils.clip_grad_value_, refused for mxddp models' params (see the module's docstring)."""
    params = _as_list(parameters)
    if _open_models_without_torch_grads(params):
        raise NotImplementedError("clip_grad_value_ on the params of a mxddp model: their gradients live in mxddp's "
                                  "grad buffer, and with a GradScaler they stay scaled until the step; clip by norm "
                                  "(torch.nn.utils.clip_grad_norm_ or model.clip_grad_norm_) instead")
    return _TORCH_CLIP_GRAD_VALUE(params, clip_value, foreach)


def install() -> None:
    """Puts the two functions above in torch.nn.utils and torch.nn.utils.clip_grad (where torch's
    deprecated clip_grad_norm finds clip_grad_norm_); they fall through to torch's own."""
    clip_grad_norm_.torch_original = _TORCH_CLIP_GRAD_NORM
    clip_grad_value_.torch_original = _TORCH_CLIP_GRAD_VALUE
    for namespace in (torch.nn.utils, torch.nn.utils.clip_grad):
        namespace.clip_grad_norm_ = clip_grad_norm_
        namespace.clip_grad_value_ = clip_grad_value_
