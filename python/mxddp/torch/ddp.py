"""``DistributedDataParallel`` for any PyTorch module, on mxddp's C++ DDP.

Construction registers the module's trainable params (``named_parameters()`` order, a shared
param such as a tied embedding once, frozen params left out as Megatron does) with the C++ DDP,
which places them by mxddp's layout (reverse order, padding, buckets) in one contiguous param
buffer and one grad buffer. Each param's values are copied in, and then the param *is* a view of
the param buffer (``param.data``), with ``param.main_grad`` a view of the grad buffer. A
post-accumulate-grad hook adds ``param.grad`` into ``main_grad``, frees ``param.grad`` and reports
the param ready, so with ``overlap_grad_reduce`` a bucket's collective starts during backward.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from mxddp import _C
from mxddp.torch import launch
from mxddp.torch.config import DistributedDataParallelConfig

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _trainable_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The params mxddp takes, checked: (name, param) in named_parameters() order."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"DistributedDataParallel wraps a torch.nn.Module; got {type(module).__name__}")
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not params:
        frozen = sum(1 for _ in module.parameters())
        raise ValueError(f"module {type(module).__name__} has no trainable parameters (requires_grad=True); "
                         f"{frozen} frozen ones: there is nothing for DistributedDataParallel to synchronize")
    first_name, first = params[0]
    storages: dict[int, str] = {}
    for name, p in params:
        if p.dtype not in _DTYPES:
            raise TypeError(f"param '{name}' has dtype {p.dtype}, which mxddp does not take; "
                            "valid: torch.float32, torch.bfloat16")
        if p.dtype != first.dtype:
            raise TypeError(f"param '{name}' is {p.dtype} but '{first_name}' is {first.dtype}: "
                            "mxddp keeps every trainable param in one buffer of one dtype")
        if p.device.type != "cpu":
            raise ValueError(f"param '{name}' is on {p.device}; mxddp.torch runs on the CPU")
        if not p.is_contiguous():
            raise ValueError(f"param '{name}' is not contiguous (shape {tuple(p.shape)}, strides {p.stride()}); "
                             "make it contiguous before wrapping (param.data = param.data.contiguous())")
        storage = p.untyped_storage().data_ptr()
        if p.numel() > 0 and storage in storages:
            raise ValueError(f"params '{storages[storage]}' and '{name}' share storage; mxddp gives each param "
                             "a place of its own in its buffer, which would break that sharing (share the "
                             "Parameter object itself to tie weights)")
        storages[storage] = name
    return params


class DistributedDataParallel(torch.nn.Module):
    """Megatron-core's ``DistributedDataParallel(module, ddp_config)`` on mxddp's buffers.

    Call ``mxddp.torch.init()`` first. ``model(...)`` runs the module. Per iteration::

        opt.zero_grad()                       # zeroes the grad buffer
        with model.no_sync(): ...             # accumulation micro-batches (nothing reduced)
        loss = model(batch); loss.backward()  # buckets reduce as their grads are ready
        model.finish_grad_sync()              # waits for (or issues) the rest
        opt.step()

    Like Megatron (and unlike torch's DDP) construction does not broadcast rank 0's params: seed
    the ranks alike, or call ``broadcast_params()``.
    """

    def __init__(self, module: torch.nn.Module, config: DistributedDataParallelConfig | None = None):
        super().__init__()
        config = DistributedDataParallelConfig() if config is None else config
        if not isinstance(config, DistributedDataParallelConfig):
            raise TypeError(f"config must be a mxddp.torch.DistributedDataParallelConfig; got {type(config).__name__}")
        params = _trainable_params(module)
        self.module = module
        self.ddp_config = config
        self.param_dtype = params[0][1].dtype
        specs = [(name, list(p.shape), bool(getattr(p, "shared_embedding", False))) for name, p in params]
        self._cpp = _C.DistributedDataParallel(specs, config.to_cpp(_DTYPES[self.param_dtype]))
        launch._track_model(self)
        self._params = [p for _, p in params]
        self._names = [name for name, _ in params]
        self._hooks = []
        # Set when a grad is reported, cleared by finish_grad_sync: the optimizer refuses to step on
        # grads that were not synchronized.
        self._grads_pending_sync = False
        with torch.no_grad():
            for i, p in enumerate(self._params):
                view = self._cpp.param(i)
                view.copy_(p.data)
                p.data = view
                p.main_grad = self._cpp.main_grad(i)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(i)))

    def _make_grad_hook(self, index: int):
        cpp = self._cpp

        def hook(param: torch.Tensor) -> None:
            # Megatron's hook: accumulate into main_grad, free .grad, mark the param ready.
            if param.grad is not None:
                param.main_grad.add_(param.grad)
                param.grad = None
            self._grads_pending_sync = True
            cpp.grad_ready(index)

        return hook

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate in the grad buffer and nothing is reduced while inside."""
        self._cpp.enter_no_sync()
        try:
            yield
        finally:
            self._cpp.exit_no_sync()

    def finish_grad_sync(self) -> None:
        """Issues what has not been issued, waits for every collective: main_grad then holds the
        reduced grads (this rank's shard of them with the distributed optimizer)."""
        self._cpp.finish_grad_sync()
        self._grads_pending_sync = False

    def zero_grad_buffer(self) -> None:
        self._cpp.zero_grad_buffer()
        self._grads_pending_sync = False

    def broadcast_params(self) -> None:
        """Copies rank 0's params to every rank (collective)."""
        self._cpp.broadcast_params()

    # ---- where things live (zero copy), for tests and the curious ----
    def param_buffer(self) -> torch.Tensor:
        """The whole param buffer, [numel] in the params' dtype; every param is a view into it."""
        return self._cpp.param_buffer()

    def grad_buffer(self) -> torch.Tensor:
        """The whole grad buffer, [numel]; every param's main_grad is a view into it."""
        return self._cpp.grad_buffer()

    def registered_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The params mxddp holds, in registration order."""
        return list(zip(self._names, self._params))

    @property
    def num_buckets(self) -> int:
        return self._cpp.num_buckets

    def close(self) -> None:
        """Frees mxddp's buffers: the params get storage of their own (their current values), and
        main_grad and the hooks are removed. Close the optimizer first."""
        if self._cpp.closed:
            return
        if self._cpp.open_optimizers:
            raise RuntimeError("close the DistributedOptimizer before its DistributedDataParallel")
        with torch.no_grad():
            for p in self._params:
                p.data = p.data.clone()
                if hasattr(p, "main_grad"):
                    del p.main_grad
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._cpp.close()
