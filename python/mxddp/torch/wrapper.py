"""What ``DistributedDataParallel`` and ``FullyShardedDataParallel`` share as torch modules: the
C++ handle (``_cpp``, a ``_C.DataParallel``), the registered params, ``no_sync``, the state the
optimizer and the checkpoints read and reset (whether reported grads await their sync), and the
check that the registered params are still the ones the module trains with.

That check: a param replaced after wrapping (``module.fc.weight = nn.Parameter(...)``, or
``param.data = new``, or ``module.to(dtype)``, which replaces every ``.data``) would be silent, the
new tensor never trained and this rank's values apart from the others'. So the wrapper records
where each param sits in the module (owner and attribute) and the data pointer it gave the param
(mxddp's buffer, a gathered unit's storage, or a stand-in), re-recorded whenever it changes
``.data`` itself, and compares both at every forward and ``finish_grad_sync``: a dict look-up and a
``data_ptr()`` per param.

Lifetime: a wrapper dropped without ``close()`` is freed, with mxddp's buffers, once neither it nor
its module is reachable. torch keeps a tensor's hooks where Python's garbage collector cannot see
them, so the hooks the wrappers put on params and ready tokens hold the wrapper weakly; the module holds its wrapper where the collector does see it (``_hold_from_module``),
since the module's params view the wrapper's buffers and report into it for as long as it lives."""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch

from mxddp.torch import grad_fusion, module_copies, mxfp8, torch_clip, torch_grads, watched_params


def _all_module_prefixed(state_dict, module: torch.nn.Module) -> bool:
    """Whether every key of `state_dict` starts with ``module.`` while none of `module`'s does."""
    keys = [k for k in state_dict if isinstance(k, str)]
    return bool(keys) and len(keys) == len(state_dict) and all(k.startswith("module.") for k in keys) and \
        not any(k.startswith("module.") for k in module.state_dict(keep_vars=True))


class _HeldWrapper:
    """The wrapped module's reference to its wrapper (the attribute ``_mxddp_wrapper``). A copy of the
    module leaves it out (module_copies.py); one whose class copies ``__dict__`` itself (an fx
    GraphModule's own ``__deepcopy__`` and ``__reduce__``) holds None there."""

    __slots__ = ("wrapper",)

    def __init__(self, wrapper: "DataParallelModule"):
        self.wrapper = wrapper

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (type(None), ())


def refuse_wrapped_module(module: torch.nn.Module) -> None:
    """Raises ValueError where ``module`` is the module of an open wrapper already (which it holds)."""
    held = vars(module).get("_mxddp_wrapper")
    if isinstance(held, _HeldWrapper) and not held.wrapper._cpp.closed:
        raise ValueError(f"this {type(module).__name__} is wrapped by an open mxddp.torch {type(held.wrapper).__name__} "
                         "already (which it keeps alive while it lives). Close that model first (model.close(), after "
                         "its optimizer's close()), or wrap a module that is not wrapped")


def refuse_wrapped(name: str, param: torch.nn.Parameter) -> None:
    """Raises ValueError where ``param`` is held by an open wrapper (whose hooks and buffers it still uses)."""
    holder = torch_clip.open_holder(param)
    if holder is not None:
        raise ValueError(f"param '{name}' is held by an open mxddp.torch {type(holder).__name__} already: its "
                         "values live in that model's buffers and its gradients report into it. Close that model "
                         "first (model.close(), after its optimizer's close()), or wrap a module that is not wrapped")


def _let_go(hooks: list, param_refs: list, module_refs: list, replaced_forward_ids: set, wrapper_ref) -> None:
    """Run when a wrapper dropped without close() is collected. Its hooks are removed: torch's
    register_multi_grad_hook on a param holds the param itself (its gradient accumulator) where the
    collector cannot see it, so the param, and the buffer its data views, would never be freed. A
    param or a module the script still holds (kept beside the module, which went) becomes a plain
    one holding what it held, in storage of its own (close() gives every param its values; a
    sharded or MXFP8 param holds a NaN stand-in between iterations), so mxddp's buffers go too."""
    for h in hooks:
        h.remove()
    for ref in module_refs:
        module = ref()
        if module is not None:  # alive, so id() names the same module as at wrap time
            module_copies.remove(module, wrapper_ref())
            if id(module) in replaced_forward_ids:
                grad_fusion.restore_forward(module)
    params = [p for p in (ref() for ref in param_refs) if p is not None]
    with torch.no_grad():
        for p in params:
            p.data = p.data.clone()
            torch_grads.keep_own(p)
            vars(p).pop("main_grad", None)
    watched_params.unwatch(params)


class DataParallelModule(torch.nn.Module):
    """The base of the two wrappers. A subclass sets ``_cpp``, ``_names``, ``_params``,
    ``_mxfp8_kind`` (index -> 'linear' or 'conv1d' for its MXFP8 params) and ``ddp_config``, calls
    ``_init_sync_state()`` in its constructor and ``_record_param_places()`` once the params have
    their data, then changes a param's ``.data`` only through ``_set_data`` and calls
    ``_check_params_in_place`` at the start of its forward and finish_grad_sync. It sets ``device``
    (where the params live) and ``_stream`` (on a GPU, the stream it was wrapped on) too."""

    device = torch.device("cpu")
    _stream = None  # on a GPU: torch's current stream at wrap time, which its work must run on

    # ---- torch DDP's API that mxddp does not have, refused naming what to do instead ----

    def __deepcopy__(self, memo):
        raise TypeError(f"copy.deepcopy of a mxddp.torch {type(self).__name__}: its buffers and communicator "
                        "cannot be copied; copy the module inside instead (copy.deepcopy(model.module), "
                        "torch.optim.swa_utils.AveragedModel(model.module), an EMA of model.module)")

    def __reduce_ex__(self, protocol):
        raise TypeError(f"pickling a mxddp.torch {type(self).__name__} (torch.save(model)): its buffers and "
                        "communicator cannot be saved; save model.state_dict(), or torch.save(model.module)")

    def join(self, *args, **kwargs):
        raise NotImplementedError("join() (torch DDP's uneven inputs) is not supported by mxddp.torch: every rank must "
                                  "run the same number of iterations; give each the same number of batches (a "
                                  "DistributedSampler with drop_last=True)")

    def join_hook(self, *args, **kwargs):
        self.join()

    def register_comm_hook(self, *args, **kwargs):
        raise NotImplementedError("register_comm_hook() is not supported by mxddp.torch: its reductions are its own "
                                  "(reduce-scatter or all-reduce of the grad buffer); the DDP config chooses their "
                                  "dtype (grad_reduce_in_fp32) and scaling (average_in_collective)")

    def _record_param_places(self) -> None:
        """Records, after the params were given their data, every (module, attribute) holding a
        registered param (a shared one in each of its modules) and each param's data pointer."""
        index_of = {id(p): i for i, p in enumerate(self._params)}
        self._param_places: list[tuple[torch.nn.Module, str, str, int]] = []  # (owner, attribute, its name, index)
        seen: set[tuple[int, str]] = set()
        for prefix, owner in self.module.named_modules(remove_duplicate=False):
            for attr, p in owner._parameters.items():
                if p is not None and id(p) in index_of and (id(owner), attr) not in seen:
                    seen.add((id(owner), attr))
                    self._param_places.append((owner, attr, f"{prefix}.{attr}" if prefix else attr, index_of[id(p)]))
        self._data_ptrs = [p.data_ptr() for p in self._params]
        self._data_replaced: set[int] = set()  # found by _set_data before it overwrote the .data
        torch_clip.hold(self, self._params)  # torch.nn.utils.clip_grad_norm_ on them asks this model
        self._hold_from_module()
        watched_params.watch(self._params)  # a write through .data is counted (param_writes.py)

    def _hold_from_module(self) -> None:
        """The module keeps its wrapper alive (see the module docstring); close() lets go. Once the
        wrapper is collected (its module with it), ``_let_go`` undoes the wrap for what outlived them."""
        self._wrapped_modules = [weakref.ref(m) for m in self.module.modules()]  # the tree as wrapped
        self.module._mxddp_wrapper = _HeldWrapper(self)
        module_copies.install(self)
        self._let_go = weakref.finalize(self, _let_go, self._hooks, [weakref.ref(p) for p in self._params],
                                        self._wrapped_modules, {id(m) for m in self._replaced_forwards},
                                        weakref.ref(self))
        self._let_go.atexit = False

    # What _hold_from_module sets (before it: nothing held, no module overridden, no finalizer).
    _wrapped_modules: list = []
    _let_go = None

    def _release_from_module(self) -> None:
        """At close() or a failed wrap: the module lets go of its wrapper, and nothing is undone when it
        is collected (close() undid it all; the params the script keeps hold their values in their own
        storage)."""
        held = vars(self.module).get("_mxddp_wrapper")
        if isinstance(held, _HeldWrapper) and held.wrapper is self:
            del self.module._mxddp_wrapper
        # The tree as wrapped: a module taken out of it since keeps the override otherwise.
        for ref in self._wrapped_modules:
            sub = ref()
            if sub is not None:
                module_copies.remove(sub, self)
        if self._let_go is not None:
            self._let_go.detach()

    def _build_or_undo(self, build: Callable[[], None]) -> None:
        """Runs the constructor's part after the C++ wrapper exists. If it raises (a refusal met while
        the params get their buffers, a rank-0 broadcast that failed, any later step), the module is
        left as it was found: each param holds the tensor it held before (mxddp's values went into its
        own buffers), the rest is undone as close() undoes it (``_unwrap``), and the error is raised;
        one the undo meets is noted on it."""
        original_data = [p.data for p in self._params]
        try:
            build()
        except BaseException as failure:
            try:
                with torch.no_grad():
                    for p, data in zip(self._params, original_data):
                        p.data = data
                self._unwrap()
            except BaseException as undo_failure:
                if hasattr(failure, "add_note"):  # Python >= 3.11
                    failure.add_note(f"mxddp: undoing the failed wrap failed too: {undo_failure!r}")
            raise

    def _unwrap(self) -> None:
        """What close() and a failed constructor share, once every param holds storage of its own: the
        params lose main_grad (DDP's) and their watch, the hooks and replaced forwards go, the module
        lets go of the wrapper, and the buffers are freed whatever else fails."""
        try:
            for p in self._params:
                torch_grads.keep_own(p)  # a .grad torch_grads.py gave it stays, in storage of its own
                if hasattr(p, "main_grad"):
                    del p.main_grad
            watched_params.unwatch(self._params)
            for owner in self._replaced_forwards:
                grad_fusion.restore_forward(owner)
            self._replaced_forwards = []
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._release_from_module()
        finally:
            self._cpp.close()

    def _set_data(self, index: int, data: torch.Tensor) -> None:
        """param.data = data, for the wrappers' own swaps (FSDP's gather and release): the pointer
        is re-recorded, and a .data someone else replaced meanwhile is remembered, not lost."""
        p = self._params[index]
        if p.data_ptr() != self._data_ptrs[index]:
            self._data_replaced.add(index)
        p.data = data
        self._data_ptrs[index] = p.data_ptr()

    def _check_params_in_place(self, where: str) -> None:
        """Raises RuntimeError naming the first registered param that was replaced after wrapping."""
        if self._cpp.closed:
            return
        wrapper = type(self).__name__
        for owner, attr, qualified, i in self._param_places:
            if owner._parameters.get(attr) is not self._params[i]:
                raise RuntimeError(
                    f"{where}: param '{self._names[i]}' was replaced after wrapping: the module's '{qualified}' is "
                    f"no longer the Parameter {wrapper} registered (a new nn.Parameter assigned to it?). mxddp trains "
                    "the registered one, so the new one would never train. Copy new values into the param instead "
                    "(`with torch.no_grad(): param.copy_(values)`), or build the module as it should be before "
                    "wrapping it")
        for i, p in enumerate(self._params):
            if i in self._data_replaced or p.data_ptr() != self._data_ptrs[i]:
                raise RuntimeError(
                    f"{where}: param '{self._names[i]}' no longer holds the storage {wrapper} gave it: its .data was "
                    "replaced after wrapping (`param.data = ...`, or .to()/.half()/.float() on the wrapped module). "
                    "mxddp trains and synchronizes its own buffers, so the new tensor would never train and this "
                    "rank would hold other values than the rest. Copy new values in instead "
                    "(`with torch.no_grad(): param.copy_(values)`), or convert the module before wrapping it")
        stream = self._stream
        if stream is not None and torch.cuda.current_stream(self.device).cuda_stream != stream:
            raise RuntimeError(
                f"{where}: torch's current stream on {self.device} is not the one {wrapper} was wrapped on: mxddp "
                "orders its collectives, gathers and frees after the work of that stream only, so work on another "
                "one could race with them. Run the model on the stream that was current when it was wrapped "
                "(or wrap it inside the same `torch.cuda.stream(...)` block)")

    # Each param's version counter when params and main params last agreed (param_writes.py): set
    # by the first DistributedOptimizer opened on the model; None while none is open.
    _param_versions = None

    # HSDP (FullyShardedDataParallel with a replica group) sets it: checkpoints refuse such models.
    _hybrid = False

    def _refuse_hybrid(self, what: str) -> None:
        """Checkpoints of hybrid-sharded models are not handled yet: every replica group would write
        the same shards, and a load would not know which replica's to read."""
        if self._hybrid:
            raise NotImplementedError(f"{what}: this model is hybrid-sharded (HSDP: device_mesh= or "
                                      "num_distributed_optimizer_instances > 1), and checkpoints of HSDP models are "
                                      "not supported yet; save from a plain FSDP or DDP run")

    def _params_holding_values(self) -> list[int]:
        """The registered params whose torch tensor holds their values now (not a NaN stand-in)."""
        return [i for i in range(len(self._params)) if i not in self._mxfp8_kind]

    def _stand_in_params(self) -> set[int]:
        """The registered params whose Parameter is a NaN stand-in between iterations."""
        return set(range(len(self._params))) - set(self._params_holding_values())

    def _pending_gathers(self, indices: list[int]) -> list[int]:
        """Of these params, those whose overlapped all-gather is still to land."""
        return []

    # Weak references to the DistributedOptimizers built on this model, oldest first.
    _mxt_optimizers: tuple = ()

    def _add_optimizer(self, optimizer) -> None:
        self._mxt_optimizers = tuple(r for r in self._mxt_optimizers if r() is not None) + (weakref.ref(optimizer),)

    def _open_optimizers(self) -> list:
        """The DistributedOptimizers open on this model (param_writes.py copies into each)."""
        return [o for o in (ref() for ref in self._mxt_optimizers) if o is not None and not o._closed]

    def _init_sync_state(self) -> None:
        # Set when a grad is reported, cleared by finish_grad_sync: the optimizer refuses to step on
        # grads that were not synchronized.
        self._grads_pending_sync = False
        # With reuse_grad_buf_for_mxfp8_param_ag (DDP only) a step only updates the main params; the
        # model's copies are brought up to date by opt.zero_grad(), which the next forward must follow.
        self._awaiting_zero_grad = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate and are not reduced while inside, where the strategy allows it (DDP,
        FSDP no_shard and optim; FSDP optim_grads* still reduce-scatter every micro-batch, since
        they keep only a shard of the gradients)."""
        self._cpp.enter_no_sync()
        try:
            yield
        finally:
            self._cpp.exit_no_sync()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """FSDP1's name: clips the synchronized gradients by their global norm and returns the norm
        before clipping. The gradients live in mxddp's grad buffer (``.grad`` is None), so this asks
        the DistributedOptimizer built on this model, which holds the sharded view of them (as
        ``torch.nn.utils.clip_grad_norm_`` on this model's params does: torch_clip.py). Collective."""
        optimizer = self._optimizer()
        if optimizer is None:
            raise RuntimeError(f"{type(self).__name__}.clip_grad_norm_({max_norm!r}): no "
                               "mxddp.torch.DistributedOptimizer is built on this model (or it was garbage-collected); "
                               "the gradients are clipped by the optimizer that holds them: build "
                               "`mxt.DistributedOptimizer(model, optimizer)` first")
        return optimizer.clip_grad_norm_(max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    def registered_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The params mxddp holds, in registration order."""
        return list(zip(self._names, self._params))

    def _mxfp8_forward_values(self, index: int) -> torch.Tensor:
        """MXFP8 param ``index``'s values as its forward reads them (an nn.Linear's row-wise copy, a
        Conv1D's column-wise one), dequantized into a new tensor of the registered dtype (which the
        Parameter no longer has if it was converted after wrapping): what a state dict or close() gives."""
        p = self._params[index]
        return mxfp8.dequantize(self._cpp, index, mxfp8.forward_axis(self._mxfp8_kind[index]), p.shape,
                                self.param_dtype, self.device)

    # How its state dict is keyed: ``module.<name>`` as torch DDP's and Megatron-FSDP's wrappers, or
    # (False) as the module's own, as Megatron's DDP passes it through.
    _module_prefixed_keys = True

    def _torch_state_dict(self, args, kwargs) -> dict:
        """torch's own state dict, keyed as this wrapper keys it."""
        if self._module_prefixed_keys:
            return torch.nn.Module.state_dict(self, *args, **kwargs)
        return self.module.state_dict(*args, **kwargs)

    def _torch_load_state_dict(self, state_dict, strict: bool, assign: bool):
        """torch's own load, of a state dict keyed as this wrapper keys it. Keyed as the module's own,
        a dict keyed ``module.<name>`` (every key; the module has no such keys itself: a dict saved from
        torch's form, or from this form before it followed Megatron) loads too."""
        if self._module_prefixed_keys:
            return torch.nn.Module.load_state_dict(self, state_dict, strict=strict, assign=assign)
        if _all_module_prefixed(state_dict, self.module):
            state_dict = {key[len("module."):]: value for key, value in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _register_nested_load_keys(self) -> None:
        """A wrapper keyed as its module, inside a container whose own load_state_dict runs: torch
        recurses into the wrapper's child ``module`` and looks for ``<prefix>module.<name>``, while
        the container's state_dict (which calls this wrapper's) wrote ``<prefix><name>``. The pre-hook
        moves the keys there, so the container's save and load agree."""
        def hook(state_dict, prefix, *_unused):
            if self._module_prefixed_keys:
                return
            inner = prefix + "module."
            for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
                state_dict[inner + key[len(prefix):]] = state_dict.pop(key)

        self._register_load_state_dict_pre_hook(hook)

    def _state_dict_with(self, values: dict[int, torch.Tensor], args, kwargs) -> dict:
        """torch's state dict (keyed as ``_torch_state_dict``), with ``values`` (id(param) -> tensor)
        in place of those params' own tensors, under every name a shared param has."""
        destination = self._torch_state_dict(args, kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        names_prefix = prefix + "module" if self._module_prefixed_keys else prefix.removesuffix(".")
        for name, p in self.module.named_parameters(prefix=names_prefix, remove_duplicate=False):
            if id(p) in values and name in destination:
                destination[name] = values[id(p)]
        return destination

    # ---- The optimizer's zero_grad around the C++ one ----

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``model.zero_grad()``: the registered params' gradients (main_grad, in the grad
        buffer; FSDP's shards) are zeroed, and torch's own zero_grad runs for any other param's
        ``.grad``."""
        self.zero_grad_buffer()
        super().zero_grad(set_to_none=set_to_none)

    def _optimizer(self):
        """The DistributedOptimizer last built on this model, while it lives (the model's
        clip_grad_norm_ calls its); None otherwise."""
        live = [o for o in (ref() for ref in self._mxt_optimizers) if o is not None]
        return live[-1] if live else None

    def _drop_pending_clip(self) -> None:
        """A clip_grad_norm_ scales the grads it measured: once they are zeroed it no longer applies."""
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._clip_coeff = 1.0

    def _before_zero_grad(self) -> None:
        """What must happen before the grads are zeroed (FSDP: report a backward's unused params)."""

    def _after_param_update(self, gathered: bool) -> None:
        """The optimizer wrote new main params: every rank's params hold them now (gathered: a
        force_param_sync), or a gather of them is still to come (a step). FSDP keeps track of which
        units' full params are stale (its read guards and finish_param_sync)."""

    def _after_zero_grad(self, set_to_none: bool = True) -> None:
        self._grads_pending_sync = False
        self._awaiting_zero_grad = False
