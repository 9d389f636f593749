"""Zero copy: the torch params and main_grads are views of mxddp's buffers, placed by its layout;
no grad tensor outlives its hook; buckets reduce during backward with overlap; frozen and tied
params; the memory tracker's figures."""
import pytest
import torch

import mxddp.torch as mxt


class Tied(torch.nn.Module):
    """An embedding tied to its output projection, with a frozen layer in between."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.hidden = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.hidden(self.frozen(self.embed(ids)))))


def loss_of(model, rank):
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(rank))
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def config(**kw):
    return mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True, **kw)


def test_params_and_main_grads_are_views_of_the_buffers(ranks):
    torch.manual_seed(0)
    module = Tied()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    frozen_ptr = module.frozen.weight.data_ptr()
    model = mxt.DistributedDataParallel(module, config(overlap_grad_reduce=True, bucket_size=500))
    try:
        names = [n for n, _ in model.registered_params()]
        # named_parameters order, the tied weight once, the frozen layer left out.
        assert names == ["embed.weight", "hidden.weight", "hidden.bias"]
        assert module.head.weight is module.embed.weight
        pbuf, gbuf = model.param_buffer(), model.grad_buffer()
        assert pbuf.dtype == torch.float32 and gbuf.dtype == torch.float32
        for i, (n, p) in enumerate(model.registered_params()):
            start, end = model._cpp.param_range(i)
            assert end - start == p.numel()
            assert p.data_ptr() == pbuf.data_ptr() + 4 * start, n
            assert p.main_grad.data_ptr() == gbuf.data_ptr() + 4 * start, n
            torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)  # values copied in
        # Reverse registration order, as Megatron lays out.
        assert model._cpp.param_range(0)[0] > model._cpp.param_range(2)[0]
        assert module.frozen.weight.data_ptr() == frozen_ptr
        assert not hasattr(module.frozen.weight, "main_grad")
        # A write through the buffer is a write to the param.
        with torch.no_grad():
            pbuf[model._cpp.param_range(2)[0]] = 7.0
        assert module.hidden.bias[0].item() == 7.0
    finally:
        model.close()
    # close(): params keep their values in storage of their own; main_grad is gone.
    assert module.hidden.bias[0].item() == 7.0
    assert not hasattr(module.embed.weight, "main_grad")


@pytest.mark.parametrize("fusion", [False, True])
def test_hook_frees_grad_and_buckets_reduce_during_backward(ranks, fusion):
    """With fusion the weights' dW goes to main_grad in their modules' backward (the biases still
    take the hook); without, every param's grad goes through the hook."""
    rank, _ = ranks
    torch.manual_seed(0)
    module = Tied()
    model = mxt.DistributedDataParallel(module, config(overlap_grad_reduce=True, bucket_size=200),
                                        gradient_accumulation_fusion=fusion)
    seen = {}
    try:
        assert model._cpp.num_bucket_groups >= 2
        # The embedding's grad is the last to be final (its lookup runs first in forward); by the time
        # backward reaches the embedding, the bucket holding hidden's params has been issued.
        hidden_group = model._cpp.bucket_of_param(2)

        def before_embedding_backward(mod, grad_out):
            seen["issued"] = model._cpp.bucket_group_issued(hidden_group)

        module.embed.register_full_backward_pre_hook(before_embedding_backward)
        loss_of(model, rank).backward()
        assert seen["issued"] is True
        for n, p in model.registered_params():
            assert p.grad is None, n
            assert p.main_grad.abs().sum() > 0, n
        assert module.frozen.weight.grad is None
        model.finish_grad_sync()
    finally:
        model.close()


def test_memory_tracker_counts_the_buffers_and_optimizer_shards(ranks):
    rank, world = ranks
    torch.manual_seed(0)
    model = mxt.DistributedDataParallel(Tied(), config())
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-3))
    try:
        usage = mxt.memory_usage()
        numel = model._cpp.numel
        assert numel % world == 0 and numel >= sum(p.numel() for _, p in model.registered_params())
        assert usage["params"][0] == 4 * numel
        assert usage["grads"][0] == 4 * numel
        # F32 params: each rank's param shard is its main params (Megatron's rule), not a copy.
        assert usage["main_params"][0] == 0
        assert usage["optimizer_state"][0] == 2 * 4 * numel // world
        # On the CPU every byte is the host's, and the device's share is none.
        assert mxt.memory_usage("host") == usage
        assert all(v == (0, 0) for v in mxt.memory_usage("device").values())
        with pytest.raises(ValueError, match="place 'gpu' is not one of"):
            mxt.memory_usage("gpu")
        opt.zero_grad()
        loss_of(model, rank).backward()
        model.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok and norm > 0
    finally:
        opt.close()
        model.close()
    after = mxt.memory_usage()
    assert after["params"][0] == 0 and after["grads"][0] == 0 and after["main_params"][0] == 0


def test_no_sync_accumulates_without_reducing(ranks):
    rank, world = ranks
    torch.manual_seed(0)
    module = Tied()
    model = mxt.DistributedDataParallel(module, config(overlap_grad_reduce=True, bucket_size=200))
    try:
        with model.no_sync():
            loss_of(model, rank).backward()
            assert not any(model._cpp.bucket_group_issued(g) for g in range(model._cpp.num_bucket_groups))
        local = [p.main_grad.clone() for _, p in model.registered_params()]
        loss_of(model, rank).backward()  # the same batch again: local grads double, then reduce
        model.finish_grad_sync()
        reduced = model.grad_buffer().clone()
        # The mean over ranks of 2 x each rank's local grad, checked through an all-reduce.
        for (n, p), g in zip(model.registered_params(), local):
            mean = 2 * g.clone()
            mxt.all_reduce(mean, "avg")
            start, end = model._cpp.param_range([m for m, _ in model.registered_params()].index(n))
            # With the distributed optimizer only this rank's shard of each bucket is reduced.
            for b in range(model.num_buckets):
                bs, be = model._cpp.bucket_range(b)
                shard = ((be - bs) // world * rank + bs, (be - bs) // world * (rank + 1) + bs)
                lo, hi = max(start, shard[0]), min(end, shard[1])
                if lo < hi:
                    torch.testing.assert_close(reduced[lo:hi], mean.flatten()[lo - start:hi - start],
                                               rtol=1e-6, atol=1e-7)
    finally:
        model.close()


def test_each_step_hands_the_free_heap_pages_back_unless_told_not_to(ranks, monkeypatch):
    rank, _ = ranks
    calls = []
    monkeypatch.setattr(mxt.optimizer._C, "release_free_heap_pages", lambda: calls.append(1) or True)
    for release, expected in ((True, 2), (False, 0)):
        torch.manual_seed(0)
        model = mxt.DistributedDataParallel(Tied(), config())
        opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-3), release_heap_after_step=release)
        try:
            calls.clear()
            for _ in range(2):
                opt.zero_grad()
                loss_of(model, rank).backward()
                model.finish_grad_sync()
                assert opt.step()[0]
            assert len(calls) == expected, (release, calls)
        finally:
            opt.close()
            model.close()
    with pytest.raises(TypeError, match="release_heap_after_step must be a bool; got 'yes'"):
        mxt.DistributedOptimizer(None, mxt.OptimizerConfig(lr=1e-3), release_heap_after_step="yes")
