"""Where a wrapped module's buffers live, and the communicator that serves them there.

A module whose params are on the CPU is served by mxddp's host communicator of its process group
(``process_group.communicator_for``). A module on ``cuda:N`` gets buffers on that GPU: a second
communicator over the same ranks, made once per (group, device, stream) and cached, whose engine is

- ``nccl`` when every rank of the group has a GPU of its own (NCCL refuses two ranks of one
  communicator on one device) and this build has NCCL: an NCCL communicator (``include/mxddp/nccl.h``)
  whose unique id travels over the host communicator;
- ``staged`` otherwise (ranks that share a GPU): the host engine (MPI, or a private gloo group under
  torch.distributed), each collective's input copied to page-locked host memory in the stream's
  order and its output copied back (``src/comm/staged_backend.h``).

``MXDDP_DEVICE_ENGINE=nccl|staged`` chooses instead. The device communicator's work is ordered on
torch's current stream of the device at wrap time (the stream the model's forward and backward then
run on): a collective waits for the work enqueued before it was issued, and ``wait()`` makes that
stream wait for it, never the host. mxddp's device buffers come from torch's caching allocator, so
the two share one pool.

The host communicator stays the group's handle for the package's own small collectives (the
ranks' agreement, flags, buffers): those move CPU tensors.
"""
from __future__ import annotations

import hashlib
import os
import socket
from typing import Optional

import torch

from mxddp import _C
from mxddp.torch import process_group

ENGINES = ("nccl", "staged")
_ENGINE_VARIABLE = "MXDDP_DEVICE_ENGINE"

# (id(user group) or None, device index, stream) -> (the group, kept alive so its id is not reused, its handle)
_handles: dict[tuple[Optional[int], int, int], tuple[object, "_C.Communicator"]] = {}


def params_device(params: list[tuple[str, torch.Tensor]]) -> torch.device:
    """The one device of the named params: the CPU or a CUDA device (any other, or params on two
    devices, is a ValueError naming them). Params on the meta device (the planner's) count as the CPU."""
    first_name, first = params[0]
    for name, p in params:
        if p.device.type not in ("cpu", "cuda", "meta"):
            raise ValueError(f"param '{name}' is on {p.device}; mxddp.torch takes params on the CPU or a CUDA device")
        if p.device != first.device:
            raise ValueError(f"param '{name}' is on {p.device} but '{first_name}' is on {first.device}: mxddp "
                             "keeps every trainable param in one buffer on one device (module.to(device) first)")
    return torch.device("cpu") if first.device.type == "meta" else first.device


def choose_engine(identities: list[bytes], nccl_built: bool, requested: Optional[str]) -> str:
    """The engine of a device communicator over ranks whose GPUs are ``identities`` (one per rank, in
    rank order; equal bytes: the same GPU). ``requested``: MXDDP_DEVICE_ENGINE's value, or None."""
    if requested is not None and requested not in ENGINES:
        raise ValueError(f"{_ENGINE_VARIABLE}={requested!r} is not a device engine; valid: {', '.join(ENGINES)}")
    shared = len(set(identities)) < len(identities)
    if requested == "nccl":
        if not nccl_built:
            raise RuntimeError(f"{_ENGINE_VARIABLE}=nccl, but this build of mxddp._C has no NCCL communicator "
                               "(it was built where CMake found no nccl.h and libnccl); valid here: staged")
        if shared:
            raise RuntimeError(f"{_ENGINE_VARIABLE}=nccl, but ranks of the group share a GPU, and NCCL refuses "
                               "two ranks of one communicator on one device; valid here: staged")
        return "nccl"
    if requested == "staged":
        return "staged"
    return "nccl" if nccl_built and not shared else "staged"


def gpu_identity(device: torch.device) -> bytes:
    """32 bytes naming this process's GPU ``device`` in the job: its host, the kernel's boot and the
    GPU's UUID, hashed (equal on two ranks exactly when they use the same GPU)."""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", device.index))
    return hashlib.sha256(f"{socket.gethostname()}|{process_group.boot_id()}|{uuid}".encode()).digest()


def agreement_items(device: torch.device) -> list[tuple[str, str]]:
    """What every rank of a group must agree on before a model on ``device`` is wrapped: the kind of
    device (the index may differ) and, on a GPU, the settings that choose the device path."""
    if device.type == "cpu":
        return [("device", "cpu")]
    return [("device", device.type), (_ENGINE_VARIABLE, repr(os.environ.get(_ENGINE_VARIABLE)))]


def check_usable(device: torch.device) -> None:
    """Refuses, naming why, a CUDA device this process cannot put mxddp's buffers on, or one that is
    not torch's current device (where mxddp allocates and launches)."""
    if not _C.built_with_cuda():
        raise RuntimeError(f"the module is on {device}, but {_C.cuda_devices()[1]}")
    count, why = _C.cuda_devices()
    if count == 0:
        raise RuntimeError(f"the module is on {device}, but mxddp sees no CUDA device: {why}")
    if device.index is None or not 0 <= device.index < count:
        raise RuntimeError(f"the module is on {device}; this process's CUDA devices are 0 to {count - 1}")
    current = torch.cuda.current_device()
    if current != device.index:
        raise RuntimeError(f"the module is on {device} but torch's current device is cuda:{current}: mxddp allocates "
                           f"and runs its work on the current device, so call torch.cuda.set_device({device.index}) "
                           "before wrapping, as for torch DDP")


def checked_device(params: list[tuple[str, torch.Tensor]]) -> torch.device:
    """params_device(params), refused as check_usable refuses it on a GPU: what a wrapper runs before
    the ranks' agreement, so that a rank that cannot use its GPU fails every rank at once."""
    on = params_device(params)
    if on.type == "cuda":
        check_usable(on)
    return on


def communicator_for(group, host: "_C.Communicator", device: torch.device) -> "_C.Communicator":
    """The communicator whose buffers are on ``device`` (a checked_device) over the ranks of
    ``group`` (None: the world), whose host communicator is ``host``: ``host`` itself for the CPU.
    Collective over the group's members the first time a (group, device, stream) is seen."""
    if device.type == "cpu":
        return host
    stream = current_stream(device)
    key = (None if group is None else id(group), device.index, stream)
    cached = _handles.get(key)
    if cached is not None:
        return cached[1]
    identities = _C.all_gather_bytes(gpu_identity(device), host)
    engine = choose_engine(identities, _C.built_with_nccl(), os.environ.get(_ENGINE_VARIABLE))
    runner = None
    if engine == "staged" and _C.backend() == "torch":
        import torch.distributed as dist

        from mxddp.torch import launch

        user_group = group if group is not None else dist.distributed_c10d._get_default_group()
        runner, _, _ = process_group.private_runner(user_group, launch.timeout_s())
    _C.use_torch_caching_allocator()
    with torch.cuda.device(device):
        handle = _C.add_device_group(host, device.index, stream, engine, runner)
    _handles[key] = (group, handle)
    return handle


def current_stream(device: torch.device) -> Optional[int]:
    """torch's current stream on ``device`` (its cudaStream_t as an int: 0 is the legacy default
    stream), what a model wrapped now is ordered on; None for the CPU."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def host_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU (itself if it is there): what the C++ layers take as an initial value."""
    return t if t.device.type in ("cpu", "meta") else t.cpu()


def forget_communicators() -> None:
    """The runtime is being finalized (launch.shutdown): its communicators go with it."""
    _handles.clear()
