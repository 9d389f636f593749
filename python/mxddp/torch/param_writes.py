"""Values a script writes into a wrapped model's params outside the optimizer, kept rather than undone.

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
recording only serves the checks below. Every optimizer open on the model takes the values (two
optimizers over parts of one model each keep main params for all of it).

Three writes cannot be kept, and are refused naming the param:
- one made while an overlapped param all-gather (``overlap_param_gather``) is still to land on that
  param: the gather overwrites the part other ranks hold, so the ranks would differ. Refused where
  the gather is waited for (the next forward, ``finish_param_sync()``) or where the optimizer would
  take it first; call ``model.finish_param_sync()`` after the step and before writing;
- one made between a step and the ``zero_grad()`` that stages its values into the params
  (``reuse_grad_buf_for_mxfp8_param_ag``): the params still hold the values from before the step,
  and the elements the write left as they were cannot be told from written ones; write after
  ``zero_grad()``;
- one into a Parameter that is a NaN stand-in: an MXFP8 weight (its values kept as MXFP8), or
  under FSDP's optim_grads_params any param outside its unit's forward. ``zero_()`` and ``fill_``
  (``torch.nn.init.zeros_``, ``constant_``) reach a stand-in; ``copy_`` fails in torch itself.

A write through ``p.data`` (``p.data.clamp_()``, WGAN's clipping; ``p.data.mul_(mask)``, pruning)
counts too: while wrapped, a registered param's ``.data`` is a view that shares the Parameter's
version counter, as ``p.detach()`` does (watched_params.py), so everything above holds for it.

A write torch does not count (under ``torch.autograd._unsafe_preserve_version_counter``, through
``data_ptr()``, through a ``.data`` taken before wrapping or of a script's own Parameter class) is
not seen at all, so with BF16 params the next step undoes it; ``optimizer.reload_model_params()``
takes every param after one.
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


def take(model) -> None:
    """Before anything reads or writes the main params: the params written since the last record()
    go into the main params of every optimizer open on the model (a copy where those are not the
    params themselves), and the versions are recorded again. Writes that cannot be kept (the
    module's docstring) are refused, and no longer count as writes."""
    indices = written(model)
    if not indices:
        return
    stand_ins = model._stand_in_params()
    lost = [i for i in indices if i in stand_ins]
    if lost:
        names = ", ".join(repr(model._names[i]) for i in lost)
        with torch.no_grad():
            for i in lost:  # the stand-in's NaN back (zero_ and fill_ can write it)
                model._params[i].fill_(float("nan"))
        _said(model, lost)
        raise RuntimeError(f"param(s) {names} were written in place (torch.nn.init, fill_, zero_, .data, ...), but "
                           "their Parameters hold only NaN stand-ins (MXFP8 weights, kept as MXFP8; FSDP's "
                           "optim_grads_params params outside their unit's forward, kept as shards, their gathered "
                           "values inside it freed after it), so the values "
                           "reach nothing. Initialize them before wrapping, or load them with model.load_state_dict "
                           "(FSDP), mxddp.torch.load_checkpoint or DCP")
    if model._awaiting_zero_grad:
        _refuse_unstaged(model, indices)
    _refuse_pending(model, model._pending_gathers(indices), "the optimizer was about to take it")
    if model.param_dtype != torch.float32:
        sources = {i: model._params[i] for i in indices}
        with torch.no_grad():
            for optimizer in model._open_optimizers():
                copy_into_main(optimizer, sources, changed_only=True)
    record(model)


def _refuse_unstaged(model, indices) -> None:
    """Raises for the first of `indices` (written between a step and the zero_grad() that stages its
    values, MXFP8 reuse), after recording them: said once. Their other elements still hold the values
    from before the step, which taking the param would write back over the step's."""
    _said(model, indices)
    raise RuntimeError(
        f"param '{model._names[indices[0]]}' was written in place between DistributedOptimizer.step() and "
        "zero_grad() with reuse_grad_buf_for_mxfp8_param_ag: until zero_grad() stages the step's values into the "
        "params they still hold those from before the step, so taking the param would write them back over the "
        "step's wherever the write left an element as it was. Write after opt.zero_grad() (or "
        "opt.force_param_sync())")


def _said(model, indices) -> None:
    """A refusal names these params once: their writes no longer count."""
    for i in indices:
        model._param_versions[i] = model._params[i]._version


def _refuse_pending(model, indices, where: str) -> None:
    """Raises for the first of `indices` (written params whose gather had not landed), after
    recording them: said once."""
    if not indices:
        return
    _said(model, indices)
    raise RuntimeError(
        f"param '{model._names[indices[0]]}' was written in place after DistributedOptimizer.step() while its "
        f"all-gather was still to land (overlap_param_gather; {where}). The gather writes the step's values "
        "over the part of it other ranks hold, so the write cannot be kept and the ranks would differ. Call "
        "model.finish_param_sync() after the step and before writing params, then write again")


def check_not_overwritten(model, indices) -> None:
    """After the all-gathers of `indices` landed (they were pending before): none of them was
    written since the step."""
    versions = model._param_versions
    if versions is None:
        return
    params = model._params
    _refuse_pending(model, [i for i in indices if params[i]._version != versions[i]], "the gather has landed")
