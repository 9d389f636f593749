"""torch.amp.GradScaler (device "cpu", enabled) with mxddp's DistributedOptimizer over a user's
torch AdamW, against torch DDP (gloo) + the same AdamW and scaler: scaled losses that overflow on
purpose (an initial scale whose grads overflow F32, and one rank's loss blown up mid-run so the Inf
lands in one rank's shard only; at one rank, in that rank's), with and without scaler.unscale_ +
clipping. Every step's loss, the scale after every update (equal on every rank) and the final params
match torch's.
"""
import copy

import pytest
import torch

import mxddp.torch as mxt
from test_user_optimizer import batch, make_mlp, two_groups, wrap

STEPS = 10
BLOW_UP_STEP = 6


def blow_up_rank(world):
    """Rank 1, or the only rank."""
    return min(1, world - 1)


def scaled_loss(model, rank, world, step, first_overflows):
    x, y = batch(rank, step)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if step == 0 and first_overflows:
        return loss, loss * 64  # overflows at the initial scale on every rank
    if step == BLOW_UP_STEP and rank == blow_up_rank(world):
        return loss, loss * 1e38  # overflows once scaled: an Inf on this rank only
    return loss, loss


def make_opt(m):
    return torch.optim.AdamW(two_groups(m, g1={"weight_decay": 0.0}), lr=1e-2)


def make_scaler():
    # At 2^127 the scaled grads overflow F32: the first step is skipped and backs off to 2^77, where
    # the grads are finite but their sum of squares is far beyond F32 (the norm must be unscaled
    # before it travels), then training proceeds.
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_factor=2.0, backoff_factor=2.0 ** -50,
                                growth_interval=3)


def run(model, opt, clip_fn, rank, world):
    scaler = make_scaler()
    losses, scales = [], []
    for step in range(STEPS):
        opt.zero_grad()
        # With clipping the first step does not overflow: its clip_grad_norm_ (before the optimizer
        # has met the scaler) must already report the unscaled norm.
        loss, to_scale = scaled_loss(model, rank, world, step, first_overflows=clip_fn is None)
        scaler.scale(to_scale).backward()
        if hasattr(model, "finish_grad_sync"):
            model.finish_grad_sync()
        if clip_fn is not None:
            scaler.unscale_(opt)
            clip_fn()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales


@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_matches_torch_ddp(ranks, clip):
    rank, world = ranks
    module = make_mlp()
    reference = copy.deepcopy(module)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    ref_opt = make_opt(reference)
    expected, expected_scales = run(ddp, ref_opt, (lambda: torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3))
                                    if clip else None, rank, world)

    model = wrap(module)
    opt = mxt.DistributedOptimizer(model, make_opt(model.module))
    norms = []

    def clip_mxddp():
        norms.append(opt.clip_grad_norm_(0.3).item())

    try:
        with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
            got, got_scales = run(model, opt, clip_mxddp if clip else None, rank, world)
    finally:
        opt.close()
        model.close()
    # The run must have skipped steps (the initial overflows and the one-rank Inf) and trained.
    assert clip or expected_scales[0] < 2.0 ** 127
    assert expected_scales[BLOW_UP_STEP] < expected_scales[BLOW_UP_STEP - 1]
    assert got_scales == expected_scales, (got_scales, expected_scales)
    everyone = torch.tensor(got_scales, dtype=torch.float64)
    gathered = [torch.zeros_like(everyone) for _ in range(world)]
    torch.distributed.all_gather(gathered, everyone)
    assert all(torch.equal(g, everyone) for g in gathered), "the scale differs across ranks"
    for step, (e, g) in enumerate(zip(expected, got)):
        assert abs(g - e) <= 1e-5 * abs(e), f"step {step}: mxddp {g!r}, torch {e!r}"
    assert max(abs(e - expected[0]) for e in expected) > 1e-3 * abs(expected[0])
    for (n, a), b in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"param {n}: {m}")
    if clip:
        finite = [n for n in norms if n == n and n != float("inf")]
        assert norms[0] in finite and all(n < 1e6 for n in finite), \
            f"clip_grad_norm_ must report the unscaled norm: {norms}"
