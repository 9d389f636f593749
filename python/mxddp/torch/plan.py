"""``mxddp.torch.plan``: the model-state bytes each rank will hold, before anything is allocated.

The figures come from mxddp's C++ memory planner (plan.h's ``plan_ddp_memory``, and
``plan_fsdp_memory`` when ``cfg.use_megatron_fsdp``), which replays the allocations of the DDP's or
FSDP's buffers, the gathers and transient gradients of FSDP's iterations, the distributed
optimizer's shards and the MPI backend's gradient-sync staging against a memory tracker without
making them. They are per rank (every rank holds the same bytes) and equal, category by category
and to the byte, what ``memory_usage()`` reports once the model has synchronized its gradients and
the optimizer has stepped (FSDP: after two iterations or more; the peaks from its construction).

FSDP's units come from ``fsdp_units`` (the function FullyShardedDataParallel forms them with), from
``fsdp_unit_modules`` and the fine-grained param gather; the plan drives the hooked modules in the
order the FSDP's hooks run (docs/plan.md, "FSDP for torch modules").

Planning needs no ranks: ``mxddp.torch.init()`` need not have been called, and ``world`` may be any
size (a plan for 64 ranks from one laptop process). The module may live on the meta device
(``with torch.device("meta"): module = ...``), so a model too large to build can be planned.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from mxddp import _C
from mxddp.torch.config import DistributedDataParallelConfig, OptimizerConfig
from mxddp.torch.ddp import _DTYPES, _check_fusion_flag, _mxfp8_flags, _mxfp8_kinds, _trainable_params
from mxddp.torch.fsdp import colwise_forward_flags, decide_fine_grained, fusion_flags, unit_mxfp8_flags
from mxddp.torch.fsdp_units import check_unit_module_classes, fsdp_units, in_forward_order, recompute_regions

# Micro-batches per iteration: the planner replays at most four (later ones repeat), so the bound
# only keeps the count an int the C++ side takes.
_MICRO_BATCHES_MAX = (1 << 31) - 1

# The planner's bound: 2^20 ranks (docs/plan.md), far beyond any machine, small enough that no
# figure overflows.
_WORLD_MAX = 1 << 20


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's bytes per category (the tracker's names: params, grads, main_params,
    optimizer_state, mxfp8, scratch, comm, gathered), and the layout they come from."""

    world: int
    live_bytes: dict[str, int]   # after a gradient sync and a step
    peak_bytes: dict[str, int]   # from construction on (the DDP holds no transients: = live)
    total_live_bytes: int
    total_peak_bytes: int        # the peak of the sum
    params_numel: int            # the registered params' elements (a tied param once)
    buffer_numel: int            # the padded buffer: params + start alignment + bucket-end padding
    num_buckets: int
    param_start_padding_numel: int
    bucket_end_padding_numel: int
    buckets: list[tuple[int, int]]  # per bucket in buffer order: (elements, padding at its end)
    # The iterations after the first (peaks from then on): what every later iteration reaches.
    steady_peak_bytes: dict[str, int] = field(default_factory=dict)
    steady_total_peak_bytes: int = 0
    # FSDP: the most bytes gathered at once per slot ("values", "rowwise", "colwise"; MXFP8 params
    # gather a row-wise copy for forward and a column-wise one for backward); DDP: zeros.
    peak_gathered_bytes: dict[str, int] = field(default_factory=dict)
    strategy: str = "ddp"          # "ddp", or the FSDP's data_parallel_sharding_strategy
    num_units: int = 0             # FSDP: the units gathered and released together
    largest_unit_numel: int = 0    # FSDP: the largest unit's padded elements
    # "host" and "device": each place's own {live_bytes, peak_bytes, total_live_bytes, total_peak_bytes}
    # (plan(device="cuda") puts the data-parallel buffers and the optimizer's state on the device).
    by_place: dict[str, dict] = field(default_factory=dict)
    device: str = "cpu"            # what plan() was asked for

    def memory_usage(self, place: Optional[str] = None) -> dict[str, tuple[int, int]]:
        """The plan in ``mxddp.torch.memory_usage(place)``'s form: {category: (live_bytes, peak_bytes)},
        on every place together (None) or on the "host" or the "device" alone."""
        if place is None:
            return {k: (self.live_bytes[k], self.peak_bytes[k]) for k in self.live_bytes}
        if place not in ("host", "device"):
            raise ValueError(f"place={place!r} is not valid; valid: None, 'host', 'device'")
        one = self.by_place[place]
        return {k: (one["live_bytes"][k], one["peak_bytes"][k]) for k in one["live_bytes"]}

    def __str__(self) -> str:
        what = "DDP" if self.strategy == "ddp" else f"FSDP {self.strategy}, {self.num_units} unit(s)"
        rows = [f"mxddp plan per rank at world {self.world} ({what}): {self.params_numel} params in "
                f"{self.buffer_numel} buffer elements, {self.num_buckets} bucket(s)"]
        for k, v in self.peak_bytes.items():
            if v:
                rows.append(f"  {k:16} {v:>16,} B")
        rows.append(f"  {'total':16} {self.total_peak_bytes:>16,} B")
        for k, v in self.peak_gathered_bytes.items():
            if v:
                rows.append(f"  gathered {k:7} {v:>16,} B at most at once")
        return "\n".join(rows)


def _planned_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The params DistributedDataParallel would register, with the same checks; a module on the
    meta device (no storage to compare) is checked for all but shared storage."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"plan takes a torch.nn.Module; got {type(module).__name__}")
    return _trainable_params(module, meta_ok=True)


def plan(module: torch.nn.Module, world: int, cfg: DistributedDataParallelConfig | None = None,
         opt_cfg: OptimizerConfig | None = None, fsdp_unit_modules: Optional[Sequence] = None,
         micro_batches: int = 1, forward_order: Optional[Sequence[str]] = None,
         checkpointed_modules: Optional[Sequence] = None, gradient_accumulation_fusion: bool = True,
         device: str = "cpu") -> MemoryPlan:
    """The bytes per rank per category that ``DistributedDataParallel(module, cfg)`` (and, with
    ``opt_cfg``, a ``DistributedOptimizer`` on it) hold at ``world`` ranks after a gradient sync and a
    step: the same figures ``memory_usage()`` reports then, to the byte. With
    ``cfg.use_megatron_fsdp``, the same for ``FullyShardedDataParallel(module, cfg,
    fsdp_unit_modules)`` trained with ``micro_batches`` micro-batches per iteration, after two
    iterations or more: its shards, its gathers and transient gradients at their peak, and the most
    bytes gathered at once per slot (``peak_gathered_bytes``).

    module: a torch.nn.Module on the CPU or the meta device, whose trainable params (a tied param
    once, frozen ones left out) are what the DDP would register. world: the data-parallel size,
    1..2^20. cfg: the DDP's config (default: the default config). opt_cfg: the optimizer's config,
    or None to plan the DDP alone (its optimizer then holds nothing); for DDP it needs
    ``cfg.use_distributed_optimizer``. fsdp_unit_modules (FSDP only): the module classes that form
    units, e.g. ``[GPT2Block]``. micro_batches (FSDP only; DDP's bytes do not depend on it): per
    iteration, the first ones under ``no_sync``. checkpointed_modules (FSDP only; DDP's bytes do
    not depend on it): the module classes whose forward ``torch.utils.checkpoint`` re-runs in
    backward (what HF's ``gradient_checkpointing_enable()`` wraps: the decoder layer class), so
    the plan replays that re-run's gathers: with fine-grained units a layer's units are gathered
    together again for its backward (docs/plan.md). None: no activation recompute.
    gradient_accumulation_fusion (FSDP only): as the wrapper's (True, its default, has a fused
    non-unit weight's unsharded grads from its last reader's backward on). The FSDP plan
    replays the units in module-tree order, or (FSDP only) in
    ``forward_order``: the names of the units' modules in the order the model's forward calls them,
    as ``FullyShardedDataParallel.forward_order`` reports after a forward; where the two differ
    (fine-grained units of a Llama layer) only the latter gives the gathered peaks to the byte.
    device: where the ranks' modules will be, "cpu" or "cuda": on a GPU the DDP's or FSDP's buffers
    and the optimizer's state are planned as device bytes (``MemoryPlan.memory_usage("device")``),
    and no gradient staging (the NCCL engine has none; the staged engine's page-locked copies are
    not planned).
    Needs no ``init()`` and no ranks; allocates nothing.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not valid; valid: 'cpu', 'cuda'")
    place = "device" if device == "cuda" else "host"
    if isinstance(world, bool) or not isinstance(world, int):
        raise TypeError(f"world must be an int (the data-parallel size); got {world!r}")
    if not 1 <= world <= _WORLD_MAX:
        raise ValueError(f"world={world} is not valid: the data-parallel size is 1..{_WORLD_MAX}")
    cfg = DistributedDataParallelConfig() if cfg is None else cfg
    if not isinstance(cfg, DistributedDataParallelConfig):
        raise TypeError(f"cfg must be a mxddp.torch.DistributedDataParallelConfig; got {type(cfg).__name__}")
    if opt_cfg is not None and not isinstance(opt_cfg, OptimizerConfig):
        raise TypeError(f"opt_cfg must be a mxddp.torch.OptimizerConfig or None; got {type(opt_cfg).__name__}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) \
            or not 1 <= micro_batches <= _MICRO_BATCHES_MAX:
        raise ValueError(f"micro_batches={micro_batches!r} is not valid: an int, 1..{_MICRO_BATCHES_MAX}")
    _check_fusion_flag(gradient_accumulation_fusion)
    if cfg.use_megatron_fsdp:
        return _plan_fsdp(module, world, cfg, opt_cfg, fsdp_unit_modules, micro_batches, forward_order,
                          checkpointed_modules, gradient_accumulation_fusion, place)
    check_unit_module_classes(checkpointed_modules, "checkpointed_modules")
    if forward_order is not None:
        raise ValueError("forward_order is given but cfg.use_megatron_fsdp is False: it orders FSDP's units")
    if fsdp_unit_modules is not None:
        raise ValueError("fsdp_unit_modules is given but cfg.use_megatron_fsdp is False: units are FSDP's (set "
                         "use_megatron_fsdp=True, or pass fsdp_unit_modules=None to plan the DDP)")
    params = _planned_params(module)
    dtype = params[0][1].dtype
    # The DDP's own rule for which params are MXFP8 (plain nn.Linear and HF Conv1D weights, the mxfp8 attribute).
    mxfp8_flags = _mxfp8_flags(module, params, cfg)
    specs = [(name, list(p.shape), bool(getattr(p, "shared_embedding", False)), flag)
             for (name, p), flag in zip(params, mxfp8_flags)]
    # cfg.to_cpp carries every field the config accepts, so the plan follows whatever it says.
    out = _C.plan_ddp_memory(specs, cfg.to_cpp(_DTYPES[dtype]), None if opt_cfg is None else opt_cfg.optimizer, world,
                             place)
    return _memory_plan(out, device=device)


def _plan_fsdp(module: torch.nn.Module, world: int, cfg: DistributedDataParallelConfig,
               opt_cfg: OptimizerConfig | None, fsdp_unit_modules: Optional[Sequence],
               micro_batches: int, forward_order: Optional[Sequence[str]],
               checkpointed_modules: Optional[Sequence], gradient_accumulation_fusion: bool, place: str) -> MemoryPlan:
    params = _planned_params(module)
    dtype = params[0][1].dtype
    names, tensors = [n for n, _ in params], [p for _, p in params]
    # FullyShardedDataParallel's own rules, called as it calls them: which params are MXFP8 (the
    # DDP's plain nn.Linear and HF Conv1D weights, those in units only, and which copy each
    # one's forward reads), the fine-grained gather (with no recompute granularity: Megatron's
    # names the policy takes, which a torch.utils.checkpoint around a layer is not), and the units.
    mxfp8_flags = unit_mxfp8_flags(module, params, cfg, fsdp_unit_modules)
    fine = decide_fine_grained(cfg, any(mxfp8_flags), None, [])
    units = fsdp_units(module, names, tensors, fsdp_unit_modules, fine)
    if not units.units:
        raise ValueError("use_megatron_fsdp=True needs units, and fsdp_unit_modules makes none here: pass the classes "
                         "of the module's repeated blocks (e.g. fsdp_unit_modules=[GPT2Block])")
    fsdp_cfg = cfg.to_fsdp_cpp(_DTYPES[dtype])
    specs = [(name, list(p.shape), bool(getattr(p, "shared_embedding", False)), flag)
             for (name, p), flag in zip(params, mxfp8_flags)]
    ordered = in_forward_order(units.hooked, forward_order)
    regions = recompute_regions(module, ordered, checkpointed_modules)
    hooked = [(list(h.params), h.unit, region) for h, region in zip(ordered, regions)]
    colwise = colwise_forward_flags(_mxfp8_kinds(module, tensors, mxfp8_flags), len(tensors))
    fused = fusion_flags(module, params, cfg, mxfp8_flags, gradient_accumulation_fusion)
    out = _C.plan_fsdp_memory(specs, units.units, hooked, fsdp_cfg,
                              None if opt_cfg is None else opt_cfg.optimizer, world, micro_batches,
                              colwise if any(colwise) else [], fused if any(fused) else [],
                              cfg.num_distributed_optimizer_instances, place)
    return _memory_plan(out, strategy=cfg.data_parallel_sharding_strategy, num_units=len(units.units),
                        device="cuda" if place == "device" else "cpu")


def _memory_plan(out: dict, strategy: str = "ddp", num_units: int = 0, device: str = "cpu") -> MemoryPlan:
    """A MemoryPlan from the planner's dict."""
    layout = out["layout"]
    return MemoryPlan(world=out["dp"], live_bytes=dict(out["live_bytes"]), peak_bytes=dict(out["peak_bytes"]),
                      total_live_bytes=out["total_live_bytes"], total_peak_bytes=out["total_peak_bytes"],
                      params_numel=layout["params_numel"], buffer_numel=layout["buffer_numel"],
                      num_buckets=layout["num_buckets"], param_start_padding_numel=layout["param_start_padding_numel"],
                      bucket_end_padding_numel=layout["bucket_end_padding_numel"],
                      buckets=[tuple(b) for b in layout["buckets"]],
                      steady_peak_bytes=dict(out["steady_peak_bytes"]),
                      steady_total_peak_bytes=out["steady_total_peak_bytes"],
                      peak_gathered_bytes=dict(out["peak_gathered_bytes"]), strategy=strategy, num_units=num_units,
                      largest_unit_numel=layout["largest_unit_numel"], by_place=dict(out["by_place"]), device=device)
