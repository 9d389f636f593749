"""``copy.deepcopy`` and pickle (``torch.save`` of a whole module) of a module a mxddp wrapper holds,
or of any module inside it: the copy is a plain module (an EMA, a teacher model, a saved model), and
a copy that would hold NaN is refused.

Why: the wrappers put forward hooks on submodules (Megatron's param gather, FSDP's unit gather and
release), replace the forward of fused and MXFP8 modules, and the module holds its wrapper
(wrapper.py, "Lifetime"). A copy taking them along would run the original wrapper's hooks in its own
forward, and would not pickle (the hooks are closures). And a param kept as MXFP8, or sharded by
FSDP, holds a NaN stand-in between iterations: its copy would be NaN, silently. So each module of
the wrapped tree gets an instance ``__getstate__`` (pickle and copy read it through the instance,
where it overrides Module's) giving its class's state without them, or raising TypeError naming the
param when one of the module's own params holds a stand-in. close() removes them."""
from __future__ import annotations

import functools
import weakref
from collections import OrderedDict

import torch

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")  # where the wrappers' module hooks live


def install(wrapper) -> None:
    """Every module of ``wrapper.module`` copies as a plain one while ``wrapper`` is open."""
    ref = weakref.ref(wrapper)
    for sub in wrapper.module.modules():
        sub.__getstate__ = functools.partial(_copy_state, sub, ref)


def remove(module: torch.nn.Module) -> None:
    """Gives ``module`` (one module, not its children) Module's own ``__getstate__`` back."""
    getstate = vars(module).get("__getstate__")
    if isinstance(getstate, functools.partial) and getstate.func is _copy_state:
        del module.__getstate__


def _copy_state(module: torch.nn.Module, wrapper_ref) -> dict:
    wrapper = wrapper_ref()  # alive: its collection removes these (wrapper._let_go)
    index_of = {id(p): i for i, p in enumerate(wrapper._params)}
    stand_ins = wrapper._stand_in_params()
    for p in module._parameters.values():
        i = index_of.get(id(p)) if p is not None else None
        if i in stand_ins:
            mxfp8 = i in wrapper._mxfp8_kind
            raise TypeError(
                f"copying (copy.deepcopy, pickle, torch.save) a module wrapped by {type(wrapper).__name__}: its param "
                f"'{wrapper._names[i]}' holds a NaN stand-in between iterations ("
                + ("it is kept as MXFP8" if mxfp8 else "FSDP shards it across the ranks")
                + "), so the copy would hold NaN. Build the copy from the model's state dict instead (model.state_dict()"
                + (", which dequantizes it" if mxfp8 else ", which gathers it: collective, every rank calls it")
                + ", into a module built as this one), or copy the module before wrapping it")
    state = type(module).__getstate__(module)  # Module's: a copy of __dict__
    state.pop("__getstate__", None)
    state.pop("_mxddp_wrapper", None)
    if any(m is module for m in wrapper._replaced_forwards):
        state.pop("forward", None)
    own = {getattr(h, "id", None) for h in wrapper._hooks}  # a multi-grad hook's handle has none (on tensors)
    for key in _HOOK_DICTS:
        state[key] = OrderedDict((k, hook) for k, hook in state[key].items() if k not in own)
    return state
