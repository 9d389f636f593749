"""``DistributedDataParallel``'s constructor forms, resolved into one description (``DdpArgs``).

Two forms, told apart by whether a Megatron ``DistributedDataParallelConfig`` is given:

- torch's: ``DistributedDataParallel(module, **torch_kwargs)``, as a torch DDP script wraps. Its
  defaults suit a torch DDP user (overlapped reduction, a replicated optimizer, torch's 25 MB
  buckets) and it follows torch DDP: rank 0's params and buffers broadcast at wrap time, buffers
  before every forward, grads synchronized at the end of ``backward()``, an unused param refused
  unless ``find_unused_parameters=True``.
- Megatron's: ``DistributedDataParallel(config, ddp_config, module)`` (megatron-core's order, by
  position or keyword) or mxddp's ``DistributedDataParallel(module, ddp_config)``. The config's own
  (Megatron's) defaults, and Megatron's behaviour: nothing broadcast unless asked, grads
  synchronized by ``finish_grad_sync()``, an unused param's gradient a zero that is reduced as any.

torch DDP's keyword arguments are taken in both forms where they mean something there; each is
honoured or refused by name, never ignored.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mxddp.torch.config import DistributedDataParallelConfig

# torch DDP's default bucket_cap_mb: MiB of gradient per bucket.
TORCH_BUCKET_CAP_MB = 25
# disable_bucketing (Megatron): a bucket size in elements that no model reaches, so one bucket.
_ONE_BUCKET = 2 ** 62
# TransformerConfig fields mxddp reads, with the values it honours (None: any bool).
# torch DDP's other keyword arguments, taken at their torch default only.
_OTHER_TORCH_ARGS = {"mixed_precision": None, "skip_all_reduce_unused_params": False,
                     "delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None, "device_mesh": None}


@dataclass
class DdpArgs:
    """What the constructor resolved: the module, the config and the torch-DDP behaviours."""

    module: torch.nn.Module
    ddp_config: DistributedDataParallelConfig
    transformer_config: Any  # Megatron's TransformerConfig (or any object like it); None in torch's form
    torch_form: bool
    gradient_accumulation_fusion: bool
    broadcast_buffers: bool
    # True: unused params found and agreed on (self._unused_params); False: refused at the synced
    # backward; None (Megatron's form, unset): their zero gradient is reduced and stepped on as any.
    find_unused_parameters: Optional[bool]
    static_graph: bool
    init_sync: bool  # rank 0's params and buffers broadcast at wrap time
    process_group: Any  # the user's torch.distributed group, None: mxddp's world


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")


def _split_forms(args: tuple, kwargs: dict) -> tuple[torch.nn.Module, Optional[DistributedDataParallelConfig], Any]:
    """(module, ddp_config or None, transformer_config or None) from the positional arguments and
    the keywords ``module``, ``ddp_config``, ``config`` (popped from kwargs)."""
    module = kwargs.pop("module", None)
    ddp_config = kwargs.pop("ddp_config", None)
    config = kwargs.pop("config", None)
    # mxddp's former keyword: DistributedDataParallel(module, config=DistributedDataParallelConfig(...)).
    if isinstance(config, DistributedDataParallelConfig):
        if ddp_config is not None:
            raise TypeError("both config= and ddp_config= are a DistributedDataParallelConfig; give one")
        config, ddp_config = None, config
    args = list(args)
    if args and isinstance(args[0], torch.nn.Module):  # (module[, ddp_config])
        if len(args) > 2:
            raise TypeError(f"DistributedDataParallel(module, ddp_config) takes at most 2 positional arguments; "
                            f"got {len(args)} (Megatron's order is (config, ddp_config, module))")
        if module is not None:
            raise TypeError("module given both by position and as module=")
        module = args[0]
        if len(args) == 2:
            if ddp_config is not None:
                raise TypeError("ddp_config given both by position and as ddp_config=")
            ddp_config = args[1]
    elif args:  # Megatron's (config, ddp_config, module)
        if len(args) > 3:
            raise TypeError(f"DistributedDataParallel(config, ddp_config, module) takes at most 3 positional "
                            f"arguments; got {len(args)}")
        names = ("config", "ddp_config", "module")
        given = {"config": config, "ddp_config": ddp_config, "module": module}
        for name, value in zip(names, args):
            if given[name] is not None:
                raise TypeError(f"{name} given both by position and as {name}=")
            given[name] = value
        config, ddp_config, module = given["config"], given["ddp_config"], given["module"]
    if module is None:
        raise TypeError("DistributedDataParallel needs the module to wrap: (module), (module, ddp_config) or "
                        "Megatron's (config, ddp_config, module)")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"DistributedDataParallel wraps a torch.nn.Module; got {type(module).__name__}")
    if ddp_config is not None and not isinstance(ddp_config, DistributedDataParallelConfig):
        raise TypeError(f"ddp_config must be a mxddp.torch.DistributedDataParallelConfig; got "
                        f"{type(ddp_config).__name__}")
    if config is not None and ddp_config is None:
        raise TypeError("Megatron's order (config, ddp_config, module) needs its ddp_config, a "
                        "mxddp.torch.DistributedDataParallelConfig")
    return module, ddp_config, config


def _read_transformer_config(config: Any, fusion: Optional[bool]) -> bool:
    """What mxddp reads of Megatron's TransformerConfig: ``gradient_accumulation_fusion`` (Megatron's
    layers read it; here the wrapper does), and two values it refuses; the rest (sizes, dtypes,
    recompute) belongs to the model, which the module already is. Returns the fusion flag."""
    if config is None:
        return True if fusion is None else fusion
    if getattr(config, "calculate_per_token_loss", False):
        raise ValueError("config.calculate_per_token_loss=True is not supported by mxddp.torch: the gradients are "
                         "always averaged over the data-parallel ranks (1/dp); valid: False")
    if getattr(config, "fp16", False):
        raise ValueError("config.fp16=True is not supported by mxddp.torch: params are float32 or bfloat16 and "
                         "there is no FP16 loss scaler in the DDP; valid: False (bf16 instead)")
    from_config = getattr(config, "gradient_accumulation_fusion", None)
    if from_config is not None:
        _check_bool("config.gradient_accumulation_fusion", from_config)
        if fusion is not None and fusion != from_config:
            raise ValueError(f"gradient_accumulation_fusion={fusion!r} but config.gradient_accumulation_fusion="
                             f"{from_config!r}: give one, or the same in both")
        return from_config
    return True if fusion is None else fusion


def _grad_itemsize(module: torch.nn.Module, config: DistributedDataParallelConfig) -> int:
    """Bytes per gradient element in the grad buffer: F32 with grad_reduce_in_fp32, else the params'."""
    if config.grad_reduce_in_fp32:
        return 4
    dtypes = {p.dtype for p in module.parameters() if p.requires_grad}
    return 2 if dtypes == {torch.bfloat16} else 4


def _torch_default_config(module: torch.nn.Module, bucket_cap_mb: Any) -> DistributedDataParallelConfig:
    """torch DDP's defaults in mxddp's terms: overlapped reduction, no distributed optimizer (every
    rank steps on every param, as torch DDP + a torch optimizer), buckets of bucket_cap_mb MiB."""
    mb = TORCH_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    # 2**43 MiB is 2**63 bytes: beyond it the bucket's size in elements leaves the C++ int64.
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 < mb < 2 ** 43:
        raise ValueError(f"bucket_cap_mb must be a number in (0, 2**43) (MiB of gradient per bucket); "
                         f"got {bucket_cap_mb!r}")
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=False)
    return dataclasses.replace(config, bucket_size=max(1, int(mb * 2 ** 20) // _grad_itemsize(module, config)))


def _one_device(value) -> Optional[torch.device]:
    """A device_ids entry or output_device as a device (an int is a CUDA ordinal); None if it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return torch.device("cuda", value)
    if isinstance(value, (str, torch.device)):
        try:
            return torch.device(value)
        except RuntimeError:
            return None
    return None


def _check_device_ids(module, device_ids, output_device) -> None:
    """torch DDP's device_ids and output_device for a module on one device: None, or (on a GPU) that
    device, as torch takes them; anything else (several devices, another one) is refused."""
    params = module.parameters() if isinstance(module, torch.nn.Module) else ()  # not a Module: refused later
    on = next((p.device for p in params if p.requires_grad), torch.device("cpu"))
    if on.type == "cuda":
        valid = f"None or [{on.index}] ({on})"
        if device_ids is not None and (not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1 or
                                       _one_device(device_ids[0]) != on):
            raise ValueError(f"device_ids={device_ids!r} does not name the module's device {on}: mxddp.torch, as "
                             f"torch DDP for a module on one GPU, takes that device only; valid: {valid}")
        if output_device is not None and _one_device(output_device) != on:
            raise ValueError(f"output_device={output_device!r} is not the module's device {on}: the output stays "
                             f"where the module puts it; valid: None or {on.index}")
        return
    if device_ids is not None:
        raise ValueError(f"device_ids={device_ids!r} is not supported for a module on {on}: torch DDP also takes "
                         "device_ids=None there; valid: None")
    if output_device is not None:
        raise ValueError(f"output_device={output_device!r} is not supported by mxddp.torch: the output stays "
                         f"where the module puts it ({on}), as torch DDP's for a CPU module; valid: None")


def resolve(args: tuple, kwargs: dict) -> DdpArgs:
    """Every argument of ``DistributedDataParallel(...)``, checked: each torch DDP keyword honoured
    or refused by name, an unknown keyword a TypeError."""
    kwargs = dict(kwargs)
    module, ddp_config, transformer_config = _split_forms(args, kwargs)
    torch_form = ddp_config is None
    fusion = kwargs.pop("gradient_accumulation_fusion", None)
    if fusion is not None:
        _check_bool("gradient_accumulation_fusion", fusion)
    fusion = _read_transformer_config(transformer_config, fusion)

    _check_device_ids(module, kwargs.pop("device_ids", None), kwargs.pop("output_device", None))
    dim = kwargs.pop("dim", 0)
    if dim != 0:
        raise ValueError(f"dim={dim!r} is not supported: torch DDP's dim splits inputs across device_ids, which "
                         "mxddp does not have; valid: 0")
    init_sync = kwargs.pop("init_sync", torch_form)
    _check_bool("init_sync", init_sync)
    broadcast_buffers = kwargs.pop("broadcast_buffers", torch_form)
    _check_bool("broadcast_buffers", broadcast_buffers)
    find_unused = kwargs.pop("find_unused_parameters", False if torch_form else None)
    if find_unused is not None:
        _check_bool("find_unused_parameters", find_unused)
    static_graph = kwargs.pop("static_graph", False)
    _check_bool("static_graph", static_graph)
    if static_graph and find_unused is not True:
        # torch's static graph learns the unused params in its first iteration and treats them as
        # find_unused_parameters=True does from then on: the same result here, found each step.
        find_unused = True
    as_view = kwargs.pop("gradient_as_bucket_view", None)
    if as_view is not None:
        _check_bool("gradient_as_bucket_view", as_view)
        if not as_view:
            raise ValueError("gradient_as_bucket_view=False is not supported by mxddp.torch: each param's "
                             "gradient always lives in mxddp's bucket (param.main_grad, a view of the grad buffer); "
                             "valid: True (or leave it out)")
    bucket_cap_mb = kwargs.pop("bucket_cap_mb", None)
    process_group = kwargs.pop("process_group", None)
    check_process_group(process_group)
    disable_bucketing = kwargs.pop("disable_bucketing", False)
    _check_bool("disable_bucketing", disable_bucketing)
    pg_collection = kwargs.pop("pg_collection", None)
    if pg_collection is not None:
        raise ValueError("pg_collection is not supported by mxddp.torch: give the data-parallel group as "
                         "process_group= instead; valid: None")
    for name, default in _OTHER_TORCH_ARGS.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if value is not default and value != default:
                raise ValueError(f"{name}={value!r} is not supported by mxddp.torch (a torch DDP argument it has "
                                 f"no counterpart for); valid: {default!r}, its torch default")
    if kwargs:
        raise TypeError(f"DistributedDataParallel got an unexpected keyword argument '{sorted(kwargs)[0]}'")

    if torch_form:  # (_split_forms took a TransformerConfig only with a ddp_config)
        ddp_config = _torch_default_config(module, bucket_cap_mb)
    elif bucket_cap_mb is not None:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} with a DistributedDataParallelConfig: set its "
                         "bucket_size (elements) instead")
    if init_sync and ddp_config.fp8_param_gather:
        raise ValueError("init_sync=True with fp8_param_gather=True: the MXFP8 copies are taken from each rank's "
                         "values at wrap time, before a broadcast could reach them; seed every rank alike instead")
    if disable_bucketing:
        ddp_config = dataclasses.replace(ddp_config, bucket_size=_ONE_BUCKET)
    return DdpArgs(module=module, ddp_config=ddp_config, transformer_config=transformer_config, torch_form=torch_form,
                   gradient_accumulation_fusion=fusion, broadcast_buffers=broadcast_buffers,
                   find_unused_parameters=find_unused, static_graph=static_graph,
                   init_sync=init_sync, process_group=process_group)


def check_process_group(process_group: Any) -> None:
    """process_group=: None (mxddp's world) or a torch.distributed ProcessGroup, whose communicator
    ``process_group.communicator_for`` gives (ddp.py asks it before anything else, since it also
    starts mxddp under torchrun)."""
    if process_group is None:
        return
    import torch.distributed as dist
    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError(f"process_group must be None or a torch.distributed ProcessGroup; got "
                        f"{type(process_group).__name__}")
