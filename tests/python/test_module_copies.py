"""Copies of a wrapped module (module_copies.py): ``copy.deepcopy`` (an EMA, a teacher model) and
``torch.save`` of the whole module give a plain module, computing what the original computes, with
none of mxddp's hooks or replaced forwards (a copy's forward left the wrapper alone and pickles);
a module whose own param does not hold its current values (a NaN stand-in between iterations, kept
as MXFP8 or sharded by FSDP; values from before the step while an overlapped all-gather is pending)
is refused, naming the param, where the copy used to hold NaN or a mix without a word.
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


@pytest.mark.parametrize("wrap", ["DDP overlap_param_gather", "FSDP optim, overlapped"])
def test_a_copy_while_a_param_gather_is_pending_is_refused(ranks, wrap):
    """Right after opt.step() with overlap_param_gather the params still hold their values from
    before it (their all-gathers land at their modules' next forward): a copy would mix old and new
    values, differently on each rank. After model.finish_param_sync() (every rank) it is taken."""
    rank, _ = ranks
    module = make_lm()
    model = WRAPS["DDP overlap_param_gather"](module) if wrap.startswith("DDP") else \
        mxt.FullyShardedDataParallel(module, fsdp_config("optim", overlap=True, fine_grained=False))
    opt = optimizer(model)
    opt.zero_grad()
    lm_loss(model, batch(rank, 0)).backward()
    model.finish_grad_sync()
    opt.step()
    with pytest.raises(TypeError, match=r"still holds its values from before the last step.*model.finish_param_sync"):
        copy.deepcopy(module)
    model.finish_param_sync()
    copied = copy.deepcopy(module)
    for (name, p), q in zip(module.named_parameters(), copied.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
    opt.close()
    model.close()


def test_an_fx_graph_module_copies_as_before(ranks):
    """An fx GraphModule copies itself (its own __deepcopy__ and __reduce__, which read no
    __getstate__): the copy holds no wrapper, and the copy and the save work as before."""
    module = torch.fx.symbolic_trace(make_lm())
    model = mxt.DistributedDataParallel(module)
    ids = batch(0, 0)[:, :-1]
    for copied in (copy.deepcopy(module), saved_and_loaded(module)):
        assert getattr(copied, "_mxddp_wrapper", None) is None
        with torch.no_grad():
            torch.testing.assert_close(copied(ids), module(ids), rtol=0, atol=0)
    model.close()


def test_close_cleans_the_tree_as_it_was_wrapped(ranks):
    """A submodule the script took out of the tree after wrapping, and a frozen submodule shared with
    a second wrapped model: close() removes its own override from the first, and leaves the other
    model's on the second."""
    shared = torch.nn.Linear(8, 8).requires_grad_(False)
    first, second = make_lm(), make_lm()
    first.shared, second.shared = shared, shared
    model_a = mxt.DistributedDataParallel(first, config())
    model_b = mxt.DistributedDataParallel(second, config())
    taken_out = first.norm
    first.norm = torch.nn.LayerNorm(taken_out.normalized_shape).to(torch.bfloat16)
    model_a.close()
    assert "__getstate__" not in vars(taken_out)
    assert vars(shared)["__getstate__"].args[1]() is model_b, "closing one model removed the other's override"
    model_b.close()
    assert "__getstate__" not in vars(shared)
