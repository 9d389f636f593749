"""``FullyShardedDataParallel`` for any PyTorch module, on mxddp's C++ FSDP (Megatron-FSDP).

Construction finds the units (``fsdp_units.py``: every module of a class in ``fsdp_unit_modules``,
or with the fine-grained param gather each weighted submodule of one) and hands the trainable
params, the units and the initial values to the C++ ``FullyShardedDataParallel``, which keeps on
each rank what ``data_parallel_sharding_strategy`` keeps (docs/fsdp.md has the table). The params,
the config and the units are compared across ranks first (``agreement.py``).

The C++ hooks are driven by torch module hooks (docs/python.md says why these):
  - the wrapper's forward gathers the non-unit params first (``before_forward``), kept until the
    gradients are synchronized: a model may read them outside their module (a tied head);
  - forward pre-hook of each unit module: ``before_forward`` gathers the unit, then the torch
    params become views of the gathered storage;
  - forward post-hook: the params go back to stand-ins (a NaN broadcast to their shape, no
    storage), then ``after_forward`` releases the unit; a recompute keeps them for its backward;
    with grad enabled it also registers the unit's pre-backward on its outputs
    (``register_multi_grad_hook``, mode "any": when the first output's gradient is computed);
  - pre-backward: ``before_backward`` re-gathers the unit and the params view it again;
  - a param's post-accumulate-grad hook adds ``param.grad`` into its ``main_grad`` (FSDP's
    transient unsharded grads) and reports it ready; with gradient accumulation fusion (the
    default, DDP's rule: ``grad_fusion.py``) a weight's modules add its dW into ``main_grad``
    themselves and its ready token reports it; a unit's post-backward (``after_backward``:
    release, reduce-scatter) runs when its last param has reported.
  - a forward pre-hook on each module that owns params but gathers none itself (a unit's
    submodule; a module of the non-unit params) refuses to run it where its params hold stand-ins
    or the values from before the last step (``_register_read_guards``).
Saved views. An op may save for backward not the param but a view of it (``F.linear`` saves
``weight.t()``), which points at the storage of the gather in forward, released after the unit's
forward; the re-gather in backward lands elsewhere. So while ``model(...)`` runs, a
``saved_tensors_hooks`` pair replaces a saved view of gathered param storage by (param, size,
stride, offset) and rebuilds it in backward from the param's storage then. Inside
``torch.utils.checkpoint`` (non-reentrant) its own hooks take precedence, and the recompute's views
are of the backward's gather, which is still held when they are read. Call the wrapper, not the
inner module, so the hooks are on.

With params that are not sharded (``no_shard``, ``optim``, ``optim_grads``) the torch params view
the resident param storage for the model's whole life, and only the hooks' waits and reductions
remain. A param that took no gradient in a backward (unused) is reported with a zero gradient
when the gradients are synchronized or the next forward starts.

Every swap of a param's ``.data`` goes through ``_set_data``, which re-records its pointer for the
check that a param was not replaced after wrapping (``wrapper.py``), made at the start of the
wrapper's forward (before any swap) and of ``finish_grad_sync``.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten

from mxddp import _C
from mxddp.torch import (agreement, device as devices, grad_fusion, hsdp, launch, load_state, mxfp8, param_writes,
                         process_group as process_groups)
from mxddp.torch.config import DistributedDataParallelConfig
from mxddp.torch.ddp import (_DTYPES, _check_force_all_reduce, _check_fusion_flag, _fusion_flags, _fusion_marks,
                              _mxfp8_flags, _mxfp8_kinds, _trainable_params)
from mxddp.torch.fsdp_units import fsdp_units, in_forward_order
from mxddp.torch.wrapper import DataParallelModule

RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")


def _in_backward() -> bool:
    """Inside an autograd backward (a recompute re-running forward), where a unit is gathered by its
    pre-backward."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def decide_fine_grained(config: DistributedDataParallelConfig, mxfp8_params: bool,
                        recompute_granularity: Optional[str], recompute_modules: Sequence[str]) -> bool:
    """Whether the fine-grained param gather is on: Megatron's rule (``megatron``: required for
    MXFP8 params with fp8_param_gather) or the recompute-aware one (required only where MXFP8 params
    meet a selective recompute that re-runs weighted submodules, mlp or layernorm, alone: their
    re-run reads row-wise weights, which in backward only a fine-grained gather brings), otherwise
    as the flag says. The same rule as the C++ trainer's (include/mxddp/fsdp_fine_grained.h)."""
    flag = config.megatron_fsdp_enable_fine_grained_param_gather
    if config.fine_grained_param_gather_policy == "megatron":
        required, why = mxfp8_params, "MXFP8 params with fp8_param_gather"
    else:
        reruns = recompute_granularity == "selective" and bool({"mlp", "layernorm"} & set(recompute_modules))
        required = mxfp8_params and reruns
        why = f"MXFP8 params with fp8_param_gather and selective recompute of {', '.join(recompute_modules)}"
    if required and flag is False:
        raise ValueError("megatron_fsdp_enable_fine_grained_param_gather=False is not valid here: the "
                         f"{config.fine_grained_param_gather_policy} policy requires the fine-grained param gather "
                         f"for {why}; valid: None or True")
    return required or flag is True


def _check_recompute(granularity: Optional[str], modules: Optional[Sequence[str]]) -> list[str]:
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity={granularity!r} is not valid; valid: None, 'full', 'selective'")
    if modules is None:
        return ["core_attn"] if granularity == "selective" else []
    if isinstance(modules, str) or not all(m in RECOMPUTE_MODULES for m in modules):
        raise ValueError(f"recompute_modules={modules!r} is not valid; valid: a list of {', '.join(RECOMPUTE_MODULES)}")
    if modules and granularity != "selective":
        raise ValueError(f"recompute_modules={list(modules)!r} needs recompute_granularity='selective'; "
                         f"got {granularity!r}")
    return list(modules)


def unit_mxfp8_flags(module: torch.nn.Module, params: list[tuple[str, torch.nn.Parameter]],
                     config: DistributedDataParallelConfig, fsdp_unit_modules) -> list[bool]:
    """The DDP package's MXFP8 flags (fp8_param_gather: plain nn.Linear and HF Conv1D weights), for
    the params in units only: MXFP8 params are gathered per unit and pass, so a Linear outside every
    unit (a head) stays BF16, and one marked ``mxfp8 = True`` there is refused. Unit membership does
    not depend on the fine-grained gather, so the coarse units decide it. (The memory plan calls it.)"""
    flags = _mxfp8_flags(module, params, config)
    names, tensors = [n for n, _ in params], [p for _, p in params]
    in_units = {i for u in fsdp_units(module, names, tensors, fsdp_unit_modules, False).units for i in u}
    for i, flag in enumerate(flags):
        if flag and i not in in_units:
            if getattr(tensors[i], "mxfp8", None) is True:
                raise ValueError(f"param '{names[i]}' is marked mxfp8=True but is in no FSDP unit: MXFP8 params are "
                                 "gathered per unit and pass; put its module inside a unit class of "
                                 "fsdp_unit_modules, or leave it BF16")
            flags[i] = False
    return flags


def fusion_flags(module: torch.nn.Module, params: list[tuple[str, torch.nn.Parameter]],
                 config: DistributedDataParallelConfig, mxfp8_flags: list[bool],
                 gradient_accumulation_fusion: bool) -> list[bool]:
    """[param] whether its modules' backward adds its weight gradient into main_grad (the FSDP's
    transient unsharded grads), by the DDP's rule (ddp.py's _fusion_flags; MXFP8 weights' Functions
    add theirs anyway)."""
    marks = _fusion_marks(params, gradient_accumulation_fusion)
    param_dtype = params[0][1].dtype
    grad_dtype = config.to_fsdp_cpp(_DTYPES[param_dtype]).grad_dtype  # the C++ FSDP's rule
    main_grad_dtype = next(t for t, name in _DTYPES.items() if name == grad_dtype)
    return _fusion_flags(grad_fusion.param_owners(module), params, marks, main_grad_dtype, mxfp8_flags)


def colwise_forward_flags(kinds: dict[int, str], num_params: int) -> list[bool]:
    """Per param, from the MXFP8 params' kinds (``_mxfp8_kinds``): whether it is an MXFP8 weight
    whose forward reads the column-wise copy (an HF Conv1D's W [in, out]); the C++ FSDP then gathers
    that copy for forward and the row-wise one for backward (``ParamSpec::mxfp8_colwise_forward``)."""
    return [i in kinds and mxfp8.forward_axis(kinds[i]) == "col" for i in range(num_params)]


class _SavedParamView:
    """A saved tensor that was a view of param ``index``'s gathered storage, rebuilt on unpack."""

    __slots__ = ("index", "size", "stride", "offset")

    def __init__(self, index: int, size, stride, offset: int):
        self.index, self.size, self.stride, self.offset = index, size, stride, offset


_warned_compiled_runs_eagerly = False


def _warn_compiled_runs_eagerly() -> None:
    global _warned_compiled_runs_eagerly
    if not _warned_compiled_runs_eagerly:
        _warned_compiled_runs_eagerly = True
        warnings.warn("torch.compile of a mxddp.torch FullyShardedDataParallel whose params are sharded "
                      "(optim_grads_params, or MXFP8 weights): its forward runs eagerly, uncompiled; compile the "
                      "module before wrapping it instead (docs/python.md, torch.compile)", stacklevel=2)


def _is_compiling() -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)  # torch >= 2.3
    return bool(is_compiling is not None and is_compiling())


class FullyShardedDataParallel(DataParallelModule):
    """Megatron-core's ``FullyShardedDataParallel(config, ddp_config, module, fsdp_unit_modules)``
    on mxddp's C++ FSDP, for a module on the CPU.

    ``config`` is a ``DistributedDataParallelConfig`` with ``use_megatron_fsdp=True`` and
    ``use_distributed_optimizer=True``. ``fsdp_unit_modules``: the classes whose instances are
    units (e.g. ``[GPT2Block]``); None makes the whole module one unit (gathered for its forward
    and again for its backward, as FSDP2's ``fully_shard`` on the root alone). ``recompute_granularity`` / ``recompute_modules`` (Megatron's
    TransformerConfig fields) say what the caller recomputes, for the recompute-aware policy only:
    the recompute itself is the caller's (``torch.utils.checkpoint``). ``gradient_accumulation_fusion``:
    as DistributedDataParallel's (``fused_params`` says which params it fuses).

    The training loop is DDP's: ``opt.zero_grad()``; micro-batches under ``no_sync()`` and the last
    one outside; ``model.finish_grad_sync()``; ``opt.step()``. With ``optim_grads_params`` a
    param's torch tensor holds values only while its unit is gathered (in its module's forward and
    backward); outside, it is a NaN stand-in of the right shape. ``close()`` (collective) gives
    every param its values back.
    """

    def __init__(self, module: torch.nn.Module, config: Optional[DistributedDataParallelConfig] = None,
                 fsdp_unit_modules: Optional[Sequence[type]] = None, *, recompute_granularity: Optional[str] = None,
                 recompute_modules: Optional[Sequence[str]] = None, gradient_accumulation_fusion: bool = True,
                 process_group=None, device_mesh=None):
        super().__init__()
        if process_group is not None and device_mesh is not None:
            raise ValueError("give FullyShardedDataParallel either process_group= (FSDP over that group) or "
                             "device_mesh= (hybrid sharding over a 2-D (replicate, shard) mesh), not both")

        def describe():
            _check_fusion_flag(gradient_accumulation_fusion)
            cfg = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True) \
                if config is None else config
            if not isinstance(cfg, DistributedDataParallelConfig):
                raise TypeError(f"config must be a mxddp.torch.DistributedDataParallelConfig; got {type(cfg).__name__}")
            if not cfg.use_megatron_fsdp:
                raise ValueError("FullyShardedDataParallel needs a config with use_megatron_fsdp=True (and "
                                 "use_distributed_optimizer=True); for DDP use mxddp.torch.DistributedDataParallel")
            modules = _check_recompute(recompute_granularity, recompute_modules)
            params = _trainable_params(module)
            on = devices.checked_device(params)
            names, tensors = [n for n, _ in params], [p for _, p in params]
            flags = unit_mxfp8_flags(module, params, cfg, fsdp_unit_modules)
            fused = fusion_flags(module, params, cfg, flags, gradient_accumulation_fusion)
            fine_grained = decide_fine_grained(cfg, any(flags), recompute_granularity, modules)
            units = fsdp_units(module, names, tensors, fsdp_unit_modules, fine_grained)
            items = agreement.param_items(names, tensors, flags) + cfg.agreement_items() + [
                ("FSDP units (each unit's params)", repr(units.units)),
                ("recompute_granularity", repr(recompute_granularity)), ("recompute_modules", repr(modules)),
                ("gradient_accumulation_fusion", repr(gradient_accumulation_fusion))] + devices.agreement_items(on)
            return (cfg, params, flags, fused, fine_grained, units, on), items

        # Checked, and compared across ranks (of process_group; of the world for plain FSDP and HSDP), before
        # the C++ FSDP exists, so a refusal leaves nothing allocated. The communicator first: it starts
        # mxddp if the script has not (under torchrun, on torch.distributed's default group).
        group_comm = process_groups.communicator_for(process_group)
        config, params, flags, self.fused_params, self.fine_grained_param_gather, self.units, self.device = \
            agreement.agree("FullyShardedDataParallel", describe, group_comm if process_group is not None else None)
        self.module = module
        self.ddp_config = config
        self.param_dtype = params[0][1].dtype
        self._names = [n for n, _ in params]
        self._params = [p for _, p in params]
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self._unit_of = [-1] * len(self._params)
        for u, members in enumerate(self.units.units):
            for i in members:
                self._unit_of[i] = u
        specs = [(n, list(p.shape), bool(getattr(p, "shared_embedding", False))) for n, p in params]
        self._mxfp8_kind = _mxfp8_kinds(module, self._params, flags)
        colwise = colwise_forward_flags(self._mxfp8_kind, len(self._params))
        # HSDP (mxddp.torch.hsdp): a (replicate, shard) device_mesh or config.num_distributed_optimizer_instances
        # shards within the shard group and all-reduces each reduced shard across the replica group.
        hybrid = hsdp.hsdp_communicators(device_mesh, config.num_distributed_optimizer_instances)
        comm, replica = hybrid if hybrid is not None else (group_comm, None)
        self._comm = comm  # the (shard) group's host communicator handle: the package's small collectives run on it
        self._stream = devices.current_stream(self.device)  # what the model's work must run on (None: the CPU)
        if self.device.type != "cpu":
            if hybrid is not None:
                raise NotImplementedError(f"hybrid sharding (device_mesh= or num_distributed_optimizer_instances) of a "
                                          f"module on {self.device} is not built: its two communicators would not be "
                                          "ordered on one stream; wrap it with plain FSDP, or keep it on the CPU")
            comm = devices.communicator_for(process_group, comm, self.device)
        self._buffers_comm = comm  # its backend: "nccl", or the host engine's name when staged
        self.device_mesh = device_mesh
        self._hybrid = hybrid is not None  # checkpoints refuse HSDP models (not handled yet)
        self._hooks: list = []
        self._replaced_forwards: list[torch.nn.Module] = []  # MXFP8 and fused modules
        self._cpp = _C.FullyShardedDataParallel(specs, self.units.units, config.to_fsdp_cpp(_DTYPES[self.param_dtype]),
                                                flags if any(flags) else [],
                                                [devices.host_tensor(p.detach()) for p in self._params],
                                                colwise if any(colwise) else [], comm=comm, replica=replica)
        launch._track_model(self)
        self._build_or_undo(lambda: self._build(module, config, flags))

    def _build(self, module: torch.nn.Module, config: DistributedDataParallelConfig, flags: list[bool]) -> None:
        """The constructor's part after the C++ FSDP exists: the params get their stand-ins or views,
        and the hooks and forwards go in."""
        self._mxfp8 = flags
        self._shards_params = self._cpp.shards_params
        self._saved_tensors_hooks = (self._eager(self._pack), self._eager(self._unpack))  # while it shards params
        self._eager_forward = self._eager(self._forward)
        self._init_sync_state()
        self._grads_live = False
        self._reported = [False] * len(self._params)
        self._unit_pending = [len(u) for u in self.units.units]
        self._unit_backward_started = [False] * len(self.units.units)
        # For a unit's MXFP8 modules standing in for its hooks in a re-run (_register_rerun_hooks):
        self._unit_in_forward = [False] * len(self.units.units)  # between its own pre- and post-forward
        # Ran forward with grad, and no re-run without its hooks has gathered for it since; cleared
        # by its post-backward.
        self._rerun_pending = [False] * len(self.units.units)
        self._rerun_left = [0] * len(self.units.units)  # its MXFP8 modules yet to run in that re-run
        self._units_called: Optional[list[int]] = None  # the units the running forward called, in order
        self._forward_order: Optional[list[str]] = None
        self._unit_names = {h.unit: h.name for h in self.units.hooked if h.unit >= 0}
        self._backward_seen = False
        self._gathered_storage: dict[int, int] = {}  # storage address -> param, for params viewing a gather
        owners = grad_fusion.param_owners(module)
        unit_modules = {id(h.module) for h in self.units.hooked if h.unit >= 0}
        rerun_owners: dict[int, dict[int, torch.nn.Module]] = {}  # unit -> its MXFP8 submodules, by id
        with torch.no_grad():
            for i, p in enumerate(self._params):
                if flags[i]:
                    p.data = mxfp8.stand_in(p.shape, p.dtype, self.device)
                    token = grad_fusion.new_ready_token(self.device)
                    self._hooks.append(token.register_post_accumulate_grad_hook(self._make_token_hook(i)))
                    for owner in owners[id(p)]:
                        mxfp8.install(owner, self._cpp, i, token)
                        self._replaced_forwards.append(owner)
                        # A fine-grained unit is the module itself, whose own hooks run in a re-run.
                        if self._unit_of[i] >= 0 and id(owner) not in unit_modules:
                            rerun_owners.setdefault(self._unit_of[i], {})[id(owner)] = owner
                    continue
                p.data = mxfp8.stand_in(p.shape, p.dtype, self.device) if self._shards_params else self._cpp.param(i)
                if self.fused_params[i]:
                    token = grad_fusion.new_ready_token(self.device)
                    live, cpp = weakref.ref(self), self._cpp  # wrapper.py, "Lifetime"
                    self._hooks += grad_fusion.register_ready_hooks(
                        token, p, lambda i=i: cpp.main_grad(i), lambda i=i: live()._report(i))
                    for owner in owners[id(p)]:
                        grad_fusion.install(owner, self._cpp, i, token)
                        self._replaced_forwards.append(owner)
                else:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(i)))
        for unit, modules in rerun_owners.items():
            self._register_rerun_hooks(unit, list(modules.values()))
        # Units only: the non-unit params are gathered when the wrapper's forward starts, since a
        # model may read them outside their module's forward (a tied LM head reading the embedding).
        for h in self.units.hooked:
            if h.unit >= 0:
                # First of the module's pre-hooks (as DDP's gather hooks): one registered before wrapping
                # may read the unit's params.
                pre, post = self._make_pre_forward(h.params, h.unit), self._make_post_forward(h.params, h.unit)
                self._hooks.append(h.module.register_forward_pre_hook(self._eager(pre), prepend=True))
                self._hooks.append(h.module.register_forward_hook(self._eager(post)))
        self._non_unit_params = self.units.non_unit_params
        self._defer_non_unit = config.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")
        # The non-unit params whose gradients come through the hook, and are held back (a fused
        # one adds its dW into main_grad itself).
        self._deferred_count = sum(1 for i in self._non_unit_params if not self.fused_params[i])
        self._deferred: list[tuple[int, Optional[torch.Tensor]]] = []  # non-unit grads not yet handed over
        # optim and optim_grads with overlap_param_gather: a step leaves each unit's updated params to its
        # next pre-forward (the non-unit ones to the wrapper's forward), so until then this rank's full
        # params hold the values from before the step. Whether each unit's, and the non-unit ones, hold
        # the last step's result (read by the guards below and finish_param_sync):
        self._stale_after_step = config.overlap_param_gather and \
            config.data_parallel_sharding_strategy in ("optim", "optim_grads")
        self._unit_current = [True] * len(self.units.units)
        self._non_unit_current = True
        self._register_read_guards(module)
        self._record_param_places()

    # ---- the hooks ----

    def _view(self, indices) -> None:
        """The torch params of these indices view their gathered storage."""
        if self._shards_params:
            for i in indices:
                if not self._mxfp8[i]:
                    self._set_data(i, self._cpp.param(i))
                    self._gathered_storage[self._params[i].untyped_storage().data_ptr()] = i

    def _stand_in(self, indices) -> None:
        """The torch params of these indices let go of the storage the C++ FSDP is about to free."""
        if self._shards_params:
            for i in indices:
                if not self._mxfp8[i]:
                    p = self._params[i]
                    self._gathered_storage.pop(p.untyped_storage().data_ptr(), None)
                    self._set_data(i, mxfp8.stand_in(p.shape, p.dtype, self.device))

    def _pack(self, t: torch.Tensor):
        if not self._gathered_storage or t.layout != torch.strided or t.device != self.device:
            return t
        index = self._gathered_storage.get(t.untyped_storage().data_ptr())
        if index is None or t is self._params[index]:
            return t  # an activation, or the param itself (whose storage backward swaps in)
        p = self._params[index]
        return _SavedParamView(index, t.size(), t.stride(), t.storage_offset() - p.storage_offset())

    def _unpack(self, saved):
        if not isinstance(saved, _SavedParamView):
            return saved
        base = self._params[saved.index].detach()  # its storage now: the backward's gather
        return base.as_strided(saved.size, saved.stride, base.storage_offset() + saved.offset)

    def _make_pre_forward(self, indices: tuple[int, ...], unit: int):
        params = list(indices)

        def hook(_module, _args) -> None:
            if self._units_called is not None:
                self._units_called.append(unit)
            self._unit_in_forward[unit] = True
            stale = not self._unit_current[unit]
            self._cpp.before_forward(params)
            self._unit_current[unit] = True
            self._view(params)
            if stale:
                param_writes.check_not_overwritten(self, params)

        return hook

    def _register_rerun_hooks(self, unit: int, modules: list[torch.nn.Module]) -> None:
        """Hooks on the MXFP8 submodules of a unit module (not fine-grained). A re-run of the unit's
        forward inside its backward reads the forward's MXFP8 copies, which the backward's gather
        does not hold, and HF's layers re-run only their forward (transformers checkpoints
        ``forward``, not ``__call__``, so that module hooks stay outside the checkpoint): the unit's
        own pre- and post-forward do not run then. Its MXFP8 modules stand in for them: the first
        one's pre-forward gathers as a recompute's pre-forward does, and once each has run (a re-run
        calls each once), the last one's post-forward releases the row-wise copies as a
        recompute's post-forward does, so the run holds what mxt.plan replays."""
        params = self.units.units[unit]

        def pre(_module, _args) -> None:
            # A re-run: the unit ran forward (a backward will follow) and its own pre-forward did
            # not run now, before or after its pre-backward (whichever the layer's last op makes first).
            if self._rerun_pending[unit] and not self._unit_in_forward[unit]:
                self._rerun_pending[unit] = False
                self._rerun_left[unit] = len(modules)
                self._cpp.before_forward(params)

        def post(_module, _args, _output) -> None:
            if self._rerun_left[unit] > 0:
                self._rerun_left[unit] -= 1
                if self._rerun_left[unit] == 0:
                    self._cpp.after_forward(params)

        for m in modules:
            self._hooks.append(m.register_forward_pre_hook(self._eager(pre), prepend=True))
            self._hooks.append(m.register_forward_hook(self._eager(post)))

    def _register_read_guards(self, module: torch.nn.Module) -> None:
        """A forward pre-hook on every module that owns registered params directly but gathers none
        itself: a submodule of a unit module (without the fine-grained gather), or a module of the
        non-unit params. Such a module run where its params hold no current values (its unit's
        submodule called by the parent, outside the unit's forward and backward; a non-unit module
        called outside the wrapper's forward) would compute with NaN stand-ins (optim_grads_params)
        or, on the ranks that did not update them, the values from before the last step (optim,
        optim_grads with overlap_param_gather): it is refused, naming the module. no_shard: none
        needed, every rank's params are always current."""
        if self.ddp_config.data_parallel_sharding_strategy == "no_shard":
            return
        gathering = {id(h.module) for h in self.units.hooked if h.unit >= 0}
        index_of = {id(p): i for i, p in enumerate(self._params)}
        for name, sub in module.named_modules():
            if id(sub) in gathering:
                continue
            own = sorted({index_of[id(p)] for p in sub._parameters.values() if p is not None and id(p) in index_of})
            if own:
                guard = self._make_read_guard(name, self._unit_of[own[0]], own)
                self._hooks.append(sub.register_forward_pre_hook(self._eager(guard), prepend=True))

    def _make_read_guard(self, name: str, unit: int, own: list[int]):
        plain = [i for i in own if not self._mxfp8[i]]  # an MXFP8 weight's forward reads the C++ copies

        def current() -> bool:
            if self._shards_params:
                return all(self._gathered_storage.get(self._params[i].untyped_storage().data_ptr()) == i for i in plain)
            return self._unit_current[unit] if unit >= 0 else self._non_unit_current

        def hook(sub, _args) -> None:
            if current() or _in_backward():
                return
            what = "NaN stand-ins" if self._shards_params else \
                "the values from before the last step on this rank (its updated params are gathered later)"
            if unit >= 0:
                owner = self._unit_names[unit] or "<root>"
                raise RuntimeError(
                    f"'{name}' ({type(sub).__name__}) ran outside the forward and backward of its FSDP unit "
                    f"'{owner}', where its params hold {what}: a unit is gathered by its own module's hooks. Call "
                    f"'{owner}' itself, make each weighted submodule a unit of its own "
                    "(megatron_fsdp_enable_fine_grained_param_gather=True)"
                    + ("" if self._shards_params else ", call model.finish_param_sync() after opt.step()")
                    + f", or keep '{name}' out of the units")
            raise RuntimeError(
                f"'{name}' ({type(sub).__name__}) ran outside the wrapper's forward, where its params (in no FSDP "
                f"unit) hold {what}: they are gathered when the wrapper's forward starts"
                + (" and kept until finish_grad_sync()" if self._shards_params else "")
                + ". Call it inside model(...)"
                + ("" if self._shards_params else ", or call model.finish_param_sync() after opt.step() first"))

        return hook

    def _make_post_forward(self, indices: tuple[int, ...], unit: int):
        params = list(indices)

        def hook(_module, _args, output):
            self._unit_in_forward[unit] = False
            if torch.is_grad_enabled():
                self._rerun_pending[unit] = True
            if self._cpp.phase != "recompute":  # a recompute's backward reads the values next
                self._stand_in(params)
            self._cpp.after_forward(params)
            if torch.is_grad_enabled() and not self._unit_backward_started[unit]:
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(tensors, self._make_pre_backward(params, unit),
                                                                  mode="any")
            return None

        return hook

    def _make_pre_backward(self, params: list[int], unit: int):
        def hook(_grad) -> None:
            if self._unit_backward_started[unit]:
                return  # a recompute's outputs, or a second output of the unit
            self._unit_backward_started[unit] = True
            self._backward_seen = True
            self._cpp.before_backward(params)
            self._view(params)

        return hook

    def _make_grad_hook(self, index: int):
        live = weakref.ref(self)  # a hook on a tensor: wrapper.py, "Lifetime"

        def hook(param: torch.Tensor) -> None:
            model = live()
            grad, param.grad = param.grad, None
            if model._defer_non_unit and model._unit_of[index] < 0:
                model._backward_seen = True
                model._deferred.append((index, grad))
                if len(model._deferred) == model._deferred_count:
                    model._flush_deferred()
                return
            if grad is not None:
                model._cpp.main_grad(index).add_(grad)
            model._report(index)

        return hook

    def _flush_deferred(self) -> None:
        """Hands the non-unit params' gradients over together. With sharded grads the C++ FSDP
        allocates a bucket's unsharded grads at its first main_grad and frees them after its
        reduce-scatter, which waits for its last param; the non-unit bucket's last is the
        embedding, at the very end of backward, so taking a final norm's gradient at once would
        hold an embedding-sized buffer through the whole backward, at the activations' peak."""
        deferred, self._deferred = self._deferred, []
        for index, grad in deferred:
            if grad is not None:
                self._cpp.main_grad(index).add_(grad)
        for index, _ in deferred:
            self._report(index)

    def _make_token_hook(self, index: int):
        live = weakref.ref(self)  # a hook on a tensor: wrapper.py, "Lifetime"

        def hook(token: torch.Tensor) -> None:
            token.grad = None  # the MXFP8 Function added dW into main_grad itself
            live()._report(index)

        return hook

    def _report(self, index: int) -> None:
        self._backward_seen = True
        self._grads_pending_sync = True
        self._grads_live = True
        self._cpp.grad_ready(index)
        self._reported[index] = True
        unit = self._unit_of[index]
        if unit >= 0:
            self._unit_pending[unit] -= 1
            if self._unit_pending[unit] == 0:
                self._post_backward(unit)

    def _post_backward(self, unit: int) -> None:
        params = self.units.units[unit]
        self._stand_in(params)
        self._cpp.after_backward(params)
        self._unit_backward_started[unit] = False
        self._rerun_pending[unit] = False
        self._rerun_left[unit] = 0

    def _complete_backward(self) -> None:
        """Reports every param that took no gradient in the last backward (a zero one), so that
        its unit's post-backward runs and the micro-batch ends, then starts the next."""
        if self._deferred:
            self._flush_deferred()
        if not self._backward_seen:
            return
        for i, done in enumerate(self._reported):
            if not done:
                self._cpp.main_grad(i)  # the zero gradient this rank adds
                self._report(i)
        self._reported = [False] * len(self._params)
        self._unit_pending = [len(u) for u in self.units.units]
        self._backward_seen = False

    # ---- the module and the training loop ----

    def forward(self, *args, **kwargs):
        if self._shards_params:
            if _is_compiling():
                _warn_compiled_runs_eagerly()
            return self._eager_forward(*args, **kwargs)
        return self._forward(*args, **kwargs)

    def _forward(self, *args, **kwargs):
        # First: the swaps below would overwrite a replaced .data, and the replacement would go unseen.
        self._check_params_in_place("forward")
        self._complete_backward()
        if self._non_unit_params:  # gathered now, kept until the gradients are synchronized
            stale = not self._non_unit_current
            self._cpp.before_forward(self._non_unit_params)
            self._non_unit_current = True
            self._view(self._non_unit_params)
            if stale:
                param_writes.check_not_overwritten(self, self._non_unit_params)
        self._units_called = []
        try:
            if self._shards_params:
                with torch.autograd.graph.saved_tensors_hooks(*self._saved_tensors_hooks):
                    out = self.module(*args, **kwargs)
            else:
                out = self.module(*args, **kwargs)
            if sorted(self._units_called) == list(range(self.num_units)):
                self._forward_order = [self._unit_names[u] for u in self._units_called]
        finally:
            self._units_called = None
        if not torch.is_grad_enabled():  # a forward-only pass: no backward will release the non-unit params
            self._stand_in(self._non_unit_params)
            self._cpp.release_gathered_params()
        return out

    def _eager(self, fn):
        """``fn``, and every frame it calls, run eagerly under torch.compile where this FSDP shards
        params (docs/python.md, "torch.compile"): the forward-time hooks swap each param's .data
        between its gathered view and a stand-in, which dynamo would trace as mutations of graph
        inputs, and the saved-tensor hooks look params up by storage address, which it would make
        guards that fail at every step. Frames called from them must not compile either (the
        default of torch.compiler.disable): compiled, ``_set_data`` or the module's frames below an
        eager wrapper forward gave a graph a param's stand-in where it later got the gathered view.
        Unsharded, ``fn`` itself, which dynamo traces."""
        return torch.compiler.disable(fn, recursive=True) if self._shards_params else fn

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Waits for every reduction (issuing what is left): each rank's grad shards then hold the
        reduced gradients. Releases the non-unit params. force_all_reduce (Megatron's, which
        finalize_model_grads passes): True only with no_shard, which all-reduces anyway."""
        _check_force_all_reduce(force_all_reduce, self.ddp_config.data_parallel_sharding_strategy != "no_shard")
        self._check_params_in_place("finish_grad_sync")
        self._complete_backward()
        self._stand_in(self._non_unit_params)
        self._cpp.finish_grad_sync()
        self._grads_pending_sync = False

    def zero_grad_buffer(self) -> None:
        self._complete_backward()
        self._cpp.zero_grad_buffer()
        self._grads_pending_sync = False
        self._grads_live = False
        self._drop_pending_clip()

    def finish_param_sync(self) -> None:
        """Collective where a step left gathers pending (optim and optim_grads with overlap_param_gather:
        each unit's updated params are gathered in its next pre-forward): gathers them now, so that every
        rank's params hold the step's result outside forward (an EMA of the weights, a hand-made eval).
        Nothing to do otherwise: no_shard and a step without overlap leave every param current, and
        optim_grads_params holds no full params outside a unit's forward (``state_dict()`` gathers them)."""
        if self._cpp.closed or (all(self._unit_current) and self._non_unit_current):
            return
        if self._grads_pending_sync:
            raise RuntimeError("finish_param_sync() between backward and finish_grad_sync(): its gathers would "
                               "interleave with the gradient reductions; call model.finish_grad_sync() first")
        self._gather_every_unit(lambda _indices: None)

    def _before_param_update(self) -> None:
        """Nothing to wait for: the C++ FSDP finishes a pending param gather before the optimizer
        updates the shards it reads."""

    def _after_param_update(self, gathered: bool) -> None:
        if gathered or self._stale_after_step:
            self._unit_current = [gathered] * len(self._unit_current)
            self._non_unit_current = gathered

    @property
    def grads_live(self) -> bool:
        """Whether a gradient has been reported since the last zero_grad."""
        return self._grads_live

    def _before_zero_grad(self) -> None:
        self._complete_backward()  # a backward's unused params are reported before the zeroing

    def _after_zero_grad(self, set_to_none: bool = True) -> None:
        super()._after_zero_grad(set_to_none)
        self._grads_live = False

    def _params_holding_values(self) -> list[int]:
        # optim_grads_params: between iterations every param is a stand-in (its unit released).
        return [] if self._shards_params else super()._params_holding_values()

    def _pending_gathers(self, indices: list[int]) -> list[int]:
        # optim and optim_grads with overlap: a unit's updated params land at its next pre-forward.
        return [i for i in indices
                if not (self._unit_current[self._unit_of[i]] if self._unit_of[i] >= 0 else self._non_unit_current)]

    def peak_gathered_bytes(self) -> dict[str, int]:
        """This rank's most bytes gathered at once per slot since construction or the last reset:
        values (BF16/F32 params), rowwise and colwise (MXFP8 payloads and scales)."""
        return {slot: self._cpp.peak_gathered_bytes(slot) for slot in ("values", "rowwise", "colwise")}

    def reset_peak_gathered_bytes(self) -> None:
        self._cpp.reset_peak_gathered_bytes()

    @property
    def num_units(self) -> int:
        return self._cpp.num_units

    @property
    def forward_order(self) -> Optional[list[str]]:
        """The units' modules (their names in ``module.named_modules()``) in the order the last
        forward that ran each unit once called them; None before one has. The C++ FSDP follows the
        same order for its forward and backward prefetch (it may differ from the module tree's:
        Llama registers its norms after the attention and MLP they precede, which a fine-grained
        unit per submodule shows). ``mxt.plan(..., forward_order=model.forward_order)`` replays it."""
        return None if self._forward_order is None else list(self._forward_order)

    def _full_values(self) -> list[torch.Tensor]:
        """Collective: every param's values (MXFP8: as their forward reads them), by a forward-like pass
        of pre- and post-forward hooks over the hooked modules."""
        values: list[Optional[torch.Tensor]] = [None] * len(self._params)

        def take(indices) -> None:
            for i in indices:
                if values[i] is None:
                    values[i] = self._mxfp8_forward_values(i) if self._mxfp8[i] \
                        else self._cpp.param(i).clone()

        self._gather_every_unit(take)
        return values

    def _gather_every_unit(self, take) -> None:
        """Collective: a forward-like pass of pre- and post-forward hooks over the hooked modules,
        calling ``take(params)`` while each one's params are gathered. The pre-forward hooks gather the
        units (optim_grads_params) or wait for the all-gather of the updated params that the last step
        started (optim, optim_grads with overlap). In the order the forward calls the units, which the
        C++ FSDP learns from passes like this one."""
        stale = self._pending_gathers(range(len(self._params)))
        for h in in_forward_order(self.units.hooked, self._forward_order):
            self._cpp.before_forward(list(h.params))
            take(h.params)
            self._cpp.after_forward(list(h.params))
        self._cpp.release_gathered_params()
        self._unit_current = [True] * len(self._unit_current)
        self._non_unit_current = True
        param_writes.check_not_overwritten(self, stale)

    def state_dict(self, *args, **kwargs):
        """Collective (every rank calls it): torch's state dict of the wrapper (keys ``module.<name>``)
        with every registered param's full values (MXFP8 weights: those their forward reads), gathered
        for the purpose; the sharded params' own tensors hold only stand-ins outside their unit. After
        ``close()`` the params hold their values themselves: torch's own (not collective).

        Every rank calls it, and rank 0 alone writes the result (as torch FSDP's full state dict). A
        call on rank 0 alone cannot be told from a slow peer, so it is not refused: the watchdog ends
        the job after ``init(timeout_s)`` with an error naming the all-gather and the ranks that never
        reached it, rather than it waiting for ever. (DDP's state_dict is local: any rank alone.)"""
        if self._cpp.closed:
            return super().state_dict(*args, **kwargs)
        if self._grads_pending_sync:
            raise RuntimeError("state_dict() between backward and finish_grad_sync(): the gathers it needs would "
                               "interleave with the gradient reductions; call model.finish_grad_sync() first")
        return self._state_dict_with({id(p): v for p, v in zip(self._params, self._full_values())}, args, kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Collective: torch's load of a full state dict (keys ``module.<name>``, as ``state_dict()``
        gives), as torch FSDP's full-state-dict load. Everything is checked on every rank first
        (torch's missing and unexpected keys with ``strict``, shapes always); a rank that fails makes
        every rank raise, and nothing has changed. Then the buffers and frozen params take their values,
        and the registered params: where they keep their storage (no_shard, optim, optim_grads) as
        DDP's (the optimizer takes them before its next step, param_writes.py); sharded
        (optim_grads_params) through the DistributedOptimizer's main params, the master copy the
        shards are staged and gathered from, which must be built. Refused for MXFP8 weights (kept
        only as MXFP8) and for HSDP. After ``close()``: torch's own."""
        if self._cpp.closed:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the params' storage, which is mxddp's "
                             "buffers; use assign=False")
        self._refuse_hybrid("FullyShardedDataParallel.load_state_dict")
        what = "FullyShardedDataParallel.load_state_dict"
        optimizer = self._optimizer()
        values, incompatible = load_state.agreed(what, self._comm, lambda: self._check_load(state_dict, strict,
                                                                                             optimizer))
        self.finish_param_sync()  # collective where a step left gathers pending
        load_state.copy_module_entries(self.module, values, self._params)
        loaded = {i: values[name] for i, name in enumerate(self._names) if name in values}  # strict=False: some
        if self._shards_params:
            with torch.no_grad():
                param_writes.copy_into_main(optimizer, loaded)
            optimizer.force_param_sync()  # every rank's shards and gathers from the main params just written
        else:
            with torch.no_grad():
                for i, value in loaded.items():
                    self._params[i].copy_(value)  # taken by the optimizer before its next step
        return incompatible

    def _check_load(self, state_dict, strict: bool, optimizer):
        """load_state_dict's checks on this rank: (module key -> value, torch's _IncompatibleKeys)."""
        if self._grads_pending_sync:
            raise RuntimeError("load_state_dict between backward and finish_grad_sync(): call model.finish_grad_sync() "
                               "first")
        if any(self._mxfp8):
            names = ", ".join(n for n, m in zip(self._names, self._mxfp8) if m)
            raise RuntimeError(f"load_state_dict: the MXFP8 weights ({names}) are kept only as MXFP8 by the C++ FSDP; "
                               "load into the module before wrapping it, or use mxddp.torch.load_checkpoint")
        if self._shards_params and optimizer is None:
            raise RuntimeError("load_state_dict with optim_grads_params: the params are shards staged from the "
                               "DistributedOptimizer's main params, so build `mxt.DistributedOptimizer(model, ...)` "
                               "first (or load into the module before wrapping it)")
        return load_state.check(type(self).__name__, self.module, state_dict, strict, prefix="module.")

    def _close_at_exit(self) -> None:
        # Not collective: the ranks close their open models in no agreed order at exit, so the
        # params get stand-ins instead of gathered values.
        if self._cpp.closed:
            return
        with torch.no_grad():
            for i, p in enumerate(self._params):
                p.data = mxfp8.stand_in(p.shape, p.dtype, self.device)
        self._unwrap()

    def close(self) -> None:
        """Collective. Frees mxddp's buffers: every param gets storage of its own holding its
        current values (MXFP8 weights the values their forward reads, and their module its own
        forward back); the hooks are removed. Close the optimizer first."""
        if self._cpp.closed:
            return
        if self._cpp.open_optimizers:
            raise RuntimeError("close the DistributedOptimizer before its FullyShardedDataParallel")
        self._complete_backward()
        with torch.no_grad():
            for p, v in zip(self._params, self._full_values()):
                p.data = v
        self._unwrap()
