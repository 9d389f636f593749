"""Forward pre-hooks a script registered before wrapping that read a module's params (torch's old
``weight_norm`` and ``prune`` compute ``weight`` from ``weight_g``/``weight_v`` or ``weight_orig``
in one) run after mxddp's gather: with ``overlap_param_gather`` the losses are those of a run
without it (they read the pre-step values of other ranks' shards before), and under FSDP's
``optim_grads_params`` they read the gathered values, not the NaN stand-ins."""
import warnings

import pytest
import torch
import torch.nn.utils.prune

import mxddp.torch as mxt


def losses(rank, reparametrize, fsdp=None, overlap=False, steps=4):
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                 torch.nn.Linear(32, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm's deprecation
        if reparametrize == "weight_norm":
            torch.nn.utils.weight_norm(module[2])
        else:
            torch.nn.utils.prune.l1_unstructured(module[2], "weight", 0.3)
    module = module.to(torch.bfloat16)
    cfg = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                            overlap_param_gather=overlap)
    if fsdp is None:
        cfg.bucket_size = 200  # several buckets: the later gathers are still in flight at the forward
        model = mxt.DistributedDataParallel(module, cfg)
    else:
        cfg.use_megatron_fsdp, cfg.data_parallel_sharding_strategy = True, fsdp
        model = mxt.FullyShardedDataParallel(module, cfg, fsdp_unit_modules=[torch.nn.Linear])
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-2))
    out = []
    try:
        for step in range(steps):
            opt.zero_grad()
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step + 10 * rank)).to(torch.bfloat16)
            loss = model(x).float().square().mean()
            loss.backward()
            model.finish_grad_sync()
            opt.step()
            out.append(loss.item())
    finally:
        opt.close()
        model.close()
    return out


@pytest.mark.parametrize("reparametrize", ["weight_norm", "prune"])
@pytest.mark.parametrize("fsdp", [None, "optim"])
def test_a_pre_hook_registered_before_wrapping_reads_gathered_params(ranks, reparametrize, fsdp):
    rank, _ = ranks
    assert losses(rank, reparametrize, fsdp, overlap=True) == losses(rank, reparametrize, fsdp, overlap=False)


@pytest.mark.parametrize("reparametrize", ["weight_norm", "prune"])
def test_a_pre_hook_registered_before_wrapping_reads_a_gathered_unit(ranks, reparametrize):
    rank, _ = ranks
    sharded = losses(rank, reparametrize, "optim_grads_params")
    assert all(v == v for v in sharded), f"a NaN loss: the hook read the stand-ins ({sharded})"
    assert sharded == losses(rank, reparametrize, "optim")
