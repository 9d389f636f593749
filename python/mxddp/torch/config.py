"""The configs, with Megatron-core's field names and defaults.

Every field is either carried out by mxddp or refused with an error that names it: nothing is
accepted and ignored. A field Megatron has that is not listed here is a TypeError (unexpected
keyword argument).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from mxddp import _C


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# Skipped steps in a row that OptimizerConfig allows by default: a NaN or Inf that persists this
# long (a NaN in a param) will not go away, and bf16/f32 training has no loss scaler whose
# overflows would skip steps on purpose.
DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS = 10
# OptimizerConfig's numeric fields (the C++ optimizer's floats).
_FLOAT_FIELDS = ("lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "clip_grad")
FINE_GRAINED_POLICIES = ("megatron", "recompute-aware")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}")


def _refuse_unless(name: str, value: Any, allowed: Any, why: str) -> None:
    if value != allowed:
        raise ValueError(f"{name}={value!r} is not supported by mxddp.torch: {why}; valid: {allowed!r}")


@dataclass
class DistributedDataParallelConfig:
    """Megatron-core's ``DistributedDataParallelConfig`` (megatron/core/distributed).

    Carried out: grad_reduce_in_fp32, overlap_grad_reduce, use_distributed_optimizer, bucket_size
    (elements; None: one bucket without overlap, max(40M, 1M x dp) with it, as Megatron),
    pad_buckets_for_high_nccl_busbw, average_in_collective, check_for_nan_in_grad,
    overlap_param_gather (the all-gather waited for module by module in forward pre-hooks),
    fp8_param_gather and reuse_grad_buf_for_mxfp8_param_ag (nn.Linear and HF Conv1D weights kept as MXFP8), and
    mxddp's own buckets_per_group and force_all_reduce. The other fields take their Megatron default
    only.

    For ``FullyShardedDataParallel`` (``use_megatron_fsdp=True``, which needs
    use_distributed_optimizer=True): data_parallel_sharding_strategy, overlap_param_gather,
    overlap_grad_reduce, grad_reduce_in_fp32, suggested_communication_unit_size (elements; None:
    twice the average unit), fsdp_double_buffer, fp8_param_gather (optim_grads_params only),
    megatron_fsdp_enable_fine_grained_param_gather (None: the policy decides; True: on; False:
    explicitly off, an error where the policy requires it) and fine_grained_param_gather_policy
    ("megatron" or "recompute-aware"; see docs/fsdp.md). DDP's bucketing fields are refused there.
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: Optional[int] = None
    pad_buckets_for_high_nccl_busbw: bool = False
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: Optional[int] = None
    preserve_fp32_weights: bool = True
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    delay_wgrad_compute: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: Optional[bool] = None
    fine_grained_param_gather_policy: str = "recompute-aware"
    # mxddp's own: buckets per collective call, and all-reduce even with the distributed optimizer.
    buckets_per_group: int = 1
    force_all_reduce: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type in ("bool", bool):
                _check_bool(f.name, getattr(self, f.name))
        if self.bucket_size is not None and (isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int)
                                             or self.bucket_size < 1):
            raise ValueError(f"bucket_size must be None or an int >= 1 (elements); got {self.bucket_size!r}")
        if isinstance(self.buckets_per_group, bool) or not isinstance(self.buckets_per_group, int) \
                or self.buckets_per_group < 1:
            raise ValueError(f"buckets_per_group must be an int >= 1; got {self.buckets_per_group!r}")
        # The param all-gather and the MXFP8 params it feeds exist only with the distributed optimizer.
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather=True needs use_distributed_optimizer=True: without it there is no "
                             "param all-gather to overlap (every rank updates every param)")
        _refuse_unless("align_param_gather", self.align_param_gather, False,
                       "it makes every pipeline stage launch its param all-gathers together, and mxddp has no "
                       "pipeline parallelism (overlap_param_gather works without it)")
        if self.fp8_param_gather and not self.use_distributed_optimizer:
            raise ValueError("fp8_param_gather=True needs use_distributed_optimizer=True: MXFP8 params are quantized "
                             "after the all-gather of the optimizer's shards")
        if self.reuse_grad_buf_for_mxfp8_param_ag and not self.fp8_param_gather:
            raise ValueError("reuse_grad_buf_for_mxfp8_param_ag=True needs fp8_param_gather=True: it stages the MXFP8 "
                             "params' all-gather in the grad buffer, and without MXFP8 params there is nothing to stage")
        _refuse_unless("num_distributed_optimizer_instances", self.num_distributed_optimizer_instances, 1,
                       "mxddp has one distributed optimizer instance over the whole data-parallel group")
        _refuse_unless("check_for_large_grads", self.check_for_large_grads, False, "mxddp has no large-grad check")
        _refuse_unless("use_custom_fsdp", self.use_custom_fsdp, False,
                       "it is Megatron's former name of use_megatron_fsdp; set use_megatron_fsdp=True instead")
        if self.data_parallel_sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"data_parallel_sharding_strategy={self.data_parallel_sharding_strategy!r} is not valid; "
                             f"valid: {', '.join(map(repr, SHARDING_STRATEGIES))}")
        if not (self.megatron_fsdp_enable_fine_grained_param_gather is None
                or isinstance(self.megatron_fsdp_enable_fine_grained_param_gather, bool)):
            raise TypeError("megatron_fsdp_enable_fine_grained_param_gather must be None, True or False; got "
                            f"{self.megatron_fsdp_enable_fine_grained_param_gather!r}")
        if self.fine_grained_param_gather_policy not in FINE_GRAINED_POLICIES:
            raise ValueError(f"fine_grained_param_gather_policy={self.fine_grained_param_gather_policy!r} is not "
                             f"valid; valid: {', '.join(map(repr, FINE_GRAINED_POLICIES))}")
        size = self.suggested_communication_unit_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"suggested_communication_unit_size must be None or an int >= 1 (elements); got {size!r}")
        if self.use_megatron_fsdp:
            self._check_fsdp()
        else:
            self._check_ddp()
        _refuse_unless("gradient_reduce_div_fusion", self.gradient_reduce_div_fusion, True,
                       "mxddp always fuses the 1/dp scaling into the collective")
        _refuse_unless("preserve_fp32_weights", self.preserve_fp32_weights, True,
                       "the distributed optimizer always keeps F32 main params")
        _refuse_unless("keep_fp8_transpose_cache", self.keep_fp8_transpose_cache, False,
                       "mxddp's FSDP gathers the column-wise MXFP8 copy for each backward and keeps none between")
        _refuse_unless("nccl_ub", self.nccl_ub, False, "mxddp's collectives run over MPI, not NCCL")
        _refuse_unless("delay_wgrad_compute", self.delay_wgrad_compute, False, "mxddp does not split wgrad")

    def agreement_items(self) -> list[tuple[str, str]]:
        """Every field as ``("DistributedDataParallelConfig.<field>", repr(value))``: what every rank
        must give alike (``agreement.py``)."""
        return [(f"DistributedDataParallelConfig.{f.name}", repr(getattr(self, f.name))) for f in fields(self)]

    def _check_ddp(self) -> None:
        why = "it is an FSDP field: set use_megatron_fsdp=True and wrap with mxddp.torch.FullyShardedDataParallel"
        _refuse_unless("data_parallel_sharding_strategy", self.data_parallel_sharding_strategy, "no_shard", why)
        _refuse_unless("suggested_communication_unit_size", self.suggested_communication_unit_size, None, why)
        _refuse_unless("fsdp_double_buffer", self.fsdp_double_buffer, False, why)
        _refuse_unless("megatron_fsdp_enable_fine_grained_param_gather",
                       self.megatron_fsdp_enable_fine_grained_param_gather, None, why)

    def _check_fsdp(self) -> None:
        if not self.use_distributed_optimizer:
            raise ValueError("use_megatron_fsdp=True needs use_distributed_optimizer=True: FSDP's optimizer always "
                             "keeps each rank's shard of the main params and state, as Megatron-FSDP's")
        why = "it is DDP's bucketing; FSDP has a bucket per unit"
        _refuse_unless("bucket_size", self.bucket_size, None, why)
        _refuse_unless("pad_buckets_for_high_nccl_busbw", self.pad_buckets_for_high_nccl_busbw, False,
                       "FSDP pads every bucket to divide into dp equal shards anyway")
        _refuse_unless("buckets_per_group", self.buckets_per_group, 1, why)
        _refuse_unless("force_all_reduce", self.force_all_reduce, False,
                       "FSDP reduces by its sharding strategy (no_shard all-reduces)")
        _refuse_unless("average_in_collective", self.average_in_collective, False,
                       "FSDP always scales by 1/dp before the collective")
        _refuse_unless("check_for_nan_in_grad", self.check_for_nan_in_grad, False,
                       "FSDP has no NaN check of its own (the optimizer skips a step whose grad norm is not finite)")
        _refuse_unless("reuse_grad_buf_for_mxfp8_param_ag", self.reuse_grad_buf_for_mxfp8_param_ag, False,
                       "FSDP has no param buffer to stage in (its MXFP8 params are gathered per unit)")
        if self.fp8_param_gather and self.data_parallel_sharding_strategy != "optim_grads_params":
            raise ValueError("fp8_param_gather=True under FSDP needs data_parallel_sharding_strategy="
                             f"'optim_grads_params' (MXFP8 shards gathered per unit); got "
                             f"{self.data_parallel_sharding_strategy!r}")

    def to_fsdp_cpp(self, param_dtype: str) -> "_C.FsdpConfig":
        c = _C.FsdpConfig()
        c.data_parallel_sharding_strategy = self.data_parallel_sharding_strategy
        c.overlap_param_gather = self.overlap_param_gather
        c.overlap_grad_reduce = self.overlap_grad_reduce
        c.suggested_communication_unit_size = self.suggested_communication_unit_size
        c.fsdp_double_buffer = self.fsdp_double_buffer
        c.grad_reduce_in_fp32 = self.grad_reduce_in_fp32
        c.param_dtype = param_dtype
        return c

    def to_cpp(self, param_dtype: str) -> "_C.DdpConfig":
        c = _C.DdpConfig()
        c.grad_reduce_in_fp32 = self.grad_reduce_in_fp32
        c.overlap_grad_reduce = self.overlap_grad_reduce
        c.use_distributed_optimizer = self.use_distributed_optimizer
        c.bucket_size = self.bucket_size
        c.pad_buckets_for_high_nccl_busbw = self.pad_buckets_for_high_nccl_busbw
        c.average_in_collective = self.average_in_collective
        c.check_for_nan_in_grad = self.check_for_nan_in_grad
        c.force_all_reduce = self.force_all_reduce
        c.buckets_per_group = self.buckets_per_group
        c.param_dtype = param_dtype
        c.overlap_param_gather = self.overlap_param_gather
        c.fp8_param_gather = self.fp8_param_gather
        c.reuse_grad_buf_for_mxfp8_param_ag = self.reuse_grad_buf_for_mxfp8_param_ag
        return c


@dataclass
class OptimizerConfig:
    """Megatron-core's ``OptimizerConfig`` (megatron/core/optimizer), the fields mxddp's optimizer has.

    optimizer: "adam" (AdamW: decoupled weight decay) or "sgd" (momentum). Weight decay applies to
    params of two or more dimensions only (not to biases and norms), as Megatron's default param
    groups. clip_grad: max global grad norm (0 disables clipping).

    max_consecutive_skipped_steps (mxddp's own): how many steps in a row ``step()`` may skip (a NaN
    or Inf global grad norm: nothing is updated) before the next skip raises ``mxddp.Error``; 0
    raises at the first, as Megatron's ``--check-for-nan-in-loss-and-grad``; None never raises.
    The first skip of a run of them warns (``SkippedStepWarning``) naming the norm and the params.
    """

    optimizer: str = "adam"
    lr: Optional[float] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    max_consecutive_skipped_steps: Optional[int] = DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS

    def __post_init__(self) -> None:
        limit = self.max_consecutive_skipped_steps
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"max_consecutive_skipped_steps must be None (never raise) or an int >= 0; got {limit!r}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r} is not supported; valid: 'adam', 'sgd'")
        if self.lr is None:
            raise ValueError("lr must be set (Megatron's OptimizerConfig leaves it None; mxddp needs a value)")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number; got {value!r}")

    def agreement_items(self) -> list[tuple[str, str]]:
        """Every field as ``("OptimizerConfig.<field>", value)``, numbers as the floats the C++
        optimizer takes (so ``lr=1`` and ``lr=1.0`` agree): what every rank must give alike."""
        def text(name: str) -> str:
            value = getattr(self, name)
            return repr(float(value)) if name in _FLOAT_FIELDS else repr(value)

        return [(f"OptimizerConfig.{f.name}", text(f.name)) for f in fields(self)]

    def to_cpp(self) -> "_C.OptimizerConfig":
        c = _C.OptimizerConfig()
        c.optimizer = self.optimizer
        c.lr = float(self.lr)
        c.weight_decay = float(self.weight_decay)
        c.adam_beta1 = float(self.adam_beta1)
        c.adam_beta2 = float(self.adam_beta2)
        c.adam_eps = float(self.adam_eps)
        c.sgd_momentum = float(self.sgd_momentum)
        c.clip_grad = float(self.clip_grad)
        return c
