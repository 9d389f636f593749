"""megatron-core's optimizer entry point on mxddp: ``get_megatron_optimizer``, with megatron-core
0.16's signature, so that a Megatron training loop changes only its import lines.

It builds mxddp's ``DistributedOptimizer`` over Megatron's param groups (``megatron_groups.py``)
for one model chunk. Megatron's ``OptimizerParamScheduler`` drives it through ``param_groups``
(it writes each group's ``lr`` and ``weight_decay`` from the group's ``max_lr``, ``min_lr`` and
``wd_mult``): mxddp ships no scheduler of its own; with megatron-core installed use its scheduler,
without it any ``torch.optim.lr_scheduler`` (the optimizer is a ``torch.optim.Optimizer``).
"""
from __future__ import annotations

from typing import Any, Optional

from mxddp.torch.config import OptimizerConfig
from mxddp.torch.optimizer import DistributedOptimizer
from mxddp.torch.wrapper import DataParallelModule

# Fields a config override may not change (megatron-core's check_config_overrides_consistency):
# they choose the optimizer itself, not a group's hyperparameters.
_NOT_OVERRIDABLE = ("overlap_param_gather_with_optimizer_step", "optimizer", "optimizer_cpu_offload")


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: list, config_overrides: Optional[dict] = None,
                           use_gloo_process_groups: bool = True, pg_collection: Any = None,
                           dump_param_to_param_group_map: Optional[str] = None):
    """megatron-core's ``get_megatron_optimizer(config, model_chunks, ...)``: mxddp's
    ``DistributedOptimizer`` over the one model chunk (a mxddp.torch DistributedDataParallel or
    FullyShardedDataParallel) with Megatron's param groups. Collective.

    config_overrides: ``{ParamKey: override dict}`` as Megatron's (any key with
    ``matches(param, name)``); None gives Megatron's standard groups. use_gloo_process_groups:
    either value (mxddp's optimizer uses no gloo group). pg_collection and
    dump_param_to_param_group_map: None only (mxddp's data-parallel group is every rank; it writes
    no param-group map). ``config.use_distributed_optimizer`` must be the DDP config's, as Megatron
    needs (its optimizer would otherwise step on grads the DDP did not reduce in full)."""
    if not isinstance(config, OptimizerConfig):
        raise TypeError(f"config must be a mxddp.torch.OptimizerConfig; got {type(config).__module__}."
                        f"{type(config).__name__}")
    if not isinstance(model_chunks, (list, tuple)):
        raise TypeError(f"model_chunks must be a list of model chunks; got {type(model_chunks).__name__}")
    if len(model_chunks) != 1:
        raise ValueError(f"model_chunks has {len(model_chunks)} chunks; mxddp takes exactly one (several chunks are "
                         "Megatron's virtual pipeline stages, and mxddp has no pipeline parallelism); valid: [model]")
    model = model_chunks[0]
    if not isinstance(model, DataParallelModule):
        raise TypeError("model_chunks[0] must be a mxddp.torch.DistributedDataParallel or FullyShardedDataParallel; "
                        f"got {type(model).__name__}")
    if not isinstance(use_gloo_process_groups, bool):
        raise TypeError(f"use_gloo_process_groups must be a bool; got {use_gloo_process_groups!r}")
    if pg_collection is not None:
        raise ValueError(f"pg_collection={pg_collection!r} is not supported by mxddp.torch: its data-parallel group is "
                         "every rank, with no tensor, pipeline or expert parallel groups; valid: None")
    if dump_param_to_param_group_map is not None:
        raise ValueError(f"dump_param_to_param_group_map={dump_param_to_param_group_map!r} is not supported by "
                         "mxddp.torch: it writes no param-group map; valid: None")
    for override in (config_overrides or {}).values():
        for name in _NOT_OVERRIDABLE:
            if isinstance(override, dict) and name in override and override[name] != getattr(config, name):
                raise ValueError(f"config_overrides sets {name}={override[name]!r} but the config has "
                                 f"{getattr(config, name)!r}: {name} chooses the optimizer, not a group's "
                                 "hyperparameters; valid: the config's value")
    config.check_model(model, exact=True)
    if config_overrides is None:
        return DistributedOptimizer(model, config)
    return DistributedOptimizer(model, config, config_overrides=config_overrides)
