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
param when one of the module's own params does not hold its current values. close() removes them.
A class that copies its ``__dict__`` itself (an fx GraphModule) gets none: it copies as torch copies it."""
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
        if _reads_getstate(type(sub)):
            sub.__getstate__ = functools.partial(_copy_state, sub, ref)


def _reads_getstate(cls: type) -> bool:
    """Whether copy and pickle of a ``cls`` read ``__getstate__``: not where the class copies its
    ``__dict__`` itself (an fx GraphModule's own ``__deepcopy__`` and ``__reduce__``), which would carry
    the override along; such a module copies as torch copies it (the hold on the wrapper as None)."""
    return getattr(cls, "__deepcopy__", None) is None and cls.__reduce__ is object.__reduce__ and \
        cls.__reduce_ex__ is object.__reduce_ex__


def remove(module: torch.nn.Module, wrapper) -> None:
    """Gives ``module`` (one module, not its children) Module's own ``__getstate__`` back, if the one
    it has is ``wrapper``'s (a frozen submodule shared by two wrapped models has the later one's)."""
    getstate = vars(module).get("__getstate__")
    if isinstance(getstate, functools.partial) and getstate.func is _copy_state and getstate.args[1]() is wrapper:
        del module.__getstate__


def _copy_state(module: torch.nn.Module, wrapper_ref):
    state = type(module).__getstate__(module)  # Module's: a copy of __dict__
    if not isinstance(state, dict):
        return state
    state.pop("__getstate__", None)
    wrapper = wrapper_ref()
    if wrapper is None or wrapper._cpp.closed:  # a module the tree no longer held at close()
        return state
    _refuse_stale(module, wrapper)
    state.pop("_mxddp_wrapper", None)
    if any(m is module for m in wrapper._replaced_forwards):
        state.pop("forward", None)
    own = {getattr(h, "id", None) for h in wrapper._hooks}  # a multi-grad hook's handle has none (on tensors)
    for key in _HOOK_DICTS:
        if isinstance(state.get(key), dict):
            state[key] = OrderedDict((k, hook) for k, hook in state[key].items() if k not in own)
    return state


def _refuse_stale(module: torch.nn.Module, wrapper) -> None:
    """Raises TypeError where one of ``module``'s own params does not hold its current values: a NaN
    stand-in between iterations, or the values from before the last step while its overlapped
    all-gather is pending (which only the ranks together can finish)."""
    index_of = {id(p): i for i, p in enumerate(wrapper._params)}
    indices = [index_of[id(p)] for p in module._parameters.values() if p is not None and id(p) in index_of]
    stand_ins = wrapper._stand_in_params()
    wrapped_by = f"copying (copy.deepcopy, pickle, torch.save) a module wrapped by {type(wrapper).__name__}: its param"
    for i in indices:
        if i in stand_ins:
            mxfp8 = i in wrapper._mxfp8_kind
            raise TypeError(
                f"{wrapped_by} '{wrapper._names[i]}' holds a NaN stand-in between iterations ("
                + ("it is kept as MXFP8" if mxfp8 else "FSDP shards it across the ranks")
                + "), so the copy would hold NaN. Build the copy from the model's state dict instead (model.state_dict()"
                + (", which dequantizes it" if mxfp8 else ", which gathers it: collective, every rank calls it")
                + ", into a module built as this one), or copy the module before wrapping it")
    pending = wrapper._pending_gathers(indices)
    if pending:
        raise TypeError(f"{wrapped_by} '{wrapper._names[pending[0]]}' still holds its values from before the last step: "
                        "its overlapped all-gather (overlap_param_gather) lands at its module's next forward, so the "
                        "copy would hold a mix of old and new values. Call model.finish_param_sync() first (every "
                        "rank: it finishes the gathers)")
