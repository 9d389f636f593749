"""torch.distributed.checkpoint (DCP) save and load of a mxddp model and its DistributedOptimizer,
resharding across world sizes, as FSDP2 and megatron-fsdp users save theirs::

    import torch.distributed.checkpoint as dcp
    dcp.save({"app": mxt.dcp.AppState(model, opt)}, checkpoint_id=path)   # every rank
    dcp.load({"app": mxt.dcp.AppState(model, opt)}, checkpoint_id=path)   # any world size

or with plain dicts: ``state = mxt.dcp.state_dict(model, opt)``; ``dcp.save(state, ...)`` /
``dcp.load(state, ...)`` then ``mxt.dcp.load_state_dict(model, opt, state)``.

What is saved, keyed by the model's own param names (``named_parameters()`` of the wrapped module,
so a model wrapped another way, DDP or FSDP, at another dp size or bucket size, loads it):
``model.<name>``: the module's state dict (params and buffers, full tensors: DCP writes each once);
``optimizer.state.<name>.{main_param, exp_avg, exp_avg_sq | momentum_buffer}``: the optimizer's
F32 shards, each param flattened to 1-D and each rank's contiguous ranges its chunks;
``optimizer.state.<name>.step`` (torch's per-param step); ``optimizer.mxddp``: one JSON string with
the format, the optimizer kind, the param names and shapes, torch's ``param_groups`` (params named)
and a checksum of every sharded entry and of every buffer and frozen param.

Why not DTensor: a DTensor's Shard placement cuts a tensor into torch.chunk's even pieces, but mxddp
shards buffers of padded buckets, so a rank holds arbitrary element ranges of each param (none,
part, or all of it). ShardedTensor takes explicit ranges but is deprecated. DCP's
``CheckpointableTensor`` protocol (a plain tensor carrying global_shape and per-chunk offsets) says
exactly that, without placements or a collective to build metadata.

A load touches nothing until everything is in and checked: ``state_dict`` hands DCP copies (so a
save is a snapshot, and a load reads into them), and ``load_state_dict`` checks the format, the
optimizer kind, the param names and shapes, the param groups (as many, each with the same params)
and the checksums (exact: a sum of the F32 bit patterns weighted by their position, modulo 2^64,
which any sharding computes alike and a flipped bit or a chunk in the wrong place changes; the
buffers' and frozen params' over their bytes, any dtype), agrees
across ranks, and only then writes; the groups' values (lr, ...) are the checkpoint's after it, as
torch's Optimizer.load_state_dict leaves them. DCP itself refuses missing keys and size mismatches
before reading anything.
Needs torch.distributed initialized on the same ranks as mxddp (gloo on the CPU). Replicated
entries (the model's tensors, the steps) are written by one rank (DCP's dedup), so buffers must agree
across ranks (torch DDP's broadcast_buffers) to come back as every rank had them; a save warns
naming those that do not.
"""
from __future__ import annotations

import itertools
import json
import warnings
from typing import Any

import torch
import torch.distributed as dist

from mxddp.torch import launch, load_state
from mxddp.torch.checkpoint import _check_pair
from mxddp.torch.optimizer import DistributedOptimizer
from mxddp.torch.wrapper import DataParallelModule

# Bumped when the layout of what state_dict returns changes; a load refuses another.
FORMAT_VERSION = 1
_MAIN = "main_param"  # the F32 master copy (Megatron's dist-opt saves it as fp32_param)


def has_checkpointable_tensors() -> bool:
    """Whether this torch's DCP reads the CheckpointableTensor protocol (torch.distributed.checkpoint.
    protocol). Without it DCP takes the optimizer's shards for replicated tensors and writes one rank's
    only: the others' ranges would be lost at save."""
    try:
        from torch.distributed.checkpoint.protocol import CheckpointableTensor  # noqa: F401
    except ImportError:
        return False
    return True


def _check(model, optimizer, what: str) -> None:
    if not has_checkpointable_tensors():
        raise NotImplementedError(
            f"{what}: torch {torch.__version__}'s DCP has no CheckpointableTensor protocol "
            "(torch.distributed.checkpoint.protocol), which mxddp's sharded optimizer state needs; without it DCP "
            "would keep one rank's shards only. Use a torch that has it, or mxt.save_checkpoint / load_checkpoint")
    _check_pair(model, optimizer, what)  # mxddp's own checkpoints' checks: the types, the pair, HSDP
    if model.device.type != "cpu":
        raise NotImplementedError(f"{what}: the model is on {model.device}; DCP state dicts of GPU models are not "
                                  "built yet (docs/python.md, 'GPUs'): use mxt.save_checkpoint / load_checkpoint")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what}: torch.distributed is not initialized; DCP needs it "
                           "(torch.distributed.init_process_group('gloo', ...) on the ranks mxddp runs on)")
    if (dist.get_rank(), dist.get_world_size()) != (launch.rank(), launch.world_size()):
        raise RuntimeError(f"{what}: torch.distributed's default group is rank {dist.get_rank()} of "
                           f"{dist.get_world_size()} but mxddp's is rank {launch.rank()} of {launch.world_size()}; "
                           "they must be the same ranks")
    if model._grads_pending_sync:
        raise RuntimeError(f"{what}: gradients were reported but not synchronized; call model.finish_grad_sync() "
                           "(and opt.step()) first")


# ---- The optimizer's kind, param groups and steps (what differs between its two front ends) ----

def _kind(optimizer: DistributedOptimizer) -> str:
    """'adam' or 'sgd': the C++ optimizer's rule, whichever front end built it."""
    kind = getattr(optimizer, "_kind", None)
    return kind if kind is not None else optimizer.config.optimizer


def _groups(optimizer: DistributedOptimizer, model) -> list[dict[str, Any]]:
    """torch's param_groups with the params named (JSON: a tuple comes back a list): what a load
    restores, as torch's Optimizer.load_state_dict does. The optimizer built from an
    OptimizerConfig alone has one implicit group, whose lr is all it can change."""
    if not hasattr(optimizer, "param_groups"):
        return [{"lr": float(optimizer.lr), "params": list(model._names)}]
    name_of = {id(p): n for n, p in zip(model._names, model._params)}
    groups = []
    for g in optimizer.param_groups:
        entry = {k: v for k, v in g.items() if k != "params" and _is_json(v)}
        entry["params"] = [name_of[id(p)] for p in g["params"]]
        groups.append(entry)
    return groups


def _is_json(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (list, tuple)) and all(_is_json(v) for v in value)


def _check_groups(optimizer: DistributedOptimizer, model, saved):
    """Checks the checkpoint's groups against this optimizer's (the same number, each with the
    same params) before anything is written; returns the function that restores their values."""
    mine = _groups(optimizer, model)
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise ValueError(f"optimizer.mxddp: param_groups is {saved!r} in the checkpoint; valid: a list of dicts")
    if len(saved) != len(mine):
        raise ValueError(f"optimizer.mxddp: the checkpoint has {len(saved)} param group(s), this optimizer "
                         f"{len(mine)}")
    for i, (g, s) in enumerate(zip(mine, saved)):
        if s.get("params") != g["params"]:
            raise ValueError(f"optimizer.mxddp: param group {i} holds {s.get('params')!r} in the checkpoint but "
                             f"{g['params']!r} here")
        lr = s.get("lr")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise ValueError(f"optimizer.mxddp: param group {i}'s lr is {lr!r} in the checkpoint; valid: a number")

    def restore():
        if not hasattr(optimizer, "param_groups"):
            optimizer.lr = float(saved[0]["lr"])
            return
        for g, s in zip(optimizer.param_groups, saved):
            for key, value in s.items():
                if key != "params":
                    g[key] = tuple(value) if isinstance(g.get(key), tuple) and isinstance(value, list) else value
    return restore


def _param_steps(optimizer: DistributedOptimizer, count: int) -> list[int]:
    """Each param's own step count (torch's state['step']: a param no step touched stays behind)."""
    return [int(optimizer._cpp.param_step(i)) for i in range(count)]


def _set_steps(optimizer: DistributedOptimizer, total: int, steps: list[int]) -> None:
    optimizer._cpp.set_step_count(total)  # the optimizer's count, and every param's with it
    for i, step in enumerate(steps):
        if step != total:
            optimizer._cpp.set_param_step(i, step)


# ---- The shard layout ----

def _pieces(optimizer: DistributedOptimizer, ranges: str) -> dict[int, list[tuple[int, int, int, int]]]:
    """param -> [(bucket, start, end, shard_offset)]: the elements [start, end) of the flattened param
    this rank's bucket views hold at shard_offset; ranges 'update' (what it holds) or 'owned' (what it
    answers for: each element on one rank)."""
    cpp = optimizer._cpp
    out: dict[int, list[tuple[int, int, int, int]]] = {}
    for b in range(cpp.num_buckets):
        for param, start, end, shard_start, _shard_end in getattr(cpp, f"{ranges}_ranges")(b):
            if end > start:
                out.setdefault(param, []).append((b, start, end, shard_start))
    for v in out.values():
        v.sort(key=lambda piece: piece[1])
    return out


def _chunked(values: torch.Tensor, pieces, numel: int) -> torch.Tensor:
    """values (the pieces one after another) as a CheckpointableTensor of the flattened param."""
    values.global_shape = (numel,)
    offsets, local = [], 0
    for _b, start, end, _s in pieces:
        offsets.append(local)
        local += end - start
    values.global_offsets = tuple((start,) for _b, start, _e, _s in pieces)
    values.local_offsets = tuple((o,) for o in offsets)
    values.local_sizes = tuple((end - start,) for _b, start, end, _s in pieces)
    return values


def _entry_views(optimizer: DistributedOptimizer) -> list[tuple[str, Any]]:
    """(entry name, bucket -> f32 view): the main params and every state."""
    cpp = optimizer._cpp
    views = [(_MAIN, cpp.main_params)]
    views += [(n, (lambda b, i=i: cpp.state(i, b))) for i, n in enumerate(cpp.state_names)]
    return views


_WORDS_PER_CHUNK = 1 << 20  # bounds the int64 temporaries of a large tensor's checksum


def _weighted_sum(words: torch.Tensor, first_index: int) -> torch.Tensor:
    """sum(word x (first_index + position)) over a 1-D integer tensor, as an int64 scalar (torch's
    int64 arithmetic wraps, so this is modulo 2^64 and any split into pieces sums alike), a chunk
    at a time."""
    total = torch.zeros((), dtype=torch.int64)
    for lo in range(0, words.numel(), _WORDS_PER_CHUNK):
        part = words[lo:lo + _WORDS_PER_CHUNK].to(torch.int64)
        total += (part * torch.arange(first_index + lo, first_index + lo + part.numel(), dtype=torch.int64)).sum()
    return total


def _checksums(optimizer, values: dict[str, dict[str, torch.Tensor]], names, held, owned) -> dict[str, dict[str, int]]:
    """Collective. Per param and entry: the sum over the param's elements of (F32 bits as int32) x
    (flat index + 1), modulo 2^64 (torch's int64 arithmetic wraps), over each rank's owned elements
    (each counted once) taken from `values` (laid out as `held`'s pieces)."""
    entries = [n for n, _ in _entry_views(optimizer)]
    sums = torch.zeros(len(names), len(entries), dtype=torch.int64)
    for i, name in enumerate(names):
        hp = held.get(i, [])
        starts, local = [], 0
        for _b, start, end, _s in hp:
            starts.append(local)
            local += end - start
        for _b, start, end, _s in owned.get(i, []):
            k = next(k for k, p in enumerate(hp) if p[1] <= start and end <= p[2])
            lo = starts[k] + start - hp[k][1]
            for j, entry in enumerate(entries):
                sums[i, j] += _weighted_sum(values[name][entry][lo:lo + end - start].view(torch.int32), start + 1)
    dist.all_reduce(sums)
    return {name: {e: int(sums[i, j]) for j, e in enumerate(entries)} for i, name in enumerate(names)}


def _bits_checksum(t: torch.Tensor) -> int:
    """Any dtype: the optimizer entries' weighted sum (_weighted_sum, from index 1) over the tensor's
    bytes read as int32 words (int16 or bytes where its size is not a multiple of 4 or 2)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw.view(torch.int16) if raw.numel() % 2 == 0 else raw
    return int(_weighted_sum(words, 1))


def _module_entries(model, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Of the model's DCP entries, those a load copies into the module as they are: its buffers and
    frozen params (the registered params come from the optimizer's main params)."""
    registered = {id(p) for p in model._params}
    module_state = model.module.state_dict(keep_vars=True)
    return {k: v for k, v in entries.items() if k in module_state and id(module_state[k]) not in registered}


def _model_checksums(model, entries: dict[str, torch.Tensor]) -> dict[str, int]:
    """Collective. The checksum of each buffer and frozen param the ranks hold alike. DCP writes a
    replicated entry from one rank of its choosing, so one the ranks disagree on has no checksum and
    comes back as that rank's: warned about, naming it (torch DDP's broadcast_buffers keeps them alike)."""
    mine = {k: _bits_checksum(v) for k, v in _module_entries(model, entries).items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = sorted(k for k in mine if any(other.get(k) != mine[k] for other in every))
    if differ:
        warnings.warn(f"mxddp.torch.dcp.state_dict: the ranks hold different values of {differ}; DCP saves one "
                      "rank's copy of each, which a load gives every rank (broadcast the buffers first, as torch "
                      "DDP's broadcast_buffers does, to save what every rank has)", RuntimeWarning, stacklevel=3)
    return {k: v for k, v in mine.items() if k not in differ}


def _optimizer_state_dict(model, optimizer, model_checksums: dict[str, int]) -> dict[str, Any]:
    names = model._names
    held, owned = _pieces(optimizer, "update"), _pieces(optimizer, "owned")
    steps = _param_steps(optimizer, len(names))
    state: dict[str, dict[str, torch.Tensor]] = {}
    for i, name in enumerate(names):
        pieces = held.get(i, [])
        entry = {}
        for key, view in _entry_views(optimizer):
            parts = [view(b)[s:s + end - start] for b, start, end, s in pieces]
            values = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)  # a copy
            entry[key] = _chunked(values, pieces, model._params[i].numel())
        entry["step"] = torch.tensor(float(steps[i]), dtype=torch.float32)
        state[name] = entry
    # One JSON string, so DCP stores it as one item and a load gets all of it back: a nested
    # dict would be flattened into an item per leaf, and a load reads only the leaves it asks
    # for (it would not see a param the checkpoint has and this model lacks).
    meta = {"format": FORMAT_VERSION, "optimizer": _kind(optimizer), "step_count": int(optimizer.step_count),
            "params": [[n, list(p.shape)] for n, p in zip(names, model._params)],
            "param_groups": _groups(optimizer, model),
            "checksums": _checksums(optimizer, state, names, held, owned),
            "model_checksums": model_checksums}
    return {"state": state, "mxddp": json.dumps(meta)}


def _model_state_dict(model) -> dict[str, torch.Tensor]:
    """The wrapped module's state dict, keys without the wrapper's ``module.``, every tensor a copy."""
    # DDP's registered params are copies already (FSDP's gathered); buffers and frozen params are
    # torch's views of the live tensors.
    live = {t.data_ptr() for t in itertools.chain(model.module.parameters(), model.module.buffers())}
    out = {}
    for key, value in model.state_dict().items():
        name = key[len("module."):] if key.startswith("module.") else key
        out[name] = value.detach().clone() if value.data_ptr() in live else value
    return out


def state_dict(model: DataParallelModule, optimizer: DistributedOptimizer) -> dict[str, Any]:
    """Collective (every rank calls it, as dcp.save/load). ``{"model": ..., "optimizer": ...}`` for
    ``torch.distributed.checkpoint``: a snapshot of copies (the model's full tensors, this rank's
    optimizer chunks), so a save writes the state of this moment and a load reads into them;
    ``load_state_dict`` then applies what a ``dcp.load`` put in. Costs a copy of the model and of
    this rank's optimizer shard while it lives."""
    _check(model, optimizer, "mxddp.torch.dcp.state_dict")
    model.finish_param_sync()
    optimizer._take_param_writes()  # values written into the params are what is saved
    entries = _model_state_dict(model)
    return {"model": entries, "optimizer": _optimizer_state_dict(model, optimizer, _model_checksums(model, entries))}


def _check_state(model, optimizer, state):
    """What a load checks on this rank before the checksums (from the checkpoint's metadata, the
    same on every rank): returns (the metadata, the function that sets the groups)."""
    if not isinstance(state, dict) or set(state) != {"model", "optimizer"}:
        raise ValueError("the state must be what mxddp.torch.dcp.state_dict returned (keys 'model', 'optimizer'); "
                         f"got {sorted(state) if isinstance(state, dict) else type(state).__name__}")
    try:
        meta = json.loads(state["optimizer"]["mxddp"])
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"optimizer.mxddp: not mxddp's checkpoint metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"optimizer.mxddp: checkpoint format {found!r} is not this package's ({FORMAT_VERSION})")
    if isinstance(meta.get("step_count"), bool) or not isinstance(meta.get("step_count"), int) \
            or meta["step_count"] < 0:
        raise ValueError(f"optimizer.mxddp: step_count is {meta.get('step_count')!r} in the checkpoint; valid: an "
                         "int, 0 or more")
    if meta.get("optimizer") != _kind(optimizer):
        raise ValueError(f"optimizer.mxddp: the checkpoint is of a '{meta.get('optimizer')}' optimizer; this one is "
                         f"'{_kind(optimizer)}'")
    names = model._names
    shapes = {n: shape for n, shape in meta.get("params", [])}
    if list(shapes) != list(names):
        missing = [n for n in names if n not in shapes]
        extra = [n for n in shapes if n not in names]
        raise ValueError(f"optimizer.mxddp: the checkpoint's params differ from this model's: missing {missing}, "
                         f"not in this model {extra}" if missing or extra else
                         "optimizer.mxddp: the checkpoint holds this model's params in another order")
    for n, p in zip(names, model._params):
        if list(shapes[n]) != list(p.shape):
            raise ValueError(f"param '{n}' has shape {list(shapes[n])} in the checkpoint but {list(p.shape)} here")
    return meta, _check_groups(optimizer, model, meta.get("param_groups"))


def _compare_checksums(meta, sums, model, model_entries) -> None:
    for n, entries in sums.items():
        for e, v in entries.items():
            saved = meta.get("checksums", {}).get(n, {}).get(e)
            if saved != v:
                raise ValueError(f"optimizer.state.{n}.{e}: checksum {v} of the loaded values differs from the "
                                 f"saved {saved}: the checkpoint is corrupted")
    # Buffers and frozen params; a checkpoint from before they had checksums (or one the ranks
    # disagreed on when it was saved) has none for them.
    saved_model = meta.get("model_checksums", {})
    for k, t in _module_entries(model, model_entries).items():
        loaded = _bits_checksum(t) if k in saved_model else None
        if loaded is not None and loaded != saved_model[k]:
            raise ValueError(f"model.{k}: checksum {loaded} of the loaded values differs from the saved "
                             f"{saved_model[k]}: the checkpoint is corrupted")


def load_state_dict(model: DataParallelModule, optimizer: DistributedOptimizer, state: dict[str, Any]) -> None:
    """Collective. Applies ``state`` (a ``state_dict`` that ``dcp.load`` filled) to the optimizer's
    main params, states, step counts and lr, then the params (from the main params, the master copy)
    and the module's buffers and frozen params. Every check comes first and the ranks agree on the
    outcome; on any failure every rank raises naming it and nothing has changed."""
    _check(model, optimizer, "mxddp.torch.dcp.load_state_dict")
    what = "mxddp.torch.dcp.load_state_dict"
    meta, set_groups = load_state.agreed(what, None, lambda: _check_state(model, optimizer, state))
    names, values = model._names, state["optimizer"]["state"]
    held, owned = _pieces(optimizer, "update"), _pieces(optimizer, "owned")
    sums = _checksums(optimizer, values, names, held, owned)
    # The same outcome everywhere (the optimizer's sums are global; DCP gives every rank the same
    # model entries).
    load_state.agreed(what, None, lambda: _compare_checksums(meta, sums, model, state["model"]))
    steps = [int(round(float(values[n]["step"]))) for n in names]
    optimizer._take_param_writes()  # now, not in force_param_sync below: the load writes over them
    with torch.no_grad():
        for i, name in enumerate(names):
            local = 0
            for b, start, end, s in held.get(i, []):
                for key, view in _entry_views(optimizer):
                    view(b)[s:s + end - start].copy_(values[name][key][local:local + end - start])
                local += end - start
        registered = {id(p) for p in model._params}
        module_state = model.module.state_dict(keep_vars=True)
        for key, value in state["model"].items():
            target = module_state.get(key)
            if target is not None and id(target) not in registered:
                target.copy_(value)
    _set_steps(optimizer, int(meta["step_count"]), steps)
    set_groups()
    optimizer.force_param_sync()  # every rank's params from the main params just written


class AppState:
    """A ``Stateful`` for ``dcp.save({"app": AppState(model, opt)}, ...)`` and ``dcp.load`` (which
    calls ``state_dict`` for the tensors to read into and ``load_state_dict`` once they are in).
    torch's ``Stateful`` is a runtime-checkable protocol, so these two methods make it one without
    importing torch.distributed.checkpoint (seconds) whenever mxddp.torch is imported."""

    def __init__(self, model: DataParallelModule, optimizer: DistributedOptimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: A002 (torch's name)
        load_state_dict(self.model, self.optimizer, state_dict)
