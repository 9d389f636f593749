"""The configs, with Megatron-core's field names and defaults.

Every field of megatron-core 0.16's ``DistributedDataParallelConfig`` and ``OptimizerConfig`` is
here with Megatron's default, so a Megatron script's config builds unchanged. Each field is either
carried out by mxddp or, where its value asks for something mxddp does not do, refused with a
``ValueError`` that names the field, the value and what is valid: nothing is accepted and ignored.
A field whose effect Megatron confines to a setting mxddp refuses (NCCL user buffers, fp16 loss
scaling, the Muon optimizer, CPU offload, timers) takes any well-typed value, since with that
setting off Megatron ignores it too. mxddp's own fields come after Megatron's.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch

from mxddp import _C


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# Skipped steps in a row that OptimizerConfig allows by default: a NaN or Inf that persists this
# long (a NaN in a param) will not go away, and bf16/f32 training has no loss scaler whose
# overflows would skip steps on purpose.
DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS = 10
# OptimizerConfig's numeric fields (the C++ optimizer's floats).
_FLOAT_FIELDS = ("lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "clip_grad")
# OptimizerConfig's numbers the scheduler or an inert setting reads: None or a number.
_OPTIONAL_NUMBER_FIELDS = ("min_lr", "decoupled_lr", "decoupled_min_lr", "loss_scale")
_NUMBER_FIELDS = ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "muon_momentum",
                  "muon_extra_scale_factor", "optimizer_offload_fraction")
FINE_GRAINED_POLICIES = ("megatron", "recompute-aware")
# megatron-core's FP8 recipes (megatron.core.enums.Fp8Recipe).
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise", "custom")
# The param dtypes mxddp keeps (ddp.py's _DTYPES).
PARAM_DTYPES = (torch.float32, torch.bfloat16)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}")


def is_number(value: Any) -> bool:
    """A real number (not a bool) that a float holds: the C++ side takes every such field as a double."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:  # an int such as 10**400
        return False
    return True


def number_text(value: Any) -> str:
    """repr(value), but an int too long to print (Python refuses beyond 4300 digits) by its size."""
    if isinstance(value, int) and value.bit_length() > 1024:
        return f"an int of {value.bit_length()} bits, beyond a float's range"
    return repr(value)


def _refuse_unless(name: str, value: Any, allowed: Any, why: str) -> None:
    if value != allowed:
        raise ValueError(f"{name}={value!r} is not supported by mxddp.torch: {why}; valid: {allowed!r}")


# What the C++ side's int64 and int fields hold.
_INT64_MAX = 2 ** 63 - 1
_INT32_MAX = 2 ** 31 - 1


def _int_in(value: Any, low: int, high: int) -> bool:
    """Whether value is an int (not a bool) in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_bools(config: Any) -> None:
    for f in fields(config):
        if f.type in ("bool", bool):
            _check_bool(f.name, getattr(config, f.name))


# ---- Hybrid sharding ---------------------------------------------------------------------------
# num_distributed_optimizer_instances > 1: FullyShardedDataParallel's HSDP (mxddp.torch.hsdp: shard
# groups of dp/N ranks, replicated across the N groups). Under DistributedDataParallel (Megatron's
# partial distributed optimizer) it is refused, as is outer_dp_sharding_strategy other than
# 'no_shard' (Megatron-FSDP's sharding across the outer group).
def _check_hybrid(config: "DistributedDataParallelConfig") -> None:
    n = config.num_distributed_optimizer_instances
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_distributed_optimizer_instances must be an int >= 1; got {n!r}")
    if n > 1 and not config.use_megatron_fsdp:
        _refuse_unless("num_distributed_optimizer_instances", n, 1,
                       "under DistributedDataParallel mxddp has one distributed optimizer instance over the whole "
                       "data-parallel group; hybrid sharding (HSDP) is FullyShardedDataParallel's "
                       "(use_megatron_fsdp=True), where it is the number of replica groups (mxddp.torch.hsdp)")
    if n > 1 and config.reduce_scatter_with_fp32_accumulation:
        raise ValueError(f"reduce_scatter_with_fp32_accumulation=True with num_distributed_optimizer_instances={n} "
                         "is not supported (nor in Megatron); valid: one of the two")
    if config.outer_dp_sharding_strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"outer_dp_sharding_strategy={config.outer_dp_sharding_strategy!r} is not valid; "
                         f"valid: {', '.join(map(repr, SHARDING_STRATEGIES))}")
    _refuse_unless("outer_dp_sharding_strategy", config.outer_dp_sharding_strategy, "no_shard",
                   "mxddp's hybrid FSDP replicates across the outer (replica) group; it does not shard there")
# ---------------------------------------------------------------------------------------------------


@dataclass
class DistributedDataParallelConfig:
    """Megatron-core's ``DistributedDataParallelConfig`` (megatron/core/distributed), every field.

    Carried out: grad_reduce_in_fp32, overlap_grad_reduce, use_distributed_optimizer, bucket_size
    (elements; None: one bucket without overlap, max(40M, 1M x dp) with it, as Megatron),
    pad_buckets_for_high_nccl_busbw, average_in_collective, check_for_nan_in_grad,
    overlap_param_gather (the all-gather waited for module by module in forward pre-hooks),
    fp8_param_gather and reuse_grad_buf_for_mxfp8_param_ag (nn.Linear and HF Conv1D weights kept as
    MXFP8), gradient_reduce_div_fusion (either value: Megatron's DDP does not read it, and under
    FSDP False scales the grads by 1/dp before a sum, True fuses the same scaling into the
    collective, the same values), reduce_scatter_with_fp32_accumulation (mxddp's reduce-scatter of
    F32 grads accumulates in F32; refused at wrap time for BF16 grads under the distributed
    optimizer, the one place Megatron uses it), and mxddp's own buckets_per_group and
    force_all_reduce. disable_symmetric_registration and fsdp_manual_registration take either
    value (they tune NCCL user-buffer registration, which only nccl_ub turns on, and nccl_ub is
    refused). The other fields take their Megatron default only.

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
    reduce_scatter_with_fp32_accumulation: bool = False
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
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    delay_wgrad_compute: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: Optional[bool] = None
    fine_grained_param_gather_policy: str = "recompute-aware"
    # mxddp's own: buckets per collective call, and all-reduce even with the distributed optimizer.
    buckets_per_group: int = 1
    force_all_reduce: bool = False

    def __post_init__(self) -> None:
        _check_bools(self)
        if self.bucket_size is not None and not _int_in(self.bucket_size, 1, _INT64_MAX):
            raise ValueError("bucket_size must be None or an int in [1, 2**63 - 1] (elements); "
                             f"got {self.bucket_size!r}")
        if not _int_in(self.buckets_per_group, 1, _INT32_MAX):
            raise ValueError(f"buckets_per_group must be an int in [1, 2**31 - 1]; got {self.buckets_per_group!r}")
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
        _check_hybrid(self)
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
        if size is not None and not _int_in(size, 1, _INT64_MAX):
            raise ValueError("suggested_communication_unit_size must be None or an int in [1, 2**63 - 1] (elements); "
                             f"got {size!r}")
        if self.use_megatron_fsdp:
            self._check_fsdp()
        else:
            self._check_ddp()
        _refuse_unless("preserve_fp32_weights", self.preserve_fp32_weights, True,
                       "the distributed optimizer always keeps F32 main params")
        _refuse_unless("keep_fp8_transpose_cache", self.keep_fp8_transpose_cache, False,
                       "mxddp's FSDP gathers the column-wise MXFP8 copy for each backward and keeps none between")
        _refuse_unless("nccl_ub", self.nccl_ub, False, "mxddp's collectives run over MPI, not NCCL")
        _refuse_unless("delay_wgrad_compute", self.delay_wgrad_compute, False, "mxddp does not split wgrad")

    def agreement_items(self) -> list[tuple[str, str]]:
        """Every field as ``("DistributedDataParallelConfig.<field>", repr(value))``: what every rank
        must give alike (``agreement.py``). The fields are checked again first: the wrappers call this
        when they take the config, and a script may have set a field after construction."""
        self.__post_init__()
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

    def _check_fp32_accumulation(self, param_dtype: str) -> None:
        """reduce_scatter_with_fp32_accumulation asks that the grads' reduce-scatter add in F32.
        mxddp's does for F32 grads (F32 params, or grad_reduce_in_fp32); for BF16 grads its MPI
        reduction may round to BF16 between ranks, so that is refused. Megatron uses the field only
        for the distributed optimizer's reduce-scatter: elsewhere (all-reduce, FSDP) it is inert."""
        if not self.reduce_scatter_with_fp32_accumulation or self.use_megatron_fsdp:
            return
        if self.use_distributed_optimizer and not self.force_all_reduce and param_dtype != "f32" \
                and not self.grad_reduce_in_fp32:
            raise ValueError(f"reduce_scatter_with_fp32_accumulation=True with {param_dtype} params and "
                             "grad_reduce_in_fp32=False is not supported by mxddp.torch: the BF16 grads' "
                             "reduce-scatter may round to BF16 between ranks; set grad_reduce_in_fp32=True (F32 "
                             "grads, reduced in F32: what this field asks for); valid: "
                             "reduce_scatter_with_fp32_accumulation=False")

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
        """The C++ DDP's config for params of ``param_dtype`` ("f32" or "bf16"); refuses what
        depends on it (reduce_scatter_with_fp32_accumulation with BF16 grads)."""
        self._check_fp32_accumulation(param_dtype)
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
    """Megatron-core's ``OptimizerConfig`` (megatron/core/optimizer), every field.

    Carried out: optimizer ("adam": Adam with decoupled_weight_decay=True (AdamW, the default) or
    L2 decay (False, torch's Adam); "sgd": momentum, L2 decay), lr (required), weight_decay,
    adam_beta1/2, adam_eps, sgd_momentum, clip_grad (max global grad norm; 0 disables clipping),
    apply_wd_to_qk_layernorm, decoupled_lr and decoupled_min_lr (Megatron's param groups, see
    ``megatron_groups.py``), min_lr (the groups' ``min_lr``, which Megatron's scheduler reads).
    Checked against the model when the optimizer is built (``check_model``): bf16 and params_dtype
    (the model's param dtype), use_distributed_optimizer, reuse_grad_buf_for_mxfp8_param_ag and,
    with it, overlap_param_gather (the DDP config's), fp8_recipe (MXFP8 params are "mxfp8").
    Refused at any other value: fp16 (mxddp keeps F32 or BF16 params), loss_scale (no grad
    scaler), use_precision_aware_optimizer and main_grads/main_params/exp_avg/exp_avg_sq dtypes
    (F32 main params and states always, as Megatron without precision-aware), optimizer "muon",
    overlap_param_gather_with_optimizer_step, optimizer_cpu_offload, config_logger_dir.
    log_num_zeros_in_grad: ``step()`` counts the zeros in the synchronized grads, as Megatron's. Inert, any value (Megatron ignores them here too): the
    dynamic loss-scaling fields (fp16 only), muon_* (Muon only), the offload fields (offload only),
    store_param_remainders (precision-aware only), barrier_with_L1_time (timers only). timers:
    any value, never called (Megatron-LM sets its Timers after construction; mxddp reports no
    timings to them). Every field is checked again when the optimizer takes the config.

    max_consecutive_skipped_steps (mxddp's own): how many steps in a row ``step()`` may skip (a NaN
    or Inf global grad norm: nothing is updated) before the next skip raises ``mxddp.Error``; 0
    raises at the first, as Megatron's ``--check-for-nan-in-loss-and-grad``; None never raises.
    The first skip of a run of them warns (``SkippedStepWarning``) naming the norm and the params.
    """

    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False
    fp8_recipe: Optional[str] = None
    fp16: bool = False
    bf16: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    params_dtype: torch.dtype = torch.float32
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True
    main_grads_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    optimizer: str = "adam"
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    decoupled_weight_decay: bool = True
    sgd_momentum: float = 0.9
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_extra_scale_factor: float = 1.0
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Optional[Callable] = None
    config_logger_dir: str = ""
    # mxddp's own.
    max_consecutive_skipped_steps: Optional[int] = DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS

    def __post_init__(self) -> None:
        _check_bools(self)
        limit = self.max_consecutive_skipped_steps
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"max_consecutive_skipped_steps must be None (never raise) or an int >= 0; got {limit!r}")
        if self.optimizer == "muon":
            raise ValueError("optimizer='muon' is not supported; valid: 'adam', 'sgd' (mxddp's optimizer has no "
                             "Muon: its Newton-Schulz orthogonalization needs whole matrices, not shards)")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r} is not supported; valid: 'adam', 'sgd'")
        if self.lr is None:
            raise ValueError("lr must be set (Megatron's OptimizerConfig leaves it None; mxddp needs a value)")
        for name in _FLOAT_FIELDS + _NUMBER_FIELDS + ("hysteresis", "muon_num_ns_steps"):
            if not is_number(getattr(self, name)):
                raise TypeError(f"{name} must be a number a float holds; got {number_text(getattr(self, name))}")
        for name in _OPTIONAL_NUMBER_FIELDS:
            value = getattr(self, name)
            if value is not None and not is_number(value):
                raise TypeError(f"{name} must be None or a number a float holds; got {number_text(value)}")
        self._check_precision()
        self._check_refused()

    def _check_precision(self) -> None:
        if self.fp8_recipe is not None and self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe={self.fp8_recipe!r} is not valid; valid: None, "
                             f"{', '.join(map(repr, FP8_RECIPES))}")
        _refuse_unless("fp16", self.fp16, False,
                       "mxddp keeps F32 or BF16 params (bf16=True for BF16), never FP16")
        if self.params_dtype not in PARAM_DTYPES:
            raise ValueError(f"params_dtype={self.params_dtype!r} is not supported by mxddp.torch: it keeps F32 or "
                             "BF16 params; valid: torch.float32, torch.bfloat16")
        _refuse_unless("use_precision_aware_optimizer", self.use_precision_aware_optimizer, False,
                       "mxddp's optimizer keeps F32 main params, grads and states")
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            # Megatron asserts the same without use_precision_aware_optimizer.
            _refuse_unless(name, getattr(self, name), torch.float32,
                           "mxddp's optimizer keeps F32 main params, grads and states")

    def _check_refused(self) -> None:
        _refuse_unless("loss_scale", self.loss_scale, None,
                       "mxddp's optimizer has no Megatron grad scaler (loss scaling is for FP16 training, which "
                       "mxddp does not do)")
        _refuse_unless("overlap_param_gather_with_optimizer_step", self.overlap_param_gather_with_optimizer_step, False,
                       "it splits off the first of several model chunks (pipeline parallelism), which mxddp does "
                       "not have; overlap_param_gather in the DDP config overlaps the gather with forward")
        _refuse_unless("optimizer_cpu_offload", self.optimizer_cpu_offload, False,
                       "mxddp's optimizer state already lives where its params do (host memory for mxddp.torch) and "
                       "has no hybrid device optimizer")
        _refuse_unless("config_logger_dir", self.config_logger_dir, "", "mxddp does not dump configs")

    def check_model(self, model: Any, exact: bool = True) -> None:
        """Refuses a config that describes another model than ``model`` (a mxddp.torch
        DistributedDataParallel or FullyShardedDataParallel): bf16 and params_dtype against its
        param dtype, use_distributed_optimizer and reuse_grad_buf_for_mxfp8_param_ag (and then
        overlap_param_gather, which Megatron's optimizer reads only then) against its DDP config,
        fp8_recipe against MXFP8 params. exact (``get_megatron_optimizer``, where these fields mean
        what they mean in Megatron): every one must match. Not exact (``DistributedOptimizer(model,
        OptimizerConfig)``, whose defaults mxddp scripts rely on: bf16=False over BF16 params, the
        distributed optimizer without use_distributed_optimizer=True): only a value that asks for
        what the model does not have is refused."""
        dtype, ddp = model.param_dtype, model.ddp_config
        bf16 = dtype == torch.bfloat16
        if self.bf16 != bf16 and (exact or self.bf16):
            raise ValueError(f"OptimizerConfig.bf16={self.bf16!r} but the model's params are {dtype}; valid: "
                             f"bf16={bf16!r} (bf16=True exactly when the params are torch.bfloat16)")
        if self.params_dtype != dtype and (exact or self.params_dtype != torch.float32):
            raise ValueError(f"OptimizerConfig.params_dtype={self.params_dtype!r} but the model's params are {dtype}; "
                             f"valid: params_dtype={dtype!r}")
        if self.use_distributed_optimizer != ddp.use_distributed_optimizer \
                and (exact or self.use_distributed_optimizer):
            raise ValueError(f"OptimizerConfig.use_distributed_optimizer={self.use_distributed_optimizer!r} but the "
                             "model's DistributedDataParallelConfig has "
                             f"{ddp.use_distributed_optimizer!r}; valid: the DDP config's value")
        if self.reuse_grad_buf_for_mxfp8_param_ag != ddp.reuse_grad_buf_for_mxfp8_param_ag \
                and (exact or self.reuse_grad_buf_for_mxfp8_param_ag):
            raise ValueError("OptimizerConfig.reuse_grad_buf_for_mxfp8_param_ag="
                             f"{self.reuse_grad_buf_for_mxfp8_param_ag!r} but the model's "
                             "DistributedDataParallelConfig has "
                             f"{ddp.reuse_grad_buf_for_mxfp8_param_ag!r}; valid: the DDP config's value")
        if self.reuse_grad_buf_for_mxfp8_param_ag and self.overlap_param_gather != ddp.overlap_param_gather:
            raise ValueError(f"OptimizerConfig.overlap_param_gather={self.overlap_param_gather!r} but the model's "
                             f"DistributedDataParallelConfig has {ddp.overlap_param_gather!r} (with "
                             "reuse_grad_buf_for_mxfp8_param_ag they must agree); valid: the DDP config's value")
        if ddp.fp8_param_gather and self.fp8_recipe not in (None, "mxfp8"):
            raise ValueError(f"OptimizerConfig.fp8_recipe={self.fp8_recipe!r} but the model keeps MXFP8 params "
                             "(fp8_param_gather=True); valid: 'mxfp8' or None")

    def agreement_items(self) -> list[tuple[str, str]]:
        """Every field as ``("OptimizerConfig.<field>", value)``, numbers as the floats the C++
        optimizer takes (so ``lr=1`` and ``lr=1.0`` agree): what every rank must give alike. The
        fields are checked again first (a script may have set one after construction); timers is left
        out (each rank's own object, never called)."""
        self.__post_init__()
        numbers = _FLOAT_FIELDS + _OPTIONAL_NUMBER_FIELDS + _NUMBER_FIELDS

        def text(name: str) -> str:
            value = getattr(self, name)
            return repr(float(value)) if name in numbers and value is not None else repr(value)

        return [(f"OptimizerConfig.{f.name}", text(f.name)) for f in fields(self) if f.name != "timers"]

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


@dataclass
class AdamOptimizerConfig(OptimizerConfig):
    """Megatron-core's ``AdamOptimizerConfig``: an ``OptimizerConfig`` with optimizer="adam"."""

    optimizer: str = "adam"


@dataclass
class SGDOptimizerConfig(OptimizerConfig):
    """Megatron-core's ``SGDOptimizerConfig``: an ``OptimizerConfig`` with optimizer="sgd"."""

    optimizer: str = "sgd"
