"""Megatron's OptimizerConfig path as megatron-core 0.16's OptimizerParamScheduler drives it
(issue 44 item 1): param_groups with lr, weight_decay, wd_mult, max_lr, min_lr; a schedule that
sets each group's lr and weight_decay = wd * wd_mult every step (linear warmup, cosine decay, a
weight-decay increment) trains as torch DDP + AdamW with the same per-group values and clipping;
step() returns Megatron's triple and get_grad_norm() the same norm. (torch.optim.lr_scheduler's
schedulers over a user's optimizer are in test_user_optimizer.py.)
"""
import copy
import math

import torch

import mxddp.torch as mxt
from test_user_optimizer import assert_same, loss_of, make_mlp, wrap

STEPS, WARMUP, LR, MIN_LR, WD0, WD1, CLIP = 8, 3, 1e-2, 1e-3, 0.01, 0.1, 0.5


def lr_at(step, group):
    """Linear warmup to max_lr, then cosine down to min_lr (Megatron's default decay style)."""
    max_lr, min_lr = group.get("max_lr", LR), group.get("min_lr", MIN_LR)
    if step < WARMUP:
        return max_lr * (step + 1) / WARMUP
    ratio = (step - WARMUP) / (STEPS - WARMUP)
    return min_lr + 0.5 * (max_lr - min_lr) * (math.cos(math.pi * ratio) + 1.0)


def wd_at(step):
    return WD0 + (WD1 - WD0) * step / (STEPS - 1)  # Megatron's "linear" weight-decay increment


def schedule(opt, step):
    for g in opt.param_groups:
        g["lr"] = lr_at(step, g)
        g["weight_decay"] = wd_at(step) * g.get("wd_mult", 1.0)


def test_megatron_param_groups_driven_like_optimizer_param_scheduler(ranks):
    rank, _ = ranks
    module = make_mlp()
    reference = copy.deepcopy(module)
    decay = [p for p in reference.parameters() if p.ndim >= 2]
    rest = [p for p in reference.parameters() if p.ndim < 2]
    ref_opt = torch.optim.AdamW([{"params": decay, "wd_mult": 1.0}, {"params": rest, "wd_mult": 0.0}], lr=LR)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    expected = []
    for step in range(STEPS):
        schedule(ref_opt, step)
        ref_opt.zero_grad()
        loss = loss_of(ddp, rank, step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        ref_opt.step()
        expected.append(loss.item())

    model = wrap(module)
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=LR, weight_decay=WD0, clip_grad=CLIP))
    got = []
    try:
        groups = opt.param_groups
        assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
        for key in ("lr", "weight_decay", "lr_mult", "max_lr", "min_lr", "default_config", "is_decoupled_lr",
                    "is_expert_parallel"):
            assert all(key in g for g in groups), key
        for g in groups:
            g["min_lr"] = MIN_LR
        for step in range(STEPS):
            schedule(opt, step)
            opt.zero_grad()
            loss = loss_of(model, rank, step)
            loss.backward()
            model.finish_grad_sync()
            norm = opt.get_grad_norm()
            update_successful, grad_norm, num_zeros = opt.step()
            assert update_successful and num_zeros is None
            assert abs(grad_norm - norm) <= 1e-6 * norm
            got.append(loss.item())
    finally:
        opt.close()
        model.close()
    assert_same(expected, got, "Megatron-style schedule")
    for (n, a), b in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"param {n}: {m}")
