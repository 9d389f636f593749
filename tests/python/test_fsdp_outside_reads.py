"""FSDP: modules run where their params hold no current values are refused, and
finish_param_sync() brings every rank the step's result (2 and 4 ranks).

Outside its unit's forward and backward a unit's param holds a NaN stand-in (optim_grads_params)
or, with optim and optim_grads and overlap_param_gather, the values from before the last step on
the ranks that did not update it (its gather waits for the unit's next pre-forward). Each case is
run against torch on one process with the same batches (every rank feeds the same one)."""
from __future__ import annotations

import pytest
import torch

import mxddp.torch as mxt

STEPS = 3
LR = 0.01


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(torch.nn.Module):
    """``order``: where the parent calls the first block's Linear itself: "none", "before" the
    block ran in this forward, or "after"."""

    def __init__(self, order: str):
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)  # in no unit
        self.b1, self.b2 = Block(), Block()
        self.order = order

    def forward(self, x):
        x = self.embed(x)
        if self.order == "before":
            y = self.b1.fc(x)
            return self.b2(self.b1(x) + y)
        if self.order == "after":
            h = self.b1(x)
            return self.b2(h + self.b1.fc(h))
        return self.b2(self.b1(x))


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + step))


def torch_run(order: str, ema_decay: float = 0.0):
    """Losses (and, with ema_decay, the EMA of every param taken after each step) of torch's AdamW."""
    torch.manual_seed(0)
    module = Net(order)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.0)
    ema = [p.detach().clone() for p in module.parameters()]
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = module(batch(step)).pow(2).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        with torch.no_grad():
            torch._foreach_lerp_(ema, list(module.parameters()), 1.0 - ema_decay)
    return losses, ema


def wrap(order: str, strategy: str, fine_grained: bool = False):
    torch.manual_seed(0)
    module = Net(order)
    config = mxt.DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=True, overlap_param_gather=True,
        megatron_fsdp_enable_fine_grained_param_gather=fine_grained)
    model = mxt.FullyShardedDataParallel(module, config, fsdp_unit_modules=[Block])
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=0.0))
    return module, model, opt


def train_losses(order: str, strategy: str, fine_grained: bool = False) -> list[float]:
    """The losses of STEPS steps of mxddp's FSDP; the model and optimizer closed after."""
    module, model, opt = wrap(order, strategy, fine_grained)
    try:
        return [train_step(model, opt, step) for step in range(STEPS)]
    finally:
        opt.close()
        model.close()


def train_step(model, opt, step: int) -> float:
    opt.zero_grad()
    loss = model(batch(step)).pow(2).sum()
    loss.backward()
    model.finish_grad_sync()
    opt.step()
    return loss.item()


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_a_unit_submodule_the_parent_runs_before_the_unit_is_refused(ranks, strategy):
    """Before this stop: optim and optim_grads trained on the old weights of the ranks that did not
    update them (loss 3.466 where torch's is 3.298), optim_grads_params on NaN."""
    module, model, opt = wrap("before", strategy)
    try:
        if strategy != "optim_grads_params":
            train_step(model, opt, 0)  # the first forward reads the initial values, current everywhere
        with pytest.raises(RuntimeError, match="'b1.fc' \\(Linear\\) ran outside the forward and backward of its "
                                               "FSDP unit 'b1'.*megatron_fsdp_enable_fine_grained_param_gather"):
            model(batch(1))
    finally:
        opt.close()
        model.close()


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_a_unit_submodule_the_parent_runs_after_the_unit_matches_torch(ranks, strategy):
    """After the unit's pre-forward the unsharded params hold the step's result: allowed, and right."""
    expected, _ = torch_run("after")
    assert train_losses("after", strategy) == pytest.approx(expected, rel=1e-5)


def test_a_sharded_unit_submodule_the_parent_runs_after_the_unit_is_refused(ranks):
    module, model, opt = wrap("after", "optim_grads_params")
    try:
        with pytest.raises(RuntimeError, match="'b1.fc' \\(Linear\\) ran outside .* hold NaN stand-ins"):
            model(batch(0))
    finally:
        opt.close()
        model.close()


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_fine_grained_units_and_no_shard_let_the_parent_run_them(ranks, strategy, order):
    """With the fine-grained gather the Linear is a unit of its own, gathered by its own hooks
    wherever it runs; no_shard keeps every param current on every rank."""
    expected, _ = torch_run(order)
    assert train_losses(order, strategy, fine_grained=strategy != "no_shard") == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_finish_param_sync_gives_every_rank_the_step_result(ranks, strategy):
    """An EMA of the weights taken after each step: every rank's equals torch's once
    finish_param_sync() has run. Without it a module run outside forward is refused."""
    rank, world = ranks
    decay = 0.5
    expected_losses, expected_ema = torch_run("none", decay)
    module, model, opt = wrap("none", strategy)
    try:
        ema = [p.detach().clone() for p in module.parameters()]
        losses = []
        for step in range(STEPS):
            losses.append(train_step(model, opt, step))
            if step == 0:
                with pytest.raises(RuntimeError, match="'embed' \\(Linear\\) ran outside the wrapper's forward.*"
                                                       "values from before the last step.*finish_param_sync"):
                    module.embed(batch(0))
                with pytest.raises(RuntimeError, match="'b2.fc' \\(Linear\\) ran outside .*finish_param_sync"):
                    module.b2.fc(batch(0))
            model.finish_param_sync()
            module.embed(batch(0))  # now current: allowed
            with torch.no_grad():
                torch._foreach_lerp_(ema, list(module.parameters()), 1.0 - decay)
    finally:
        opt.close()
        model.close()
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for got, want in zip(ema, expected_ema):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The same on every rank: rank 0's, broadcast, equals this rank's.
    flat = torch.cat([e.flatten() for e in ema])
    root = flat.clone()
    mxt.broadcast(root, root=0)
    assert torch.equal(root, flat)


def test_a_module_of_no_unit_run_after_finish_grad_sync_is_refused(ranks):
    """optim_grads_params: the params of no unit are released by finish_grad_sync()."""
    module, model, opt = wrap("none", "optim_grads_params")
    try:
        train_step(model, opt, 0)
        with pytest.raises(RuntimeError, match="'embed' \\(Linear\\) ran outside the wrapper's forward.*"
                                               "NaN stand-ins.*kept until finish_grad_sync"):
            module.embed(batch(0))
        model(batch(1))  # the wrapper's forward gathers them: no refusal inside it
    finally:
        opt.close()
        model.close()


def test_finish_param_sync_between_backward_and_finish_grad_sync_is_refused(ranks):
    module, model, opt = wrap("none", "optim")
    try:
        train_step(model, opt, 0)
        module.forward = lambda x: module.b1(module.embed(x))
        model(batch(1)).pow(2).sum().backward()
        with pytest.raises(RuntimeError, match="finish_param_sync\\(\\) between backward and finish_grad_sync"):
            model.finish_param_sync()
        model.finish_grad_sync()
        model.finish_param_sync()
        module.b2.fc(batch(0))
    finally:
        opt.close()
        model.close()
