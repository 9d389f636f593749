"""Megatron's ``num_zeros_in_grad``: with ``OptimizerConfig(log_num_zeros_in_grad=True)`` the
step's third value, and ``count_zeros()`` alone, count the zero elements of the synchronized
grads once each, summed over the ranks, whatever the wrapper and strategy: the count of a plain
torch model's grads over the global batch. (megatron-core's own count is compared in
test_megatron_api.py.)"""
import pytest
import torch

import mxddp.torch as mxt

STEPS = 3


def batch(step, rank, world):
    """Rank r's inputs: features 0-3 are 0 on every rank (their weight columns' grads are 0 after
    the sum), features 4-7 on rank 0 only (0 in its own grads, not in the sum at world > 1)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
    x[:, :(8 if rank == 0 else 4)] = 0.0
    return x


def module():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def torch_counts(world):
    """The zeros of a plain torch model's grads, each step, over the global batch."""
    model = module()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counts = []
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.cat([batch(step, r, world) for r in range(world)])
        model(x).square().mean().backward()
        counts.append(float(sum(int((p.grad == 0).sum()) for p in model.parameters())))
        opt.step()
    return counts


def wrap(kind):
    distributed = kind != "ddp_replicated"
    cfg = mxt.DistributedDataParallelConfig(use_distributed_optimizer=distributed, overlap_grad_reduce=True,
                                            grad_reduce_in_fp32=True)
    if kind.startswith("ddp"):
        cfg.bucket_size = 200  # several buckets, each padded
        return mxt.DistributedDataParallel(module(), cfg), distributed
    cfg.use_megatron_fsdp, cfg.data_parallel_sharding_strategy = True, kind
    return mxt.FullyShardedDataParallel(module(), cfg, fsdp_unit_modules=[torch.nn.Linear]), distributed


# F32 only: BF16 grads summed in another order than the reference's can round to an accidental
# zero in one and not the other (tests/optim/distributed_optimizer_test.cc counts BF16 grads).
@pytest.mark.parametrize("kind", ["ddp", "ddp_replicated", "optim", "optim_grads", "optim_grads_params"])
def test_step_counts_the_zeros_of_the_summed_grads_once(ranks, kind):
    rank, world = ranks
    model, distributed = wrap(kind)
    config = mxt.OptimizerConfig(lr=1e-2, use_distributed_optimizer=distributed, log_num_zeros_in_grad=True)
    opt = mxt.DistributedOptimizer(model, config)
    try:
        counts = []
        for step in range(STEPS):
            opt.zero_grad()
            model(batch(step, rank, world)).square().mean().backward()
            model.finish_grad_sync()
            alone = opt.count_zeros()
            ok, _, num_zeros = opt.step()
            assert ok and isinstance(num_zeros, float) and num_zeros == alone
            counts.append(num_zeros)
    finally:
        opt.close()
        model.close()
    # 32 x 4 weight elements at least (x 8 at world 1); every rank the same count.
    assert min(counts) >= 32 * (8 if world == 1 else 4)
    assert counts == torch_counts(world)


def test_count_zeros_under_a_torch_optimizer_and_none_without_the_flag(ranks):
    rank, world = ranks
    model, _ = wrap("ddp")
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    try:
        with pytest.raises(RuntimeError, match=r"count_zeros\(\) was called before any backward"):
            opt.count_zeros()
        model(batch(0, rank, world)).square().mean().backward()
        model.finish_grad_sync()
        assert opt.count_zeros() == torch_counts(world)[0]
    finally:
        opt.close()
        model.close()
    model, _ = wrap("ddp")
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2, use_distributed_optimizer=True))
    try:
        opt.zero_grad()
        model(batch(0, rank, world)).square().mean().backward()
        model.finish_grad_sync()
        assert opt.step()[2] is None  # not counted without log_num_zeros_in_grad, as Megatron's
    finally:
        opt.close()
        model.close()
