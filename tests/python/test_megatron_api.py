"""Megatron-core's own API on mxddp.torch: its configs (every field of megatron-core 0.16's
DistributedDataParallelConfig and OptimizerConfig, honoured or refused by name), its param groups,
and a Megatron-style training loop written once against megatron-core's API and run twice, with
only the import switched (megatron.core, then mxddp.torch): the losses must be equal.

The tests that need megatron-core skip, saying so, where it is not importable; the config
refusals run everywhere.
"""
import copy
import dataclasses
import math
import warnings

import pytest
import torch

import mxddp.torch as mxt
from mxddp.torch.config import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig
from mxddp.torch.megatron import get_megatron_optimizer
from mxddp.torch.megatron_groups import megatron_param_groups

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        import megatron.core.distributed as mcore_distributed
        import megatron.core.optimizer as mcore_optimizer
        from megatron.core import parallel_state
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer import TransformerConfig
    MCORE_MISSING = None
except ImportError as e:
    MCORE_MISSING = f"megatron-core is not importable here ({e}); pip install megatron-core==0.16.1"

needs_mcore = pytest.mark.skipif(MCORE_MISSING is not None, reason=MCORE_MISSING or "")
_DO_CONFIG = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True)


# ---- configs ---------------------------------------------------------------------------------------

@needs_mcore
def test_every_megatron_field_is_taken_at_megatrons_default():
    # Megatron's own defaults, field by field, build mxddp's configs (a TypeError before).
    ddp = mcore_distributed.DistributedDataParallelConfig()
    opt = mcore_optimizer.OptimizerConfig(lr=1e-3)
    for ours, theirs in ((mxt.DistributedDataParallelConfig, ddp), (OptimizerConfig, opt)):
        values = {f.name: getattr(theirs, f.name) for f in dataclasses.fields(theirs) if f.init}
        built = ours(**values)
        defaults = {f.name: f.default for f in dataclasses.fields(ours)}
        for name, value in values.items():
            assert getattr(built, name) == value
            if name != "lr":
                assert defaults[name] == value, f"{ours.__name__}.{name}: mxddp's default differs from Megatron's"
    assert len([f for f in dataclasses.fields(ddp) if f.init]) == 27
    assert len([f for f in dataclasses.fields(opt) if f.init]) == 50


def test_ddp_fields_honoured_at_other_values():
    # Megatron's DDP does not read gradient_reduce_div_fusion, and under FSDP False only moves the
    # 1/dp scaling before the sum: the same values.
    for fsdp in (False, True):
        mxt.DistributedDataParallelConfig(gradient_reduce_div_fusion=False, use_megatron_fsdp=fsdp,
                                          use_distributed_optimizer=fsdp)
    # NCCL user-buffer registration knobs: inert without nccl_ub, as in Megatron.
    mxt.DistributedDataParallelConfig(disable_symmetric_registration=True, fsdp_manual_registration=True)
    # F32 accumulation of the reduce-scatter: what F32 grads get anyway.
    cfg = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True)
    cfg.to_cpp("f32")
    mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                      reduce_scatter_with_fp32_accumulation=True).to_cpp("bf16")


@pytest.mark.parametrize("field,value,message", [
    ("outer_dp_sharding_strategy", "optim", "outer_dp_sharding_strategy='optim' is not supported.*valid: 'no_shard'"),
    ("outer_dp_sharding_strategy", "zero", "outer_dp_sharding_strategy='zero' is not valid; valid: 'no_shard'"),
    ("num_distributed_optimizer_instances", 2, "num_distributed_optimizer_instances=2 is not supported.*valid: 1"),
    ("disable_symmetric_registration", "yes", None),
])
def test_ddp_fields_refused_by_name(field, value, message):
    if message is None:
        with pytest.raises(TypeError, match=f"{field} must be a bool"):
            mxt.DistributedDataParallelConfig(**{field: value})
        return
    with pytest.raises(ValueError, match=message):
        mxt.DistributedDataParallelConfig(**{field: value})


def test_fp32_accumulation_refused_for_bf16_grads():
    cfg = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True)
    with pytest.raises(ValueError, match="reduce_scatter_with_fp32_accumulation=True with bf16 params and "
                                         "grad_reduce_in_fp32=False is not supported.*set grad_reduce_in_fp32=True"):
        cfg.to_cpp("bf16")
    # Without the distributed optimizer Megatron all-reduces and never reads the field.
    mxt.DistributedDataParallelConfig(reduce_scatter_with_fp32_accumulation=True).to_cpp("bf16")


@pytest.mark.parametrize("field,value,message", [
    ("fp16", True, "fp16=True is not supported.*valid: False"),
    ("optimizer", "muon", "optimizer='muon' is not supported; valid: 'adam', 'sgd'.*Muon"),
    ("loss_scale", 1024.0, "loss_scale=1024.0 is not supported.*valid: None"),
    ("use_precision_aware_optimizer", True, "use_precision_aware_optimizer=True is not supported"),
    ("main_grads_dtype", torch.bfloat16, "main_grads_dtype=torch.bfloat16 is not supported.*valid: torch.float32"),
    ("exp_avg_sq_dtype", torch.float16, "exp_avg_sq_dtype=torch.float16 is not supported"),
    ("params_dtype", torch.float16, "params_dtype=torch.float16 is not supported.*valid: torch.float32, "
                                    "torch.bfloat16"),
    ("overlap_param_gather_with_optimizer_step", True,
     "overlap_param_gather_with_optimizer_step=True is not supported"),
    ("optimizer_cpu_offload", True, "optimizer_cpu_offload=True is not supported"),
    ("config_logger_dir", "/tmp/x", "config_logger_dir='/tmp/x' is not supported.*valid: ''"),
    ("fp8_recipe", "fancy", "fp8_recipe='fancy' is not valid; valid: None, 'delayed'"),
    ("min_lr", "low", None),
])
def test_optimizer_fields_refused_by_name(field, value, message):
    if message is None:
        with pytest.raises(TypeError, match=f"{field} must be None or a number"):
            OptimizerConfig(lr=1e-3, **{field: value})
        return
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(lr=1e-3, **{field: value})


def test_optimizer_fields_inert_where_megatron_ignores_them():
    # Loss scaling without fp16, Muon's knobs without Muon, offload knobs without offload.
    OptimizerConfig(lr=1e-3, initial_loss_scale=2.0 ** 16, hysteresis=4, muon_momentum=0.9, muon_num_ns_steps=3,
                    optimizer_offload_fraction=0.5, pin_cpu_grads=False, store_param_remainders=False,
                    barrier_with_L1_time=True, min_lr=1e-5, decoupled_lr=1e-4, decoupled_min_lr=1e-6)
    assert mxt.DistributedDataParallelConfig().num_distributed_optimizer_instances == 1
    # Megatron's per-optimizer subclasses.
    assert AdamOptimizerConfig(lr=1e-3).optimizer == "adam" and SGDOptimizerConfig(lr=1e-3).optimizer == "sgd"


# ---- param groups ----------------------------------------------------------------------------------

class _Named(torch.nn.Module):
    """Every kind of param Megatron's groups tell apart."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.embed.weight.is_embedding_or_output_parameter = True
        self.proj = torch.nn.Linear(8, 8)
        self.q_layernorm = torch.nn.LayerNorm(8)
        self.norm = torch.nn.LayerNorm(8)
        self.scale = torch.nn.Parameter(torch.tensor(1.0))          # 0-D: Megatron decays it
        self.wide = torch.nn.Module()
        self.wide.bias = torch.nn.Parameter(torch.zeros(2, 4))      # 2-D named .bias: Megatron does not
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)


def _group_summary(groups, names):
    keys = ("wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr", "default_config", "is_expert_parallel")
    return [({k: g[k] for k in keys}, sorted(names[id(p)] for p in g["params"])) for g in groups]


@needs_mcore
@pytest.mark.parametrize("kw", [{}, {"apply_wd_to_qk_layernorm": True},
                                {"decoupled_lr": 1e-4, "decoupled_min_lr": 1e-6, "min_lr": 1e-5}])
def test_param_groups_are_megatrons(ranks, kw):
    module = _Named()
    names = {id(p): n for n, p in module.named_parameters()}
    theirs = mcore_optimizer._get_param_groups([module], mcore_optimizer.OptimizerConfig(lr=1e-3, **kw), None)
    ours = megatron_param_groups(list(module.named_parameters()), OptimizerConfig(lr=1e-3, **kw))
    assert _group_summary(ours, names) == _group_summary(theirs, names)
    for g in ours:  # mxddp's one difference: wd_mult applies from the start, not from the scheduler's first step
        assert g["weight_decay"] == 0.01 * g["wd_mult"] and g["lr"] == 1e-3


@needs_mcore
def test_param_groups_with_megatrons_config_overrides(ranks):
    # A caller's overrides replace the standard ones, merged per param as Megatron merges them.
    ParamKey = mcore_optimizer.ParamKey
    overrides = {ParamKey(name="proj.*"): {"max_lr": 5e-4, "wd_mult": 0.5},
                 ParamKey(attr="is_embedding_or_output_parameter"): {"wd_mult": 0.0}}
    module = _Named()
    names = {id(p): n for n, p in module.named_parameters()}
    config = dict(lr=1e-3, min_lr=1e-5)
    theirs = mcore_optimizer._get_param_groups([module], mcore_optimizer.OptimizerConfig(**config), overrides)
    ours = megatron_param_groups(list(module.named_parameters()), OptimizerConfig(**config), overrides)
    assert _group_summary(ours, names) == _group_summary(theirs, names)
    overridden = sorted(names[id(p)] for g in ours if g["max_lr"] == 5e-4 for p in g["params"])
    assert overridden == ["proj.bias", "proj.weight"]
    conflicting = {ParamKey(name="proj.*"): {"wd_mult": 0.5},
                   ParamKey(name="*.weight"): {"wd_mult": 0.0}}
    with pytest.raises(ValueError, match="param 'proj.weight': conflicting overrides for wd_mult: 0.5 and 0.0"):
        megatron_param_groups(list(module.named_parameters()), OptimizerConfig(**config), conflicting)


# ---- the Megatron-style loop -----------------------------------------------------------------------

ITERATIONS = 8


def _module() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                               torch.nn.Linear(32, 8))


def megatron_loop(api, transformer_config, rank, config_overrides=None, scheduled=True, finalize=None,
                  log_num_zeros_in_grad=False):
    """A Megatron training loop, written against megatron-core's API only: ``api`` holds the names
    a script imports (DistributedDataParallel, DistributedDataParallelConfig, OptimizerConfig,
    get_megatron_optimizer). Returns per iteration (loss, update_successful, grad_norm,
    num_zeros_in_grad, each group's lr and weight_decay after the scheduler's step), and the final
    params. ``config_overrides``: get_megatron_optimizer's; ``scheduled``: with Megatron's scheduler;
    ``finalize``: what ends the grad sync (Megatron's finalize_model_grads), else finish_grad_sync().
    ``log_num_zeros_in_grad``: the config's; then input features 0-3 are 0 on every rank (32 x 4
    elements of the first weight's grad are 0 after the sum) and features 4-7 on rank 0 only (0 in
    its local grad, not after the sum over several ranks)."""
    ddp_config = api.DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                   grad_reduce_in_fp32=True, bucket_size=300)
    model = api.DistributedDataParallel(transformer_config, ddp_config, _module())
    opt_config = api.OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.1, adam_beta2=0.95,
                                     clip_grad=1.0, use_distributed_optimizer=True,
                                     log_num_zeros_in_grad=log_num_zeros_in_grad)
    optimizer = api.get_megatron_optimizer(opt_config, [model], config_overrides=config_overrides)
    scheduler = None if not scheduled else OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2,
                                        lr_decay_steps=ITERATIONS, lr_decay_style="cosine", start_wd=0.05,
                                        end_wd=0.1, wd_incr_steps=ITERATIONS, wd_incr_style="linear")
    history = []
    for it in range(ITERATIONS):
        gen = torch.Generator().manual_seed(1000 * it + rank)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        if log_num_zeros_in_grad:
            x[:, :(8 if rank == 0 else 4)] = 0.0
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if finalize is None:
            model.finish_grad_sync()
        else:
            finalize([model])
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
        if scheduler is not None:
            scheduler.step(increment=1)
        history.append((loss.item(), update_successful, grad_norm, num_zeros_in_grad,
                        [(g["lr"], g["weight_decay"], g["wd_mult"]) for g in optimizer.param_groups]))
    params = [p.detach().clone() for p in model.module.parameters()]
    return history, params, model, optimizer


class _Api:
    def __init__(self, ddp, ddp_config, opt_config, get_optimizer):
        self.DistributedDataParallel = ddp
        self.DistributedDataParallelConfig = ddp_config
        self.OptimizerConfig = opt_config
        self.get_megatron_optimizer = get_optimizer


def _megatron_api():
    return _Api(mcore_distributed.DistributedDataParallel, mcore_distributed.DistributedDataParallelConfig,
                mcore_optimizer.OptimizerConfig, mcore_optimizer.get_megatron_optimizer)


def _mxddp_api():
    return _Api(mxt.DistributedDataParallel, mxt.DistributedDataParallelConfig, mxt.OptimizerConfig,
                get_megatron_optimizer)


@pytest.fixture(scope="module")
def megatron_state(ranks):
    """megatron-core's parallel state over the session's gloo group (every rank data-parallel)."""
    if MCORE_MISSING is not None:
        pytest.skip(MCORE_MISSING)
    parallel_state.initialize_model_parallel()
    yield TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=1)
    parallel_state.destroy_model_parallel()


@needs_mcore
def test_num_zeros_in_grad_is_megatrons(ranks, megatron_state):
    from megatron_on_cpu import megatron_on_cpu

    rank, world = ranks
    with megatron_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, _, _, _ = megatron_loop(_megatron_api(), megatron_state, rank, log_num_zeros_in_grad=True)
    ours, _, model, optimizer = megatron_loop(_mxddp_api(), megatron_state, rank, log_num_zeros_in_grad=True)
    try:
        expected = 32 * (8 if world == 1 else 4)  # the columns of zero inputs on every rank
        for it, (mine, ref) in enumerate(zip(ours, theirs)):
            assert mine[0] == pytest.approx(ref[0], rel=1e-6), f"iteration {it}: loss"
            assert isinstance(mine[3], float) and mine[3] == ref[3] == expected, f"iteration {it}: num_zeros_in_grad"
        assert optimizer.count_zeros() == expected  # alone, on the last iteration's grads
    finally:
        optimizer.close()
        model.close()


@needs_mcore
def test_megatron_loop_runs_unchanged_on_mxddp(ranks, megatron_state):
    from megatron_on_cpu import megatron_on_cpu

    rank, _ = ranks
    with megatron_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, their_params, _, _ = megatron_loop(_megatron_api(), megatron_state, rank)
    ours, our_params, model, optimizer = megatron_loop(_mxddp_api(), megatron_state, rank)
    try:
        for it, (mine, ref) in enumerate(zip(ours, theirs)):
            assert mine[0] == pytest.approx(ref[0], rel=1e-6), f"iteration {it}: loss"
            assert mine[1] is ref[1] is True
            # Megatron's norm sums F32 squares per tensor, mxddp's is exact: they agree to F32 rounding.
            assert mine[2] == pytest.approx(ref[2], rel=1e-6), f"iteration {it}: grad norm"
            assert mine[3] is ref[3] is None
            # The scheduler wrote the same lr and weight decay (wd_mult 0 for biases and norms) into each group.
            assert mine[4] == ref[4], f"iteration {it}: (lr, weight_decay, wd_mult) per group"
        assert [g["wd_mult"] for g in optimizer.param_groups] == [1.0, 0.0]
        for a, b in zip(our_params, their_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert not math.isclose(ours[0][0], ours[-1][0])  # it trained
    finally:
        optimizer.close()
        model.close()


def _overrides(kind):
    ParamKey = mcore_optimizer.ParamKey
    if kind == "betas_eps":
        return {ParamKey(name="*.weight"): {"betas": (0.5, 0.6), "eps": 1e-2}}
    return {ParamKey(name="*.weight"): {"weight_decay": 0.0, "lr": 1e-4}}


@needs_mcore
@pytest.mark.parametrize("kind,scheduled", [("betas_eps", True), ("betas_eps", False), ("lr_wd", False)])
def test_config_overrides_values_are_the_groups_as_megatrons(ranks, megatron_state, kind, scheduled):
    """An override's betas and eps (which Megatron's torch optimizer reads from the group), and without
    a scheduler its lr and weight_decay (which torch's add_param_group keeps): before this check mxddp
    kept them in the group and stepped with the config's (final params 2-30% from Megatron's)."""
    from megatron_on_cpu import megatron_on_cpu

    rank, _ = ranks
    with megatron_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, their_params, _, _ = megatron_loop(_megatron_api(), megatron_state, rank, _overrides(kind), scheduled)
    ours, our_params, model, optimizer = megatron_loop(_mxddp_api(), megatron_state, rank, _overrides(kind), scheduled)
    try:
        for it, (mine, ref) in enumerate(zip(ours, theirs)):
            assert mine[0] == pytest.approx(ref[0], rel=1e-6), f"iteration {it}: loss"
            assert mine[4] == ref[4], f"iteration {it}: (lr, weight_decay, wd_mult) per group"
        for a, b in zip(our_params, their_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    finally:
        optimizer.close()
        model.close()


@needs_mcore
def test_megatrons_finalize_model_grads_hooks_and_timers(ranks, megatron_state):
    """Megatron's own finalize_model_grads (which calls finish_grad_sync(force_all_reduce=False)) ends
    the grad sync as finish_grad_sync() does; start_grad_sync and start_param_sync take a hook's
    positional arguments and Megatron's keywords; timers set after construction (Megatron-LM's way)
    are accepted and never called."""
    from megatron.core.distributed import finalize_model_grads

    rank, _ = ranks
    expected, expected_params, model, optimizer = megatron_loop(_mxddp_api(), megatron_state, rank)
    optimizer.close()
    model.close()
    ours, our_params, model, optimizer = megatron_loop(_mxddp_api(), megatron_state, rank,
                                                       finalize=finalize_model_grads)
    try:
        assert [h[0] for h in ours] == [h[0] for h in expected]
        for a, b in zip(our_params, expected_params):
            assert torch.equal(a, b)
        model.start_grad_sync(model.module, (torch.zeros(1),))  # as a hook: positional arguments ignored
        model.start_param_sync(model.module, (), force_sync=True, force_dispatch=True)
        with pytest.raises(NotImplementedError, match="force_all_reduce=True.*reduce-scatters its grads.*"
                                                      r"DistributedDataParallelConfig\(force_all_reduce=True\)"):
            model.finish_grad_sync(force_all_reduce=True)
        with pytest.raises(TypeError, match="force_dispatch must be True or False; got 'yes'"):
            model.start_param_sync(force_dispatch="yes")
    finally:
        optimizer.close()
        model.close()
    config = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True)
    config.timers = lambda *a, **k: pytest.fail("mxddp called the timers")  # a different object on each rank
    model = mxt.DistributedDataParallel(megatron_state, _DO_CONFIG, _module())
    try:
        get_megatron_optimizer(config, [model]).close()
    finally:
        model.close()


def test_config_fields_set_after_construction_are_checked_where_the_config_is_taken(ranks):
    config = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True)
    config.loss_scale = 4096.0
    ddp_config = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True)
    ddp_config.nccl_ub = True
    with pytest.raises(ValueError, match="nccl_ub=True is not supported"):
        mxt.DistributedDataParallel(_module(), ddp_config)
    model = mxt.DistributedDataParallel(_module(), _DO_CONFIG)
    try:
        with pytest.raises(ValueError, match="loss_scale=4096.0 is not supported"):
            mxt.DistributedOptimizer(model, config)
        config.loss_scale = None
        config.optimizer_cpu_offload = True
        with pytest.raises(ValueError, match="optimizer_cpu_offload=True is not supported"):
            mxt.DistributedOptimizer(model, config)
    finally:
        model.close()


@needs_mcore
def test_get_megatron_optimizer_refusals(ranks, megatron_state):
    model = mxt.DistributedDataParallel(megatron_state, _DO_CONFIG,
                                        _module())
    try:
        config = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True)
        with pytest.raises(ValueError, match="model_chunks has 2 chunks; mxddp takes exactly one"):
            get_megatron_optimizer(config, [model, model])
        with pytest.raises(ValueError, match="OptimizerConfig.use_distributed_optimizer=False but the model's "
                                             "DistributedDataParallelConfig has True"):
            get_megatron_optimizer(OptimizerConfig(lr=1e-3), [model])
        with pytest.raises(ValueError, match=r"OptimizerConfig.bf16=True but the model's params are torch.float32"):
            get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, bf16=True,
                                                   params_dtype=torch.bfloat16), [model])
        with pytest.raises(ValueError, match=r"params_dtype=torch.bfloat16 but the model's params are torch.float32"):
            get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True,
                                                   params_dtype=torch.bfloat16), [model])
        with pytest.raises(ValueError, match="pg_collection=.* is not supported"):
            get_megatron_optimizer(config, [model], pg_collection=object())
        with pytest.raises(TypeError, match="config must be a mxddp.torch.OptimizerConfig; got "
                                            "megatron.core.optimizer.optimizer_config.OptimizerConfig"):
            get_megatron_optimizer(mcore_optimizer.OptimizerConfig(lr=1e-3), [model])
    finally:
        model.close()


@needs_mcore
def test_get_megatron_optimizer_groups_are_megatrons(ranks, megatron_state):
    # The optimizer's own groups, not only megatron_param_groups: a 0-D param decayed, a 2-D
    # ".bias" not, the decoupled lr on the embedding, as Megatron's _get_param_groups has them.
    model = mxt.DistributedDataParallel(megatron_state, _DO_CONFIG,
                                        _Named())
    optimizer = None
    try:
        kw = {"lr": 1e-3, "min_lr": 1e-5, "decoupled_lr": 1e-4}
        optimizer = get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=True, **kw), [model])
        names = {id(p): n for n, p in model.named_parameters()}
        theirs = mcore_optimizer._get_param_groups([model], mcore_optimizer.OptimizerConfig(**kw), None)
        assert _group_summary(optimizer.param_groups, names) == _group_summary(theirs, names)
    finally:
        if optimizer is not None:
            optimizer.close()
        model.close()


def test_decoupled_weight_decay_false_is_adams_l2(ranks):
    # Megatron's decoupled_weight_decay=False is torch's Adam (weight_decay * p added to the grad),
    # with Megatron's groups: no decay for biases and norms. Every rank sees the same batch, so the
    # averaged grads are the local ones and torch's Adam on a copy is the reference.
    torch.manual_seed(7)
    module = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.Linear(12, 3))
    reference = copy.deepcopy(module)
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True))
    config = OptimizerConfig(lr=1e-2, weight_decay=0.5, decoupled_weight_decay=False, clip_grad=0.0,
                             use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(config, [model])
    groups = megatron_param_groups(list(reference.named_parameters()), config)
    torch_adam = torch.optim.Adam([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                                  lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    try:
        for it in range(3):
            gen = torch.Generator().manual_seed(it)
            x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
            model.zero_grad_buffer()
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            model.finish_grad_sync()
            assert optimizer.step()[0]
            torch_adam.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            torch_adam.step()
        for (name, a), b in zip(model.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6, msg=name)
    finally:
        optimizer.close()
        model.close()


@needs_mcore
def test_state_dict_keys_loss_scale_and_reload_as_megatrons(ranks, megatron_state):
    """What Megatron-LM calls around its loop: the model's state dict keyed as megatron-core's DDP keys
    it (the module's own keys: a dict saved from a Megatron run loads strictly), the optimizer's
    get_loss_scale and scale_loss (1, no grad scaler), and reload_model_params."""
    from megatron_on_cpu import megatron_on_cpu

    rank, _ = ranks
    with megatron_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, theirs, their_optimizer = megatron_loop(_megatron_api(), megatron_state, rank)
        their_state = {k: v.detach().clone() for k, v in theirs.state_dict().items()}
        their_scale = their_optimizer.get_loss_scale().cpu()
    _, _, model, optimizer = megatron_loop(_mxddp_api(), megatron_state, rank)
    try:
        assert list(model.state_dict()) == list(their_state)
        model.load_state_dict(their_state)  # strict
        for name, p in model.module.named_parameters():
            assert torch.equal(p.detach(), their_state[name]), name
        assert torch.equal(optimizer.get_loss_scale(), their_scale)
        loss = torch.tensor(2.5)
        assert torch.equal(optimizer.scale_loss(loss), their_scale * loss)
        # torch DDP's keys load too (every key module.<name>), and a mix of the two is torch's error.
        model.load_state_dict({"module." + k: v for k, v in their_state.items()})
        mixed = {("module." + k if i % 2 else k): v for i, (k, v) in enumerate(their_state.items())}
        with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"module\."):
            model.load_state_dict(mixed)
        optimizer.reload_model_params()
    finally:
        optimizer.close()
        model.close()


def test_disable_and_enable_forward_pre_hook(ranks):
    """Megatron-LM turns the param-gather hooks off around evaluation and saves: the pending gathers
    finish (param_sync), a forward while they are off reads current params even after a step, and
    they turn back on. Misuse is refused as Megatron asserts."""
    rank, _ = ranks
    torch.manual_seed(4)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    config = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                               overlap_param_gather=True, bucket_size=200)
    model = mxt.DistributedDataParallel(module, config)
    optimizer = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))

    def step():
        optimizer.zero_grad()
        model(x).square().mean().backward()
        model.finish_grad_sync()
        assert optimizer.step()[0]

    try:
        step()
        assert model._cpp.param_sync_pending
        model.disable_forward_pre_hook()
        assert not model._cpp.param_sync_pending
        with pytest.raises(RuntimeError, match="disabled already"):
            model.disable_forward_pre_hook()
        step()  # a step with the hooks off: its forward finishes the gathers itself

        assert model._cpp.param_sync_pending
        with torch.no_grad():
            evaluated = model(x)
        assert not model._cpp.param_sync_pending
        model.enable_forward_pre_hook()
        with pytest.raises(RuntimeError, match="enabled already"):
            model.enable_forward_pre_hook()
        with torch.no_grad():
            assert torch.equal(model(x), evaluated)
        step()
        model.disable_forward_pre_hook(param_sync=False)
        assert model._cpp.param_sync_pending
        model.enable_forward_pre_hook()
    finally:
        optimizer.close()
        model.close()
    plain = mxt.DistributedDataParallel(torch.nn.Linear(4, 4), mxt.DistributedDataParallelConfig(
        use_distributed_optimizer=True))
    try:
        with pytest.raises(RuntimeError, match="with use_distributed_optimizer=True and overlap_param_gather=True"):
            plain.disable_forward_pre_hook()
    finally:
        plain.close()
