"""Ranks that disagree about what they wrap are refused at wrap time, on every rank, with one
message naming the first differing param or config field, each value and the ranks holding it
(issue 40, item 5): a param [64, 16] on one rank against [16, 64] on another (the same size, so
the same layout) or lr=1e-2 against lr=1.0 would otherwise train silently wrong. Rank 1 (the last
rank) differs from the others in each case; agreeing ranks still build and train.
"""
import pytest
import torch
import torch.distributed as dist

import mxddp
import mxddp.torch as mxt
from conftest import needs_ranks


class Params(torch.nn.Module):
    """A module holding the given params (name -> shape), in that order; forward sums x @ each."""

    def __init__(self, shapes: dict, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        for name, shape in shapes.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(*shape, dtype=dtype)))

    def forward(self, x):
        return sum((x[:, :p.shape[0]] @ p if p.dim() == 2 else x[:, :p.shape[0]] * p).sum() for p in self.parameters())


def differing(ranks):
    """Whether this rank is the one that differs (the last); skips at one rank."""
    rank, world = ranks
    needs_ranks(world, 2, "ranks that disagree")
    return rank == world - 1


def refused_everywhere(ranks, build, *expected):
    """build() raises mxddp.Error on every rank, with the same message, holding each expected text
    (where "on rank 0" stands for the ranks that agree and "on rank 1" for the last, which differs)."""
    _, world = ranks
    with pytest.raises(mxddp.Error) as e:
        build()
    message = str(e.value)
    others = "rank 0" if world == 2 else "ranks " + ", ".join(map(str, range(world - 1)))
    for text in expected:
        text = text.replace("on rank 1", f"on rank {world - 1}").replace("on rank 0", f"on {others}")
        assert text in message, message
    messages = [None] * ranks[1]
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, messages
    return message


DDP = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True)
FSDP = mxt.DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                         data_parallel_sharding_strategy="optim_grads_params")


def wrap(kind, module, config=None, **kw):
    if kind == "ddp":
        return mxt.DistributedDataParallel(module, config or DDP, **kw)
    return mxt.FullyShardedDataParallel(module, config or FSDP, **kw)


# (what rank 1 builds instead, the texts the message must hold)
PARAM_CASES = {
    "shape": ({"a": (8,), "w": (16, 64)},
              ["param #1", "'w' [64, 16] torch.float32 on rank 0", "'w' [16, 64] torch.float32 on rank 1"]),
    "name": ({"a": (8,), "v": (64, 16)}, ["param #1", "'w' [64, 16]", "'v' [64, 16]"]),
    "order": ({"w": (64, 16), "a": (8,)}, ["param #0", "'a' [8] torch.float32 on rank 0", "'w' [64, 16]"]),
    "extra at the end": ({"a": (8,), "w": (64, 16), "b": (4,)},
                         ["param #2", "(absent) on rank 0", "'b' [4] torch.float32 on rank 1",
                          "the numbers of params differ: 2 on rank 0; 3 on rank 1"]),
    "extra in the middle": ({"a": (8,), "b": (4,), "w": (64, 16)}, ["param #1", "'w' [64, 16]", "'b' [4]"]),
    "missing": ({"a": (8,)}, ["param #1", "'w' [64, 16] torch.float32 on rank 0", "(absent) on rank 1"]),
}
AGREED = {"a": (8,), "w": (64, 16)}


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", list(PARAM_CASES))
def test_params_that_differ_are_refused_naming_the_param_and_ranks(ranks, kind, case):
    shapes, expected = PARAM_CASES[case]
    module = Params(shapes if differing(ranks) else AGREED)
    name = "DistributedDataParallel" if kind == "ddp" else "FullyShardedDataParallel"
    refused_everywhere(ranks, lambda: wrap(kind, module), name, *expected)
    assert all(not hasattr(p, "main_grad") for p in module.parameters())  # nothing was built


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_dtype_that_differs_is_refused(ranks, kind):
    module = Params(AGREED, torch.bfloat16 if differing(ranks) else torch.float32)
    refused_everywhere(ranks, lambda: wrap(kind, module), "param #0",
                       "'a' [8] torch.float32 on rank 0", "'a' [8] torch.bfloat16 on rank 1")


def test_a_frozen_param_on_one_rank_is_refused(ranks):
    module = Params(AGREED)
    module.w.requires_grad_(not differing(ranks))
    refused_everywhere(ranks, lambda: wrap("ddp", module), "param #1", "(absent) on rank 1")


# (config field, rank 0's value, rank 1's value, value texts): one of each kind of field.
DDP_FIELD_CASES = [
    ("overlap_grad_reduce", False, True, ["False on rank 0", "True on rank 1"]),             # bool
    ("bucket_size", None, 100, ["None on rank 0", "100 on rank 1"]),                          # int or None
    ("buckets_per_group", 1, 2, ["1 on rank 0", "2 on rank 1"]),                              # int
]


@pytest.mark.parametrize("field,mine,theirs,texts", DDP_FIELD_CASES, ids=[c[0] for c in DDP_FIELD_CASES])
def test_a_ddp_config_field_that_differs_is_refused(ranks, field, mine, theirs, texts):
    config = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               **{field: theirs if differing(ranks) else mine})
    refused_everywhere(ranks, lambda: wrap("ddp", Params(AGREED), config),
                       f"DistributedDataParallelConfig.{field} is", *texts)


def test_an_fsdp_strategy_that_differs_is_refused(ranks):  # a str field
    strategy = "optim_grads" if differing(ranks) else "optim_grads_params"
    config = mxt.DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                               data_parallel_sharding_strategy=strategy)
    refused_everywhere(ranks, lambda: wrap("fsdp", Params(AGREED), config),
                       "DistributedDataParallelConfig.data_parallel_sharding_strategy is",
                       "'optim_grads_params' on rank 0", "'optim_grads' on rank 1")


def test_fsdp_units_that_differ_are_refused(ranks):
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    units = [torch.nn.Linear] if differing(ranks) else None
    refused_everywhere(ranks, lambda: wrap("fsdp", module, fsdp_unit_modules=units),
                       "FSDP units (each unit's params) is", "[[0, 1, 2, 3]] on rank 0", "[[0, 1], [2, 3]] on rank 1")


def test_a_wrapper_argument_that_differs_is_refused(ranks):
    refused_everywhere(ranks, lambda: wrap("ddp", Params(AGREED), gradient_accumulation_fusion=not differing(ranks)),
                       "gradient_accumulation_fusion is", "True on rank 0", "False on rank 1")


# (field, rank 0's value, rank 1's value, value texts): a float, a str, an optional int.
OPTIMIZER_FIELD_CASES = [
    ("lr", 1e-2, 1.0, ["0.01 on rank 0", "1.0 on rank 1"]),
    ("optimizer", "adam", "sgd", ["'adam' on rank 0", "'sgd' on rank 1"]),
    ("max_consecutive_skipped_steps", 10, None, ["10 on rank 0", "None on rank 1"]),
]


@pytest.mark.parametrize("field,mine,theirs,texts", OPTIMIZER_FIELD_CASES, ids=[c[0] for c in OPTIMIZER_FIELD_CASES])
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_an_optimizer_config_field_that_differs_is_refused(ranks, kind, field, mine, theirs, texts):
    values = {"lr": 1e-2, field: theirs if differing(ranks) else mine}  # (before the wrap: it may skip)
    model = wrap(kind, Params(AGREED))
    refused_everywhere(ranks, lambda: mxt.DistributedOptimizer(model, mxt.OptimizerConfig(**values)),
                       f"DistributedOptimizer: the {ranks[1]} ranks do not build the same thing: "
                       f"OptimizerConfig.{field} is", *texts)
    assert model._cpp.open_optimizers == 0
    model.close()


def test_the_same_number_written_as_int_or_float_agrees(ranks):
    lr = 1 if differing(ranks) else 1.0  # (before the wrap: it may skip)
    model = wrap("ddp", Params(AGREED))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=lr))
    opt.close()
    model.close()


def test_a_rank_that_cannot_wrap_fails_every_rank_naming_it(ranks):
    """A check one rank alone fails (a float64 param there) ends every rank, none left waiting."""
    bad = differing(ranks)
    module = Params(AGREED, torch.float64 if bad else torch.float32)
    with pytest.raises(TypeError if bad else mxddp.Error) as e:
        wrap("ddp", module)
    if bad:
        assert "has dtype torch.float64" in str(e.value)
    else:
        assert f"rank {ranks[1] - 1} cannot build it" in str(e.value) and "torch.float64" in str(e.value)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_agreeing_ranks_build_and_train(ranks, kind):
    rank, world = ranks
    module = Params(AGREED)
    model = wrap(kind, module)
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2))
    opt.zero_grad()
    model(torch.ones(2, 64) * (rank + 1)).backward()
    model.finish_grad_sync()
    assert opt.step()[0]
    opt.close()
    model.close()
