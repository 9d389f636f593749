"""A torch state dict loaded into a wrapper whose Parameters do not all hold their values (FSDP's
sharded params are NaN stand-ins outside their unit): torch's checks, done here before anything is
copied, agreed across the ranks, then the copies.

torch's own ``load_state_dict`` copies entry by entry into the Parameters, which would write into the
stand-ins, and raises only at the end. So the checks come first, with torch's messages (missing and
unexpected keys under ``strict``, shape mismatches always), every rank learns whether any rank failed
(the copies that follow are collective), and only then are the buffers, the frozen params and the
registered params written, the last by the wrapper's own way.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn.modules.module import _IncompatibleKeys

from mxddp import _C


def check(wrapper: str, module: torch.nn.Module, state_dict, strict: bool, prefix: str):
    """torch's checks of ``state_dict`` against ``module``: keyed ``prefix`` + the module's keys (the
    wrapper's own state dict), or, where no key starts with ``prefix``, the module's keys themselves
    (a plain module's, torch FSDP2's or FSDP1's full state dict). Returns (module key -> value for
    every key both have, torch's _IncompatibleKeys); raises torch's RuntimeError ("Error(s) in
    loading state_dict for ...") otherwise."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
    def under(key) -> bool:
        return isinstance(key, str) and key.startswith(prefix)

    if not any(under(key) for key in state_dict):
        prefix = ""
    expected = module.state_dict(keep_vars=True)
    for key, target in expected.items():
        if not isinstance(target, torch.Tensor):
            raise NotImplementedError(f"{wrapper}.load_state_dict: entry '{prefix}{key}' is a module's extra state "
                                      "(get_extra_state), which this load does not restore; load into the module "
                                      "before wrapping it")
    given = {key[len(prefix):]: value for key, value in state_dict.items() if under(key)}
    unexpected = [key for key in state_dict if not under(key) or key[len(prefix):] not in expected]
    missing = [prefix + key for key in expected if key not in given]
    errors = []
    if strict:
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    values = {}
    for key, target in expected.items():
        if key not in given:
            continue
        value = given[key]
        if not isinstance(value, torch.Tensor):
            errors.append(f'While copying the parameter named "{prefix}{key}", expected torch.Tensor or Tensor-like '
                          f"object from checkpoint but received {type(value)}")
        elif value.shape != target.shape:
            errors.append(f"size mismatch for {prefix}{key}: copying a param with shape {value.shape} from "
                          f"checkpoint, the shape in current model is {target.shape}.")
        else:
            values[key] = value
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(wrapper, "\n\t".join(errors)))
    return values, _IncompatibleKeys(missing, unexpected)


def agreed(what: str, comm, check):
    """Collective over comm: check()'s result where it passed on every rank; otherwise every rank
    raises (this rank's own error where it failed here), so none goes on to a copy that is collective."""
    try:
        result, error = check(), None
    except Exception as e:  # noqa: BLE001 (re-raised below, once every rank knows)
        result, error = None, e
    flags = _C.all_gather_bytes(b"\1" if error is not None else b"\0", comm)
    if error is not None:
        raise error
    failed = [r for r, flag in enumerate(flags) if flag != b"\0"]
    if failed:
        raise RuntimeError(f"{what}: the load failed on rank(s) {failed} (see their errors); nothing was changed")
    return result


def copy_module_entries(module: torch.nn.Module, values: dict, registered: list[torch.nn.Parameter]) -> None:
    """The checked values of the module's buffers and of its params that no wrapper holds (frozen)."""
    held = {id(p) for p in registered}
    targets = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, value in values.items():
            if id(targets[key]) not in held:
                targets[key].copy_(value)
