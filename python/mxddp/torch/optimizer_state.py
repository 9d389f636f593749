"""``DistributedOptimizer.state_dict()`` / ``load_state_dict()`` in torch's format.

``{"state": {i: {"step", "exp_avg", "exp_avg_sq"} or {"step", "momentum_buffer"}}, "param_groups":
[{..., "params": [i, ...]}]}`` with i the param's place in the groups' order (torch's numbering), so
``torch.save`` writes it and a script's resume code reads it. A replicated optimizer (every rank
updates the whole model) holds full state on every rank: its state dict is full tensors, loadable on
any rank and into a plain torch optimizer. A sharded one holds only this rank's shard: each state
tensor is then the flat run of the param's elements this rank owns, ``"mxddp"`` records the rank,
the world size and a fingerprint of this rank's layout, and loading it anywhere else is refused.
Where the main params are not the params themselves (BF16 params), each param's F32 main values
travel as ``"main_param"`` so a resume is exact. No collective inside ``state_dict()``: rank 0 may
call it alone.
"""
from __future__ import annotations

import hashlib

import torch


_FORMAT = 1


def _ranges(cpp) -> list[list[tuple]]:
    return [cpp.update_ranges(b) for b in range(cpp.num_buckets)]


def layout_fingerprint(model, cpp) -> str:
    """This rank's part of the layout: every update range with its param's name and shape."""
    h = hashlib.sha256()
    for b, ranges in enumerate(_ranges(cpp)):
        for (p, ps, pe, ss, se) in ranges:
            h.update(f"{b}:{model._names[p]}:{tuple(model._params[p].shape)}:{ps}:{pe}:{ss}:{se};".encode())
    return h.hexdigest()[:16]


def is_full(model, cpp) -> bool:
    """Whether this rank's update ranges cover every element of every param (a replicated optimizer,
    or one rank)."""
    covered = [0] * len(model._params)
    for ranges in _ranges(cpp):
        for (p, ps, pe, _ss, _se) in ranges:
            covered[p] += pe - ps
    return all(c == p.numel() for c, p in zip(covered, model._params))


def _torch_order(opt) -> list[int]:
    """Registration indices in torch's state-dict numbering (group order, then each group's order)."""
    index_of = {id(p): i for i, p in enumerate(opt.model._params)}
    return [index_of[id(p)] for g in opt.param_groups for p in g["params"]]


def state_dict(opt) -> dict:
    cpp, model = opt._cpp, opt.model
    full = is_full(model, cpp)
    names = cpp.state_names
    aliased = model.param_dtype == torch.float32  # main params are the param shards themselves
    order = _torch_order(opt)
    place = {reg: k for k, reg in enumerate(order)}
    per_param: dict[int, dict] = {}
    for b in range(cpp.num_buckets):
        views = [cpp.state(s, b) for s in range(len(names))]
        main = cpp.main_params(b)
        for (p, ps, pe, ss, se) in cpp.update_ranges(b):
            if p not in place:
                continue  # not trained: no state, as torch keeps none
            entry = per_param.setdefault(p, {"parts": []})
            entry["parts"].append((ps, pe, [v[ss:se].clone() for v in views], main[ss:se].clone()))
    state = {}
    for p, entry in per_param.items():
        shape = model._params[p].shape
        numel = model._params[p].numel()
        if full:
            # On the params' device, as torch's optimizers keep their state (and a sharded dict's views are).
            tensors = [torch.zeros(numel, dtype=torch.float32, device=model.device) for _ in names]
            main = torch.zeros(numel, dtype=torch.float32, device=model.device)
            for ps, pe, parts, m in entry["parts"]:
                for t, part in zip(tensors, parts):
                    t[ps:pe] = part
                main[ps:pe] = m
            s = {n: t.view(shape) for n, t in zip(names, tensors)}
            if not aliased:
                s["main_param"] = main.view(shape)
        else:
            entry["parts"].sort(key=lambda x: x[0])
            s = {n: torch.cat([x[2][k] for x in entry["parts"]]) for k, n in enumerate(names)}
            s["elements"] = [(ps, pe) for ps, pe, _, _ in entry["parts"]]
            if not aliased:
                s["main_param"] = torch.cat([x[3] for x in entry["parts"]])
        step = cpp.param_step(p)
        if step == 0:
            continue  # torch has no state for a param never stepped
        if opt._kind == "sgd":
            # torch.optim.SGD keeps only momentum_buffer, and none at all without momentum (then
            # only the F32 main values travel, where they are copies).
            if not opt.param_groups[opt._group_of[p]]["momentum"]:
                if aliased:
                    continue
                s = {"main_param": s["main_param"], **({"elements": s["elements"]} if "elements" in s else {})}
        else:
            s["step"] = torch.tensor(float(step))
        state[place[p]] = s
    groups = []
    k = 0
    for g in opt.param_groups:
        d = {key: value for key, value in g.items() if key != "params"}
        d["params"] = list(range(k, k + len(g["params"])))
        k += len(g["params"])
        groups.append(d)
    out = {"state": state, "param_groups": groups}
    if not full:
        # Every param's step count, in registration order: the state above has entries only for the
        # params this rank holds a part of, and the others' counts must come back too (a DCP save
        # after the load writes every param's).
        out["mxddp"] = {"format": _FORMAT, "sharded": True, "rank": model._comm.rank, "world": model._comm.size,
                        "layout": layout_fingerprint(model, cpp), "step_count": cpp.step_count,
                        "param_steps": [cpp.param_step(r) for r in range(len(model._params))]}
    else:
        out["mxddp"] = {"format": _FORMAT, "sharded": False, "step_count": cpp.step_count}
    return out


def load_state_dict(opt, sd: dict) -> bool:
    """Validates everything, then writes states, main params, step counts and the groups'
    hyperparameters; returns whether it wrote main params (which the params must then be synced
    with). Raises ValueError naming what does not match."""
    cpp, model = opt._cpp, opt.model
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("DistributedOptimizer.load_state_dict: expected a dict with 'state' and 'param_groups' "
                         f"(an optimizer state_dict); got {type(sd).__name__} with keys "
                         f"{sorted(sd) if isinstance(sd, dict) else []}")
    meta = sd.get("mxddp", {"sharded": False})
    full = is_full(model, cpp)
    if meta.get("sharded"):
        here = (model._comm.rank, model._comm.size, layout_fingerprint(model, cpp))
        there = (meta.get("rank"), meta.get("world"), meta.get("layout"))
        if full or here != there:
            raise ValueError("DistributedOptimizer.load_state_dict: this state dict holds one rank's shard (saved on "
                             f"rank {there[0]} of {there[1]}, layout {there[2]}); it loads only on that rank of the "
                             f"same layout, and here is rank {here[0]} of {here[1]}, layout {here[2]}"
                             f"{' (a replicated optimizer)' if full else ''}. Save and load on every rank, or "
                             "save full state with mxddp.torch.checkpoint")
        steps = meta.get("param_steps")
        if steps is not None and (not isinstance(steps, list) or len(steps) != len(model._params)
                                  or not all(isinstance(c, int) and c >= 0 for c in steps)):
            raise ValueError("DistributedOptimizer.load_state_dict: the state dict's per-param step counts "
                             f"(mxddp.param_steps) are not {len(model._params)} counts >= 0")
    # Full state (a replicated optimizer's, or torch's own) loads anywhere: a sharded optimizer takes
    # its ranges of each param.
    groups = sd["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"DistributedOptimizer.load_state_dict: the state dict has {len(groups)} param groups, "
                         f"this optimizer {len(opt.param_groups)}")
    for i, (saved, ours) in enumerate(zip(groups, opt.param_groups)):
        if len(saved["params"]) != len(ours["params"]):
            raise ValueError(f"DistributedOptimizer.load_state_dict: param group {i} has {len(saved['params'])} params "
                             f"in the state dict, {len(ours['params'])} here")
    order = _torch_order(opt)
    names = cpp.state_names
    aliased = model.param_dtype == torch.float32
    saved_ids = [k for g in groups for k in g["params"]]
    state = sd["state"]
    # Check every entry before writing any.
    for k_saved, reg in zip(saved_ids, order):
        s = state.get(k_saved)
        if s is None:
            continue
        numel = model._params[reg].numel()
        for n in names:
            t = s.get(n)
            if t is None:
                continue
            want = sum(pe - ps for ps, pe in s["elements"]) if "elements" in s else numel
            if not isinstance(t, torch.Tensor) or t.numel() != want:
                raise ValueError(f"DistributedOptimizer.load_state_dict: state '{n}' of param "
                                 f"'{model._names[reg]}' has {getattr(t, 'numel', lambda: '?')()} elements; "
                                 f"expected {want}")
    wrote_main = False
    for k_saved, reg in zip(saved_ids, order):
        s = state.get(k_saved, {})
        flat = {n: (s[n].detach().reshape(-1).to(torch.float32) if isinstance(s.get(n), torch.Tensor) else None)
                for n in names}
        main = s.get("main_param")
        main = main.detach().reshape(-1).to(torch.float32) if isinstance(main, torch.Tensor) else None
        offsets = None
        if "elements" in s:
            offsets, at = {}, 0
            for ps, pe in s["elements"]:
                offsets[ps] = at
                at += pe - ps
        for b in range(cpp.num_buckets):
            for (p, ps, pe, ss, se) in cpp.update_ranges(b):
                if p != reg:
                    continue
                src = slice(ps, pe) if offsets is None else slice(offsets[ps], offsets[ps] + pe - ps)
                for si, n in enumerate(names):
                    view = cpp.state(si, b)
                    view[ss:se] = flat[n][src] if flat[n] is not None else 0.0
                if main is not None and not aliased:
                    cpp.main_params(b)[ss:se] = main[src]
                    wrote_main = True
        # SGD's state has no step (torch's): a param with a momentum buffer has stepped.
        step = s.get("step", sd.get("mxddp", {}).get("step_count", 1) if s else 0)
        if "param_steps" in meta:  # a sharded state dict's own record of every param's count
            step = meta["param_steps"][reg]
        cpp.set_param_step(reg, int(float(step)))
    for saved, ours in zip(groups, opt.param_groups):
        for key, value in saved.items():
            if key != "params":
                ours[key] = value
    step_count = sd.get("mxddp", {}).get("step_count")
    if step_count is None:
        step_count = max([cpp.param_step(r) for r in order] or [0])
    # set_step_count would reset every param's own count: write the total directly through it and
    # restore the per-param counts after.
    counts = [cpp.param_step(r) for r in range(len(model._params))]
    cpp.set_step_count(int(step_count))
    for r, c in enumerate(counts):
        cpp.set_param_step(r, c)
    return wrote_main
