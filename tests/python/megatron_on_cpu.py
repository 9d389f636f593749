"""Runs megatron-core 0.16's DDP and optimizer on the CPU, for the tests that compare mxddp.torch
with them (test_megatron_api.py).

megatron-core assumes CUDA: it allocates its buffers on ``torch.cuda.current_device()``, makes
small tensors with ``device='cuda'`` (the grad norm, overflow flags) and accepts params whose
``type()`` is a ``torch.cuda.*Tensor``. Inside ``megatron_on_cpu()`` those go to the CPU instead;
nothing else changes, so its arithmetic is its own. Everything is put back on exit.
"""
import contextlib

import torch
from torch.overrides import TorchFunctionMode


class _CudaAsCpu(TorchFunctionMode):
    """Every torch call that names a CUDA device (by name, torch.device or index) gets the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or torch.device(device).type == "cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_on_cpu():
    saved = (torch.cuda.current_device, torch.Tensor.type, torch.Tensor.cuda)
    plain_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        # Megatron checks param.type() against 'torch.cuda.FloatTensor' and friends.
        if args or kwargs:
            return plain_type(self, *args, **kwargs)
        name = plain_type(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        with _CudaAsCpu():
            yield
    finally:
        torch.cuda.current_device, torch.Tensor.type, torch.Tensor.cuda = saved
