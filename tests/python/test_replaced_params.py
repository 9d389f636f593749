"""A param replaced after wrapping is refused at the next forward or finish_grad_sync, naming it
(issue 40, item 6): a new nn.Parameter assigned to the module, or a new ``param.data`` (also what
``module.to(dtype)`` does), would otherwise never train while the run goes on. DDP (with MXFP8
weights too) and FSDP, whose own gathers and releases swap the params' storage all the time, so a
legitimate run must not be refused either.
"""
import pytest
import torch

import mxddp.torch as mxt


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x))


class TiedNet(torch.nn.Module):
    """An embedding, two Blocks (FSDP's units) and a head tied to the embedding (non-unit)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 32)
        self.blocks = torch.nn.ModuleList([Block(32), Block(32)])
        self.head = torch.nn.Linear(32, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h).float().square().mean()


KINDS = ["ddp", "ddp:mxfp8", "fsdp:no_shard", "fsdp:optim_grads_params", "fsdp:optim_grads_params:fine_grained"]


def wrap(kind):
    module = TiedNet()
    if kind.startswith("ddp"):
        mxfp8 = kind == "ddp:mxfp8"
        if mxfp8:
            module = module.to(torch.bfloat16)
        config = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                   overlap_param_gather=True, fp8_param_gather=mxfp8)
        model = mxt.DistributedDataParallel(module, config)
    else:
        _, strategy, *fine = kind.split(":")
        config = mxt.DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                                   data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True,
                                                   overlap_param_gather=True,
                                                   megatron_fsdp_enable_fine_grained_param_gather=bool(fine) or None)
        model = mxt.FullyShardedDataParallel(module, config, [Block])
    return module, model, mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2))


def batch(rank, step):
    return torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def train_step(model, opt, rank, step):
    opt.zero_grad()
    model(batch(rank, step)).backward()
    model.finish_grad_sync()
    assert opt.step()[0]


def close(model, opt):
    opt.close()
    model.close()


# (what is replaced, how) -> the texts the error names
REPLACEMENTS = {
    "a unit's weight by a new Parameter": (
        lambda m: setattr(m.blocks[0].fc, "weight", torch.nn.Parameter(torch.randn(32, 32))),
        ["param 'blocks.0.fc.weight' was replaced after wrapping", "the module's 'blocks.0.fc.weight'"]),
    "a bias's .data": (
        lambda m: setattr(m.blocks[1].fc.bias, "data", torch.zeros(32)),
        ["param 'blocks.1.fc.bias' no longer holds the storage", "its .data was replaced"]),
    "the tied head by a Parameter of its own": (
        lambda m: setattr(m.head, "weight", torch.nn.Parameter(m.embed.weight.detach().clone())),
        ["param 'embed.weight' was replaced after wrapping", "the module's 'head.weight'"]),
    "every .data, by module.to(float64)": (
        lambda m: m.to(torch.float64), ["param 'embed.weight' no longer holds the storage"]),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("replacement", list(REPLACEMENTS))
def test_a_param_replaced_between_steps_is_refused_at_the_next_forward(ranks, kind, replacement):
    rank, _ = ranks
    module, model, opt = wrap(kind)
    train_step(model, opt, rank, 0)
    replace, expected = REPLACEMENTS[replacement]
    replace(module)
    opt.zero_grad()
    with pytest.raises(RuntimeError) as e:
        model(batch(rank, 1))
    for text in ["forward: ", *expected]:
        assert text in str(e.value), str(e.value)
    close(model, opt)


@pytest.mark.parametrize("kind", KINDS)
def test_a_param_replaced_after_backward_is_refused_at_finish_grad_sync(ranks, kind):
    rank, _ = ranks
    module, model, opt = wrap(kind)
    opt.zero_grad()
    model(batch(rank, 0)).backward()
    weight = module.blocks[0].fc.weight
    module.blocks[0].fc.weight = torch.nn.Parameter(torch.randn(32, 32))
    with pytest.raises(RuntimeError, match="finish_grad_sync: param 'blocks.0.fc.weight' was replaced after wrapping"):
        model.finish_grad_sync()
    module.blocks[0].fc.weight = weight  # put back, the run goes on
    model.finish_grad_sync()
    assert opt.step()[0]
    close(model, opt)


@pytest.mark.parametrize("kind", KINDS)
def test_a_legitimate_run_is_not_refused(ranks, kind):
    """Steps, an evaluation forward under no_grad, values copied into a param (not replacing it),
    a state dict: nothing is refused, and the copied values train."""
    rank, _ = ranks
    module, model, opt = wrap(kind)
    for step in range(3):
        train_step(model, opt, rank, step)
        with torch.no_grad():
            model(batch(rank, 10 + step))
    bias = module.blocks[0].fc.bias
    if kind == "ddp":  # F32 params: the param buffer holds this rank's shard of the main params
        with torch.no_grad():
            bias.copy_(torch.full((32,), 0.5))
    state = model.state_dict()
    prefix = "module." if kind.startswith("fsdp") else ""  # Megatron's DDP keys it as the module
    assert set(state) >= {prefix + "embed.weight", prefix + "blocks.0.fc.weight"}
    train_step(model, opt, rank, 3)
    if kind == "ddp":  # trained from the copied values (lr 1e-2: Adam moves each by about 0.01)
        assert (bias.detach() - 0.5).abs().max() < 0.05, bias
    close(model, opt)
