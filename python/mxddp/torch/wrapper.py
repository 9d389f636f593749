"""What ``DistributedDataParallel`` and ``FullyShardedDataParallel`` share as torch modules: the
C++ handle (``_cpp``, a ``_C.DataParallel``), the registered params, ``no_sync``, and the state the
optimizer and the checkpoints read and reset (whether reported grads await their sync)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from mxddp.torch import mxfp8


class DataParallelModule(torch.nn.Module):
    """The base of the two wrappers. A subclass sets ``_cpp``, ``_names``, ``_params``,
    ``_mxfp8_kind`` (index -> 'linear' or 'conv1d' for its MXFP8 params) and ``ddp_config`` and
    calls ``_init_sync_state()`` in its constructor."""

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

    def registered_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The params mxddp holds, in registration order."""
        return list(zip(self._names, self._params))

    def _mxfp8_forward_values(self, index: int) -> torch.Tensor:
        """MXFP8 param ``index``'s values as its forward reads them (an nn.Linear's row-wise copy, a
        Conv1D's column-wise one), dequantized into a new tensor: what a state dict or close() gives."""
        p = self._params[index]
        return mxfp8.dequantize(self._cpp, index, mxfp8.forward_axis(self._mxfp8_kind[index]), p.shape, p.dtype)

    def _state_dict_with(self, values: dict[int, torch.Tensor], args, kwargs) -> dict:
        """torch's state dict of the wrapper (keys ``module.<name>``, as torch's wrappers key them),
        with ``values`` (id(param) -> tensor) in place of those params' own tensors, under every
        name a shared param has."""
        destination = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for name, p in self.module.named_parameters(prefix=prefix + "module", remove_duplicate=False):
            if id(p) in values and name in destination:
                destination[name] = values[id(p)]
        return destination

    # ---- The optimizer's zero_grad around the C++ one ----

    def _before_zero_grad(self) -> None:
        """What must happen before the grads are zeroed (FSDP: report a backward's unused params)."""

    def _after_zero_grad(self) -> None:
        self._grads_pending_sync = False
        self._awaiting_zero_grad = False
