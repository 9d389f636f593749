"""``DistributedOptimizer``: mxddp's C++ distributed optimizer stepping on a DDP's buffers.

Each rank keeps F32 main params and the AdamW (or SGD) state for its shard of every bucket; a step
computes the global grad norm, clips, updates the shard and all-gathers the updated params into the
param buffer, which the torch params are views of.
"""
from __future__ import annotations

from typing import Optional

from mxddp import _C
from mxddp.torch import launch
from mxddp.torch.config import OptimizerConfig
from mxddp.torch.wrapper import DataParallelModule


class DistributedOptimizer:
    """Megatron-core's distributed optimizer for a ``mxddp.torch.DistributedDataParallel`` built
    with ``use_distributed_optimizer=True``, or a ``mxddp.torch.FullyShardedDataParallel`` (whose
    shards it steps on, whatever the strategy: no_shard keeps a replicated optimizer)."""

    def __init__(self, model: DataParallelModule, config: OptimizerConfig):
        if not isinstance(model, DataParallelModule):
            raise TypeError("model must be a mxddp.torch.DistributedDataParallel or FullyShardedDataParallel; got "
                            f"{type(model).__name__}")
        if not isinstance(config, OptimizerConfig):
            raise TypeError(f"config must be a mxddp.torch.OptimizerConfig; got {type(config).__name__}")
        if not model.ddp_config.use_distributed_optimizer:
            raise ValueError("DistributedOptimizer needs the model's DistributedDataParallelConfig to have "
                             "use_distributed_optimizer=True (it steps on each rank's shard of the buckets)")
        self.model = model
        self.config = config
        self._cpp = _C.DistributedOptimizer(model._cpp, config.to_cpp())
        launch._track_optimizer(self)

    def step(self) -> tuple[bool, float, Optional[int]]:
        """Collective. Returns Megatron's ``(update_successful, grad_norm, num_zeros_in_grad)``:
        update_successful is False when the global grad norm is NaN or Inf (nothing changes, as
        ``mxddp train`` skips such a step); grad_norm is before clipping; num_zeros_in_grad is
        None (not counted, as Megatron without log_num_zeros_in_grad)."""
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
        if not skipped and self.model.ddp_config.reuse_grad_buf_for_mxfp8_param_ag:
            self.model._awaiting_zero_grad = True  # the update waits in the main params for zero_grad()
        return (not skipped, grad_norm, None)

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
