"""mxddp.torch.FullyShardedDataParallel against PyTorch DDP + AdamW, and its gathers.

Parity: an HF GPT2LMHeadModel (units: GPT2Block; the tied embedding, wpe and ln_f non-unit) and a
plain MLP (units: its Block class; a LayerNorm and the head after them, non-unit), every sharding
strategy x overlap (grad reduce and param gather) on/off x micro-batches 1 and 3 x fine-grained
gather on/off x recompute (torch.utils.checkpoint around each unit, non-reentrant) on/off, at the
dp of the launch (CTest runs 2 and 4, and a subset under injected collective delays): every
step's loss within 1e-5 (relative, F32) of the reference's, the trained params alike, every gather
released after each step and nothing left gathered.
"""
import copy
import gc
import os
import time

import pytest
import torch
import torch.utils.checkpoint

import mxddp
import mxddp.torch as mxt
from micro_batches import backward_micro_batches
from test_mxfp8 import quantize
from test_parity import (BETAS, CLIP, EPS, LR, WD, gpt2_batch, gpt2_loss, make_gpt2, make_llama, mlp_batch, mlp_loss,
                         reference_optimizer)

STEPS = 4
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class Block(torch.nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.fc = torch.nn.Linear(n_in, n_out)
        self.act = torch.nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


class Mlp(torch.nn.Module):
    """Units: the Blocks. recompute: True (or "reentrant": torch's other form) re-runs each Block's
    forward in backward."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(32, 64), Block(64, 64), Block(64, 64)])
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 10)
        self.recompute = False
        self.skip_last_block = False  # it still runs, but takes no part in the output

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            # The reentrant form gives no gradient to a block whose input needs none (the first).
            reentrant = self.recompute == "reentrant"
            if self.recompute and not (reentrant and i == 0):
                y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
            else:
                y = block(x)
            x = x if self.skip_last_block and i == len(self.blocks) - 1 else y
        return self.head(self.norm(x))


def make_mlp():
    return Mlp()


def gpt2_block_class():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    return GPT2Block


def llama_block_class():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return LlamaDecoderLayer


def set_recompute(name, module, on):
    if name == "mlp":
        module.recompute = on
    elif on:
        # transformers after 5.17 (the GPU machine's) renamed gradient_checkpointing_enable, deprecating it.
        if hasattr(module, "activation_checkpointing_enable"):
            module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module.train()


MODELS = {"mlp": (make_mlp, mlp_batch, mlp_loss, lambda: [Block]),
          "gpt2": (make_gpt2, gpt2_batch, gpt2_loss, lambda: [gpt2_block_class()]),
          "llama": (make_llama, gpt2_batch, gpt2_loss, lambda: [llama_block_class()])}

_reference_cache = {}


def reference(name, rank, world, micro_batches):
    """Every step's loss and the trained params of torch DDP + AdamW (same clipping, Megatron's
    param groups), once per model and micro-batch count."""
    key = (name, world, micro_batches)
    if key not in _reference_cache:
        make, batch_fn, loss_fn, _ = MODELS[name]
        torch.manual_seed(0)
        module = make()
        initial = copy.deepcopy(module)
        ddp = torch.nn.parallel.DistributedDataParallel(module)
        opt = reference_optimizer(module)
        losses = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            losses.append(backward_micro_batches(ddp, loss_fn, batch_fn, rank, step, micro_batches))
            torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
            opt.step()
        _reference_cache[key] = (initial, losses, {n: p.detach().clone() for n, p in module.named_parameters()})
    return _reference_cache[key]


def fsdp_config(strategy, overlap, fine_grained, **kw):
    return mxt.DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=overlap, overlap_param_gather=overlap, grad_reduce_in_fp32=True,
        megatron_fsdp_enable_fine_grained_param_gather=True if fine_grained else None, **kw)


def optimizer(model):
    return mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=LR, weight_decay=WD, adam_beta1=BETAS[0],
                                                               adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=CLIP))


def train_steps(model, opt, loss_fn, batch_fn, rank, micro_batches):
    """STEPS iterations; each step succeeds and (FSDP) leaves nothing gathered. Returns the losses."""
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(backward_micro_batches(model, loss_fn, batch_fn, rank, step, micro_batches))
        model.finish_grad_sync()
        if isinstance(model, mxt.FullyShardedDataParallel):
            assert not model._cpp.anything_gathered, f"step {step}: a gather outlived finish_grad_sync"
        update_successful, grad_norm, _ = opt.step()
        assert update_successful and grad_norm > 0
    return losses


def train_fsdp(name, module, rank, micro_batches, config, fusion=True):
    _, batch_fn, loss_fn, units = MODELS[name]
    model = mxt.FullyShardedDataParallel(module, config, fsdp_unit_modules=units(),
                                         gradient_accumulation_fusion=fusion)
    # F32: every 2-D weight of a Linear, Conv1D or Embedding adds its dW into main_grad itself, or none.
    fusable = {n for n, p in module.named_parameters() if p.ndim == 2 and "norm" not in n and "ln_" not in n}
    assert {n for (n, _), f in zip(model.registered_params(), model.fused_params) if f} == (fusable if fusion else set())
    opt = optimizer(model)
    try:
        losses = train_steps(model, opt, loss_fn, batch_fn, rank, micro_batches)
        # Fused or not, no .grad outlives its hook; a fused weight never gets one.
        assert all(p.grad is None for p in module.parameters())
        gathered = (model._cpp.gathers_started, model._cpp.releases_done, model.peak_gathered_bytes(),
                    model.forward_order)
    finally:
        opt.close()
        model.close()
    return losses, gathered


CASES = [(name, strategy, overlap, micro_batches, fine_grained, recompute)
         for name in ("mlp", "gpt2") for strategy in STRATEGIES for overlap in (False, True)
         for micro_batches in (1, 3) for fine_grained in (False, True) for recompute in (False, True)] + [
    # HF Llama (grouped-query attention, RMSNorm, untied head), a unit per LlamaDecoderLayer: every
    # strategy overlapped over 3 micro-batches, and the fine-grained gather with and without recompute.
    *[("llama", strategy, True, 3, False, False) for strategy in STRATEGIES],
    ("llama", "optim_grads_params", True, 1, True, True),
    ("llama", "optim_grads_params", True, 3, True, False),
    ("llama", "optim_grads_params", False, 3, True, False)]


@pytest.mark.parametrize("name,strategy,overlap,micro_batches,fine_grained,recompute", CASES)
def test_losses_match_torch_ddp_adamw(ranks, name, strategy, overlap, micro_batches, fine_grained, recompute):
    rank, world = ranks
    initial, expected, trained = reference(name, rank, world, micro_batches)
    module = copy.deepcopy(initial)
    set_recompute(name, module, recompute)
    # The recompute runs: the first unit's forward runs again in each micro-batch's backward. (Its
    # first submodule with params counts the calls: HF re-runs a layer's forward without the
    # layer's own hooks, its submodules' run.)
    first_unit = next(m for m in module.modules() if isinstance(m, tuple(MODELS[name][3]())))
    counted = next(m for m in first_unit.modules()
                   if m is not first_unit and next(m.parameters(recurse=False), None) is not None)
    forward_calls = []
    counted.register_forward_pre_hook(lambda *_: forward_calls.append(None))
    config = fsdp_config(strategy, overlap, fine_grained)
    got, (gathers, releases, peak, forward_order) = train_fsdp(name, module, rank, micro_batches, config)
    assert len(forward_calls) == STEPS * micro_batches * (2 if recompute else 1), len(forward_calls)
    # Training moves the params, or matching them proves nothing.
    assert max((p - trained[n]).abs().max().item() for n, p in initial.named_parameters()) > 1e-3
    for step, (e, g) in enumerate(zip(expected, got)):
        assert abs(g - e) <= 1e-5 * abs(e), f"rank {rank} step {step}: mxddp {g!r}, torch {e!r}"
    # Every gather released; params gathered per unit only when the strategy shards them; and the
    # most gathered at once is what the memory plan says, to the byte, in the units' forward order
    # (for Llama's fine-grained units not the module tree's) and with the recompute's re-gathers
    # (the checkpointed layers are the unit classes here).
    assert gathers == releases
    units = MODELS[name][3]()
    planned = mxt.plan(copy.deepcopy(initial), world, config, None, fsdp_unit_modules=units,
                       micro_batches=micro_batches, forward_order=forward_order,
                       checkpointed_modules=units if recompute else None)
    assert peak == planned.peak_gathered_bytes, (peak, planned.peak_gathered_bytes)
    # On one rank a gather is the shard in place: the hooks gather, no bytes are gathered.
    assert (gathers > 0) == (strategy == "optim_grads_params") and (peak["values"] > 0) == (gathers > 0 and world > 1)
    for n, p in module.named_parameters():
        torch.testing.assert_close(p, trained[n], rtol=1e-4, atol=1e-4, msg=lambda m: f"param {n}: {m}")


def test_the_injected_delay_is_on_where_asked(ranks):
    """The injected-delay runs (CTest sets MXDDP_TEST_COLLECTIVE_DELAY_US=min,max) do delay: the
    world communicator injects that range (the C++ delay is tested on its own in
    fsdp_jitter_test), and 20 all-reduces take at least 20 min + 2 (max - min) us, which the sum of
    20 uniform draws misses with probability 4e-13 (Irwin-Hall). Without the variable, none."""
    delay = os.environ.get("MXDDP_TEST_COLLECTIVE_DELAY_US")
    if not delay:
        assert mxddp._C.collective_delay_us() == (0, 0)
        pytest.skip("no injected delay asked for (MXDDP_TEST_COLLECTIVE_DELAY_US unset)")
    low_us, high_us = (int(v) for v in delay.split(","))
    assert high_us > low_us
    assert mxddp._C.collective_delay_us() == (low_us, high_us)
    one = torch.zeros(1)
    start = time.perf_counter()
    for _ in range(20):
        mxt.all_reduce(one)
    assert time.perf_counter() - start >= (20 * low_us + 2 * (high_us - low_us)) * 1e-6


@pytest.mark.parametrize("name,strategy", [(n, s) for n in ("mlp", "gpt2", "llama") for s in STRATEGIES])
def test_without_gradient_accumulation_fusion_too(ranks, name, strategy):
    """gradient_accumulation_fusion=False (every gradient through the post-accumulate-grad hook, the
    non-unit ones held back together) gives torch's losses too, overlapped over 3 micro-batches, and
    the same gathers."""
    rank, world = ranks
    initial, expected, trained = reference(name, rank, world, 3)
    config = fsdp_config(strategy, True, False)
    got, (gathers, releases, peak, _) = train_fsdp(name, copy.deepcopy(initial), rank, 3, config, fusion=False)
    assert gathers == releases
    for step, (e, g) in enumerate(zip(expected, got)):
        assert abs(g - e) <= 1e-5 * abs(e), f"rank {rank} step {step}: mxddp {g!r}, torch {e!r}"
    planned = mxt.plan(copy.deepcopy(initial), world, config, None, fsdp_unit_modules=MODELS[name][3](),
                       micro_batches=3, gradient_accumulation_fusion=False)
    assert peak == planned.peak_gathered_bytes


class HandTiedLm(torch.nn.Module):
    """An embedding whose table the head reads by hand (``h @ embed.weight.t()``), outside the
    Embedding's forward: a fused non-unit weight with a gradient of its own beside its dW."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 24)
        self.blocks = torch.nn.ModuleList([Block(24, 24), Block(24, 24)])

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return h @ self.embed.weight.t()


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_a_fused_weight_read_outside_its_module(ranks, strategy):
    """The read's gradient is added into main_grad beside the fused dW, once per backward: the
    losses of the run without fusion (within f32 rounding: fused dW accumulates in another order)."""
    rank, world = ranks

    def run(fusion):
        torch.manual_seed(0)
        module = HandTiedLm()
        model = mxt.FullyShardedDataParallel(module, fsdp_config(strategy, True, False), fsdp_unit_modules=[Block],
                                             gradient_accumulation_fusion=fusion)
        assert model.fused_params[[n for n, _ in model.registered_params()].index("embed.weight")] == fusion
        opt = optimizer(model)

        def loss_fn(m, ids):
            return torch.nn.functional.cross_entropy(m(ids).reshape(-1, 40), ids.roll(1, -1).reshape(-1))

        def batch_fn(r, step, micro):
            return torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(100 * step + 10 * micro + r))

        try:
            return train_steps(model, opt, loss_fn, batch_fn, rank, 2)
        finally:
            opt.close()
            model.close()

    fused, unfused = run(True), run(False)
    assert abs(unfused[-1] - unfused[0]) > 1e-3 * unfused[0]  # the losses move
    for f, u in zip(fused, unfused):
        assert abs(f - u) <= 1e-6 * abs(u), (fused, unfused)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reentrant_recompute_matches_too(ranks, strategy):
    """torch.utils.checkpoint's reentrant form (its backward re-runs the unit inside a nested
    backward) gathers and releases as the non-reentrant one does."""
    rank, world = ranks
    initial, expected, trained = reference("mlp", rank, world, 3)
    module = copy.deepcopy(initial)
    module.recompute = "reentrant"
    got, (gathers, releases, _, _) = train_fsdp("mlp", module, rank, 3, fsdp_config(strategy, True, False))
    assert gathers == releases
    for step, (e, g) in enumerate(zip(expected, got)):
        assert abs(g - e) <= 1e-5 * abs(e), f"rank {rank} step {step}: mxddp {g!r}, torch {e!r}"


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_no_unit_classes_make_the_whole_module_one_unit(ranks, name):
    """fsdp_unit_modules=None: one unit of every param, gathered for the forward and again for the
    backward (FSDP2's fully_shard on the root alone); still torch DDP's losses."""
    rank, world = ranks
    initial, expected, _ = reference(name, rank, world, 1)
    _, batch_fn, loss_fn, _ = MODELS[name]
    model = mxt.FullyShardedDataParallel(copy.deepcopy(initial), fsdp_config("optim_grads_params", True, False))
    opt = optimizer(model)
    try:
        assert model.num_units == 1 and model.units.non_unit_params == []
        got = train_steps(model, opt, loss_fn, batch_fn, rank, 1)
        assert model._cpp.gathers_started == model._cpp.releases_done == 2 * STEPS
    finally:
        opt.close()
        model.close()
    for step, (e, g) in enumerate(zip(expected, got)):
        assert abs(g - e) <= 1e-5 * abs(e), f"rank {rank} step {step}: mxddp {g!r}, torch {e!r}"


def test_fine_grained_lowers_the_peak_gathered_bytes(ranks):
    """Each GPT2Block submodule is a unit: the most gathered at once is below the block-unit run's."""
    rank, world = ranks
    peaks = {}
    for fine in (False, True):
        initial, _, _ = reference("gpt2", rank, world, 1)
        _, (_, _, peak, _) = train_fsdp("gpt2", copy.deepcopy(initial), rank, 1,
                                     fsdp_config("optim_grads_params", False, fine))
        peaks[fine] = peak["values"]
    if world == 1:  # a gather is the shard in place: nothing gathered either way
        assert peaks[True] == peaks[False] == 0, peaks
    else:
        assert 0 < peaks[True] < peaks[False], peaks


def test_views_only_while_gathered(ranks):
    """optim_grads_params: a unit's params view gathered storage inside its forward and hold NaN
    stand-ins (no storage) outside; the other strategies keep views of resident storage."""
    rank, world = ranks
    torch.manual_seed(0)
    module = make_mlp()
    seen = {}

    def probe(mod, _args, _out):
        seen["inside"] = mod.fc.weight.detach().clone()
        # A view of the C++ FSDP's gathered storage, not a copy: the same address as the binding's
        # own view of that param's gathered values.
        seen["ptrs"] = mod.fc.weight.data_ptr(), model._cpp.param(index).data_ptr()

    module.blocks[1].register_forward_hook(probe)  # registered first: runs before FSDP's post-hook
    model = mxt.FullyShardedDataParallel(module, fsdp_config("optim_grads_params", False, False),
                                         fsdp_unit_modules=[Block])
    index = [n for n, _ in model.registered_params()].index("blocks.1.fc.weight")
    try:
        weight = module.blocks[1].fc.weight
        assert weight.shape == (64, 64) and torch.isnan(weight).all() and weight.untyped_storage().nbytes() <= 4
        mlp_loss(model, mlp_batch(rank, 0, 0)).backward()
        model.finish_grad_sync()
        assert torch.isfinite(seen["inside"]).all()
        assert seen["ptrs"][0] == seen["ptrs"][1], seen["ptrs"]
        assert torch.isnan(weight).all()
    finally:
        model.close()
    assert torch.equal(module.blocks[1].fc.weight, seen["inside"])  # close() gave it its values back


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_state_dict_gathers_the_full_params(ranks, strategy):
    """state_dict() (collective) holds every param's values, not the stand-ins, and equals what
    close() gives back."""
    rank, world = ranks
    torch.manual_seed(0)
    module = make_mlp()
    model = mxt.FullyShardedDataParallel(module, fsdp_config(strategy, True, False), fsdp_unit_modules=[Block])
    opt = optimizer(model)
    try:
        opt.zero_grad()
        mlp_loss(model, mlp_batch(rank, 0, 0)).backward()
        with pytest.raises(RuntimeError, match="finish_grad_sync"):
            model.state_dict()
        model.finish_grad_sync()
        opt.step()
        state = model.state_dict()
    finally:
        opt.close()
        model.close()
    assert set(state) == {"module." + n for n, _ in module.state_dict().items()}
    for n, p in module.named_parameters():
        assert torch.isfinite(state["module." + n]).all() and torch.equal(state["module." + n], p), n
    # After close() the params hold their values: the wrapper's state dict is torch's, no collective.
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_load_state_dict_restores_a_full_state_dict(ranks, strategy, dtype):
    """torch FSDP's full-state-dict load: the values of a state_dict() (or of the module's own keys)
    come back on every rank, sharded or not, and the next step starts from them; every check first,
    agreed across the ranks, so a bad dict on one rank changes nothing anywhere."""
    rank, world = ranks
    torch.manual_seed(0)
    module = make_mlp().to(dtype)
    model = mxt.FullyShardedDataParallel(module, fsdp_config(strategy, True, False), fsdp_unit_modules=[Block])
    opt = optimizer(model)

    def step(lr=LR):
        opt.lr = lr
        opt.zero_grad()
        x, y = mlp_batch(rank, 0, 0)
        torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y).backward()
        model.finish_grad_sync()
        opt.step()

    def same(a, b):
        return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)

    try:
        step()
        state = model.state_dict()
        step()
        step()
        moved = model.state_dict()
        assert not same(moved, state)
        assert list(model.load_state_dict(state)) == [[], []]
        assert same(model.state_dict(), state)
        step(lr=0.0)  # AdamW with lr 0 changes nothing: the step started from the loaded values
        assert same(model.state_dict(), state)
        # The module's own keys (a plain module's, torch FSDP2's), strict=False with a key left out.
        own = {k.removeprefix("module."): v for k, v in moved.items() if k != "module.head.bias"}
        assert model.load_state_dict(own, strict=False).missing_keys == ["head.bias"]  # named as the dict keys them
        assert same({k: v for k, v in model.state_dict().items() if k != "module.head.bias"},
                    {k: v for k, v in moved.items() if k != "module.head.bias"})
        assert torch.equal(model.state_dict()["module.head.bias"], state["module.head.bias"])
        # Refusals, with nothing changed.
        before = model.state_dict()
        with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "module.head.bias"'):
            model.load_state_dict({k: v for k, v in state.items() if k != "module.head.bias"})
        bad = dict(state)
        if rank == world - 1:
            bad["module.head.weight"] = torch.zeros(3, 3)
        with pytest.raises(RuntimeError, match=r"size mismatch for module.head.weight" if rank == world - 1
                           else rf"the load failed on rank\(s\) \[{world - 1}\]"):
            model.load_state_dict(bad)
        assert same(model.state_dict(), before)
    finally:
        opt.close()
        model.close()
    if strategy == "optim_grads_params":
        model = mxt.FullyShardedDataParallel(make_mlp(), fsdp_config(strategy, True, False), fsdp_unit_modules=[Block])
        try:
            with pytest.raises(RuntimeError, match=r"build `mxt.DistributedOptimizer\(model, ...\)` first"):
                model.load_state_dict(state)
        finally:
            model.close()


def test_load_state_dict_restores_buffers_and_frozen_params(ranks):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    module[2].bias.requires_grad_(False)
    model = mxt.FullyShardedDataParallel(module, fsdp_config("optim_grads_params", True, False),
                                         fsdp_unit_modules=[torch.nn.Linear])
    opt = optimizer(model)
    try:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            module[1].running_mean.fill_(3.0)
            module[1].num_batches_tracked.fill_(7)
            module[2].bias.fill_(-1.0)
        model.load_state_dict(state)
        for k, v in model.state_dict().items():
            assert torch.equal(v, state[k]), k
    finally:
        opt.close()
        model.close()


def test_a_param_without_gradient_is_reported_with_zero(ranks):
    """A unit whose output is unused in one iteration still finishes: its params report zero
    gradients when the gradients are synchronized, and the run goes on."""
    rank, world = ranks
    torch.manual_seed(0)
    module = make_mlp()
    model = mxt.FullyShardedDataParallel(module, fsdp_config("optim_grads_params", True, False),
                                         fsdp_unit_modules=[Block])
    opt = optimizer(model)
    module.skip_last_block = True
    try:
        for step in range(2):
            opt.zero_grad()
            mlp_loss(model, mlp_batch(rank, step, 0)).backward()
            model.finish_grad_sync()
            assert opt.step()[0]
            assert not model._cpp.anything_gathered
    finally:
        opt.close()
        model.close()


def test_refusals_name_the_field(ranks):
    with pytest.raises(ValueError, match="use_megatron_fsdp=True"):
        mxt.FullyShardedDataParallel(make_mlp(), mxt.DistributedDataParallelConfig(use_distributed_optimizer=True))
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        mxt.DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim")
    with pytest.raises(ValueError, match="data_parallel_sharding_strategy='zero3'"):
        mxt.DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                          data_parallel_sharding_strategy="zero3")
    with pytest.raises(ValueError, match="data_parallel_sharding_strategy"):
        mxt.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim")  # DDP
    with pytest.raises(ValueError, match="bucket_size"):
        mxt.DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True, bucket_size=100)
    with pytest.raises(ValueError, match="suggested_communication_unit_size"):
        mxt.DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                          suggested_communication_unit_size=-1)
    with pytest.raises(ValueError, match="fp8_param_gather"):
        mxt.DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                          data_parallel_sharding_strategy="optim", fp8_param_gather=True)
    with pytest.raises(TypeError, match="fsdp_unit_modules"):
        mxt.FullyShardedDataParallel(make_mlp(), fsdp_config("optim", False, False), fsdp_unit_modules=["Block"])
    with pytest.raises(ValueError, match="no submodule of those classes"):
        mxt.FullyShardedDataParallel(make_mlp(), fsdp_config("optim", False, False),
                                     fsdp_unit_modules=[torch.nn.Conv2d])
    for delay in ((5, 1), (-1, 2), (0, 1.5), (True, 2), (1, 2, 3), "0,1"):
        with pytest.raises(ValueError, match="collective_delay_us must be None or \\(min, max\\) ints"):
            mxt.init(collective_delay_us=delay)
    with pytest.raises(ValueError, match="recompute_granularity='some'"):
        mxt.FullyShardedDataParallel(make_mlp(), fsdp_config("optim", False, False), fsdp_unit_modules=[Block],
                                     recompute_granularity="some")


def test_a_unit_param_shared_outside_the_unit_is_refused(ranks):
    module = make_mlp()
    module.extra = torch.nn.Linear(64, 64)
    module.extra.weight = module.blocks[1].fc.weight  # a unit's weight, also read outside the unit
    with pytest.raises(ValueError, match="must be a non-unit param"):
        mxt.FullyShardedDataParallel(module, fsdp_config("optim", False, False), fsdp_unit_modules=[Block])


# ---- MXFP8 params (fp8_param_gather) under optim_grads_params ----

def bf16_mlp(head_mxfp8=None):
    """head_mxfp8: what the head (a Linear outside every unit) is marked; unmarked it stays BF16
    under FSDP, and DDP is told to keep it BF16 too, so the two train the same model."""
    torch.manual_seed(0)
    module = make_mlp().to(torch.bfloat16)
    if head_mxfp8 is not None:
        module.head.weight.mxfp8 = head_mxfp8
    return module


def bf16_batch(rank, step, micro):
    x, y = mlp_batch(rank, step, micro)
    return x.to(torch.bfloat16), y


def mxfp8_losses(model, opt, rank):
    return train_steps(model, opt, mlp_loss, bf16_batch, rank, 2)


def ddp_mxfp8_losses(module, rank):
    """The losses of DDP with the distributed optimizer and MXFP8 params: what FSDP's must give."""
    ddp = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=True, grad_reduce_in_fp32=True))
    opt = optimizer(ddp)
    try:
        return mxfp8_losses(ddp, opt, rank)
    finally:
        opt.close()
        ddp.close()


@pytest.mark.parametrize("fine_grained,recompute", [(False, False), (True, False), (False, True), (True, True)])
def test_mxfp8_params_train_as_ddp_s(ranks, fine_grained, recompute):
    """The Block Linears' weights are MXFP8 under FSDP as under DDP with the distributed optimizer:
    forward reads the row-wise copy, backward's dgrad the column-wise one, each gathered per unit;
    the first step's loss is DDP's bit for bit (the same quantized weights), the rest track it."""
    rank, world = ranks
    expected = ddp_mxfp8_losses(bf16_mlp(head_mxfp8=False), rank)
    module = bf16_mlp()
    module.recompute = recompute
    model = mxt.FullyShardedDataParallel(module, fsdp_config("optim_grads_params", True, fine_grained,
                                                             fp8_param_gather=True), fsdp_unit_modules=[Block])
    assert [model._cpp.is_mxfp8(i) for i in range(len(model.registered_params()))] == \
        [n.endswith("fc.weight") for n, _ in model.registered_params()]
    opt = optimizer(model)
    try:
        got = mxfp8_losses(model, opt, rank)
        peak = model.peak_gathered_bytes()
        assert model._cpp.gathers_started == model._cpp.releases_done
    finally:
        opt.close()
        model.close()
    assert (peak["rowwise"] > 0 and peak["colwise"] > 0) == (world > 1), peak  # one rank: the shards in place
    assert got[0] == expected[0], (got, expected)
    for e, g in zip(expected, got):
        assert abs(g - e) <= 2e-2 * abs(e), (got, expected)


class ConvBlock(torch.nn.Module):
    """An HF Conv1D (W [in, out]: forward reads the column-wise MXFP8 copy) beside an nn.Linear (the
    row-wise one) in one unit, so each pass's gather holds both orientations."""

    def __init__(self):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        self.conv = transformers.pytorch_utils.Conv1D(64, 32)  # W [32, 64]
        self.fc = torch.nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc(torch.nn.functional.gelu(self.conv(x)))


class ConvMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(32, 32)
        self.blocks = torch.nn.ModuleList([ConvBlock(), ConvBlock()])
        self.head = torch.nn.Linear(32, 10)
        self.recompute = False

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) if self.recompute else block(h)
        return self.head(h)



@pytest.mark.parametrize("fine_grained", [False, True])
def test_hf_gradient_checkpointing_of_mxfp8_units(ranks, fine_grained):
    """HF's gradient checkpointing re-runs a layer's forward in backward without the layer's own
    hooks (transformers checkpoints forward, not __call__): with a unit per GPT2Block only its
    submodules' hooks run then, and the re-run reads the forward's MXFP8 copies, which the
    backward's gather does not bring. The unit's MXFP8 modules gather them for it and release the
    row-wise ones after the last of them. The re-run runs (a submodule's forward twice per step),
    the losses are those of the run without recompute, bit for bit (the same quantized weights, the
    same ops), every gather is released, and what the run holds is the plan's with
    checkpointed_modules, per category and per gather slot."""
    rank, world = ranks
    block = gpt2_block_class()
    opt_cfg = mxt.OptimizerConfig(lr=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
                                  clip_grad=CLIP)

    def run(recompute):
        torch.manual_seed(0)
        module = make_gpt2().to(torch.bfloat16)
        initial = copy.deepcopy(module)
        set_recompute("gpt2", module, recompute)
        calls = []
        module.transformer.h[0].attn.c_attn.register_forward_pre_hook(lambda *_: calls.append(None))
        config = fsdp_config("optim_grads_params", True, fine_grained, fp8_param_gather=True)
        gc.collect()
        assert not any(live for live, _ in mxt.memory_usage().values())
        mxddp._C.reset_memory_peaks()
        model = mxt.FullyShardedDataParallel(module, config, fsdp_unit_modules=[block])
        assert sum(model._cpp.is_mxfp8(i) for i in range(len(model.registered_params()))) == 8  # the Conv1Ds
        opt = mxt.DistributedOptimizer(model, opt_cfg)
        try:
            losses = train_steps(model, opt, gpt2_loss, gpt2_batch, rank, 1)
            assert model._cpp.gathers_started == model._cpp.releases_done
            peak, order, usage = model.peak_gathered_bytes(), model.forward_order, mxt.memory_usage()
        finally:
            opt.close()
            model.close()
        assert len(calls) == STEPS * (2 if recompute else 1)
        planned = mxt.plan(initial, world, config, opt_cfg, fsdp_unit_modules=[block], forward_order=order,
                           checkpointed_modules=[block] if recompute else None)
        assert peak == planned.peak_gathered_bytes, (recompute, peak, planned.peak_gathered_bytes)
        assert usage == planned.memory_usage(), (recompute, usage, planned)
        return losses

    assert run(True) == run(False)

@pytest.mark.parametrize("fine_grained,recompute", [(False, False), (True, False), (False, True), (True, True)])
def test_conv1d_and_linear_mxfp8_weights_in_one_unit_train_as_ddp_s(ranks, fine_grained, recompute):
    """A Conv1D's forward reads its column-wise copy, a Linear's its row-wise one: each pass's gather
    brings what that pass reads of both (ParamSpec::mxfp8_colwise_forward), and the first step's
    loss is DDP's (which keeps both copies resident) bit for bit, the rest track it."""
    rank, world = ranks

    def make():
        torch.manual_seed(0)
        module = ConvMlp().to(torch.bfloat16)
        module.inp.weight.mxfp8 = module.head.weight.mxfp8 = False  # outside every unit: BF16 on both sides
        return module

    expected = ddp_mxfp8_losses(make(), rank)
    module = make()
    module.recompute = recompute
    model = mxt.FullyShardedDataParallel(module, fsdp_config("optim_grads_params", True, fine_grained,
                                                             fp8_param_gather=True), fsdp_unit_modules=[ConvBlock])
    assert {n for i, (n, _) in enumerate(model.registered_params()) if model._cpp.is_mxfp8(i)} == \
        {f"blocks.{b}.{m}.weight" for b in range(2) for m in ("conv", "fc")}
    opt = optimizer(model)
    try:
        got = mxfp8_losses(model, opt, rank)
        # The state dict holds what each forward reads: the Conv1D's column-wise values, which
        # quantize column-wise to themselves (and the Linear's row-wise ones row-wise).
        sd = model.state_dict()
        for name, axis in (("blocks.1.conv.weight", "col"), ("blocks.1.fc.weight", "row")):
            values = sd["module." + name]
            assert torch.equal(quantize(values, axis)[2].bfloat16(), values), name
        assert model._cpp.gathers_started == model._cpp.releases_done
        # Outside its unit's forward the Conv1D's column-wise copy is not gathered: a read is refused.
        with pytest.raises(mxddp.Error, match="MXFP8 param 'blocks.0.conv.weight' read col-wise while unit 0 holds "
                                              "no col-wise copy: forward and recompute read col-wise, backward's data "
                                              "gradient row-wise"):
            model._cpp.mxfp8_param(model._names.index("blocks.0.conv.weight"), "col")
    finally:
        opt.close()
        model.close()
    assert got[0] == expected[0], (got, expected)
    for e, g in zip(expected, got):
        assert abs(g - e) <= 2e-2 * abs(e), (got, expected)


def test_the_recompute_aware_policy_forces_fine_grained_where_needed(ranks):
    """MXFP8 params with a selective recompute of weighted submodules need the fine-grained gather
    (a submodule re-run in backward reads row-wise weights): recompute-aware forces it there and only
    there; megatron forces it for any MXFP8 params; an explicit False where it is forced is refused."""
    def fine(policy, flag, **recompute):
        config = fsdp_config("optim_grads_params", False, False, fp8_param_gather=True,
                             fine_grained_param_gather_policy=policy)
        config.megatron_fsdp_enable_fine_grained_param_gather = flag
        model = mxt.FullyShardedDataParallel(bf16_mlp(), config, fsdp_unit_modules=[Block], **recompute)
        on, units = model.fine_grained_param_gather, model.num_units
        model.close()
        return on, units

    assert fine("recompute-aware", None) == (False, 3)
    assert fine("recompute-aware", None, recompute_granularity="full") == (False, 3)
    assert fine("recompute-aware", None, recompute_granularity="selective") == (False, 3)  # core_attn: no weights
    assert fine("recompute-aware", None, recompute_granularity="selective", recompute_modules=["mlp"]) == (True, 3)
    assert fine("megatron", None) == (True, 3)  # each Block has one weighted submodule: the same 3 units
    assert fine("recompute-aware", True) == (True, 3)
    with pytest.raises(ValueError, match="requires the fine-grained param gather"):
        fine("recompute-aware", False, recompute_granularity="selective", recompute_modules=["layernorm"])
    with pytest.raises(ValueError, match="requires the fine-grained param gather"):
        fine("megatron", False)
    with pytest.raises(ValueError, match="'head.weight' is marked mxfp8=True but is in no FSDP unit"):
        mxt.FullyShardedDataParallel(bf16_mlp(head_mxfp8=True), fsdp_config("optim_grads_params", False, False,
                                     fp8_param_gather=True), fsdp_unit_modules=[Block])
