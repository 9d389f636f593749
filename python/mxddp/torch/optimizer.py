"""``DistributedOptimizer``: mxddp's C++ distributed optimizer stepping on a DDP's buffers.

Each rank keeps F32 main params and the AdamW (or SGD) state for its shard of every bucket; a step
computes the global grad norm, clips, updates the shard and all-gathers the updated params into the
param buffer, which the torch params are views of.

A step whose global grad norm is NaN or Inf is skipped (nothing changes). The first of a run of
skipped steps warns, naming the norm, the params whose gradients hold the NaN or Inf and, per rank,
the params whose own values do (found only then: a step that goes through pays nothing for it);
more than ``OptimizerConfig.max_consecutive_skipped_steps`` in a row raise on every rank, since a
NaN that persists (one rank's param) would otherwise skip every step forever, silently.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from mxddp import _C
from mxddp.torch import agreement, launch
from mxddp.torch.config import OptimizerConfig
from mxddp.torch.wrapper import DataParallelModule

# Params a skipped step's message names before it only counts the rest.
_NAMES_SHOWN_MAX = 8


class SkippedStepWarning(RuntimeWarning):
    """``DistributedOptimizer.step()`` skipped a step: its global grad norm was NaN or Inf."""


def _name_list(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_NAMES_SHOWN_MAX])
    return shown + (f" and {len(names) - _NAMES_SHOWN_MAX} more ({len(names)} in all)"
                    if len(names) > _NAMES_SHOWN_MAX else "")


class DistributedOptimizer:
    """Megatron-core's distributed optimizer for a ``mxddp.torch.DistributedDataParallel`` built
    with ``use_distributed_optimizer=True``, or a ``mxddp.torch.FullyShardedDataParallel`` (whose
    shards it steps on, whatever the strategy: no_shard keeps a replicated optimizer)."""

    def __init__(self, model: DataParallelModule, config: OptimizerConfig):
        def describe():
            if not isinstance(model, DataParallelModule):
                raise TypeError("model must be a mxddp.torch.DistributedDataParallel or FullyShardedDataParallel; "
                                f"got {type(model).__name__}")
            if not isinstance(config, OptimizerConfig):
                raise TypeError(f"config must be a mxddp.torch.OptimizerConfig; got {type(config).__name__}")
            if not model.ddp_config.use_distributed_optimizer:
                raise ValueError("DistributedOptimizer needs the model's DistributedDataParallelConfig to have "
                                 "use_distributed_optimizer=True (it steps on each rank's shard of the buckets)")
            return None, config.agreement_items()

        # Every rank the same config (its lr, its skip limit), checked before anything is built.
        agreement.agree("DistributedOptimizer", describe)
        self.model = model
        self.config = config
        self._cpp = _C.DistributedOptimizer(model._cpp, config.to_cpp())
        self._consecutive_skipped_steps = 0
        launch._track_optimizer(self)

    def step(self) -> tuple[bool, float, Optional[int]]:
        """Collective. Returns Megatron's ``(update_successful, grad_norm, num_zeros_in_grad)``:
        update_successful is False when the global grad norm is NaN or Inf (nothing changes, as
        ``mxddp train`` skips such a step); grad_norm is before clipping; num_zeros_in_grad is
        None (not counted, as Megatron without log_num_zeros_in_grad).

        The first skipped step of a run of them warns (``SkippedStepWarning``) with the norm and
        the params at fault; a skip beyond ``config.max_consecutive_skipped_steps`` in a row
        raises ``mxddp.Error`` on every rank naming the count and those params."""
        if not self.model.grads_live:
            raise RuntimeError("DistributedOptimizer.step() was called before any backward since the last "
                               "zero_grad(): run loss.backward() and model.finish_grad_sync() first")
        if self.model._grads_pending_sync:
            raise RuntimeError("DistributedOptimizer.step(): gradients were reported but not synchronized; call "
                               "model.finish_grad_sync() after the last backward and before step()")
        # A gather the last forward did not wait for (a module that did not run) may still be
        # reading this rank's shards, which the update is about to overwrite: finish it first.
        self.model.finish_param_sync()
        skipped, grad_norm, _clip_coeff = self._cpp.step()
        if skipped:
            self._after_skipped_step(grad_norm)
        else:
            self._consecutive_skipped_steps = 0
        if not skipped and self.model.ddp_config.reuse_grad_buf_for_mxfp8_param_ag:
            self.model._awaiting_zero_grad = True  # the update waits in the main params for zero_grad()
        return (not skipped, grad_norm, None)

    def _after_skipped_step(self, grad_norm: float) -> None:
        """Warns at the first skip of a run, raises beyond the limit. Every rank skipped (the norm
        is global) and counts alike (the configs agree), so the collectives here match."""
        self._consecutive_skipped_steps += 1
        count, limit = self._consecutive_skipped_steps, self.config.max_consecutive_skipped_steps
        over = limit is not None and count > limit
        if count > 1 and not over:
            return
        why = self._why_skipped(grad_norm)
        if over:
            raise _C.Error(f"DistributedOptimizer.step(): the step was skipped ({count} in a row, more than "
                           f"OptimizerConfig.max_consecutive_skipped_steps={limit}): {why}. A NaN or Inf that lasts "
                           "is not a passing spike (a param that holds one, a learning rate that diverged); "
                           "the run ends here rather than skip every step from now on")
        ends = "" if limit is None else \
            f"; more than {limit} skipped in a row raise (OptimizerConfig.max_consecutive_skipped_steps)"
        warnings.warn(f"DistributedOptimizer.step() skipped the step (nothing was updated): {why}{ends}",
                      SkippedStepWarning, stacklevel=3)

    def _why_skipped(self, grad_norm: float) -> str:
        """Collective. The norm, the params whose reduced gradients hold a NaN or Inf, and per rank
        the params whose own values do (those whose torch tensor holds its values here)."""
        names = self.model._names
        grads = [names[i] for i in self._cpp.nonfinite_grad_params()]
        why = (f"the global grad norm is {grad_norm}; params whose gradients hold a NaN or Inf: "
               f"{_name_list(grads) if grads else 'none'}")
        checked = self.model._params_holding_values()  # the same on every rank
        if not checked:
            return why + "; the params' values were not checked (none holds its values between iterations)"
        rank, world = launch.rank(), launch.world_size()
        flags = torch.zeros(world, len(names), dtype=torch.float32)
        for i in checked:
            if not bool(torch.isfinite(self.model._params[i].detach()).all()):
                flags[rank, i] = 1.0
        _C.all_reduce(flags, "max")
        values = [f"{_name_list([names[i] for i in flags[r].nonzero().flatten().tolist()])} on rank {r}"
                  for r in range(world) if bool(flags[r].any())]
        return why + f"; params whose values hold a NaN or Inf: {'; '.join(values) if values else 'none'}"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the grad buffer (every param's main_grad). set_to_none is Megatron's argument;
        the torch params' .grad is already None after each hook. With
        reuse_grad_buf_for_mxfp8_param_ag it then stages the main params in the grad buffer and starts
        the param all-gather (the first group only with overlap_param_gather)."""
        self.model._before_zero_grad()
        self._cpp.zero_grad()
        self.model._after_zero_grad()

    def force_param_sync(self) -> None:
        """Collective. Brings every rank's model params up to date with the main params now,
        whatever state the param sync is in (for evaluation, or reading the params, between
        iterations). With reuse_grad_buf_for_mxfp8_param_ag it zeroes the grad buffer first (the
        staging area), so call it only between finish_grad_sync/step and the next backward."""
        self._cpp.force_param_sync()
        if self.model.ddp_config.reuse_grad_buf_for_mxfp8_param_ag:
            self.model._grads_pending_sync = False  # the grad buffer was zeroed to stage in
        self.model._awaiting_zero_grad = False

    @property
    def lr(self) -> float:
        return self._cpp.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._cpp.lr = float(value)

    @property
    def step_count(self) -> int:
        return self._cpp.step_count

    def close(self) -> None:
        self._cpp.close()
