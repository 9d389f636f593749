"""Values a script writes into a DDP's params outside the optimizer, kept rather than undone.

A torch script writes params by hand: ``model.module.load_state_dict(sd)``, ``p.copy_(v)`` under
``torch.no_grad()``, weight surgery, an EMA swapped in. With torch's optimizers the next step
starts from those values. With BF16 params mxddp's optimizer steps F32 main params (Megatron's
master copy) and writes them back over the params, so such a write would be silently undone by
the next step; Megatron leaves it to the script to call ``reload_model_params()``. mxddp finds the
writes itself: torch bumps a tensor's version counter at every in-place write, and each
Parameter has its own (its ``.data`` is a view of the param buffer, but a ``.data`` assignment
keeps the Parameter's counter). The optimizer records every param's version whenever params and
main params agree (construction, after each step, after a param sync or a load) and, before
anything reads or writes the main params (a step, ``zero_grad`` that stages them, a state dict, a
checkpoint), copies the params whose version moved into their main params on this rank's shard:
one integer compare per param, and nothing copied when nothing was written. Only the elements whose
value differs from their main param's BF16 rounding are copied, so a write that left values as they
were (``model.load_state_dict(model.state_dict())``, a load that failed and was put back, the
untouched rows of a resized embedding) keeps their F32 precision.

F32 params are their own main params (the shard aliases the param buffer): nothing to copy, the
recording only serves the check below.

The one write that cannot be kept is one made while an overlapped param all-gather
(``overlap_param_gather``) is still to land on that param: the gather would overwrite it at the
next forward. That is refused where the gather is waited for, naming the param and what to call
first (``model.finish_param_sync()``).

DDP, and FSDP where its params keep their storage between iterations (no_shard, optim,
optim_grads). With optim_grads_params every Parameter is a stand-in outside its unit's forward:
values written into one reach nothing (its read guards refuse a module run outside its unit).
"""
from __future__ import annotations

import torch


def record(model) -> None:
    """Params and main params agree now: every param's version is the clean one."""
    model._param_versions = [p._version for p in model._params]


def written(model) -> list[int]:
    """Registration indices of the params written in place since the last record()."""
    versions = model._param_versions
    if versions is None:
        return []
    return [i for i, p in enumerate(model._params) if p._version != versions[i]]


def copy_into_main(optimizer, sources: dict[int, torch.Tensor], changed_only: bool = False) -> None:
    """main params[index] <- sources[index] (F32), over this rank's update ranges: where the main
    params are copies (BF16 params), the values a step starts from. changed_only: only the elements
    whose source differs from the main param rounded to the source's dtype. Local: no collective."""
    cpp = optimizer._cpp
    flat = {i: t.detach().reshape(-1) for i, t in sources.items()}
    for b in range(cpp.num_buckets):
        main = None
        for (p, ps, pe, ss, se) in cpp.update_ranges(b):
            if p in flat:
                if main is None:
                    main = cpp.main_params(b)
                src, dst = flat[p][ps:pe], main[ss:se]
                if changed_only:
                    src = torch.where(src == dst.to(src.dtype), dst, src.float())
                dst.copy_(src)


def take(optimizer) -> None:
    """Before anything reads or writes the main params: the params written since the last record()
    go into their main params (a copy where those are not the params themselves), and the versions
    are recorded again. A write into an MXFP8 weight (whose Parameter is a NaN stand-in, its values
    kept as MXFP8 by the C++ DDP) reaches nothing, and is refused."""
    model = optimizer.model
    indices = written(model)
    if not indices:
        return
    lost = [i for i in indices if i in model._mxfp8_kind]
    if lost:
        names = ", ".join(repr(model._names[i]) for i in lost)
        with torch.no_grad():
            for i in lost:  # the stand-in's NaN back (zero_ and fill_ can write it), and no longer a write
                model._params[i].fill_(float("nan"))
                model._param_versions[i] = model._params[i]._version
        raise RuntimeError(f"param(s) {names} were written in place (torch.nn.init, fill_, zero_, ...), but they are "
                           "kept as MXFP8 (fp8_param_gather): their Parameters hold only NaN stand-ins and the values "
                           "reach nothing. Initialize them before wrapping, load them with "
                           "mxddp.torch.load_checkpoint, or set `param.mxfp8 = False` before wrapping")
    if model.param_dtype != torch.float32:
        with torch.no_grad():
            copy_into_main(optimizer, {i: model._params[i] for i in indices}, changed_only=True)
    record(model)


def check_not_overwritten(model, indices) -> None:
    """After a pending all-gather of `indices` landed: none of them was written since the step
    (the gather has overwritten such a write, or raced with it)."""
    versions = model._param_versions
    if versions is None:
        return
    params = model._params
    for i in indices:
        if params[i]._version != versions[i]:
            versions[i] = params[i]._version  # said once: the param holds the step's values now
            raise RuntimeError(
                f"param '{model._names[i]}' was written in place after DistributedOptimizer.step() while its "
                "all-gather was still pending (overlap_param_gather), and the gather has written the step's values "
                "over it. Call model.finish_param_sync() after the step and before writing params")
