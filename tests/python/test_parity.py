"""Parity with PyTorch: mxddp's DDP + distributed optimizer against torch.nn.parallel.
DistributedDataParallel (gloo) + torch.optim.AdamW with the same clipping, on a plain MLP, an
HF GPT2LMHeadModel (random init, tied embedding) and an HF LlamaForCausalLM (grouped-query
attention, RMSNorm, untied head), 20 steps in F32: every step's loss within 1e-5
relative, with overlap on and off, three bucket sizes per model (one bucket, a few, one per
param or close to it: the count each gives is asserted), accumulation under no_sync, and
gradient_accumulation_fusion on and off. A NaN, +Inf or -Inf gradient on one rank skips the step
on every rank.
"""
import copy

import pytest
import torch

import mxddp.torch as mxt
from micro_batches import backward_micro_batches

STEPS = 20
LR, WD, BETAS, EPS, CLIP = 3e-3, 0.1, (0.9, 0.95), 1e-8, 0.5


def make_mlp():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                               torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))


def mlp_batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def mlp_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def make_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tied embedding the test is about
    return model


def gpt2_batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 96, (2, 16), generator=g)


def gpt2_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def make_llama():
    """HF Llama: nn.Linear projections with grouped-query attention (2 KV heads for 4), a SwiGLU MLP,
    RMSNorm, rotary positions (a buffer, no param) and an untied LM head."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    return model


# gpt2_batch and gpt2_loss serve any causal LM over the same 96 tokens.
MODELS = {"mlp": (make_mlp, mlp_batch, mlp_loss), "gpt2": (make_gpt2, gpt2_batch, gpt2_loss),
          "llama": (make_llama, gpt2_batch, gpt2_loss)}


def reference_optimizer(module):
    # Megatron's (and mxddp's) param groups: weight decay on params of 2+ dimensions only.
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=EPS)


def train_reference(module, batch_fn, loss_fn, rank, micro_batches):
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    opt = reference_optimizer(module)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = backward_micro_batches(ddp, loss_fn, batch_fn, rank, step, micro_batches)
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        opt.step()
        losses.append(total)
    return losses


def train_mxddp(module, batch_fn, loss_fn, rank, micro_batches, ddp_config, fusion=True, buckets=None):
    model = mxt.DistributedDataParallel(module, ddp_config, gradient_accumulation_fusion=fusion)
    # The bucket size must really have split the buffer as the case says, or the cases with
    # different sizes could all be running one bucket.
    if buckets is not None:
        assert model.num_buckets == buckets, f"bucket_size {ddp_config.bucket_size}: {model.num_buckets} buckets"
    # The weights of the Linear / Conv1D / Embedding modules are fused, or none is.
    assert any(model.fused_params) == fusion
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD,
                                                              adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                                                              adam_eps=EPS, clip_grad=CLIP))
    losses = []
    try:
        for step in range(STEPS):
            opt.zero_grad()
            total = backward_micro_batches(model, loss_fn, batch_fn, rank, step, micro_batches)
            model.finish_grad_sync()
            update_successful, grad_norm, num_zeros = opt.step()
            assert update_successful and grad_norm > 0 and num_zeros is None
            losses.append(total)
    finally:
        opt.close()
        model.close()
    return losses


CASES = [
    # (model, overlap_grad_reduce, bucket_size, micro_batches, gradient_accumulation_fusion)
    ("mlp", False, None, 1, True),
    ("mlp", True, None, 1, True),
    ("mlp", True, 2000, 1, True),
    ("mlp", True, 2000, 3, True),
    ("mlp", True, 500, 1, True),
    ("gpt2", False, None, 1, True),
    ("gpt2", True, 5000, 2, True),
    ("gpt2", True, 1000, 1, True),
    ("mlp", True, 2000, 3, False),
    ("gpt2", False, None, 1, False),
    ("gpt2", True, 5000, 2, False),
    ("llama", True, 5000, 2, True),
    ("llama", True, 1000, 1, True),
    ("llama", False, None, 1, False),
]

# The buckets each (model, bucket_size) gives, the same at every dp (Megatron's rule: params in
# reverse order, a bucket closes once it holds bucket_size elements or more, so a param is never
# split). None, or overlap off whatever the size, is one bucket. The smallest sizes are at or
# near one bucket per param group the rule can make: MLP 3 (its 4096- and 2048-element weights
# each close one), GPT-2 10, Llama 16.
BUCKETS = {("mlp", None): 1, ("mlp", 2000): 2, ("mlp", 500): 3,
           ("gpt2", None): 1, ("gpt2", 5000): 7, ("gpt2", 1000): 10,
           ("llama", None): 1, ("llama", 5000): 6, ("llama", 1000): 16}


def test_bucket_sizes_give_distinct_bucket_counts():
    """The parity cases cover three bucket counts per model, more buckets for smaller sizes."""
    for name in MODELS:
        sizes = sorted({b for m, o, b, _, _ in CASES if m == name and o and b is not None}, reverse=True)
        counts = [BUCKETS[name, None]] + [BUCKETS[name, b] for b in sizes]
        assert counts[0] == 1 and len(counts) >= 3 and counts == sorted(set(counts)), (name, counts)


@pytest.mark.parametrize("name,overlap,bucket_size,micro_batches,fusion", CASES)
def test_losses_match_torch_ddp_adamw(ranks, name, overlap, bucket_size, micro_batches, fusion):
    rank, world = ranks
    make, batch_fn, loss_fn = MODELS[name]
    torch.manual_seed(0)
    module = make()
    reference = copy.deepcopy(module)
    config = mxt.DistributedDataParallelConfig(overlap_grad_reduce=overlap, use_distributed_optimizer=True,
                                               bucket_size=bucket_size, grad_reduce_in_fp32=True)
    expected = train_reference(reference, batch_fn, loss_fn, rank, micro_batches)
    got = train_mxddp(module, batch_fn, loss_fn, rank, micro_batches, config, fusion,
                      buckets=BUCKETS[name, bucket_size if overlap else None])
    assert len(got) == STEPS
    # The losses must move, or matching them proves nothing: by 100x the tolerance at some step (at
    # one rank Llama's last loss is only 9e-4 from its first).
    assert max(abs(e - expected[0]) for e in expected) > 1e-3 * abs(expected[0])
    worst = max(abs(g - e) / abs(e) for e, g in zip(expected, got))
    print(f"f32 {name} overlap={overlap} bucket_size={bucket_size} micro={micro_batches} fusion={fusion} dp={world} "
          f"rank {rank}: "
          f"worst relative loss difference {worst:.2e}")
    for step, (e, g) in enumerate(zip(expected, got)):
        assert abs(g - e) <= 1e-5 * abs(e), f"rank {rank} step {step}: mxddp {g!r}, torch {e!r}"
    # And the trained params agree too (the module's params are mxddp's, then copied out by close()).
    # Adam moves a param whose grads are ~0 (a bias) by lr-sized steps of either sign, so rounding
    # differences of the grads show as absolute differences of up to ~1e-5 there.
    for (n, a), (_, b) in zip(module.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"param {n}: {m}")


@pytest.mark.parametrize("average_in_collective", [False, True])
def test_allreduce_main_grads_equal_torch_ddp_grads(ranks, average_in_collective):
    """Without the distributed optimizer every rank's main_grad is the all-reduced mean gradient."""
    rank, world = ranks
    torch.manual_seed(1)
    module = make_mlp()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=3000, average_in_collective=average_in_collective,
        grad_reduce_in_fp32=True))
    try:
        batch = mlp_batch(rank, 0, 0)
        mlp_loss(reference, batch).backward()
        mlp_loss(model, batch).backward()
        model.finish_grad_sync()
        for (n, p), q in zip(model.registered_params(), reference.module.parameters()):
            assert p.grad is None
            torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")
    finally:
        model.close()


def test_sgd_losses_match_torch_sgd(ranks):
    """optimizer="sgd": SGD with momentum (weight decay added to the grad, 2-D params only) against
    torch.optim.SGD with the same param groups and clipping."""
    rank, world = ranks
    lr, momentum, wd = 0.05, 0.9, 0.01
    torch.manual_seed(2)
    module = make_mlp()
    reference = copy.deepcopy(module)
    ref_ddp = torch.nn.parallel.DistributedDataParallel(reference)
    ref_opt = torch.optim.SGD([{"params": [p for p in reference.parameters() if p.ndim >= 2], "weight_decay": wd},
                               {"params": [p for p in reference.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                              lr=lr, momentum=momentum)
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=2000, grad_reduce_in_fp32=True))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(optimizer="sgd", lr=lr, sgd_momentum=momentum,
                                                              weight_decay=wd, clip_grad=CLIP))
    try:
        expected, got = [], []
        for step in range(STEPS):
            batch = mlp_batch(rank, step, 0)
            ref_opt.zero_grad()
            loss = mlp_loss(ref_ddp, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
            ref_opt.step()
            expected.append(loss.item())
            opt.zero_grad()
            loss = mlp_loss(model, batch)
            loss.backward()
            model.finish_grad_sync()
            assert opt.step()[0]
            got.append(loss.item())
    finally:
        opt.close()
        model.close()
    assert abs(expected[-1] - expected[0]) > 1e-3 * abs(expected[0])
    for step, (e, g) in enumerate(zip(expected, got)):
        assert abs(g - e) <= 1e-5 * abs(e), f"rank {rank} step {step}: mxddp {g!r}, torch {e!r}"


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_nonfinite_grads_skip_the_step_on_every_rank(ranks, bad):
    """A NaN, +Inf or -Inf gradient on one rank makes the global grad norm NaN or +Inf: every
    rank's step reports update_successful False and leaves the params as they were (as mxddp
    train skips the step), and the next, finite step goes through with finite params."""
    rank, world = ranks
    torch.manual_seed(3)
    module = make_mlp()
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                                  grad_reduce_in_fp32=True))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2))
    hook = None
    try:
        before = [p.detach().clone() for p in module.parameters()]
        opt.zero_grad()
        x, y = mlp_batch(rank, 0, 0)
        if rank == world - 1:
            if bad == "nan":
                # From the input: every param's grad is NaN, the fused Linear weights' too.
                x[0, 0] = float("nan")
            else:
                # An Inf input would reach the grads as NaN (the LayerNorm of an Inf row), so
                # one element of the LayerNorm weight's grad is set to it instead, before the
                # DDP's hook adds it into main_grad: one Inf in the whole grad buffer.
                def poison(grad, value=float(bad)):
                    grad = grad.clone()
                    grad[0] = value
                    return grad

                hook = module[2].weight.register_hook(poison)
        mlp_loss(model, (x, y)).backward()
        model.finish_grad_sync()
        with pytest.warns(mxt.SkippedStepWarning, match="skipped the step"):  # it says why (test_skipped_steps.py)
            update_successful, grad_norm, _ = opt.step()
        assert not update_successful, f"rank {rank}: a {bad} grad on rank {world - 1} did not skip the step"
        if bad == "nan":
            assert grad_norm != grad_norm, grad_norm  # NaN
        else:
            assert grad_norm == float("inf"), grad_norm  # the norm of -Inf is +Inf too
        for p, b in zip(module.parameters(), before):
            assert torch.equal(p.detach(), b)
        # The next, finite step goes through, and nothing of the bad grad was kept (in the main
        # params or the Adam moments) to reach the params.
        if hook is not None:
            hook.remove()
        opt.zero_grad()
        mlp_loss(model, mlp_batch(rank, 1, 0)).backward()
        model.finish_grad_sync()
        update_successful, grad_norm, _ = opt.step()
        assert update_successful and 0 < grad_norm < float("inf")
        for p, b in zip(module.parameters(), before):
            assert torch.isfinite(p).all() and not torch.equal(p.detach(), b)
    finally:
        if hook is not None:
            hook.remove()
        opt.close()
        model.close()
