"""Megatron-core 0.16's param groups for an ``OptimizerConfig``: which params get no weight decay,
which a decoupled learning rate, and the keys Megatron's ``OptimizerParamScheduler`` reads.

Megatron's rule (``megatron.core.optimizer._get_param_groups`` with its standard overrides): a
param whose name matches ``*.bias`` or that has exactly one dimension gets ``wd_mult`` 0 (with
``apply_wd_to_qk_layernorm``: a one-dimensional or ``.bias`` param gets it unless its name holds
``q_layernorm.`` or ``k_layernorm.``); a 0-dimensional param is decayed. With ``decoupled_lr``,
params with the attribute ``is_embedding_or_output_parameter`` get ``max_lr`` (and, with
``decoupled_min_lr``, ``min_lr``) of their own. A caller's ``config_overrides`` replace these
standard ones, as in Megatron. Params with the same merged overrides share a group; the group
without overrides comes first, the others sorted by their overrides.

The one difference from Megatron, on purpose: each group's ``weight_decay`` starts at
``config.weight_decay * wd_mult``. Megatron's torch optimizer starts every group at
``config.weight_decay`` and only its scheduler (whose constructor already sets ``weight_decay *
wd_mult``) stops the decay of biases and norms, so without a scheduler Megatron decays every
param; with one the two are the same from the first step.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Optional

import torch

# The sort key of the group without overrides, which Megatron puts first.
_NO_OVERRIDE: tuple = ()


def standard_overrides(config: Any) -> list[tuple[Any, dict]]:
    """Megatron's standard overrides as (matcher, override): matcher(param, name) -> bool."""
    if config.apply_wd_to_qk_layernorm:
        def no_decay(param: torch.nn.Parameter, name: str) -> bool:
            return (param.dim() == 1 or name.endswith(".bias")) and \
                not ("q_layernorm." in name or "k_layernorm." in name)
    else:
        def no_decay(param: torch.nn.Parameter, name: str) -> bool:
            return fnmatch.fnmatch(name, "*.bias") or param.dim() == 1
    overrides = [(no_decay, {"wd_mult": 0.0})]
    if config.decoupled_lr is not None:
        decoupled = {"max_lr": config.decoupled_lr}
        if config.decoupled_min_lr is not None:
            decoupled["min_lr"] = config.decoupled_min_lr
        overrides.append((lambda param, name: bool(getattr(param, "is_embedding_or_output_parameter", False)),
                          decoupled))
    return overrides


def _matchers(config_overrides: Optional[dict]) -> list[tuple[Any, dict]]:
    """A caller's ``{ParamKey: override}`` (Megatron's ParamKey, or anything with
    ``matches(param, name)``) as (matcher, override)."""
    out = []
    for key, override in config_overrides.items():
        if not callable(getattr(key, "matches", None)):
            raise TypeError(f"config_overrides key {key!r} has no matches(param, name) method; valid: "
                            "megatron.core.optimizer.ParamKey")
        if not isinstance(override, dict):
            raise TypeError(f"config_overrides[{key!r}] must be a dict of param-group fields; got {override!r}")
        if "params" in override:
            raise ValueError(f"config_overrides[{key!r}] sets 'params', which is the group's own key")
        out.append((key.matches, dict(override)))
    return out


def megatron_param_groups(named_params: list[tuple[str, torch.nn.Parameter]], config: Any,
                          config_overrides: Optional[dict] = None) -> list[dict]:
    """Megatron's param groups over ``named_params`` (a model chunk's ``named_parameters()``, the
    wrapper's names, ``module.`` first, as Megatron names them; params without requires_grad are
    left out). Each group holds ``params`` and Megatron's keys (``wd_mult``, ``lr_mult``,
    ``is_decoupled_lr``, ``max_lr``, ``min_lr``, ``default_config``, ``is_expert_parallel`` and the
    overrides) plus ``lr`` (config.lr) and ``weight_decay`` (config.weight_decay * wd_mult) where the
    overrides set neither. An override's ``betas``, ``eps`` or ``momentum`` is the group's, as Megatron's
    torch optimizer reads it (DistributedOptimizer._hyper)."""
    matchers = standard_overrides(config) if config_overrides is None else _matchers(config_overrides)
    by_key: dict[Any, list[torch.nn.Parameter]] = {}
    for name, param in named_params:
        if not param.requires_grad:
            continue
        if not getattr(param, "allreduce", True):
            raise ValueError(f"param '{name}' has allreduce=False (Megatron's mark of an expert-parallel param); "
                             "mxddp has no expert parallelism, so every param is data-parallel")
        merged: dict = {}
        matched = False
        for matches, override in matchers:
            if not matches(param, name):
                continue
            matched = True
            for k, v in override.items():
                if k in merged and merged[k] != v:
                    raise ValueError(f"param '{name}': conflicting overrides for {k}: {merged[k]!r} and {v!r}")
                merged[k] = v
        key = tuple(sorted(merged.items())) if matched else None
        by_key.setdefault(key, []).append(param)
    groups = []
    for key in sorted(by_key, key=lambda k: (k is not None, k if k is not None else _NO_OVERRIDE)):
        override = dict(key) if key is not None else {}
        group = {"params": by_key[key], "is_expert_parallel": False,
                 "default_config": not any("lr" in k for k in override),
                 "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False,
                 "max_lr": config.lr, "min_lr": config.min_lr, **override}
        # An override's own lr or weight_decay stays, as torch's add_param_group under Megatron's optimizer
        # fills only the keys a group lacks.
        group.setdefault("lr", config.lr)
        group.setdefault("weight_decay", config.weight_decay * group["wd_mult"])
        groups.append(group)
    return groups
