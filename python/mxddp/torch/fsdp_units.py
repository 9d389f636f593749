"""FSDP's units for a PyTorch module, as Megatron-FSDP forms them from ``fsdp_unit_modules``.

A *unit* is the set of params gathered and released together. Every module whose class is one of
``fsdp_unit_modules`` (the outermost one, where such modules nest) forms a unit of all the
trainable params below it; with ``fsdp_unit_modules=None`` the whole module is one unit (as
FSDP2's ``fully_shard`` on the root alone). The params of no unit (embeddings, a final norm, a head) are
*non-unit* params, gathered at their first use in an iteration and kept until the gradients are
synchronized. With the fine-grained param gather each submodule inside a unit module that owns
trainable params directly (``nn.Linear``, ``nn.LayerNorm``, ...) is a unit of its own instead.

The result is the list of *hooked modules* in module-tree order (the order ``named_modules()``
walks): the modules whose forward runs FSDP's hooks, each with its params (registration indices)
and its unit (-1 for a non-unit module), the units numbered in that order. ``FullyShardedDataParallel``
hooks exactly these modules, and the memory plan replays them, so the two cannot disagree about the
units. The tree's order is the forward's for ``nn.Sequential``, GPT-2 and the coarse units of HF
models, but not always for fine-grained ones (a Llama layer registers its norms after the attention
and MLP they precede): the C++ FSDP learns the order a forward calls the units in, and the plan takes
it as ``forward_order`` (``in_forward_order``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class HookedModule:
    name: str                 # its name in module.named_modules() ("" for the root)
    module: torch.nn.Module
    params: tuple[int, ...]   # registration indices of the params its hooks name
    unit: int                 # its unit, -1 for a non-unit module


@dataclass(frozen=True)
class FsdpUnits:
    units: list[list[int]]          # [unit] its params (registration indices), units in forward order
    hooked: list[HookedModule]      # in module-tree (forward) order

    @property
    def non_unit_params(self) -> list[int]:
        in_units = {p for u in self.units for p in u}
        return sorted({p for h in self.hooked if h.unit < 0 for p in h.params} - in_units)


def check_unit_module_classes(fsdp_unit_modules: Optional[Sequence],
                              what: str = "fsdp_unit_modules") -> tuple[type, ...]:
    """The classes, checked: None or a sequence of torch.nn.Module subclasses (``what``: the
    argument's name, for the error)."""
    if fsdp_unit_modules is None:
        return ()
    if isinstance(fsdp_unit_modules, (str, bytes)) or not isinstance(fsdp_unit_modules, Sequence):
        raise TypeError(f"{what} must be a list of torch.nn.Module classes (e.g. [GPT2Block]); "
                        f"got {fsdp_unit_modules!r}")
    classes = []
    for c in fsdp_unit_modules:
        if not (isinstance(c, type) and issubclass(c, torch.nn.Module)):
            raise TypeError(f"{what} holds {c!r}, which is not a torch.nn.Module subclass; valid: "
                            "module classes such as transformers' GPT2Block or your own block class")
        classes.append(c)
    return tuple(classes)


def recompute_regions(module: torch.nn.Module, hooked: list[HookedModule],
                      checkpointed_modules: Optional[Sequence]) -> list[int]:
    """[hooked module] its recompute region: the modules inside one module of a
    ``checkpointed_modules`` class (the outermost, where they nest), which torch.utils.checkpoint
    re-runs together in backward, share a region; -1 outside any. ``hooked`` in the order the
    forward calls them, where each region's modules must be consecutive."""
    classes = check_unit_module_classes(checkpointed_modules, "checkpointed_modules")
    roots: list[str] = []  # the outermost modules of those classes, in module-tree order
    for name, sub in module.named_modules():
        if isinstance(sub, classes) and not any(name == r or _is_below(name, r) for r in roots):
            roots.append(name)
    regions = [next((i for i, r in enumerate(roots) if h.name == r or _is_below(h.name, r)), -1) for h in hooked]
    ended: set[int] = set()  # regions some module after them has left
    for j in range(1, len(regions)):
        if regions[j - 1] != regions[j]:
            ended.add(regions[j - 1])
        r = regions[j]
        if r >= 0 and r in ended:
            raise ValueError(f"checkpointed module '{roots[r]}' holds modules the forward does not call one after "
                             f"another ('{hooked[j].name}' comes after '{hooked[j - 1].name}', outside it): a "
                             "recompute re-runs a module's forward as a whole, so the plan cannot replay this one")
    return regions


def fsdp_units(module: torch.nn.Module, param_names: list[str], params: list[torch.nn.Parameter],
               fsdp_unit_modules: Optional[Sequence], fine_grained: bool) -> FsdpUnits:
    """The units and hooked modules of ``module`` over its registered params (``params``, named
    ``param_names``, in registration order). Raises ValueError where a param would be in two units,
    or in a unit and read by a module outside it (a tied weight must be a non-unit param), and
    where ``fsdp_unit_modules`` names classes of which the module has no instance."""
    classes = check_unit_module_classes(fsdp_unit_modules)
    index_of = {id(p): i for i, p in enumerate(params)}

    def direct(sub: torch.nn.Module) -> tuple[int, ...]:
        seen: list[int] = []
        for p in sub._parameters.values():
            if p is not None and id(p) in index_of and index_of[id(p)] not in seen:
                seen.append(index_of[id(p)])
        return tuple(seen)

    # The outermost module of a unit class above each module, by name prefix; no classes: the root.
    unit_roots: list[tuple[str, torch.nn.Module]] = [] if classes else [("", module)]
    for name, sub in module.named_modules(remove_duplicate=True):
        if classes and isinstance(sub, classes) and not any(_is_below(name, r) for r, _ in unit_roots):
            unit_roots.append((name, sub))
    if classes and not unit_roots:
        names = ", ".join(c.__name__ for c in classes)
        raise ValueError(f"fsdp_unit_modules names {names}, but the module ({type(module).__name__}) has no "
                         "submodule of those classes: every param would be a non-unit param; pass the class of "
                         "its repeated blocks, or fsdp_unit_modules=None to make no units")

    units: list[list[int]] = []
    hooked: list[HookedModule] = []
    owner_of: dict[int, str] = {}  # param -> the unit (its root's or submodule's name) it is in

    def claim(p: int, owner: str) -> None:
        if p in owner_of and owner_of[p] != owner:
            raise ValueError(f"param '{param_names[p]}' is in FSDP unit '{owner_of[p] or '<root>'}' and also read by "
                             f"'{owner or '<root>'}': a unit's params are released after the unit, so a param shared "
                             "with another module must be a non-unit param (keep the modules sharing it out of "
                             "fsdp_unit_modules, as Megatron keeps the tied embedding)")
        owner_of[p] = owner

    root_names = [r for r, _ in unit_roots]
    for root_name, root in unit_roots:
        if fine_grained:
            for name, sub in root.named_modules(prefix=root_name, remove_duplicate=True):
                ps = direct(sub)
                if ps:
                    for p in ps:
                        claim(p, name)
                    hooked.append(HookedModule(name, sub, ps, len(units)))
                    units.append(list(ps))
        else:
            ps = []
            for p in root.parameters():
                if id(p) in index_of and index_of[id(p)] not in ps:
                    ps.append(index_of[id(p)])
            if ps:
                for p in ps:
                    claim(p, root_name)
                hooked.append(HookedModule(root_name, root, tuple(ps), len(units)))
                units.append(ps)
    unit_params = set(owner_of)
    for name, sub in module.named_modules(remove_duplicate=True):
        if any(_is_below(name, r) or name == r for r in root_names):
            continue
        ps = direct(sub)
        for p in ps:
            if p in unit_params:
                claim(p, name)  # raises: a unit's param read outside the unit
        if ps:
            hooked.append(HookedModule(name, sub, ps, -1))
    order = {id(sub): i for i, (_, sub) in enumerate(module.named_modules(remove_duplicate=True))}
    hooked.sort(key=lambda h: order[id(h.module)])
    return FsdpUnits(units=units, hooked=hooked)


def in_forward_order(hooked: list[HookedModule], forward_order: Optional[Sequence[str]]) -> list[HookedModule]:
    """The hooked modules with the units' ones in ``forward_order`` (their names), each in a place a
    unit module held, the non-unit ones (embeddings first, a final norm or head last) where they were."""
    if forward_order is None:
        return hooked
    units = {h.name: h for h in hooked if h.unit >= 0}
    names = [] if isinstance(forward_order, (str, bytes)) else list(forward_order)
    if not names or not all(isinstance(n, str) for n in names) or sorted(names) != sorted(units):
        missing = sorted(set(units) - set(n for n in names if isinstance(n, str)))
        raise ValueError(f"forward_order={forward_order!r} is not valid: the names of the units' modules, each once, "
                         f"in the order the forward calls them (FullyShardedDataParallel.forward_order); "
                         f"missing: {missing}; valid names: {sorted(units)}")
    ordered = iter(units[name] for name in names)
    return [next(ordered) if h.unit >= 0 else h for h in hooked]


def _is_below(name: str, root: str) -> bool:
    """Whether module `name` is strictly inside the module named `root` ("" is the root module)."""
    return name != root and (root == "" or name.startswith(root + "."))
