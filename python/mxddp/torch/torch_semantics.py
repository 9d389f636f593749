"""torch DDP's semantics on mxddp's ``DistributedDataParallel``: what a torch DDP script relies on
without calling anything for it.

- **End of backward.** The backward's first gradient of a forward's output (or, failing that, of a
  registered param) queues an autograd callback
  (``Variable._execution_engine.queue_callback``) that runs once the whole backward is done. It
  reports every param that got no gradient in this backward (its contribution is zero), so buckets
  complete in the same order on every rank and a ``no_sync`` micro-batch ends; then, in torch's form,
  it synchronizes the grads as ``finish_grad_sync()`` does. In Megatron's form the grads are
  synchronized by ``finish_grad_sync()``, which Megatron's loops call.
- **Accumulation.** ``require_backward_grad_sync`` (torch's attribute, read when a backward
  starts) and ``no_sync()`` (which sets it False while inside) make a backward accumulate into
  ``main_grad`` without reducing; the next synchronized backward reduces the sum.
- **Unused params.** Which params got a gradient since the last ``zero_grad`` is tracked; with
  ``find_unused_parameters=True`` the sync agrees on it across ranks (an all-reduce of a flag per
  param) and records ``_unused_params``, the params no rank used, which the optimizer leaves
  untouched as torch leaves a param whose ``.grad`` is None. With False, a synchronized backward
  in which a param got no gradient raises naming it (on the rank that saw it).
- **Buffers.** With ``broadcast_buffers`` rank 0's buffers are copied to every rank before a
  forward, when torch DDP copies them: before the first forward, and before any forward that follows
  one run with grad enabled and grad sync required (so once per accumulation window). Every
  buffer travels as its bytes, so integer ones (BatchNorm's ``num_batches_tracked``) too.

The class is a mixin of ``DistributedDataParallel`` (ddp.py), which sets ``_cpp``, ``_params``,
``_names`` and ``module`` and calls ``_init_torch_semantics`` and ``_on_grad``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from mxddp import _C
from mxddp.torch import launch, torch_grads

# Unused params a refusal names before it only counts the rest.
_NAMES_SHOWN_MAX = 8


@dataclass
class _Backward:
    """The backward under way: whether it synchronizes, and whether it entered the C++ no_sync."""

    syncs: bool
    entered_no_sync: bool


def _names_text(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_NAMES_SHOWN_MAX])
    return shown + (f" and {len(names) - _NAMES_SHOWN_MAX} more" if len(names) > _NAMES_SHOWN_MAX else "")


def _group_rank(group) -> int:
    return launch.rank() if group is None else torch.distributed.get_rank(group)


def _group_size(group) -> int:
    return launch.world_size() if group is None else torch.distributed.get_world_size(group)


def _wire(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` where torch's collectives on ``group`` take it: on this process's current CUDA device
    for an NCCL group, on the CPU for any other (itself if it is there already)."""
    if torch.distributed.get_backend(group) == "nccl":
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


def broadcast_tensors(tensors: list[torch.Tensor], group=None) -> None:
    """Copies the values of ``tensors`` (any dtypes, on the CPU or a GPU: they travel packed in host
    memory) on the group's rank 0 into every member's,
    in one collective: their bytes packed into one buffer and broadcast, which moves bits
    unchanged. ``group``: a torch.distributed group (torch's broadcast on it, in the script's
    order as the script's own collectives), or None: mxddp's world (the package's broadcast, which
    takes F32 and BF16 only, so the bytes travel padded to whole F32 elements)."""
    if not tensors:
        return
    parts = [t.detach().reshape(-1).contiguous().view(torch.uint8).cpu() for t in tensors]
    total = sum(p.numel() for p in parts)
    packed = torch.zeros((total + 3) // 4 * 4, dtype=torch.uint8)
    root = _group_rank(group) == 0
    if root:
        torch.cat(parts, out=packed[:total])
    if group is None:
        _C.broadcast(packed.view(torch.float32), 0)
    else:
        wire = _wire(packed, group)
        torch.distributed.broadcast(wire, src=torch.distributed.get_global_rank(group, 0), group=group)
        packed.copy_(wire)
    if root:
        return
    offset = 0
    # The version counters stay as they were, as torch DDP's buffer broadcast keeps them: a buffer
    # saved for backward (a running statistic read by a custom op) is not "modified in place".
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(tensors)):
        for t, part in zip(tensors, parts):
            n = part.numel()
            # A copy first: a byte slice at an odd offset cannot be viewed as a wider dtype.
            t.copy_(packed[offset:offset + n].clone().view(t.dtype).reshape(t.shape))
            offset += n


def all_reduce_max(t: torch.Tensor, group=None) -> None:
    """In place, the elementwise max of CPU tensor ``t`` over the group's members (None: mxddp's world)."""
    if group is None:
        _C.all_reduce(t, "max")
    else:
        wire = _wire(t, group)
        torch.distributed.all_reduce(wire, op=torch.distributed.ReduceOp.MAX, group=group)
        t.copy_(wire)


class TorchSemantics:
    """The mixin: state set up by ``_init_torch_semantics``, fed by ``_on_grad``."""

    def _init_torch_semantics(self, find_unused_parameters, broadcast_buffers: bool, sync_at_backward_end: bool,
                              static_graph: bool, group=None) -> None:
        n = len(self._params)
        self._group = group  # the user's process group (None: mxddp's world): buffers and flags go over it
        # torch's attribute: False makes the backwards accumulate without reducing.
        self.require_backward_grad_sync = True
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.static_graph = static_graph
        self._sync_at_backward_end = sync_at_backward_end
        self._reported = [False] * n  # in the C++ DDP's current micro-batch
        self._used = [False] * n      # got a gradient since the last zero_grad
        self._unused_params: list[int] = []
        # torch's zero_grad(set_to_none=False) leaves a zero .grad on every param that had one, and
        # a torch optimizer steps those: the params used in a synchronized window before such a
        # zero_grad (used_at_sync: the last sync's, agreed across ranks) are kept out of
        # _unused_params' freeze until a zero_grad(set_to_none=True).
        self._used_at_sync: set[int] = set()
        self._kept_zero_grads: set[int] = set()
        # Set by a sync that reduce-scattered the grad buffer (the distributed optimizer's): only
        # this rank's shard holds reduced grads, the rest its own, so a backward may add into it
        # only after a zero_grad.
        self._grads_scattered = False
        self._backward: _Backward | None = None
        # torch_grads.py: index -> the main_grad view given to .grad at the end of the last backward,
        # and the params whose .grad the script kept through the take-back before this backward.
        self._torch_grads: dict[int, torch.Tensor] = {}
        self._torch_grads_kept: set[int] = set()
        self._no_sync_depth = 0
        # torch DDP's require_forward_param_sync: whether the next forward broadcasts the buffers.
        self._buffers_due = True

    # ---- gradients ----

    def _on_grad(self, index: int) -> None:
        """A registered param's gradient is in its main_grad (every hook path ends here)."""
        if self._backward is None:
            self._begin_backward()
        self._reported[index] = True
        self._used[index] = True
        self._grads_pending_sync = True
        self._cpp.grad_ready(index)

    def _begin_backward(self) -> None:
        if self._torch_grads:
            torch_grads.take_back(self)  # the script's .grad, as it left them, go back into main_grad
        syncs = bool(self.require_backward_grad_sync)
        if syncs and any(self._reported):
            # Megatron's form (sync_at_backward_end off): the last backward's grads wait for
            # finish_grad_sync(), and its params would be reported twice in one micro-batch.
            raise RuntimeError(
                f"rank {launch.rank()}: a synchronizing backward began while the previous backward's gradients "
                "were not synchronized yet (in Megatron's form finish_grad_sync() does that): run every "
                "micro-batch but the last inside model.no_sync(), and call model.finish_grad_sync() after the last")
        if self._grads_scattered:
            raise RuntimeError(self._scattered_refusal())
        if not syncs:
            self._cpp.enter_no_sync()
        self._backward = _Backward(syncs=syncs, entered_no_sync=not syncs)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _hook_outputs(self, output) -> None:
        """A hook on each output tensor in the graph begins the backward there, in the backward the
        script started: a param's first gradient may come from a nested backward (reentrant
        activation checkpointing runs one per checkpointed segment), whose end is not the end of
        the whole backward (torch DDP's DDPSink serves the same purpose)."""
        if not torch.is_grad_enabled():
            return
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                t.register_hook(self._begin_backward_from_output)

    def _begin_backward_from_output(self, grad):
        if self._backward is None:
            self._begin_backward()
        return grad

    def _end_of_backward(self) -> None:
        backward, self._backward = self._backward, None
        missing = [i for i, reported in enumerate(self._reported) if not reported]
        try:
            if missing and backward.syncs and self.find_unused_parameters is False:
                raise RuntimeError(self._unused_refusal(missing))
            for i in missing:  # a zero contribution: the buckets complete, the micro-batch ends
                self._reported[i] = True
                self._cpp.grad_ready(i)
        finally:
            if backward.entered_no_sync:
                self._cpp.exit_no_sync()  # the C++ micro-batch is over: nothing is reported in it
            if not backward.syncs:
                self._reported = [False] * len(self._params)
        if backward.syncs and self._sync_at_backward_end:
            self._sync_grads()
        torch_grads.expose(self, synced=backward.syncs)

    def _unused_refusal(self, missing: list[int]) -> str:
        names = [self._names[i] for i in missing]
        return (f"rank {launch.rank()}: {len(names)} param(s) got no gradient in this backward: "
                f"{_names_text(names)}. DistributedDataParallel was built with find_unused_parameters=False, which "
                "expects every registered param to take part in every synchronized backward (torch DDP would "
                "stop at the next forward with 'Expected to have finished reduction in the prior iteration'). "
                "Build it with find_unused_parameters=True to have such params found every step (their "
                "gradients reduce as zeros where another rank used them, and the optimizer leaves a param no "
                "rank used untouched, as torch does), or set requires_grad=False before wrapping on params the "
                "model never uses")

    def _abandon_dead_backward(self) -> None:
        """A backward that raised never reached its end: leave the C++ no_sync it entered, so that the
        next backward starts clean (a synchronizing one's reported params stay reported in C++)."""
        backward, self._backward = self._backward, None
        if backward is not None and backward.entered_no_sync:
            self._cpp.exit_no_sync()
            self._reported = [False] * len(self._params)

    def _sync_grads(self) -> None:
        """What finish_grad_sync does, once per accumulation window (a second call is a no-op): every
        param not reported in the current micro-batch is (a zero contribution), the collectives are
        issued and waited for; with find_unused_parameters the ranks agree on the unused params."""
        if not self._grads_pending_sync:
            return
        for i, reported in enumerate(self._reported):
            if not reported:
                self._cpp.grad_ready(i)
        self._cpp.finish_grad_sync()
        self._reported = [False] * len(self._params)
        self._grads_pending_sync = False
        self._grads_scattered = self.ddp_config.use_distributed_optimizer and not self.ddp_config.force_all_reduce
        if self.find_unused_parameters:
            flags = torch.tensor(self._used, dtype=torch.float32)
            all_reduce_max(flags, self._group)
            self._unused_params = [i for i, used in enumerate(flags.tolist()) if used == 0.0]
            self._used_at_sync = set(range(len(self._params))) - set(self._unused_params)

    def _reset_used(self) -> None:
        """At zero_grad: no param has a gradient."""
        self._used = [False] * len(self._params)
        self._reported = [False] * len(self._params)
        self._grads_scattered = False

    def _keep_zero_grads(self, set_to_none: bool) -> None:
        if set_to_none:
            self._kept_zero_grads = set()
        else:
            self._kept_zero_grads |= self._used_at_sync
        self._used_at_sync = set()

    def _scattered_refusal(self) -> str:
        return (f"rank {launch.rank()}: a backward began on gradients already reduce-scattered and not zeroed "
                "since: with use_distributed_optimizer=True the synchronization leaves only this rank's shard "
                "of the grad buffer reduced (the rest holds this rank's own gradients), so new gradients added "
                "to it would sum wrongly. Call optimizer.zero_grad() (or model.zero_grad_buffer()) after each "
                "step and before the next backward, as Megatron's loop does; to accumulate over micro-batches, "
                "run all but the last inside model.no_sync()")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """torch's: backwards inside accumulate into main_grad without reducing (they run with
        ``require_backward_grad_sync = False``); the first synchronized backward after reduces the
        sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            self.require_backward_grad_sync = previous

    # ---- buffers ----

    def _module_buffers(self) -> list[torch.Tensor]:
        return [b for b in self.module.buffers() if b is not None]

    def _before_forward_buffers(self) -> None:
        if self._backward is not None:
            self._abandon_dead_backward()
        if self.broadcast_buffers and self._buffers_due and _group_size(self._group) > 1:
            broadcast_tensors(self._module_buffers(), self._group)

    def _after_forward_buffers(self) -> None:
        # torch DDP's rule: the next forward broadcasts only after one that will synchronize.
        self._buffers_due = torch.is_grad_enabled() and bool(self.require_backward_grad_sync)

    def _broadcast_at_wrap(self) -> None:
        """Rank 0's params (frozen ones too) and buffers to every rank, as torch DDP's construction does."""
        if _group_size(self._group) > 1:
            self._cpp.broadcast_params()  # over the DDP's communicator: the group's
            registered = {id(p) for p in self._params}
            frozen = [p for p in self.module.parameters() if id(p) not in registered]
            broadcast_tensors(self._module_buffers() + frozen, self._group)
