"""mxddp.torch.plan: the planner's bytes per rank per category equal the tracker's after a step, to
the byte (an MLP and an HF GPT2LMHeadModel; F32 and BF16; DDP alone and with the distributed
optimizer; several bucket sizes); a plan for 64 ranks of a meta-device module runs without ranks;
bad input is refused naming the value. FSDP (use_megatron_fsdp), plans only: every strategy of a
block MLP and an HF GPT2 on the meta device at world 2, 4 and 8 keeps exactly 1/world of what it
shards, only optim_grads_params gathers, the fine-grained gather gathers less and the policies
decide it as Megatron's do; bad FSDP input is refused naming the value. And the FSDP plan equals
what FullyShardedDataParallel and its optimizer hold after three iterations (every strategy,
overlap, 1-3 micro-batches, fine-grained, MXFP8 weights), per category and per gather slot."""
import gc
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

import mxddp.torch as mxt
from mxddp import _C


class Mlp(torch.nn.Module):
    """Two trainable layers around a frozen one (kept out of the buffers)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(24, 96)
        self.frozen = torch.nn.Linear(96, 96)
        self.frozen.requires_grad_(False)
        self.fc2 = torch.nn.Linear(96, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.frozen(torch.relu(self.fc1(x)))))


def gpt2_config():
    return transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)


def gpt2():
    return transformers.GPT2LMHeadModel(gpt2_config())


def mlp_loss(model, rank):
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(rank))
    return model(x.to(model.param_dtype)).float().square().mean()


def gpt2_loss(model, rank):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    return model(input_ids=ids, labels=ids).loss.float()


def ddp_config(**kw):
    return mxt.DistributedDataParallelConfig(**kw)


ADAM = mxt.OptimizerConfig(lr=1e-3)
SGD = mxt.OptimizerConfig(optimizer="sgd", lr=1e-2)

# (id, model, loss, dtype, DDP config, optimizer config or None for the DDP alone)
CASES = [
    ("mlp-ddp-one-bucket", Mlp, mlp_loss, torch.float32, ddp_config(), None),
    ("mlp-ddp-overlap-2000", Mlp, mlp_loss, torch.float32, ddp_config(overlap_grad_reduce=True, bucket_size=2000), None),
    ("mlp-distopt-adam-overlap-2000", Mlp, mlp_loss, torch.float32,
     ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=2000), ADAM),
    ("mlp-distopt-sgd-one-bucket", Mlp, mlp_loss, torch.float32, ddp_config(use_distributed_optimizer=True), SGD),
    ("mlp-distopt-force-all-reduce", Mlp, mlp_loss, torch.float32,
     ddp_config(use_distributed_optimizer=True, force_all_reduce=True, overlap_grad_reduce=True, bucket_size=700), ADAM),
    ("mlp-distopt-busbw-padding-groups", Mlp, mlp_loss, torch.float32,
     ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=1000,
                pad_buckets_for_high_nccl_busbw=True, buckets_per_group=2), ADAM),
    ("mlp-bf16-distopt-f32-grads", Mlp, mlp_loss, torch.bfloat16,
     ddp_config(use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=2000),
     ADAM),
    ("mlp-bf16-distopt-bf16-grads", Mlp, mlp_loss, torch.bfloat16,
     ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=2000), ADAM),
    ("mlp-bf16-ddp-bf16-grads", Mlp, mlp_loss, torch.bfloat16, ddp_config(overlap_grad_reduce=True, bucket_size=3000),
     None),
    ("gpt2-distopt-adam-5000", gpt2, gpt2_loss, torch.float32,
     ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=5000), ADAM),
    ("gpt2-distopt-one-bucket", gpt2, gpt2_loss, torch.float32, ddp_config(use_distributed_optimizer=True), ADAM),
    ("gpt2-ddp-overlap-20000", gpt2, gpt2_loss, torch.float32, ddp_config(overlap_grad_reduce=True, bucket_size=20000),
     None),
    ("gpt2-bf16-distopt", gpt2, gpt2_loss, torch.bfloat16,
     ddp_config(use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=8000),
     ADAM),
]


def live_bytes():
    return {k: v[0] for k, v in mxt.memory_usage().items()}


@pytest.mark.parametrize("name,make,loss_fn,dtype,cfg,opt_cfg", CASES, ids=[c[0] for c in CASES])
def test_plan_equals_the_tracker_after_a_step(ranks, name, make, loss_fn, dtype, cfg, opt_cfg):
    rank, world = ranks
    gc.collect()
    # Nothing of mxddp's is open (the last close frees the comm staging too), so the tracker's
    # figures are this model's alone.
    assert set(live_bytes().values()) == {0}, live_bytes()
    torch.manual_seed(0)
    module = make().to(dtype)
    planned = mxt.plan(module, world, cfg, opt_cfg)
    _C.reset_memory_peaks()
    model = mxt.DistributedDataParallel(module, cfg)
    opt = mxt.DistributedOptimizer(model, opt_cfg) if opt_cfg is not None else None
    try:
        for _ in range(2):
            (opt.zero_grad if opt else model.zero_grad_buffer)()
            loss_fn(model, rank).backward()
            model.finish_grad_sync()
            if opt:
                ok, _, _ = opt.step()
                assert ok
        usage = mxt.memory_usage()
        assert usage == planned.memory_usage(), (usage, planned)
        # The figures are the buffers' and shards' (not a tautology of the tracker against itself).
        n = model._cpp.numel
        assert planned.buffer_numel == n and planned.num_buckets == model.num_buckets
        grad_bytes = 4 if cfg.grad_reduce_in_fp32 or dtype == torch.float32 else 2
        assert planned.live_bytes["params"] == n * model.param_buffer().element_size()
        assert planned.live_bytes["grads"] == n * grad_bytes
        states = 0 if opt_cfg is None else (2 if opt_cfg.optimizer == "adam" else 1)
        # Megatron's rule: an f32 param shard is its own main param; bf16 params get an f32 copy.
        main_bytes = 0 if opt_cfg is None or dtype == torch.float32 else 4 * n // world
        assert planned.live_bytes["main_params"] == main_bytes
        assert planned.live_bytes["optimizer_state"] == states * 4 * n // world
        assert planned.params_numel == sum(p.numel() for _, p in model.registered_params())
        assert planned.total_peak_bytes == sum(planned.peak_bytes.values())  # nothing transient
    finally:
        if opt:
            opt.close()
        model.close()
    assert set(live_bytes().values()) == {0}, live_bytes()


MXFP8_CASES = [
    ("mlp-mxfp8", ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=2000,
                             fp8_param_gather=True)),
    ("mlp-mxfp8-reuse-overlap-gather", ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                  bucket_size=2000, fp8_param_gather=True, overlap_param_gather=True,
                                                  reuse_grad_buf_for_mxfp8_param_ag=True)),
    ("gpt2-conv1d-mxfp8-reuse", ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=20000,
                                           fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True)),
]


@pytest.mark.parametrize("name,cfg", MXFP8_CASES, ids=[c[0] for c in MXFP8_CASES])
def test_plan_of_mxfp8_linear_weights_equals_the_tracker(ranks, name, cfg):
    """The plan marks as MXFP8 exactly the params the DDP keeps as MXFP8 (its own rule: nn.Linear
    weights, and HF GPT-2's Conv1D ones), so the mxfp8 and params categories agree with the tracker
    too."""
    rank, world = ranks
    gc.collect()
    assert set(live_bytes().values()) == {0}, live_bytes()
    torch.manual_seed(0)
    module = (gpt2() if name.startswith("gpt2") else Mlp()).to(torch.bfloat16)
    loss_fn = gpt2_loss if name.startswith("gpt2") else mlp_loss
    planned = mxt.plan(module, world, cfg, ADAM)
    assert planned.live_bytes["mxfp8"] > 0, planned
    _C.reset_memory_peaks()
    model = mxt.DistributedDataParallel(module, cfg)
    opt = mxt.DistributedOptimizer(model, ADAM)
    try:
        for _ in range(2):
            opt.zero_grad()
            loss_fn(model, rank).backward()
            model.finish_grad_sync()
            ok, _, _ = opt.step()
            assert ok
        assert mxt.memory_usage() == planned.memory_usage(), (mxt.memory_usage(), planned)
    finally:
        opt.close()
        model.close()
    assert set(live_bytes().values()) == {0}, live_bytes()


def test_plan_counts_a_tied_param_once_and_leaves_frozen_ones_out(ranks):
    _, world = ranks
    module = gpt2()
    assert module.lm_head.weight is module.transformer.wte.weight
    planned = mxt.plan(module, world, ddp_config(use_distributed_optimizer=True), ADAM)
    assert planned.params_numel == sum(p.numel() for p in module.parameters())  # wte once
    mlp = Mlp()
    frozen = sum(p.numel() for p in mlp.frozen.parameters())
    assert mxt.plan(mlp, world).params_numel == sum(p.numel() for p in mlp.parameters()) - frozen


def _plain_python(code):
    """A child Python outside mpirun (the launcher's variables removed), which never calls init()."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_"))}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_plan_for_64_ranks_of_a_meta_module_runs_without_ranks(ranks):
    out = _plain_python(
        "import json, torch, transformers, mxddp.torch as mxt\n"
        "cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=48, n_layer=2, n_head=4)\n"
        "with torch.device('meta'):\n"
        "    module = transformers.GPT2LMHeadModel(cfg)\n"
        "p = mxt.plan(module, 64, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, "
        "overlap_grad_reduce=True, bucket_size=5000), mxt.OptimizerConfig(lr=1e-3))\n"
        "print(json.dumps({'initialized': mxt.is_initialized(), 'usage': p.memory_usage(), 'buckets': p.buckets}))\n")
    child = json.loads(out.strip().splitlines()[-1])
    assert child["initialized"] is False
    # The same model built on the CPU plans the same bytes (the meta device changes nothing).
    planned = mxt.plan(gpt2(), 64, ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                              bucket_size=5000), ADAM)
    assert {k: list(v) for k, v in planned.memory_usage().items()} == child["usage"]
    # At 64 ranks each bucket ends on a multiple of lcm(64, 128) = 128 elements; each rank keeps a
    # 64th of every bucket as two Adam moments, its f32 param shard being its main params; the f32
    # reduce-scatters run in place, with no MPI staging.
    n = planned.buffer_numel
    assert all(numel % 128 == 0 for numel, _ in planned.buckets) and sum(b for b, _ in planned.buckets) == n
    assert planned.live_bytes["params"] == planned.live_bytes["grads"] == 4 * n
    assert planned.live_bytes["main_params"] == 0
    assert planned.live_bytes["optimizer_state"] == 8 * n // 64
    assert planned.live_bytes["comm"] == 0


def test_plan_refuses_bad_input_naming_the_value(ranks):
    module = Mlp()
    for world in (0, -1):
        with pytest.raises(ValueError, match=f"world={world} is not valid"):
            mxt.plan(module, world)
    with pytest.raises(ValueError, match="world=1048577 is not valid"):
        mxt.plan(module, (1 << 20) + 1)
    for world in (2.0, "2", True, None):
        with pytest.raises(TypeError, match="world must be an int"):
            mxt.plan(module, world)
    with pytest.raises(TypeError, match="plan takes a torch.nn.Module; got dict"):
        mxt.plan({"w": torch.zeros(2)}, 2)
    with pytest.raises(TypeError, match="cfg must be a mxddp.torch.DistributedDataParallelConfig; got dict"):
        mxt.plan(module, 2, {"use_distributed_optimizer": True})
    with pytest.raises(TypeError, match="opt_cfg must be a mxddp.torch.OptimizerConfig or None; got str"):
        mxt.plan(module, 2, ddp_config(use_distributed_optimizer=True), "adam")
    # Without use_distributed_optimizer the optimizer is replicated: every rank holds the whole state.
    replicated, sharded = mxt.plan(module, 2, ddp_config(), ADAM), mxt.plan(module, 2, ddp_config(
        use_distributed_optimizer=True), ADAM)
    assert replicated.live_bytes["optimizer_state"] == 2 * 4 * replicated.buffer_numel
    assert sharded.live_bytes["optimizer_state"] == 2 * 4 * sharded.buffer_numel // 2
    frozen = Mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        mxt.plan(frozen, 2)
    with torch.device("meta"):
        f64 = torch.nn.Linear(4, 4).double()
    with pytest.raises(TypeError, match="param 'weight' has dtype torch.float64"):
        mxt.plan(f64, 2)
    with pytest.raises(TypeError, match="param 'weight' has dtype torch.float64"):
        mxt.plan(torch.nn.Linear(4, 4).double(), 2)


# ---- FSDP (cfg.use_megatron_fsdp): plans only; the plan-vs-measured test comes with the FSDP ----

class Block(torch.nn.Module):
    """A unit: a Linear and a LayerNorm."""

    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x)))


class BlockMlp(torch.nn.Module):
    """Non-unit modules first and last around three Block units."""

    def __init__(self, width=40):
        super().__init__()
        self.inp = torch.nn.Linear(24, width)
        self.blocks = torch.nn.Sequential(*[Block(width) for _ in range(3)])
        self.out = torch.nn.Linear(width, 10)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def fsdp_config(**kw):
    return mxt.DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True, **kw)


STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def gpt2_block():
    return transformers.models.gpt2.modeling_gpt2.GPT2Block


def fsdp_plans(make, unit_modules, world, dtype=torch.float32, opt=ADAM, micro_batches=1, **kw):
    """{strategy: plan} of a module built by make() on the meta device."""
    with torch.device("meta"):
        module = make().to(dtype)
    return {s: mxt.plan(module, world, fsdp_config(data_parallel_sharding_strategy=s, **kw), opt,
                        fsdp_unit_modules=unit_modules, micro_batches=micro_batches) for s in STRATEGIES}


FSDP_MODELS = [("mlp", BlockMlp, lambda: [Block]), ("gpt2", gpt2, lambda: [gpt2_block()])]


@pytest.mark.parametrize("name,make,units", FSDP_MODELS, ids=[m[0] for m in FSDP_MODELS])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_fsdp_plans_of_every_strategy_relate_as_their_sharding(name, make, units, world, overlap, micro_batches):
    """Each strategy keeps 1/world of what it shards: params (optim_grads_params), grads
    (optim_grads, optim_grads_params), main params and optimizer state (all but no_shard), exactly,
    since every bucket divides into world equal shards; only optim_grads_params gathers, and the
    sharded-grad strategies hold a unit's unsharded grads while it reduces."""
    plans = fsdp_plans(make, units(), world, overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                       micro_batches=micro_batches)
    full, optim, grads, params = (plans[s] for s in STRATEGIES)
    with torch.device("meta"):
        module = make()
    numel = sum(p.numel() for p in module.parameters())  # a tied param once
    for s, p in plans.items():
        assert p.strategy == s and p.world == world and p.params_numel == numel
        assert p.buffer_numel == full.buffer_numel and p.num_units == (3 if name == "mlp" else 2)
        assert p.live_bytes["scratch"] == 0
    n = full.buffer_numel
    # f32 params and grads (grad_reduce_in_fp32 default False: the param dtype), Adam's two moments.
    assert full.live_bytes["params"] == optim.live_bytes["params"] == grads.live_bytes["params"] == 4 * n
    assert params.live_bytes["params"] == 4 * n // world
    assert full.live_bytes["grads"] == optim.live_bytes["grads"] == 4 * n
    assert grads.live_bytes["grads"] == params.live_bytes["grads"] == 4 * n // world
    # f32 param shards are their own main params (Megatron's rule): no main_params anywhere.
    assert all(p.live_bytes["main_params"] == 0 for p in plans.values())
    assert full.live_bytes["optimizer_state"] == 8 * n
    for p in (optim, grads, params):
        assert p.live_bytes["optimizer_state"] == 8 * n // world
    # Gathers: optim_grads_params only, of at most the whole buffer; nothing stays gathered.
    assert params.peak_gathered_bytes["values"] > 0 and params.peak_bytes["gathered"] > 0
    assert params.peak_gathered_bytes["values"] <= 4 * n and params.live_bytes["gathered"] == 0
    assert all(v == 0 for p in (full, optim, grads) for v in p.peak_gathered_bytes.values())
    # The sharded-grad strategies' transient unsharded grads: at least the largest unit's, then freed.
    for p in (grads, params):
        assert p.peak_bytes["grads"] >= p.live_bytes["grads"] + 4 * p.largest_unit_numel
    # The mpi backend stages no f32 reduction (the reduce-scatters run in MPI's in-place form).
    assert all(p.live_bytes["comm"] == 0 for p in plans.values())
    # ZeRO-3's bytes at rest: every category sharded, 16 bytes per element (f32 params that are
    # also the main params, grads, two moments) / world.
    assert params.total_live_bytes == 16 * n // world
    # Never above no_shard's; at world 2 a model of two units can gather all its values and hold all
    # its unsharded grads at once, which adds back exactly what sharding saved.
    assert params.total_peak_bytes <= full.total_peak_bytes
    if world > 2:
        assert params.total_peak_bytes < full.total_peak_bytes


def test_fsdp_plan_of_a_meta_module_equals_the_cpu_ones():
    with torch.device("meta"):
        meta = gpt2()
    cfg = fsdp_config(data_parallel_sharding_strategy="optim_grads_params", overlap_param_gather=True)
    a = mxt.plan(meta, 4, cfg, ADAM, fsdp_unit_modules=[gpt2_block()], micro_batches=3)
    b = mxt.plan(gpt2(), 4, cfg, ADAM, fsdp_unit_modules=[gpt2_block()], micro_batches=3)
    assert a == b


def test_fsdp_fine_grained_gathers_less_and_policies_decide_it():
    """With the fine-grained gather each Linear and LayerNorm of a block is a unit: more units, a
    smaller largest unit, less gathered at once. The 'megatron' policy turns it on for MXFP8
    params; 'recompute-aware' leaves it to the flag."""
    with torch.device("meta"):
        module = BlockMlp().to(torch.bfloat16)

    def at(**kw):
        return mxt.plan(module, 4, fsdp_config(data_parallel_sharding_strategy="optim_grads_params", **kw), ADAM,
                        fsdp_unit_modules=[Block])

    coarse, fine = at(), at(megatron_fsdp_enable_fine_grained_param_gather=True)
    assert (coarse.num_units, fine.num_units) == (3, 6)
    assert fine.largest_unit_numel < coarse.largest_unit_numel
    assert fine.peak_gathered_bytes["values"] < coarse.peak_gathered_bytes["values"]
    # MXFP8 weights (the blocks' Linear weights; the non-unit Linears stay BF16, as the FSDP keeps
    # them): row- and column-wise gathers.
    mx = at(fp8_param_gather=True)
    assert mx.live_bytes["mxfp8"] > 0 and mx.peak_gathered_bytes["rowwise"] > 0 and mx.peak_gathered_bytes["colwise"] > 0
    assert mx.num_units == 3, "recompute-aware: the flag decides, and it is None"
    mx_megatron = at(fp8_param_gather=True, fine_grained_param_gather_policy="megatron")
    # Each block's one MXFP8 weight is a bucket of its own either way; its bias and norm are gathered apart.
    assert mx_megatron.num_units == 6 and mx_megatron.peak_gathered_bytes["values"] < mx.peak_gathered_bytes["values"]
    with pytest.raises(ValueError, match="the megatron policy requires the fine-grained param gather"):
        at(fp8_param_gather=True, fine_grained_param_gather_policy="megatron",
           megatron_fsdp_enable_fine_grained_param_gather=False)


def test_fsdp_plan_of_gpt2_keeps_the_tied_embedding_a_non_unit_param():
    with torch.device("meta"):
        module = gpt2()
    p = mxt.plan(module, 2, fsdp_config(data_parallel_sharding_strategy="optim_grads_params"), ADAM,
                 fsdp_unit_modules=[gpt2_block()])
    assert p.params_numel == sum(q.numel() for q in module.parameters())
    # A bucket holds consecutive params of one unit, or non-unit ones: the two blocks', and the
    # non-unit params on either side of them (wte, read by the embedding and the head, with wpe; ln_f).
    assert p.num_units == 2 and p.num_buckets == 4
    no_opt = mxt.plan(module, 2, fsdp_config(data_parallel_sharding_strategy="optim_grads_params"), None,
                      fsdp_unit_modules=[gpt2_block()])
    assert no_opt.live_bytes["main_params"] == no_opt.live_bytes["optimizer_state"] == 0
    assert no_opt.live_bytes["params"] == p.live_bytes["params"]
    s = str(p)
    assert "FSDP optim_grads_params, 2 unit(s)" in s and "gathered values" in s


def test_fsdp_plan_refuses_bad_input_naming_the_value():
    module = BlockMlp()
    assert mxt.plan(module, 2, fsdp_config(), ADAM).num_units == 1  # None: the whole module is one unit
    with pytest.raises(ValueError, match="data_parallel_sharding_strategy='full' is not valid"):
        mxt.plan(module, 2, fsdp_config(data_parallel_sharding_strategy="full"), ADAM, fsdp_unit_modules=[Block])
    with pytest.raises(ValueError, match=r"suggested_communication_unit_size must be None or an int in \[1, "):
        mxt.plan(module, 2, fsdp_config(suggested_communication_unit_size=0), ADAM, fsdp_unit_modules=[Block])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="micro_batches="):
            mxt.plan(module, 2, fsdp_config(), ADAM, fsdp_unit_modules=[Block], micro_batches=bad)
    with pytest.raises(ValueError, match="fsdp_unit_modules is given but cfg.use_megatron_fsdp is False"):
        mxt.plan(module, 2, ddp_config(), None, fsdp_unit_modules=[Block])
    with pytest.raises(ValueError, match="fine_grained_param_gather_policy='eager' is not valid"):
        mxt.plan(module, 2, fsdp_config(fine_grained_param_gather_policy="eager"), ADAM, fsdp_unit_modules=[Block])
    with pytest.raises(TypeError, match="not a torch.nn.Module subclass"):
        mxt.plan(module, 2, fsdp_config(), ADAM, fsdp_unit_modules=["Block"])
    with pytest.raises(TypeError, match="checkpointed_modules holds 'Block', which is not a torch.nn.Module subclass"):
        mxt.plan(module, 2, fsdp_config(), ADAM, fsdp_unit_modules=[Block], checkpointed_modules=["Block"])
    with pytest.raises(TypeError, match="checkpointed_modules must be a list of torch.nn.Module classes"):
        mxt.plan(module, 2, ddp_config(), None, checkpointed_modules=Block)
    # Fine-grained units of two checkpointed Blocks called interleaved: no re-run of a whole Block
    # could give that order.
    fine = fsdp_config(megatron_fsdp_enable_fine_grained_param_gather=True)
    order = ["blocks.0.fc", "blocks.1.fc", "blocks.0.norm", "blocks.1.norm", "blocks.2.fc", "blocks.2.norm"]
    with pytest.raises(ValueError, match="checkpointed module 'blocks.0' holds modules the forward does not call one "
                                         "after another \\('blocks.0.norm' comes after 'blocks.1.fc'"):
        mxt.plan(module, 2, fine, ADAM, fsdp_unit_modules=[Block], forward_order=order, checkpointed_modules=[Block])
    bf16 = BlockMlp().to(torch.bfloat16)
    bf16.inp.weight.mxfp8 = True
    with pytest.raises(ValueError, match="param 'inp.weight' is marked mxfp8=True but is in no FSDP unit"):
        mxt.plan(bf16, 2, fsdp_config(fp8_param_gather=True, data_parallel_sharding_strategy="optim_grads_params"),
                 ADAM, fsdp_unit_modules=[Block])


def test_fsdp_plan_with_recompute_regathers_a_fine_grained_layer_for_its_backward():
    """checkpointed_modules: a unit per Block re-gathers only what its backward gathers anyway (the
    plan without recompute); fine-grained units of a Block are all gathered again by its re-run and
    held to their backwards, so at once: the Block's fc and norm (the FSDP run of each is
    test_fsdp.py's matrix)."""
    module = BlockMlp()
    for overlap in (False, True):
        cfg = fsdp_config(data_parallel_sharding_strategy="optim_grads_params", overlap_param_gather=overlap,
                          overlap_grad_reduce=overlap)
        coarse = mxt.plan(module, 2, cfg, ADAM, fsdp_unit_modules=[Block])
        assert mxt.plan(module, 2, cfg, ADAM, fsdp_unit_modules=[Block], checkpointed_modules=[Block]) == coarse
        cfg = fsdp_config(data_parallel_sharding_strategy="optim_grads_params", overlap_param_gather=overlap,
                          overlap_grad_reduce=overlap, megatron_fsdp_enable_fine_grained_param_gather=True)
        fine = mxt.plan(module, 2, cfg, ADAM, fsdp_unit_modules=[Block])
        fine_rc = mxt.plan(module, 2, cfg, ADAM, fsdp_unit_modules=[Block], checkpointed_modules=[Block])
        assert fine.peak_gathered_bytes["values"] <= fine_rc.peak_gathered_bytes["values"] \
            <= coarse.peak_gathered_bytes["values"], (overlap, fine, fine_rc, coarse)
        assert fine_rc.live_bytes == fine.live_bytes  # the same shards; only the transients move
        if not overlap:  # (with overlap the backward's prefetch holds the next unit anyway: equal here)
            # One Block at once, as a unit per Block gathers it, where fine-grained alone holds a unit.
            assert fine.peak_gathered_bytes["values"] < fine_rc.peak_gathered_bytes["values"] \
                == coarse.peak_gathered_bytes["values"]


def block_mlp_loss(model, rank, dtype):
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(rank)).to(dtype)
    return model(x).float().square().mean()


def gpt2_fsdp_loss(model, rank, dtype):
    return gpt2_loss(model, rank)


# (id, model, loss, strategy, overlap, micro-batches, fine-grained, MXFP8 weights, other config fields)
FSDP_RUN_CASES = [(f"{m}-{s}-{'overlap-mb3' if ov else 'serial-mb1'}", m, s, ov, 3 if ov else 1, False, False, {})
                  for m in ("mlp", "gpt2") for s in STRATEGIES for ov in (False, True)] + [
    ("gpt2-optim_grads_params-fine-mb3", "gpt2", "optim_grads_params", True, 3, True, False, {}),
    ("mlp-mxfp8-overlap-mb3", "mlp", "optim_grads_params", True, 3, False, True, {}),
    ("mlp-mxfp8-fine-serial-mb2", "mlp", "optim_grads_params", False, 2, True, True, {}),
    # HF GPT-2's Conv1D weights: MXFP8 with the column-wise copy gathered for forward.
    ("gpt2-mxfp8-overlap-mb3", "gpt2", "optim_grads_params", True, 3, False, True, {}),
    # The prefetch's budget: a small communication unit gathers less ahead than the default; with a
    # large one, the double buffer holds two units at most.
    ("mlp-small-comm-unit-overlap-mb3", "mlp", "optim_grads_params", True, 3, False, False,
     {"suggested_communication_unit_size": 1000}),
    ("mlp-double-buffer-overlap-mb3", "mlp", "optim_grads_params", True, 3, False, False,
     {"suggested_communication_unit_size": 100_000, "fsdp_double_buffer": True}),
    # Gradient accumulation fusion off (the wrapper's argument; on everywhere else): the tied
    # embedding's gradient comes through the hook and is held back with the other non-unit ones.
    ("gpt2-no-fusion-overlap-mb3", "gpt2", "optim_grads_params", True, 3, False, False,
     {"gradient_accumulation_fusion": False}),
]


@pytest.mark.parametrize("name,model_name,strategy,overlap,micro_batches,fine,mx,extra", FSDP_RUN_CASES,
                         ids=[c[0] for c in FSDP_RUN_CASES])
def test_fsdp_plan_equals_the_tracker_after_iterations(ranks, name, model_name, strategy, overlap, micro_batches,
                                                       fine, mx, extra):
    """The FSDP plan is what FullyShardedDataParallel and its optimizer hold after three iterations of
    micro_batches micro-batches (the first ones under no_sync), per category, live and peak, and the
    most it gathered at once per slot, to the byte. The other fields (extra) change what is gathered
    at once (fusion: the grads), or their case would show nothing."""
    rank, world = ranks
    gc.collect()
    assert set(live_bytes().values()) == {0}, live_bytes()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if mx else torch.float32
    module = (BlockMlp() if model_name == "mlp" else gpt2()).to(dtype)
    units = [Block] if model_name == "mlp" else [gpt2_block()]
    loss_fn = block_mlp_loss if model_name == "mlp" else gpt2_fsdp_loss
    fields = dict(data_parallel_sharding_strategy=strategy, overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                  megatron_fsdp_enable_fine_grained_param_gather=fine or None, fp8_param_gather=mx)
    extra = dict(extra)
    fusion = extra.pop("gradient_accumulation_fusion", True)
    cfg = fsdp_config(**fields, **extra)
    planned = mxt.plan(module, world, cfg, ADAM, fsdp_unit_modules=units, micro_batches=micro_batches,
                       gradient_accumulation_fusion=fusion)
    if not fusion:
        fused = mxt.plan(module, world, cfg, ADAM, fsdp_unit_modules=units, micro_batches=micro_batches)
        # One rank keeps no unsharded grads beside the shard (FsdpStoragePlan::grads_in_shard).
        assert (planned.total_peak_bytes != fused.total_peak_bytes) == (world > 1), (planned, fused)
    if extra:
        # The same config without the field the case is about: the double buffer against its large
        # budget alone, a communication unit against the default one.
        base = {k: v for k, v in extra.items() if k != "fsdp_double_buffer"} if "fsdp_double_buffer" in extra else {}
        baseline = mxt.plan(module, world, fsdp_config(**fields, **base), ADAM, fsdp_unit_modules=units,
                            micro_batches=micro_batches)
        if world > 1:
            assert planned.peak_gathered_bytes["values"] < baseline.peak_gathered_bytes["values"], (planned, baseline)
        else:  # a gather is the shard in place
            assert planned.peak_gathered_bytes["values"] == baseline.peak_gathered_bytes["values"] == 0, planned
    _C.reset_memory_peaks()
    model = mxt.FullyShardedDataParallel(module, cfg, units, gradient_accumulation_fusion=fusion)
    opt = mxt.DistributedOptimizer(model, ADAM)
    try:
        assert model.num_units == planned.num_units
        for _ in range(3):
            opt.zero_grad()
            for m in range(micro_batches):
                if m + 1 < micro_batches:
                    with model.no_sync():
                        loss_fn(model, rank, dtype).backward()
                else:
                    loss_fn(model, rank, dtype).backward()
            model.finish_grad_sync()
            ok, _, _ = opt.step()
            assert ok
        assert mxt.memory_usage() == planned.memory_usage(), (mxt.memory_usage(), planned)
        assert model.peak_gathered_bytes() == planned.peak_gathered_bytes
    finally:
        opt.close()
        model.close()
    assert set(live_bytes().values()) == {0}, live_bytes()


DATA_PARALLEL_CATEGORIES = ("params", "grads", "main_params", "optimizer_state", "mxfp8", "gathered")


@pytest.mark.parametrize("cfg", [ddp_config(use_distributed_optimizer=True, bucket_size=3000),
                                 fsdp_config(data_parallel_sharding_strategy="optim_grads_params")],
                         ids=["ddp", "fsdp"])
def test_a_plan_on_a_gpu_puts_the_data_parallel_state_on_the_device(cfg):
    with torch.device("meta"):
        module = gpt2()
    units = [gpt2_block()] if cfg.use_megatron_fsdp else None
    host = mxt.plan(module, 4, cfg, ADAM, fsdp_unit_modules=units)
    gpu = mxt.plan(module, 4, cfg, ADAM, fsdp_unit_modules=units, device="cuda")
    assert (host.device, gpu.device) == ("cpu", "cuda")
    on_device, left_on_host = gpu.memory_usage("device"), gpu.memory_usage("host")
    for category in DATA_PARALLEL_CATEGORIES:
        assert on_device[category] == host.memory_usage()[category], category
        assert left_on_host[category] == (0, 0), category
    assert host.memory_usage("device") == {k: (0, 0) for k in host.live_bytes}, "a CPU plan holds nothing on a device"
    # The mpi backend's gradient staging is the host plan's; NCCL (a GPU per rank) has none. The rest
    # is the same bytes in another place.
    assert gpu.live_bytes["comm"] == 0 and gpu.peak_bytes["comm"] == 0
    assert {k: v for k, v in gpu.live_bytes.items() if k != "comm"} == \
        {k: v for k, v in host.live_bytes.items() if k != "comm"}
    assert gpu.total_live_bytes == host.total_live_bytes - host.live_bytes["comm"]
    with pytest.raises(ValueError, match="device='tpu' is not valid; valid: 'cpu', 'cuda'"):
        mxt.plan(module, 4, cfg, ADAM, fsdp_unit_modules=units, device="tpu")
    with pytest.raises(ValueError, match="place='gpu' is not valid; valid: None, 'host', 'device'"):
        gpu.memory_usage("gpu")
