"""overlap_param_gather: the distributed optimizer's param all-gather is started by opt.step() and
waited for module by module in forward pre-hooks (Megatron's), instead of all at once in step().

- Parity: losses, evaluation losses and final params bitwise equal to overlap_param_gather=False
  (the same bytes are gathered; only when they are waited for changes), F32 and BF16, with an
  evaluation-only forward under torch.no_grad between steps.
- The overlap is real: after step() only the first group's gather has been dispatched; when the
  first module's pre-hook runs it is in flight (dispatched, not yet waited for), and a param of a
  group not yet dispatched still holds its pre-step values then; the waits happen group by group
  as forward reaches the modules.
"""
import copy

import pytest
import torch

import mxddp.torch as mxt
from conftest import needs_ranks
from micro_batches import backward_micro_batches
from test_parity import (BETAS, CLIP, EPS, LR, WD, gpt2_batch, gpt2_loss, make_gpt2, make_mlp, mlp_batch, mlp_loss)

STEPS = 8
EVAL_AFTER = (2, 5)  # evaluation-only forwards after these steps


def optimizer_config():
    return mxt.OptimizerConfig(lr=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
                               clip_grad=CLIP)


def train(module, batch_fn, loss_fn, rank, overlap_param_gather, bucket_size, micro_batches):
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=bucket_size, grad_reduce_in_fp32=True,
        overlap_param_gather=overlap_param_gather))
    opt = mxt.DistributedOptimizer(model, optimizer_config())
    losses, evals = [], []
    try:
        assert model._cpp.num_bucket_groups >= 3  # several groups, or there is nothing to overlap
        for step in range(STEPS):
            opt.zero_grad()
            total = backward_micro_batches(model, loss_fn, batch_fn, rank, step, micro_batches)
            model.finish_grad_sync()
            ok, _, _ = opt.step()
            assert ok
            assert model._cpp.param_sync_pending == overlap_param_gather
            losses.append(total)
            if step in EVAL_AFTER:
                with torch.no_grad():
                    evals.append(loss_fn(model, batch_fn(rank, 100 + step, 0)).item())
                # The evaluation forward waited for every group: nothing is left pending.
                assert not model._cpp.param_sync_pending
    finally:
        opt.close()
        model.close()
    return losses, evals, {n: p.detach().clone() for n, p in module.named_parameters()}


MODELS = {"mlp": (make_mlp, mlp_batch, mlp_loss), "gpt2": (make_gpt2, gpt2_batch, gpt2_loss)}
CASES = [  # (model, dtype, bucket_size, micro-batches)
    ("mlp", torch.float32, 500, 1),
    ("mlp", torch.bfloat16, 500, 2),
    ("gpt2", torch.float32, 5000, 2),
]


@pytest.mark.parametrize("name,dtype,bucket_size,micro_batches", CASES)
def test_overlapped_param_gather_is_bitwise_equal_to_gather_in_step(ranks, name, dtype, bucket_size, micro_batches):
    rank, world = ranks
    make, batch_fn, loss_fn = MODELS[name]
    if dtype == torch.bfloat16:
        batch_fn = (lambda f: lambda r, s, m: (f(r, s, m)[0].bfloat16(), f(r, s, m)[1]))(batch_fn)
    torch.manual_seed(0)
    module = make().to(dtype)
    twin = copy.deepcopy(module)
    off = train(module, batch_fn, loss_fn, rank, False, bucket_size, micro_batches)
    on = train(twin, batch_fn, loss_fn, rank, True, bucket_size, micro_batches)
    assert off[0][-1] != off[0][0]
    assert on[0] == off[0], f"dp {world} rank {rank}: losses differ"
    assert on[1] == off[1] and len(on[1]) == len(EVAL_AFTER), f"dp {world} rank {rank}: evaluation losses differ"
    for n, p in off[2].items():
        assert torch.equal(on[2][n], p), f"dp {world} rank {rank}: param {n} differs"


def test_gather_is_in_flight_when_the_first_module_runs_and_waits_go_group_by_group(ranks):
    rank, world = ranks
    needs_ranks(world, 2, "param values outside this rank's shard, which the gather brings")
    torch.manual_seed(0)
    module = make_mlp()
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=500, overlap_param_gather=True))
    opt = mxt.DistributedOptimizer(model, optimizer_config())
    cpp = model._cpp
    names = [n for n, _ in model.registered_params()]
    groups = cpp.num_bucket_groups
    first, last = module[0], module[5]  # the first Linear's params gather first, the last Linear's last
    assert cpp.group_of_param(names.index("0.weight")) == groups - 1
    last_group = cpp.group_of_param(names.index("5.weight"))
    assert last_group == 0
    seen = []  # (module, pending, next group to dispatch, the last Linear's weight), before our hook

    def observe(mod, _args):
        seen.append((mod, cpp.param_sync_pending, cpp.next_param_gather_group, last.weight.detach().clone()))

    handles = [m.register_forward_pre_hook(observe, prepend=True) for m in (first, module[2], module[3], last)]
    try:
        opt.zero_grad()
        mlp_loss(model, mlp_batch(rank, 0, 0)).backward()
        model.finish_grad_sync()
        before_step = last.weight.detach().clone()
        opt.step()
        # Only the first group (the first layers) is dispatched by the step.
        assert cpp.param_sync_pending and cpp.next_param_gather_group == groups - 2
        seen.clear()
        opt.zero_grad()
        mlp_loss(model, mlp_batch(rank, 1, 0)).backward()
        after_forward = last.weight.detach().clone()
        mod, pending, next_group, last_weight_then = seen[0]
        assert mod is first and pending and next_group == groups - 2, seen[0][1:3]
        # The last Linear's group was not even dispatched: its weight held the old values outside
        # this rank's shard (the shard itself is staged by the step), and its own pre-hook fixed that.
        assert next_group > last_group
        moved = before_step != after_forward
        assert moved.any()
        assert torch.equal(last_weight_then[moved & (last_weight_then != after_forward)],
                           before_step[moved & (last_weight_then != after_forward)])
        assert (last_weight_then != after_forward).any(), "the last Linear was already gathered at the first module"
        # Group by group: what is left to dispatch shrinks as forward goes on, and the last
        # module still found the sync pending.
        dispatched = [g for _, _, g, _ in seen]
        assert dispatched == sorted(dispatched, reverse=True) and len(set(dispatched)) >= 2, dispatched
        assert seen[-1][0] is last and seen[-1][1]
        assert not cpp.param_sync_pending
        model.finish_grad_sync()
        opt.step()
    finally:
        for h in handles:
            h.remove()
        opt.close()
        model.close()


def test_finish_param_sync_and_close_bring_the_gathered_values(ranks):
    rank, world = ranks
    torch.manual_seed(0)
    module = make_mlp()
    twin = copy.deepcopy(module)
    results = []
    for overlap, m in ((False, module), (True, twin)):
        model = mxt.DistributedDataParallel(m, mxt.DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=500, overlap_param_gather=overlap))
        opt = mxt.DistributedOptimizer(model, optimizer_config())
        opt.zero_grad()
        mlp_loss(model, mlp_batch(rank, 0, 0)).backward()
        model.finish_grad_sync()
        opt.step()
        model.finish_param_sync()  # reading params outside forward: wait for the gathers first
        assert not model._cpp.param_sync_pending
        results.append([p.detach().clone() for p in m.parameters()])
        opt.close()
        model.close()
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_forward_that_skips_modules_leaves_nothing_behind(ranks):
    """Without overlap_grad_reduce a module may sit out an iteration: its group's gather is never
    waited for in forward, and the next step finishes it before updating the shards."""
    rank, world = ranks
    torch.manual_seed(0)
    module = make_mlp()
    twin = copy.deepcopy(module)
    finals = []
    for overlap, m in ((False, module), (True, twin)):
        model = mxt.DistributedDataParallel(m, mxt.DistributedDataParallelConfig(
            use_distributed_optimizer=True, bucket_size=500, overlap_param_gather=overlap))
        opt = mxt.DistributedOptimizer(model, optimizer_config())
        for step in range(4):
            opt.zero_grad()
            x, y = mlp_batch(rank, step, 0)
            if step == 2:  # the last Linear sits out
                m[:5](x).square().mean().backward()
            else:
                mlp_loss(model, (x, y)).backward()
            model.finish_grad_sync()
            opt.step()
        opt.close()
        model.close()
        finals.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*finals):
        assert torch.equal(a, b)
