"""``DistributedDataParallel`` for any PyTorch module, on mxddp's C++ DDP.

Construction registers the module's trainable params (``named_parameters()`` order, a shared
param such as a tied embedding once, frozen params left out as Megatron does) with the C++ DDP,
which places them by mxddp's layout (reverse order, padding, buckets) in one contiguous param
buffer and one grad buffer. Each param's values are copied in, and then the param *is* a view of
the param buffer (``param.data``), with ``param.main_grad`` a view of the grad buffer. Before any
of it, every rank's params (names, shapes, dtypes, order) and config are compared
(``agreement.py``): ranks that differ are refused together. With
``gradient_accumulation_fusion`` (the default) the weights of plain ``nn.Linear``, HF ``Conv1D`` and
``nn.Embedding`` modules have their gradient accumulated into ``main_grad`` by the module's own
backward and are reported ready through a token (``grad_fusion.py``; a read of such a weight outside
those modules adds its gradient as the hook below does); every other param has a
post-accumulate-grad hook that adds ``param.grad`` into ``main_grad``, frees ``param.grad`` and
reports the param ready. Either way, with ``overlap_grad_reduce`` a bucket's collective starts
during backward.

With ``overlap_param_gather`` every submodule that directly owns registered params gets a forward
pre-hook that waits for the all-gathers of the bucket groups holding them (and dispatches the next
group's), as Megatron's. With ``fp8_param_gather`` the weights of plain ``nn.Linear`` and HF
``Conv1D`` modules are kept as MXFP8 by the C++ DDP and read through the Functions in ``mxfp8.py``;
the other params are views of the C++ DDP's BF16 copies.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from mxddp import _C
from mxddp.torch import agreement, ddp_args, device, grad_fusion, launch, mxfp8, param_writes, process_group, \
    torch_grads
from mxddp.torch.config import DistributedDataParallelConfig
from mxddp.torch.torch_semantics import TorchSemantics
from mxddp.torch.wrapper import DataParallelModule, refuse_wrapped, refuse_wrapped_module

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _trainable_params(module: torch.nn.Module, meta_ok: bool = False) -> list[tuple[str, torch.nn.Parameter]]:
    """The params mxddp takes, checked: (name, param) in named_parameters() order. meta_ok (the
    planner): params on the meta device pass, unchecked for shared storage (they have none)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"DistributedDataParallel wraps a torch.nn.Module; got {type(module).__name__}")
    if not meta_ok:
        refuse_wrapped_module(module)
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not params:
        frozen = sum(1 for _ in module.parameters())
        raise ValueError(f"module {type(module).__name__} has no trainable parameters (requires_grad=True); "
                         f"{frozen} frozen ones: there is nothing for DistributedDataParallel to synchronize")
    first_name, first = params[0]
    device.params_device(params)  # one device, the CPU or CUDA
    storages: dict[int, str] = {}
    for name, p in params:
        if p.dtype not in _DTYPES:
            raise TypeError(f"param '{name}' has dtype {p.dtype}, which mxddp does not take; "
                            "valid: torch.float32, torch.bfloat16")
        if p.dtype != first.dtype:
            raise TypeError(f"param '{name}' is {p.dtype} but '{first_name}' is {first.dtype}: "
                            "mxddp keeps every trainable param in one buffer of one dtype")
        if p.device.type == "meta" and not meta_ok:
            raise ValueError(f"param '{name}' is on the meta device, which holds no values to train; "
                             "build the module on the CPU or a CUDA device (mxddp.torch.plan takes meta modules)")
        if not meta_ok:  # the planner only reads shapes
            refuse_wrapped(name, p)
        if not p.is_contiguous():
            raise ValueError(f"param '{name}' is not contiguous (shape {tuple(p.shape)}, strides {p.stride()}); "
                             "make it contiguous before wrapping (param.data = param.data.contiguous())")
        if p.device.type == "meta":
            continue
        storage = p.untyped_storage().data_ptr()
        if p.numel() > 0 and storage in storages:
            raise ValueError(f"params '{storages[storage]}' and '{name}' share storage; mxddp gives each param "
                             "a place of its own in its buffer, which would break that sharing (share the "
                             "Parameter object itself to tie weights)")
        storages[storage] = name
    return params


def _mxfp8_flags(module: torch.nn.Module, params: list[tuple[str, torch.nn.Parameter]],
                 config: DistributedDataParallelConfig) -> list[bool]:
    """Which registered params are kept as MXFP8: with fp8_param_gather, every weight of plain
    nn.Linear or HF Conv1D modules (``mxfp8.weight_kind``) whose attribute ``mxfp8`` is not False;
    a param marked ``mxfp8 = True`` must be one."""
    owners = grad_fusion.param_owners(module)
    flags = []
    for name, p in params:
        marked = getattr(p, "mxfp8", None)
        if marked not in (None, True, False):
            raise TypeError(f"param '{name}' has mxfp8={marked!r}; valid: True, False (or no attribute)")
        kind = mxfp8.weight_kind(p, owners.get(id(p), []))
        if marked is True and not config.fp8_param_gather:
            raise ValueError(f"param '{name}' is marked mxfp8=True but fp8_param_gather is False")
        if marked is True and kind is None:
            kinds = sorted({type(m).__name__ for m in owners.get(id(p), [])})
            raise ValueError(f"param '{name}' is marked mxfp8=True but is not the weight of plain nn.Linear modules "
                             f"only or HF Conv1D modules only (owned by: {', '.join(kinds)}): fp8_param_gather keeps "
                             "only those weights as MXFP8, since only their forward is replaced to read them")
        flags.append(bool(config.fp8_param_gather and kind is not None and marked is not False))
    if config.fp8_param_gather and params[0][1].dtype != torch.bfloat16:
        raise ValueError(f"fp8_param_gather=True needs BF16 params (module.to(torch.bfloat16)): the all-gather stages "
                         f"BF16 and the other params are kept as BF16 copies; got {params[0][1].dtype}")
    return flags


def _mxfp8_kinds(module: torch.nn.Module, params: list[torch.nn.Parameter], flags: list[bool]) -> dict[int, str]:
    """index -> each MXFP8 param's module kind ('linear' or 'conv1d', ``mxfp8.weight_kind``)."""
    owners = grad_fusion.param_owners(module)
    return {i: mxfp8.weight_kind(p, owners[id(p)]) for i, p in enumerate(params) if flags[i]}


def _check_fusion_flag(gradient_accumulation_fusion) -> None:
    """The wrappers' (and mxt.plan's) ``gradient_accumulation_fusion`` argument: a bool."""
    if not isinstance(gradient_accumulation_fusion, bool):
        raise TypeError(f"gradient_accumulation_fusion must be True or False; got {gradient_accumulation_fusion!r}")


def _check_force_all_reduce(force_all_reduce, scattered: bool, alternative: str = "") -> None:
    """finish_grad_sync's force_all_reduce (Megatron's): an all-reduce for one call where the grads
    are reduce-scattered (into the shards the optimizer steps) is not built."""
    if not isinstance(force_all_reduce, bool) and force_all_reduce is not None:
        raise TypeError(f"force_all_reduce must be True or False; got {force_all_reduce!r}")
    if force_all_reduce and scattered:
        raise NotImplementedError("finish_grad_sync(force_all_reduce=True): this model reduce-scatters its grads into "
                                  "the shards its optimizer steps and has no all-reduce in their place for one call; "
                                  f"call it with force_all_reduce=False{alternative}")


def _fusion_marks(params: list[tuple[str, torch.nn.Parameter]], enabled: bool) -> list[bool]:
    """Each param's attribute ``gradient_accumulation_fusion`` (absent: True), checked, and the
    wrapper's ``enabled``."""
    marks = []
    for name, p in params:
        marked = getattr(p, "gradient_accumulation_fusion", None)
        if marked not in (None, True, False):
            raise TypeError(f"param '{name}' has gradient_accumulation_fusion={marked!r}; "
                            "valid: True, False (or no attribute)")
        marks.append(enabled and marked is not False)
    return marks


def _fusion_flags(owners: dict[int, list[torch.nn.Module]], params: list[tuple[str, torch.nn.Parameter]],
                  marks: list[bool], main_grad_dtype: torch.dtype, mxfp8_flags: list[bool]) -> list[bool]:
    """Which registered params have their weight gradient accumulated into main_grad by their
    modules' backward (gradient_accumulation_fusion): every owner a fusable module, only
    embeddings where main_grad is F32 and the params BF16 (``grad_fusion.is_fusable``), not MXFP8,
    and not marked ``gradient_accumulation_fusion = False``. The DDP's and the FSDP's rule. An MXFP8
    weight with a gradient hook of the user's is refused: its gradient never reaches the Parameter."""
    for (name, p), is_mxfp8 in zip(params, mxfp8_flags):
        if is_mxfp8 and grad_fusion.has_user_grad_hooks(p):
            raise ValueError(f"param '{name}' is an MXFP8 weight with a gradient hook (register_hook or "
                             "register_post_accumulate_grad_hook): its module's backward adds the weight gradient "
                             "into main_grad from the MXFP8 copies, and the Parameter never gets one to hook; remove "
                             "the hook, or set param.mxfp8 = False before wrapping (a BF16 weight)")
    return [bool(marked and not is_mxfp8 and grad_fusion.is_fusable(p, owners.get(id(p), []), main_grad_dtype))
            for (_, p), marked, is_mxfp8 in zip(params, marks, mxfp8_flags)]


class DistributedDataParallel(TorchSemantics, DataParallelModule):
    """torch's ``DistributedDataParallel(module)`` and Megatron-core's
    ``DistributedDataParallel(config, ddp_config, module)`` on mxddp's buffers (``ddp_args.py``
    tells the forms apart; ``torch_semantics.py`` has what torch's form does by itself).

    ``mxddp.torch.init()`` first, or the wrap starts mxddp itself (``process_group.communicator_for``:
    under torchrun on torch.distributed's default group). ``model(...)`` runs the module. torch's
    form, per iteration::

        model = DistributedDataParallel(module)   # rank 0's params and buffers broadcast
        opt.zero_grad()
        with model.no_sync(): ...                 # accumulation micro-batches (nothing reduced)
        model(batch).backward()                   # grads synchronized at the end of backward
        opt.step()

    Megatron's form (a ``DistributedDataParallelConfig`` given) adds ``model.finish_grad_sync()``
    after the last backward, as Megatron's loops do; in torch's form that call is a no-op.

    torch's keyword arguments: ``device_ids`` and ``output_device`` (None: the CPU),
    ``broadcast_buffers`` (default True in torch's form, False in Megatron's), ``init_sync``
    (rank 0's params and buffers broadcast at wrap time; same defaults), ``find_unused_parameters``
    (default False in torch's form: a param that gets no gradient in a synchronized backward is an
    error; True: such params are found every step and the optimizer leaves those no rank used
    untouched; Megatron's form leaves it unset: their zero gradient is reduced and stepped on as
    any), ``static_graph`` (True: as find_unused_parameters=True), ``bucket_cap_mb`` (torch's form;
    default 25), ``gradient_as_bucket_view`` (True only: the gradient always lives in the bucket),
    ``process_group`` (the ranks to reduce over; default: every rank). Megatron's
    ``disable_bucketing`` (one bucket) and ``pg_collection`` (None only).

    ``gradient_accumulation_fusion`` (Megatron's ``TransformerConfig.gradient_accumulation_fusion``,
    read from ``config`` in Megatron's order; default True): the weights of plain ``nn.Linear``, HF
    ``Conv1D`` and ``nn.Embedding`` (no padding_idx, max_norm, scale_grad_by_freq or sparse)
    modules get their gradient added into ``main_grad`` by the module's backward, with no dW
    tensor; a param owned by any other module, marked ``gradient_accumulation_fusion = False``, or
    (but for embeddings) whose main_grad is F32 while it is BF16 keeps the post-accumulate-grad
    hook. A fused Parameter never receives a ``.grad``: reading the weight outside those modules'
    forward in a graph is an error. False: every param takes the hook.
    """

    def __init__(self, *args, **kwargs):
        super().__init__()

        def describe():
            a = ddp_args.resolve(args, kwargs)
            _check_fusion_flag(a.gradient_accumulation_fusion)
            params = _trainable_params(a.module)
            on = device.checked_device(params)
            mxfp8_flags = _mxfp8_flags(a.module, params, a.ddp_config)
            fusion_marks = _fusion_marks(params, a.gradient_accumulation_fusion)
            items = agreement.param_items([n for n, _ in params], [p for _, p in params], mxfp8_flags) + \
                a.ddp_config.agreement_items() + [
                    ("gradient_accumulation_fusion", repr(a.gradient_accumulation_fusion)),
                    ("torch_form", repr(a.torch_form)), ("broadcast_buffers", repr(a.broadcast_buffers)),
                    ("find_unused_parameters", repr(a.find_unused_parameters)), ("init_sync", repr(a.init_sync))] + \
                device.agreement_items(on)
            return (a, params, mxfp8_flags, fusion_marks, on), items

        # Checked, and compared across ranks, before the C++ DDP exists, so a refusal leaves nothing allocated.
        # The communicator first: under torchrun it also starts mxddp (on torch.distributed's default
        # group), which the ranks' agreement below runs on. Collective the first time a group is seen.
        group = kwargs.get("process_group")
        ddp_args.check_process_group(group)
        comm = process_group.communicator_for(group)
        resolved, params, mxfp8_flags, fusion_marks, self.device = agreement.agree("DistributedDataParallel", describe,
                                                                                   comm)
        module, config = resolved.module, resolved.ddp_config
        self._comm = comm  # the group's host communicator handle: the package's own small collectives run on it
        self._stream = device.current_stream(self.device)  # what the model's work must run on (None: the CPU)
        # Where the buffers live: a module on a GPU gets a communicator of that device (device.py).
        buffers_comm = device.communicator_for(group, comm, self.device)
        self._buffers_comm = buffers_comm  # its backend: "nccl", or the host engine's name when staged
        self.module = module
        self.ddp_config = config
        self.config = resolved.transformer_config  # Megatron's TransformerConfig (None in torch's form)
        self._module_prefixed_keys = resolved.torch_form
        self._register_nested_load_keys()
        self.param_dtype = params[0][1].dtype
        specs = [(name, list(p.shape), bool(getattr(p, "shared_embedding", False))) for name, p in params]
        self._params = [p for _, p in params]
        self._names = [name for name, _ in params]
        self._hooks = []
        self._replaced_forwards: list[torch.nn.Module] = []  # MXFP8 and fused modules
        # The C++ DDP copies the initial values in itself, so that with fp8_param_gather its MXFP8
        # and BF16 copies are taken from them (and the optimizer's main params too).
        self._cpp = _C.DistributedDataParallel(specs, config.to_cpp(_DTYPES[self.param_dtype]),
                                               mxfp8_flags if any(mxfp8_flags) else [],
                                               [device.host_tensor(p.detach()) for _, p in params],
                                               comm=buffers_comm)
        launch._track_model(self)
        self._build_or_undo(lambda: self._build(module, config, resolved, params, mxfp8_flags, fusion_marks))

    def _build(self, module, config, resolved, params, mxfp8_flags, fusion_marks) -> None:
        """The constructor's part after the C++ DDP exists: the params view its buffers, the hooks
        and forwards go in, and rank 0's values are broadcast."""
        self._mxfp8_kind = _mxfp8_kinds(module, self._params, mxfp8_flags)
        self._init_sync_state()
        owners = grad_fusion.param_owners(module)
        main_grads = [self._cpp.main_grad(i) for i in range(len(self._params))]
        self.fused_params = _fusion_flags(owners, params, fusion_marks, main_grads[0].dtype, mxfp8_flags)
        self.gradient_accumulation_fusion = resolved.gradient_accumulation_fusion
        self._init_torch_semantics(resolved.find_unused_parameters, resolved.broadcast_buffers,
                                   sync_at_backward_end=resolved.torch_form, static_graph=resolved.static_graph,
                                   group=resolved.process_group)
        # torch's form gives the grads to .grad for a torch optimizer (torch_grads.py): each param's
        # take-back hook goes first, before the hooks below, so that it runs before they add anything.
        fused_grads = self._cpp
        if resolved.torch_form:
            fused_grads = torch_grads.MainGrads(self)
            for i, p in enumerate(self._params):
                if not mxfp8_flags[i]:
                    self._hooks.append(p.register_hook(torch_grads.take_back_hook(self)))
                    grad_fusion.own_hooks(p, [self._hooks[-1]])
        with torch.no_grad():
            for i, p in enumerate(self._params):
                p.main_grad = main_grads[i]
                if mxfp8_flags[i] or self.fused_params[i]:
                    p.data = mxfp8.stand_in(p.shape, p.dtype, self.device) if mxfp8_flags[i] else self._cpp.param(i)
                    token = grad_fusion.new_ready_token(self.device)
                    if mxfp8_flags[i]:
                        self._hooks.append(token.register_post_accumulate_grad_hook(self._make_ready_token_hook(i)))
                        self._hooks.append(p.register_post_accumulate_grad_hook(self._make_misuse_hook(i)))
                    else:
                        self._hooks += self._register_fused_ready_hooks(i, token)
                    for owner in owners[id(p)]:
                        if mxfp8_flags[i]:
                            mxfp8.install(owner, self._cpp, i, token)
                        else:
                            grad_fusion.install(owner, fused_grads, i, token)
                        self._replaced_forwards.append(owner)
                else:
                    p.data = self._cpp.param(i)
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(i)))
        if config.overlap_param_gather:
            self._register_param_gather_hooks(module)
        self._record_param_places()
        if resolved.init_sync:
            self._broadcast_at_wrap()

    def _register_param_gather_hooks(self, module: torch.nn.Module) -> None:
        # Megatron's forward pre-hook: a module waits only for the gathers of its own params. First
        # of the module's pre-hooks: one registered before wrapping may read them (the old
        # weight_norm, spectral_norm and prune compute `weight` from `weight_orig` in one).
        index_of = {id(p): i for i, p in enumerate(self._params)}
        for sub in module.modules():
            indices = sorted({index_of[id(p)] for p in sub._parameters.values() if p is not None and id(p) in index_of})
            if indices:
                self._hooks.append(sub.register_forward_pre_hook(self._make_param_gather_hook(indices), prepend=True))

    def _make_param_gather_hook(self, indices: list[int]):
        cpp = self._cpp

        def hook(_module, _args) -> None:
            if not self._forward_pre_hook_enabled:
                return  # forward() gathered every param first
            if self._param_versions is None:
                cpp.before_forward(indices)
                return
            pending = cpp.pending_gathers(indices)  # only these can have been written over
            cpp.before_forward(indices)
            if pending:
                param_writes.check_not_overwritten(self, pending)

        return hook

    def _make_ready_token_hook(self, index: int):
        live = weakref.ref(self)  # a hook on a tensor: wrapper.py, "Lifetime"

        def hook(token: torch.Tensor) -> None:
            # Every use of the MXFP8 weight has added its dW into main_grad (mxfp8.py).
            token.grad = None
            live()._on_grad(index)

        return hook

    def _make_misuse_hook(self, index: int):
        kind = mxfp8.KINDS[self._mxfp8_kind[index]]
        why = (f"param '{self._names[index]}' is kept as MXFP8 (fp8_param_gather) and holds no values of its own "
               f"(NaN), but a gradient reached it: something read it outside its {kind}'s forward. Set "
               "`mxfp8 = False` on that param before wrapping to keep it in BF16")

        def hook(param: torch.Tensor) -> None:
            param.grad = None
            raise RuntimeError(why)

        return hook

    def _register_fused_ready_hooks(self, index: int, token: torch.Tensor) -> list:
        """grad_fusion.register_ready_hooks: the param reports once every use has added its part. The
        hooks live on the param, so they hold it (and the wrapper) weakly, or it could never be freed."""
        param = self._params[index]
        param_ref = weakref.ref(param)
        live = weakref.ref(self)  # a hook on a tensor: wrapper.py, "Lifetime"

        def report() -> None:
            live()._on_grad(index)

        return grad_fusion.register_ready_hooks(token, param, lambda: param_ref().main_grad, report)

    def _make_grad_hook(self, index: int):
        live = weakref.ref(self)  # a hook on a tensor: wrapper.py, "Lifetime"

        def hook(param: torch.Tensor) -> None:
            # Megatron's hook: accumulate into main_grad, free .grad, mark the param ready.
            model = live()
            if param.grad is not None:
                param.main_grad.add_(param.grad)
                param.grad = None
            model._on_grad(index)

        return hook

    def forward(self, *args, **kwargs):
        self._check_params_in_place("forward")
        if self._awaiting_zero_grad:
            raise RuntimeError("forward after DistributedOptimizer.step() without opt.zero_grad(): with "
                               "reuse_grad_buf_for_mxfp8_param_ag the step only updates the main params, and "
                               "opt.zero_grad() (or opt.force_param_sync()) stages and gathers them into the model")
        if not self._forward_pre_hook_enabled:
            self.finish_param_sync()  # the hooks that would wait module by module are off
        self._before_forward_buffers()
        output = self.module(*args, **kwargs)
        self._after_forward_buffers()
        self._hook_outputs(output)
        return output

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Issues what has not been issued, waits for every collective: main_grad then holds the
        reduced grads (this rank's shard of them with the distributed optimizer). A param not
        reported since the last sync adds nothing (a zero gradient). Once per accumulation window:
        a second call, or one after torch's form synchronized at the end of backward, does nothing.
        force_all_reduce (Megatron's, which finalize_model_grads passes): True only where the grads
        are all-reduced anyway (no distributed optimizer, or the config's force_all_reduce)."""
        _check_force_all_reduce(force_all_reduce, self.ddp_config.use_distributed_optimizer
                                and not self.ddp_config.force_all_reduce,
                                " (or wrap with DistributedDataParallelConfig(force_all_reduce=True))")
        self._check_params_in_place("finish_grad_sync")
        if self._no_sync_depth:
            raise RuntimeError("finish_grad_sync() inside model.no_sync(): call it after the last micro-batch, "
                               "outside the no_sync() block")
        self._sync_grads()

    def start_grad_sync(self, *unused) -> None:
        """Megatron's: starts the reduction of every bucket now. Each param not reported in this
        micro-batch is reported with a zero contribution, so with overlap_grad_reduce every
        bucket's collective is issued here; without it they are issued by finish_grad_sync() (the
        C++ DDP issues non-overlapped buckets only there), with the same result. Positional
        arguments are ignored, as Megatron's (so that it can serve as a hook)."""
        if self._no_sync_depth:
            raise RuntimeError("start_grad_sync() inside model.no_sync(): nothing is reduced inside")
        for i, reported in enumerate(self._reported):
            if not reported:
                self._reported[i] = True
                self._grads_pending_sync = True
                self._cpp.grad_ready(i)

    def scale_gradients(self, scaling_factor: float) -> None:
        """Megatron's: multiplies every param's main_grad (the whole grad buffer) by scaling_factor,
        after finish_grad_sync() (Megatron scales by 1/num_tokens there)."""
        if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, (int, float)):
            raise TypeError(f"scaling_factor must be a number; got {scaling_factor!r}")
        if self._grads_pending_sync and self.ddp_config.overlap_grad_reduce:
            raise RuntimeError("scale_gradients() while reductions may be in flight (overlap_grad_reduce): call "
                               "model.finish_grad_sync() first")
        self._cpp.grad_buffer().mul_(float(scaling_factor))

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Megatron's (positional arguments ignored, so that it can serve as a hook): with the
        distributed optimizer, brings the params up to date with the main params the last step
        updated (the all-gathers that step started, waited for here whether force_sync or
        force_dispatch or not: dispatching them without waiting needs the C++ DDP's
        start_param_sync, not bound yet). Without it every rank updated every param in place:
        nothing to gather."""
        for name, value in (("force_sync", force_sync), ("force_dispatch", force_dispatch)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False; got {value!r}")
        if self.ddp_config.use_distributed_optimizer:
            self.finish_param_sync()

    _forward_pre_hook_enabled = True

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Megatron's: the forward pre-hooks that wait for the overlapped param all-gathers
        module by module (use_distributed_optimizer with overlap_param_gather, as Megatron asserts)
        are turned off, as Megatron-LM does around evaluation and checkpoint saves; with param_sync
        the pending gathers are finished now (collective). Unlike Megatron's, a forward while they
        are off never reads params a gather has yet to update: it finishes the pending gathers
        first (param_sync=False only defers that to the next forward)."""
        if not isinstance(param_sync, bool):
            raise TypeError(f"param_sync must be True or False; got {param_sync!r}")
        if not (self.ddp_config.use_distributed_optimizer and self.ddp_config.overlap_param_gather):
            raise RuntimeError("disable_forward_pre_hook(): this model has no forward pre-hooks to disable; they exist "
                               "with use_distributed_optimizer=True and overlap_param_gather=True (Megatron asserts "
                               "the same)")
        if not self._forward_pre_hook_enabled:
            raise RuntimeError("disable_forward_pre_hook(): the forward pre-hooks are disabled already; call "
                               "enable_forward_pre_hook() first")
        self._forward_pre_hook_enabled = False
        if param_sync:
            self.finish_param_sync()

    def enable_forward_pre_hook(self) -> None:
        """Megatron's: turns the forward pre-hooks back on after ``disable_forward_pre_hook()``."""
        if self._forward_pre_hook_enabled:
            raise RuntimeError("enable_forward_pre_hook(): the forward pre-hooks are enabled already (Megatron "
                               "asserts that each enable follows a disable_forward_pre_hook())")
        self._forward_pre_hook_enabled = True

    def zero_grad_buffer(self) -> None:
        """Megatron's: zeroes every param's main_grad; nothing counts as reported or used since."""
        self._cpp.zero_grad_buffer()
        self._grads_pending_sync = False
        self._reset_used()
        self._drop_pending_clip()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._keep_zero_grads(set_to_none)
        if set_to_none:  # every .grad is None and every main_grad zero: nothing to take back
            self._torch_grads, self._torch_grads_kept = {}, set()

    def _after_zero_grad(self, set_to_none: bool = True) -> None:
        super()._after_zero_grad(set_to_none)
        self._keep_zero_grads(set_to_none)
        self._reset_used()

    def broadcast_params(self) -> None:
        """Copies rank 0's params to every rank (collective)."""
        if self.ddp_config.fp8_param_gather:
            raise RuntimeError("broadcast_params() with fp8_param_gather=True: the param buffer only stages the "
                               "all-gathers and the model's MXFP8 and BF16 copies would keep this rank's values; "
                               "seed every rank alike before wrapping instead")
        self.finish_param_sync()  # a gather still in flight would write over the broadcast
        self._cpp.broadcast_params()
        # Written behind torch's back (no version bump): every open optimizer takes rank 0's values
        # now, whole (not only where they differ from its main params, which still differ across ranks).
        for optimizer in self._open_optimizers():
            optimizer.reload_model_params()

    def finish_param_sync(self) -> None:
        """Waits for every param all-gather still pending (overlap_param_gather), so every param
        holds its updated values: for reading params outside forward after a step. Forward does
        this module by module by itself."""
        if self._cpp.param_sync_pending:
            every = list(range(len(self._params)))
            pending = self._cpp.pending_gathers(every)
            self._cpp.before_forward(every)
            param_writes.check_not_overwritten(self, pending)

    def _pending_gathers(self, indices: list[int]) -> list[int]:
        return self._cpp.pending_gathers(indices) if indices else []

    def _before_param_update(self) -> None:
        # A gather the last forward did not wait for (a module that did not run) may still be
        # reading this rank's shards, which the update is about to overwrite: finish it first.
        self.finish_param_sync()

    def dequantized_param(self, name: str, axis: Optional[str] = None) -> torch.Tensor:
        """An MXFP8 param's values (fp8_param_gather), dequantized from its row-wise ('row') or
        column-wise ('col') storage, as a new tensor; by default the one its forward reads (an
        nn.Linear's row-wise, a Conv1D's column-wise copy)."""
        if name not in self._names:
            raise KeyError(f"no registered param named '{name}'")
        if axis not in (None, "row", "col"):
            raise ValueError(f"axis must be 'row', 'col' or None (the forward's); got {axis!r}")
        index = self._names.index(name)
        p = self._params[index]
        if not self._cpp.is_mxfp8(index):
            raise ValueError(f"param '{name}' is not kept as MXFP8; read the param itself")
        if axis is None:
            return self._mxfp8_forward_values(index)
        return mxfp8.dequantize(self._cpp, index, axis, p.shape, p.dtype, self.device)

    def state_dict(self, *args, **kwargs):
        """torch's state dict of the wrapper with every param's current values, keyed as torch DDP's
        (``module.<name>``) in torch's form and as the module's own in Megatron's (whose DDP passes
        state_dict and load_state_dict through to the module): the all-gathers of an overlapped param sync are finished first, and
        MXFP8 weights, whose Parameters hold NaN stand-ins, are dequantized from the copy their
        forward reads. The registered params' entries are copies, not views of mxddp's param buffer,
        so a state dict outlives ``close()`` (which frees the buffer); with ``keep_vars=True`` they are
        the Parameters, which ``close()`` gives storage of their own. After ``close()``: torch's own."""
        if self._cpp.closed:
            return self._torch_state_dict(args, kwargs)
        self.finish_param_sync()
        keep_vars = kwargs.get("keep_vars", args[2] if len(args) > 2 else False)
        values = {} if keep_vars else {id(p): p.detach().clone() for p in self._params}
        values.update({id(self._params[i]): self._mxfp8_forward_values(i) for i in self._mxfp8_kind})
        return self._state_dict_with(values, args, kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's load into the wrapped module (keyed as ``state_dict()``); the values land in mxddp's
        param buffer, and the next step starts from them: with BF16 params an open
        DistributedOptimizer copies them into its F32 main params first (param_writes.py), as it
        does any value written into the params. Refused for MXFP8 weights (kept only as MXFP8 by
        the C++ DDP). A load that fails (a shape mismatch, a missing key) leaves every param and buffer as it was. After
        ``close()``, torch's own load into the params' storage."""
        if self._cpp.closed:
            return self._torch_load_state_dict(state_dict, strict, assign)
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the params' storage, which is mxddp's "
                             "param buffer; use assign=False")
        if self._mxfp8_kind:
            names = ", ".join(self._names[i] for i in self._mxfp8_kind)
            raise RuntimeError(f"load_state_dict: the MXFP8 weights ({names}) are kept only as MXFP8 by the C++ DDP; "
                               "load into the module before wrapping it, or use mxddp.torch.load_checkpoint")
        self.finish_param_sync()  # a gather still in flight would overwrite the loaded values
        # torch copies entry by entry and raises only at the end (a shape mismatch, a missing key), so a
        # failed load would leave some params loaded and others not: put everything back then.
        state = [t for t in itertools.chain(self.module.parameters(), self.module.buffers()) if t is not None]
        saved = [t.detach().clone() for t in state]
        try:
            return self._torch_load_state_dict(state_dict, strict, assign)
        except BaseException:
            with torch.no_grad():
                for t, v in zip(state, saved):
                    t.copy_(v)  # their values as before: the optimizer takes nothing from them
            raise

    # ---- where things live (zero copy), for tests and the curious ----
    def param_buffer(self) -> torch.Tensor:
        """The whole param buffer, [numel] in the params' dtype; every param is a view into it."""
        return self._cpp.param_buffer()

    def grad_buffer(self) -> torch.Tensor:
        """The whole grad buffer, [numel]; every param's main_grad is a view into it."""
        return self._cpp.grad_buffer()

    @property
    def grads_live(self) -> bool:
        """Whether a gradient has been reported since the grad buffer was last zeroed."""
        return self._cpp.grads_live

    @property
    def num_buckets(self) -> int:
        return self._cpp.num_buckets

    def _close_at_exit(self) -> None:
        self.close()

    def close(self) -> None:
        """Frees mxddp's buffers: the params get storage of their own (their current values), and
        main_grad and the hooks are removed (MXFP8 weights get the values their forward reads, and their
        modules and the fused ones their own forward back). Close the optimizer first."""
        if self._cpp.closed:
            return
        if self._cpp.open_optimizers:
            raise RuntimeError("close the DistributedOptimizer before its DistributedDataParallel")
        self.finish_param_sync()
        with torch.no_grad():
            for i, p in enumerate(self._params):
                if self._cpp.is_mxfp8(i):  # the values the model computes with: the forward's copy
                    p.data = self._mxfp8_forward_values(i)
                else:
                    p.data = p.data.clone()
        self._torch_grads, self._torch_grads_kept = {}, set()  # each .grad keeps storage of its own (_unwrap)
        self._unwrap()
