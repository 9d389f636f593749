"""Copies of a wrapped module (module_copies.py): ``copy.deepcopy`` (an EMA, a teacher model) and
``torch.save`` of the whole module give a plain module, computing what the original computes, with
none of mxddp's hooks or replaced forwards (a copy's forward left the wrapper alone and pickles);
a module whose own param holds a NaN stand-in between iterations (kept as MXFP8, or sharded by FSDP)
is refused, naming the param, where the copy used to hold NaN without a word.
"""
import copy
import io

import pytest
import torch

import mxddp.torch as mxt
from test_mxfp8 import batch, config, lm_loss, make_lm, optimizer
from test_fsdp import fsdp_config


def saved_and_loaded(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def mxddp_traces(module) -> list[str]:
    """What of mxddp a module tree carries: hooks, replaced forwards, instance __getstate__."""
    found = []
    for name, sub in module.named_modules():
        for what in ("forward", "__getstate__", "_mxddp_wrapper"):
            if what in vars(sub):
                found.append(f"{name or '<root>'}.{what}")
        if sub._forward_pre_hooks or sub._forward_hooks:
            found.append(f"{name or '<root>'} hooks")
    return found


WRAPS = {
    # forward pre-hooks on every module owning params, and the fused forwards of the Linears and Embedding
    "DDP overlap_param_gather": lambda m: mxt.DistributedDataParallel(
        m, config(overlap_grad_reduce=True, overlap_param_gather=True)),
    # the unit's pre- and post-forward hooks; the params hold their values (no_shard)
    "FSDP no_shard": lambda m: mxt.FullyShardedDataParallel(m, fsdp_config("no_shard", overlap=True,
                                                                             fine_grained=False)),
}


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_is_a_plain_module_computing_the_same(ranks, wrap, how):
    rank, _ = ranks
    module = make_lm()
    model = WRAPS[wrap](module)
    opt = optimizer(model)
    opt.zero_grad()
    lm_loss(model, batch(rank, 0)).backward()
    model.finish_grad_sync()
    opt.step()
    model.finish_param_sync()
    ids = batch(rank, 1)[:, :-1]
    with torch.no_grad():
        expected = model(ids)
    assert mxddp_traces(module), "the wrap left nothing on the module: this test would test nothing"
    copied = copy.deepcopy(module) if how == "deepcopy" else saved_and_loaded(module)
    assert mxddp_traces(copied) == []
    with torch.no_grad():
        torch.testing.assert_close(copied(ids), expected, rtol=0, atol=0)
    # The copy's forward ran nothing of the wrapper's: the model trains on as before.
    opt.zero_grad()
    lm_loss(model, batch(rank, 2)).backward()
    model.finish_grad_sync()
    assert opt.step()[0]
    opt.close()
    model.close()
    assert mxddp_traces(module) == [], "close() left mxddp's traces on the module"


def test_a_user_s_own_hook_is_copied(ranks):
    module = make_lm()
    calls = []
    module.fc1.register_forward_pre_hook(lambda _m, _args: calls.append(1))
    model = mxt.DistributedDataParallel(module, config(overlap_grad_reduce=True, overlap_param_gather=True))
    copied = copy.deepcopy(module)
    assert len(copied.fc1._forward_pre_hooks) == 1
    copied(batch(0, 0)[:, :-1])
    assert calls == [1]
    model.close()


@pytest.mark.parametrize("kind", ["DDP MXFP8", "FSDP optim_grads_params"])
def test_a_copy_that_would_hold_nan_is_refused_naming_the_param(ranks, kind):
    module = make_lm()
    if kind == "DDP MXFP8":
        model = mxt.DistributedDataParallel(module, config(fp8_param_gather=True))
        stand_in, why = "fc1.weight", r"it is kept as MXFP8\).*dequantizes it"
    else:
        model = mxt.FullyShardedDataParallel(module, fsdp_config("optim_grads_params", overlap=False,
                                                                 fine_grained=False))
        stand_in, why = "embed.weight", r"FSDP shards it across the ranks\).*gathers it"
    copying = module.fc1 if kind == "DDP MXFP8" else module
    for copy_it in (copy.deepcopy, saved_and_loaded):
        with pytest.raises(TypeError, match=rf"param '{stand_in}' holds a NaN stand-in between iterations \({why}"):
            copy_it(copying)
    if kind == "DDP MXFP8":  # the norm holds its values: copying it alone is fine
        torch.testing.assert_close(copy.deepcopy(module.norm).weight, module.norm.weight, rtol=0, atol=0)
    model.close()
    plain = copy.deepcopy(module)  # closed: the params hold their values again
    assert not any(torch.isnan(p).any() for p in plain.parameters())
