"""torch DDP's semantics on mxddp.torch.DistributedDataParallel (issue 43 item 3, issue 44 item 1):
the two constructor forms and torch's keyword arguments, rank 0's params and buffers broadcast at
wrap time and buffers before forwards, grads synchronized at the end of backward, accumulation
through require_backward_grad_sync and no_sync, unused params, bf16 autocast with the fused
accumulation, Megatron's DDP methods. References: torch.nn.parallel.DistributedDataParallel over
the session's gloo group, params updated by plain SGD on both sides (no optimizer involved).
Runs under mpirun at 2 and 4 ranks."""
import contextlib
import copy
import types

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

import mxddp.torch as mxt
from mxddp.torch import torch_semantics
from conftest import needs_ranks


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def sgd(pairs, lr=0.1):
    """p -= lr * grad for (param, grad) pairs."""
    with torch.no_grad():
        for p, g in pairs:
            p.sub_(lr * g)


def mx_step(model, lr=0.1):
    sgd([(p, p.main_grad) for _, p in model.registered_params()], lr)
    model.zero_grad_buffer()


def torch_step(ref, lr=0.1):
    sgd([(p, p.grad) for p in ref.parameters() if p.grad is not None], lr)
    ref.zero_grad(set_to_none=True)


# ---- construction ----

def test_torch_form_defaults_suit_a_torch_ddp_user(ranks):
    model = mxt.DistributedDataParallel(torch.nn.Linear(8, 8))
    try:
        cfg = model.ddp_config
        assert cfg.overlap_grad_reduce and not cfg.use_distributed_optimizer
        assert cfg.bucket_size == 25 * 2 ** 20 // 4  # torch's bucket_cap_mb=25, in F32 elements
        assert model.broadcast_buffers and model.find_unused_parameters is False and model.require_backward_grad_sync
    finally:
        model.close()
    model = mxt.DistributedDataParallel(torch.nn.Linear(8, 8).bfloat16(), bucket_cap_mb=1)
    try:
        assert model.ddp_config.bucket_size == 2 ** 20 // 2  # BF16 grads
    finally:
        model.close()


def test_megatron_form_keeps_megatron_defaults_in_both_orders(ranks):
    ddp_config = mxt.DistributedDataParallelConfig()
    transformer = types.SimpleNamespace(gradient_accumulation_fusion=False, calculate_per_token_loss=False, fp16=False)
    for model in (mxt.DistributedDataParallel(torch.nn.Linear(8, 8), ddp_config),
                  mxt.DistributedDataParallel(transformer, ddp_config, torch.nn.Linear(8, 8)),
                  mxt.DistributedDataParallel(config=transformer, ddp_config=ddp_config, module=torch.nn.Linear(8, 8),
                                              disable_bucketing=True)):
        try:
            assert model.ddp_config.overlap_grad_reduce is False
            assert not model.broadcast_buffers and model.find_unused_parameters is None
            if model.config is transformer:  # read from Megatron's TransformerConfig
                assert model.fused_params == [False, False]
        finally:
            model.close()


@pytest.mark.parametrize("kwargs,match", [
    ({"device_ids": [0]}, "device_ids=\\[0\\] is not supported"),
    ({"output_device": 0}, "output_device=0 is not supported"),
    ({"gradient_as_bucket_view": False}, "gradient_as_bucket_view=False is not supported"),
    ({"bucket_cap_mb": 0}, r"bucket_cap_mb must be a number in \(0, 2\*\*43\) \(MiB of gradient per bucket\); got 0"),
    ({"bucket_cap_mb": 1e300}, r"bucket_cap_mb must be a number in \(0, 2\*\*43\).*; got 1e\+300"),
    ({"bucket_cap_mb": float("inf")}, r"bucket_cap_mb must be a number in \(0, 2\*\*43\).*; got inf"),
    ({"broadcast_buffers": 1}, "broadcast_buffers must be True or False; got 1"),
    ({"mixed_precision": object()}, "mixed_precision=.* is not supported"),
    ({"process_group": object()}, "process_group must be None or a torch.distributed ProcessGroup; got object"),
])
def test_torch_arguments_mxddp_cannot_honour_are_refused_by_name(ranks, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        mxt.DistributedDataParallel(torch.nn.Linear(4, 4), **kwargs)


def test_unknown_arguments_and_transformer_values_are_refused(ranks):
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        mxt.DistributedDataParallel(torch.nn.Linear(4, 4), bogus=1)
    with pytest.raises(ValueError, match="bucket_cap_mb=1 with a DistributedDataParallelConfig"):
        mxt.DistributedDataParallel(torch.nn.Linear(4, 4), mxt.DistributedDataParallelConfig(), bucket_cap_mb=1)
    per_token = types.SimpleNamespace(calculate_per_token_loss=True)
    with pytest.raises(ValueError, match="config.calculate_per_token_loss=True is not supported"):
        mxt.DistributedDataParallel(per_token, mxt.DistributedDataParallelConfig(), torch.nn.Linear(4, 4))


# ---- broadcasts ----

def test_torch_form_broadcasts_rank0_params_buffers_and_frozen_params_at_wrap_megatron_form_does_not(ranks):
    rank, world = ranks
    needs_ranks(world, 2, "ranks that start from different params")
    for torch_form in (True, False):
        torch.manual_seed(rank)  # every rank different
        module = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
        module[1].running_mean.fill_(rank)
        module[1].num_batches_tracked.fill_(rank + 7)
        module[2].requires_grad_(False)  # frozen params: torch DDP broadcasts them too
        args = () if torch_form else (mxt.DistributedDataParallelConfig(),)
        model = mxt.DistributedDataParallel(module, *args)
        try:
            for t in (module[0].weight, module[1].running_mean, module[1].num_batches_tracked, module[2].weight):
                same = all(torch.equal(g, gathered(t.detach())[0]) for g in gathered(t.detach()))
                assert same == torch_form
        finally:
            model.close()


def test_a_process_group_is_the_one_params_buffers_and_grads_go_over(ranks):
    """Groups of two consecutive ranks (one group at 2 ranks): each group's rank 0 gives its params
    and buffers, and grads are averaged inside the group only."""
    rank, world = ranks
    groups = [dist.new_group(list(range(start, min(start + 2, world)))) for start in range(0, world, 2)]
    group = groups[rank // 2]
    torch.manual_seed(rank)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    module[1].num_batches_tracked.fill_(rank)
    leader = rank // 2 * 2
    torch.manual_seed(leader)
    expected = torch.nn.Linear(4, 4).weight.detach().clone()
    model = mxt.DistributedDataParallel(module, process_group=group)
    try:
        assert torch.equal(module[0].weight.detach(), expected)
        assert module[1].num_batches_tracked.item() == leader
        def data(r):
            return torch.randn(3, 4, generator=torch.Generator().manual_seed(r))

        model(data(rank)).square().sum().backward()
        grads = []
        for r in range(leader, min(leader + 2, world)):  # each member's local gradient, by plain torch
            w = module[0].weight.detach().clone().requires_grad_()
            h = torch.nn.functional.linear(data(r), w, module[0].bias.detach())
            torch.nn.functional.batch_norm(h, None, None, module[1].weight.detach(), module[1].bias.detach(),
                                           training=True).square().sum().backward()
            grads.append(w.grad)
        assert grads[0].abs().sum() > 0
        torch.testing.assert_close(module[0].weight.main_grad, sum(grads) / len(grads), rtol=1e-5, atol=1e-6)
    finally:
        model.close()


def test_a_module_without_buffers_issues_no_buffer_broadcast(ranks, monkeypatch):
    calls = []
    real = torch_semantics._C.broadcast
    monkeypatch.setattr(torch_semantics._C, "broadcast", lambda t, root=0: (calls.append(t.numel()), real(t, root)))
    model = mxt.DistributedDataParallel(torch.nn.Linear(4, 4))
    try:
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
        assert calls == []
    finally:
        model.close()


class BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(5, 12)
        self.bn = torch.nn.BatchNorm1d(12)
        self.out = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_batchnorm_buffers_equal_across_ranks_every_step_and_equal_to_torch_ddp(ranks, accumulate):
    rank, world = ranks
    torch.manual_seed(0)
    module = BatchNormNet()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = mxt.DistributedDataParallel(module)
    seen = {"mx": [], "torch": []}
    # The buffers each BatchNorm starts its forward with: after the broadcast, where one was due.
    module.bn.register_forward_pre_hook(lambda m, a: seen["mx"].append([b.clone() for b in m.buffers()]))
    ref.module.bn.register_forward_pre_hook(lambda m, a: seen["torch"].append([b.clone() for b in m.buffers()]))
    gen = torch.Generator().manual_seed(100 + rank)
    try:
        for step in range(4):
            for micro in range(accumulate):
                x = torch.randn(6, 5, generator=gen) * (rank + 1) + rank
                last = micro == accumulate - 1
                model.require_backward_grad_sync = last
                model(x).square().mean().backward()
                if last:
                    ref(x).square().mean().backward()
                else:
                    with ref.no_sync():
                        ref(x).square().mean().backward()
            mx_step(model)
            torch_step(ref)
            for (n, p), q in zip(module.named_parameters(), ref.module.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=lambda m: f"step {step} {n}: {m}")
        for mine, theirs in zip(seen["mx"], seen["torch"]):
            for b, r in zip(mine, theirs):
                torch.testing.assert_close(b, r, rtol=1e-6, atol=1e-6)
        # torch broadcasts before the first forward of each step only: there every rank is alike.
        for i in range(0, len(seen["mx"]), accumulate):
            for b in seen["mx"][i]:
                assert all(torch.equal(g, b) for g in gathered(b)), (i, b)
        assert module.bn.num_batches_tracked.item() == 4 * accumulate
    finally:
        model.close()


# ---- gradients ----

def mlp():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def test_grads_are_synchronized_at_the_end_of_backward_and_finish_is_idempotent(ranks):
    rank, _ = ranks
    module = mlp()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = mxt.DistributedDataParallel(module, bucket_cap_mb=0.001)  # several buckets, overlapped
    try:
        assert model.num_buckets > 1
        x = torch.randn(5, 10, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        assert not model._grads_pending_sync
        for (n, p), q in zip(model.registered_params(), ref.module.parameters()):
            torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
        before = model.grad_buffer().clone()
        model.finish_grad_sync()  # a Megatron loop's call: nothing left to do
        model.finish_grad_sync()
        assert torch.equal(model.grad_buffer(), before)
    finally:
        model.close()


class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)

    def forward(self, x, reentrant):
        return torch.utils.checkpoint.checkpoint(self.b, torch.tanh(self.a(x)), use_reentrant=reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_even_reentrant_syncs_once_at_the_end_of_the_whole_backward(ranks, reentrant):
    """A reentrant checkpoint runs a nested backward in which b's params get their gradients first:
    the end of that one is not the end of the backward (the outputs' hooks begin it outside)."""
    rank, _ = ranks
    torch.manual_seed(2)
    module = Checkpointed()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = mxt.DistributedDataParallel(module)
    try:
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
        model(x, reentrant).square().sum().backward()
        ref(x, False).square().sum().backward()
        assert not model._grads_pending_sync
        for (n, p), q in zip(model.registered_params(), ref.module.parameters()):
            torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
    finally:
        model.close()


@pytest.mark.parametrize("how", ["attribute", "no_sync"])
def test_accumulation_without_reducing_then_the_synced_backward_reduces_the_sum(ranks, how):
    rank, _ = ranks
    module = mlp()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = mxt.DistributedDataParallel(module)
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(2):
            for micro in range(3):
                x = torch.randn(4, 10, generator=gen)
                last = micro == 2
                if how == "attribute":
                    model.require_backward_grad_sync = last
                    model(x).square().sum().backward()
                elif last:
                    model(x).square().sum().backward()
                else:
                    with model.no_sync():
                        model(x).square().sum().backward()
                    with pytest.raises(RuntimeError, match="inside model.no_sync"):
                        with model.no_sync():
                            model.finish_grad_sync()
                if not last:  # nothing reduced yet: the local sums
                    assert model._grads_pending_sync
                    with ref.no_sync():
                        ref(x).square().sum().backward()
                else:
                    ref(x).square().sum().backward()
            for (n, p), q in zip(model.registered_params(), ref.module.parameters()):
                torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
            mx_step(model)
            torch_step(ref)
    finally:
        model.close()


class Branchy(torch.nn.Module):
    """A branch skipped on odd steps (by every rank), and on rank 1's even steps one more."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 8)
        self.branch = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


@pytest.mark.parametrize("overlap", [True, False])
def test_unused_params_are_found_and_agreed_on_with_and_without_overlap(ranks, overlap):
    rank, _ = ranks
    torch.manual_seed(3)
    module = Branchy()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module), find_unused_parameters=True)
    if overlap:
        model = mxt.DistributedDataParallel(module, find_unused_parameters=True)
    else:  # Megatron's form: synchronized by finish_grad_sync
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(), find_unused_parameters=True)
    names = [n for n, _ in model.registered_params()]
    branch = sorted(names.index(n) for n in ("branch.weight", "branch.bias"))
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(4):
            use = step % 2 == 0
            x = torch.randn(3, 8, generator=gen)
            model(x, use_branch=use).square().sum().backward()
            model.finish_grad_sync()
            ref(x, use_branch=use).square().sum().backward()
            assert model._unused_params == ([] if use else branch)
            for (n, p), q in zip(model.registered_params(), ref.module.parameters()):
                expected = torch.zeros_like(p) if q.grad is None else q.grad
                torch.testing.assert_close(p.main_grad, expected, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
            mx_step(model)
            torch_step(ref)
    finally:
        model.close()


def test_an_unused_param_without_find_unused_parameters_is_refused_naming_it(ranks):
    model = mxt.DistributedDataParallel(Branchy())
    try:
        model(torch.ones(2, 8)).sum().backward()
        with pytest.raises(RuntimeError, match="2 param\\(s\\) got no gradient in this backward: 'branch.weight', "
                                               "'branch.bias'.*find_unused_parameters=True"):
            model(torch.ones(2, 8), use_branch=False).sum().backward()
    finally:
        model.close()


def test_megatron_form_with_overlap_reduces_buckets_whose_params_never_reported(ranks):
    """Megatron's design: an unused param's gradient is a zero, reduced with its bucket."""
    model = mxt.DistributedDataParallel(Branchy(), mxt.DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                                      bucket_size=64))
    try:
        model(torch.ones(2, 8), use_branch=False).sum().backward()
        model.finish_grad_sync()
        assert model.module.branch.weight.main_grad.abs().sum() == 0
        assert model.module.head.weight.main_grad.abs().sum() > 0
    finally:
        model.close()


# ---- autocast ----

def autocast_run(module, ranks, mx: bool, split: bool = False, steps: int = 4):
    """Losses and final params of a bf16-autocast run: mxddp (fused accumulation) or torch DDP.
    ``split`` runs each rank's batch as two micro-batches of half its rows (torch's no_sync): the
    same loss and gradient, with the rows' sum in the weight gradient taken in another order."""
    rank, _ = ranks
    model = mxt.DistributedDataParallel(module) if mx else torch.nn.parallel.DistributedDataParallel(module)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    try:
        for _ in range(steps):
            x = torch.randn(16, 12, generator=gen)
            parts = x.chunk(2) if split else [x]
            loss = 0.0
            for i, part in enumerate(parts):
                with model.no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        part_loss = model(part).float().square().sum() / (16 * 6)
                    part_loss.backward()
                loss += part_loss.item()
            losses.append(loss)
            mx_step(model) if mx else torch_step(model)
        return losses, [p.detach().clone() for p in module.parameters()]
    finally:
        if mx:
            model.close()


def test_bf16_autocast_with_fused_accumulation_matches_torch_ddp_within_its_own_bound(ranks):
    torch.manual_seed(5)
    module = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                 torch.nn.Linear(32, 6))
    mine, mine_params = autocast_run(copy.deepcopy(module), ranks, mx=True)
    theirs, theirs_params = autocast_run(copy.deepcopy(module), ranks, mx=False)
    _, other_params = autocast_run(copy.deepcopy(module), ranks, mx=False, split=True)
    bound = max((a - b).abs().max().item() for a, b in zip(theirs_params, other_params))
    diff = max((a - b).abs().max().item() for a, b in zip(mine_params, theirs_params))
    print(f"bf16 autocast: mxddp vs torch DDP params {diff:.3e}; torch vs torch (split micro-batches) {bound:.3e}")
    assert bound > 0  # the bound is a real one: BF16 products differ with the reduction order
    assert diff <= bound
    assert max(abs(a - b) for a, b in zip(mine, theirs)) <= 1e-2 * max(abs(v) for v in theirs)


# ---- Megatron's methods, clip, state dict ----

def test_megatron_methods_scale_start_and_param_sync(ranks):
    rank, world = ranks
    model = mxt.DistributedDataParallel(mlp(), mxt.DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                                  bucket_size=100))
    try:
        model(torch.ones(2, 10) * (rank + 1)).sum().backward()
        model.start_grad_sync()  # everything was reported: nothing left to issue, no error
        with pytest.raises(RuntimeError, match="finish_grad_sync\\(\\) first"):
            model.scale_gradients(0.5)
        model.finish_grad_sync()
        before = model.grad_buffer().clone()
        model.scale_gradients(0.25)
        torch.testing.assert_close(model.grad_buffer(), before * 0.25)
        model.start_param_sync(force_sync=True)
        model.zero_grad_buffer()
        assert model.grad_buffer().abs().sum() == 0
        # start_grad_sync before any backward of a window: every bucket issued with zero contributions
        model.start_grad_sync()
        assert all(model._cpp.bucket_group_issued(g) for g in range(model._cpp.num_bucket_groups))
        model.finish_grad_sync()
    finally:
        model.close()


def test_clip_grad_norm_without_an_optimizer_is_refused(ranks):
    model = mxt.DistributedDataParallel(torch.nn.Linear(4, 4))
    try:
        with pytest.raises(RuntimeError, match="no mxddp.torch.DistributedOptimizer is built on this model"):
            model.clip_grad_norm_(1.0)
    finally:
        model.close()


def test_state_dict_on_one_rank_alone_gives_full_tensors(ranks):
    rank, _ = ranks
    module = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.BatchNorm1d(7))
    model = mxt.DistributedDataParallel(module)
    try:
        if rank == 0:  # no collective: the other ranks do not call it
            sd = model.state_dict()
            assert sd["module.0.weight"].shape == (7, 6) and torch.equal(sd["module.0.weight"], module[0].weight)
            assert "module.1.num_batches_tracked" in sd
        dist.barrier()
    finally:
        model.close()


def test_a_backward_onto_reduce_scattered_grads_is_refused(ranks):
    """With the distributed optimizer the sync leaves only this rank's shard reduced: a backward
    after the step and before zero_grad would add onto the other ranks' unreduced parts."""
    rank, _ = ranks
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True))
    opt = mxt.DistributedOptimizer(model, torch.optim.SGD(module.parameters(), lr=0.1))
    try:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        model(x).sum().backward()
        model.finish_grad_sync()
        opt.step()
        with pytest.raises(RuntimeError, match="already reduce-scattered and not zeroed.*optimizer.zero_grad"):
            model(x).sum().backward()
        opt.zero_grad()  # and the loop goes on
        model(x).sum().backward()
        model.finish_grad_sync()
        opt.step()
    finally:
        opt.close()
        model.close()


def test_megatron_form_refuses_a_second_backward_before_the_sync_naming_no_sync(ranks):
    model = mxt.DistributedDataParallel(torch.nn.Linear(8, 2), mxt.DistributedDataParallelConfig())
    try:
        model(torch.ones(2, 8)).sum().backward()
        with pytest.raises(RuntimeError, match="previous backward's gradients were not synchronized.*no_sync"):
            model(torch.ones(2, 8)).sum().backward()
        model.zero_grad_buffer()
        with model.no_sync():
            model(torch.ones(2, 8)).sum().backward()
        model(torch.ones(2, 8)).sum().backward()
        model.finish_grad_sync()
    finally:
        model.close()


def test_a_step_after_a_last_backward_inside_no_sync_says_why_it_is_refused(ranks):
    """torch DDP decides at the forward whether a backward synchronizes, mxddp when the backward starts:
    a last backward inside no_sync() after a forward outside it leaves the grads unsynchronized, and the
    step refuses them naming no_sync (torch's form has no finish_grad_sync to point to)."""
    rank, _ = ranks
    module = torch.nn.Linear(4, 2)
    model = mxt.DistributedDataParallel(module)
    opt = mxt.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        loss = model(torch.randn(3, 4)).sum()
        with model.no_sync():
            loss.backward()
        with pytest.raises(RuntimeError, match=r"the last backward ran inside model.no_sync\(\).*run the last "
                                               r"micro-batch's backward outside no_sync\(\)"):
            opt.step()
        model.finish_grad_sync()
        opt.step()
    finally:
        opt.close()
        model.close()
