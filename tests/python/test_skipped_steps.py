"""Skipped steps say why, and a run of them ends the run (issue 40, item 7): a NaN written into one
rank's param makes every later step's grad norm NaN, so every ``step()`` is skipped, forever and
silently, while that rank's copy differs from the others'. Now the first skip of a run warns with
the norm, the params whose gradients hold the NaN and the rank and params whose values do; more
than ``OptimizerConfig.max_consecutive_skipped_steps`` skips in a row raise on every rank.
"""
import warnings

import pytest
import torch
import torch.distributed as dist

import mxddp
import mxddp.torch as mxt
from mxddp.torch.optimizer import SkippedStepWarning


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def wrap(kind, **optimizer_fields):
    module = mlp()
    if kind == "ddp":
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True))
    else:
        model = mxt.FullyShardedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy=kind))
    return module, model, mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2, **optimizer_fields))


def step(model, opt, rank, i, poison=False):
    """One iteration; with poison, rank 0's input holds a NaN. Returns (update_successful, the
    SkippedStepWarnings it gave)."""
    opt.zero_grad()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * i + rank))
    if poison and rank == 0:
        x[0, 0] = float("nan")
    model(x).square().mean().backward()
    model.finish_grad_sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = opt.step()[0]
    return ok, [str(w.message) for w in caught if issubclass(w.category, SkippedStepWarning)]


def poison_last_rank(module, ranks):
    """A NaN in the last rank's copy of '2.weight' (at one rank, the only copy)."""
    rank, world = ranks
    if rank == world - 1:
        with torch.no_grad():
            module[2].weight[3, 5] = float("nan")


@pytest.mark.parametrize("kind", ["ddp", "optim_grads"])
def test_a_nan_in_one_rank_s_param_warns_once_then_ends_the_run_on_every_rank(ranks, kind):
    rank, world = ranks
    module, model, opt = wrap(kind, max_consecutive_skipped_steps=3)
    assert step(model, opt, rank, 0) == (True, [])
    poison_last_rank(module, ranks)
    ok, said = step(model, opt, rank, 1)
    assert not ok and len(said) == 1, said
    for text in ["skipped the step (nothing was updated)", "the global grad norm is nan",
                 "params whose gradients hold a NaN or Inf: '0.weight', '0.bias', '2.weight', '2.bias'",
                 f"params whose values hold a NaN or Inf: '2.weight' on rank {world - 1}",
                 "more than 3 skipped in a row raise (OptimizerConfig.max_consecutive_skipped_steps)"]:
        assert text in said[0], said[0]
    for i in (2, 3):
        assert step(model, opt, rank, i) == (False, [])  # said once
    with pytest.raises(mxddp.Error) as e:
        step(model, opt, rank, 4)
    message = str(e.value)
    for text in ["the step was skipped (4 in a row, more than OptimizerConfig.max_consecutive_skipped_steps=3)",
                 "the global grad norm is nan", f"'2.weight' on rank {world - 1}"]:
        assert text in message, message
    messages = [None] * world
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, messages  # every rank, the same words
    opt.close()
    model.close()


def test_fsdp_sharding_the_params_names_the_gradients_and_says_values_went_unchecked(ranks):
    """optim_grads_params: a param is a NaN stand-in between iterations, so only the gradients
    are named (a NaN in rank 0's input, every step)."""
    rank, world = ranks
    _, model, opt = wrap("optim_grads_params", max_consecutive_skipped_steps=1)
    ok, said = step(model, opt, rank, 0, poison=True)
    assert not ok and len(said) == 1, said
    assert "params whose gradients hold a NaN or Inf: '0.weight', '0.bias', '2.weight', '2.bias'; the params' " \
           "values were not checked (none holds its values between iterations)" in said[0], said[0]
    with pytest.raises(mxddp.Error, match=r"skipped \(2 in a row, more than "):
        step(model, opt, rank, 1, poison=True)
    opt.close()
    model.close()


def test_by_default_ten_skips_in_a_row_pass_and_the_eleventh_raises(ranks):
    rank, _ = ranks
    assert mxt.OptimizerConfig(lr=1.0).max_consecutive_skipped_steps == 10
    module, model, opt = wrap("ddp")
    poison_last_rank(module, ranks)
    results = [step(model, opt, rank, i) for i in range(10)]
    assert [ok for ok, _ in results] == [False] * 10
    assert [len(said) for _, said in results] == [1] + [0] * 9
    with pytest.raises(mxddp.Error, match=r"skipped \(11 in a row, more than "
                                          r"OptimizerConfig.max_consecutive_skipped_steps=10\)"):
        step(model, opt, rank, 10)
    opt.close()
    model.close()


def test_zero_raises_at_the_first_skip_and_none_never(ranks):
    rank, _ = ranks
    module, model, opt = wrap("ddp", max_consecutive_skipped_steps=0)
    with pytest.raises(mxddp.Error, match=r"skipped \(1 in a row, more than "
                                          r"OptimizerConfig.max_consecutive_skipped_steps=0\)"):
        step(model, opt, rank, 0, poison=True)
    opt.close()
    model.close()
    module, model, opt = wrap("ddp", max_consecutive_skipped_steps=None)
    poison_last_rank(module, ranks)
    results = [step(model, opt, rank, i) for i in range(12)]
    assert [ok for ok, _ in results] == [False] * 12 and sum(len(said) for _, said in results) == 1
    assert "raise" not in results[0][1][0]  # no limit to announce
    opt.close()
    model.close()


def test_a_step_that_goes_through_starts_the_count_again(ranks):
    """Spikes apart (a NaN in one micro-batch's input): each warns, none ends the run."""
    rank, _ = ranks
    _, model, opt = wrap("ddp", max_consecutive_skipped_steps=1)
    for i in range(3):
        ok, said = step(model, opt, rank, 2 * i, poison=True)
        assert not ok and len(said) == 1 and "params whose values hold a NaN or Inf: none" in said[0], said
        assert step(model, opt, rank, 2 * i + 1) == (True, [])
    opt.close()
    model.close()


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_a_bad_limit_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="max_consecutive_skipped_steps must be None"):
        mxt.OptimizerConfig(lr=1e-3, max_consecutive_skipped_steps=value)
