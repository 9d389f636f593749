"""What ``DistributedOptimizer(model, torch_optimizer)`` takes from a user's ``torch.optim.AdamW``,
``Adam`` or ``SGD``: which update rule, the param groups (each param's group by registration index,
-1 for a param no group holds: not trained) and each group's hyperparameters as the C++ optimizer
takes them. Anything mxddp cannot honour is refused by name rather than ignored.

``foreach`` and ``fused`` only choose among torch's implementations of the same formulas, so they
are accepted and have no effect (mxddp runs its own kernels on its shards).
"""
from __future__ import annotations

import weakref

import torch

from mxddp.torch.config import is_number, number_text

# The group keys each class has (torch 2.x) and what mxddp honours of them: the rest must hold
# their defaults, checked by _refused_settings.
_ADAM_KEYS = {"params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
              "differentiable", "fused", "decoupled_weight_decay"}
_SGD_KEYS = {"params", "lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach",
             "differentiable", "fused"}
# Keys torch's lr schedulers add to a group (OneCycleLR, CyclicLR, every LRScheduler's initial_lr):
# a group built by a scheduler before wrapping carries them.
_SCHEDULER_KEYS = {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"}
# (key, the value mxddp honours, why) for the settings that must hold one value.
_FIXED = [("amsgrad", False, "AMSGrad's max of past second moments is not implemented"),
          ("maximize", False, "mxddp's update descends"),
          ("capturable", False, "CUDA graph capture does not apply to mxddp's CPU kernels"),
          ("differentiable", False, "mxddp's update is not part of an autograd graph"),
          ("nesterov", False, "Nesterov momentum is not implemented"),
          ("dampening", 0, "SGD's dampening is not implemented (only 0)")]


def kind_of(optimizer: torch.optim.Optimizer) -> str:
    """"adam" or "sgd" (the C++ optimizer's rule) for exactly AdamW, Adam or SGD; a subclass or
    another class is refused, since its step may differ from the formulas mxddp runs."""
    cls = type(optimizer)
    if cls in (torch.optim.AdamW, torch.optim.Adam):
        return "adam"
    if cls is torch.optim.SGD:
        return "sgd"
    raise TypeError(f"DistributedOptimizer: optimizer class {cls.__module__}.{cls.__qualname__} is not supported; "
                    "valid: torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD (exactly these classes, not "
                    "subclasses), or a mxddp.torch.OptimizerConfig")


def check_group(kind: str, index: int, group: dict, construction: bool) -> None:
    """Raises naming the group, the key and its value for what mxddp cannot honour. At construction
    unknown keys are refused too; later (a step) only the settings, since schedulers add keys."""
    if construction:
        known = (_ADAM_KEYS if kind == "adam" else _SGD_KEYS) | _SCHEDULER_KEYS
        unknown = sorted(set(group) - known)
        if unknown:
            raise ValueError(f"DistributedOptimizer: param group {index} has key(s) {unknown} that mxddp would "
                             f"ignore; valid: {sorted(known - {'params'})}")
    for key, valid, why in _FIXED:
        if key in group and group[key] != valid and group[key] is not None:
            raise ValueError(f"DistributedOptimizer: param group {index} has {key}={group[key]!r}; mxddp honours "
                             f"only {key}={valid!r} ({why})")
    check_numbers(index, group)


def check_numbers(index: int, group: dict) -> None:
    """The group's hyperparameters that the C++ optimizer takes (those it has): Python numbers a
    double holds, betas two of them."""
    for key in ("lr", "weight_decay", "eps", "momentum"):
        if isinstance(group.get(key), torch.Tensor):
            raise TypeError(f"DistributedOptimizer: param group {index} has {key} as a Tensor; give a Python float "
                            "(a Tensor lr is for torch's capturable/fused kernels)")
    for key in ("lr", "weight_decay", "eps", "momentum"):
        if key in group and not is_number(group[key]):
            raise TypeError(f"DistributedOptimizer: param group {index} has {key}={number_text(group[key])}; give a "
                            "number a float holds")
    betas = group.get("betas")
    if betas is not None and any(isinstance(b, torch.Tensor) for b in betas):
        raise TypeError(f"DistributedOptimizer: param group {index} has betas as Tensors; give Python floats")
    if betas is not None and not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(map(is_number, betas))):
        text = "(" + ", ".join(map(number_text, betas)) + ")" if isinstance(betas, (tuple, list)) and \
            any(isinstance(b, int) and b.bit_length() > 1024 for b in betas) else repr(betas)
        raise TypeError(f"DistributedOptimizer: param group {index} has betas={text}; give two numbers (beta1, beta2)")


def hyper(kind: str, group: dict) -> tuple:
    """The group as the C++ optimizer's (lr, weight_decay, beta1, beta2, eps, momentum,
    decoupled_weight_decay). AdamW is Adam with decoupled decay (torch 2.x's AdamW sets the key)."""
    if kind == "adam":
        beta1, beta2 = group["betas"]
        return (float(group["lr"]), float(group["weight_decay"]), float(beta1), float(beta2), float(group["eps"]),
                0.0, bool(group.get("decoupled_weight_decay", True)))
    return (float(group["lr"]), float(group["weight_decay"]), 0.9, 0.999, 1e-8, float(group["momentum"]), False)


def group_of_params(model, groups: list[dict]) -> list[int]:
    """Each registered param's group index, -1 for a param no group holds. A param the model does
    not hold, or one in two groups, is refused naming it."""
    index_of = {id(p): i for i, p in enumerate(model._params)}
    names = model._names
    of = [-1] * len(model._params)
    for g, group in enumerate(groups):
        for k, p in enumerate(group["params"]):
            i = index_of.get(id(p))
            if i is None:
                raise ValueError(f"DistributedOptimizer: param group {g}'s param {k} {_unheld(model, p)}")
            if of[i] == g:
                raise ValueError(f"DistributedOptimizer: param '{names[i]}' is listed twice in param group {g}; "
                                 "list each param once")
            if of[i] != -1:
                raise ValueError(f"DistributedOptimizer: param '{names[i]}' is in param groups {of[i]} and {g}; "
                                 "a param belongs to one group")
            of[i] = g
    return of


def _unheld(model, p) -> str:
    """Why a param the model does not hold is refused, naming it where the wrapped module has it."""
    shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
    name = next((n for n, q in model.module.named_parameters(remove_duplicate=False) if q is p), None)
    if name is not None:
        return (f"'{name}' (shape {shape}) was frozen (requires_grad=False) when the model was wrapped, so mxddp "
                "does not train it: leave it out of the optimizer, or set requires_grad=True before wrapping")
    return (f"(shape {shape}) is not one the model holds: build the optimizer over the wrapped model's parameters "
            "(or its .module's: the same objects); a param of another module is not trained by mxddp")


def retire(optimizer: torch.optim.Optimizer, wrapper) -> None:
    """The user's torch optimizer once ``wrapper`` (its DistributedOptimizer) holds its params'
    state: its ``param_groups`` become the wrapper's (the same dicts), so an lr edit or a torch
    scheduler on it, built before or after wrapping, drives the wrapper; its step, zero_grad,
    state_dict, load_state_dict and add_param_group raise, naming the wrapper's. Before, they ran on
    a torch optimizer whose state had moved out: a zero_grad that left mxddp's grads summing, a
    step and lr edits that changed nothing."""
    optimizer.param_groups = wrapper.param_groups
    name = type(optimizer).__name__
    alive = weakref.ref(wrapper)

    def refuse(method: str):
        def call(*_args, **_kwargs):
            wrapper_now = alive()
            closed = wrapper_now is None or wrapper_now._cpp.closed
            state = " (it has since been closed: build a new one)" if closed else ""
            raise RuntimeError(f"{name}.{method}(): this torch optimizer was wrapped by mxddp.torch."
                               f"DistributedOptimizer, which holds its params' state{state}; call {method}() on the "
                               "DistributedOptimizer (opt = mxt.DistributedOptimizer(model, optimizer) replaces "
                               "it). Its param_groups are the DistributedOptimizer's, so lr edits and schedulers on "
                               "it still apply")
        return call

    for method in ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group"):
        setattr(optimizer, method, refuse(method))
    # A torch scheduler on this optimizer finds its step already patched (it would otherwise wrap the
    # refusal), and the wrapper's step records the call its check looks for (``_opt_called``).
    optimizer.step._wrapped_by_lr_sched = True
