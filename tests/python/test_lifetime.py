"""A model dropped without close() is freed: once the script holds neither the wrapper, nor its module,
nor its optimizer, the garbage collector frees every byte mxddp gave them (the buffers, the main
params, the optimizer state), as it frees a torch DDP. Before, the hooks mxddp puts on params (which
torch keeps where the collector cannot see them) held the wrapper, and a wrapper dropped in a loop
(a sweep, a notebook cell run again) kept its buffers for good.

While the script holds the module, the module keeps its wrapper alive (its params view the
wrapper's buffers and report into it), so a second wrap of it is refused, naming the param.
"""
import copy
import gc
import io

import pytest
import torch

import mxddp.torch as mxt
from mxddp.torch import grad_fusion
from test_mxfp8 import batch, config, lm_loss, make_lm, optimizer
from test_fsdp import fsdp_config


def live_bytes() -> dict[str, int]:
    """mxddp's live bytes by kind, but the communicator's staging (which collectives outside any
    model may keep from call to call)."""
    gc.collect()
    return {name: live for name, (live, _) in mxt.memory_usage().items() if live and name != "comm"}


WRAPS = {
    # torch's form: the hook path for the norm, the fused one for the Linear and Embedding weights
    "torch DDP form": lambda m: mxt.DistributedDataParallel(m),
    "Megatron DDP, overlapped": lambda m: mxt.DistributedDataParallel(
        m, config(overlap_grad_reduce=True, overlap_param_gather=True)),
    "MXFP8 params": lambda m: mxt.DistributedDataParallel(m, config(fp8_param_gather=True, overlap_grad_reduce=True)),
    "MXFP8 params in the grad buffer": lambda m: mxt.DistributedDataParallel(
        m, config(fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True)),
    "FSDP optim_grads_params": lambda m: mxt.FullyShardedDataParallel(
        m, fsdp_config("optim_grads_params", overlap=True, fine_grained=False)),
    "FSDP no_shard, hook path": lambda m: mxt.FullyShardedDataParallel(
        m, fsdp_config("no_shard", overlap=False, fine_grained=False), gradient_accumulation_fusion=False),
}


def train_two_steps(model, opt, rank):
    for step in range(2):
        opt.zero_grad()
        lm_loss(model, batch(rank, step)).backward()
        model.finish_grad_sync()
        opt.step()


@pytest.mark.parametrize("wrap", WRAPS)
def test_a_model_dropped_without_close_frees_every_byte(ranks, wrap):
    rank, _ = ranks
    assert not live_bytes(), "an earlier test left mxddp memory alive"
    model = WRAPS[wrap](make_lm())
    opt = optimizer(model)
    train_two_steps(model, opt, rank)
    held = live_bytes()
    assert held.get("params", 0) > 0 and held.get("optimizer_state", 0) > 0, held
    del model, opt
    assert not live_bytes(), f"{wrap}: dropped without close(), still held: {live_bytes()}"


def test_a_torch_optimizer_dropped_with_its_model_frees_every_byte_too(ranks):
    rank, _ = ranks
    module = make_lm().float()
    model = mxt.DistributedDataParallel(module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        opt.zero_grad()
        lm_loss(model, batch(rank, step)).backward()
        opt.step()
    assert live_bytes().get("grads", 0) > 0
    del model, module, opt
    assert not live_bytes()


def test_the_module_keeps_its_wrapper_while_the_script_holds_it(ranks):
    """Dropping only the wrapper frees nothing (the module's params view its buffers), and the
    module still trains through its hooks; dropping the module as well frees everything."""
    rank, _ = ranks
    module = make_lm()
    model = mxt.DistributedDataParallel(module, config())
    opt = optimizer(model)
    del model
    held = live_bytes()
    assert held.get("params", 0) > 0
    opt.zero_grad()
    lm_loss(opt.model, batch(rank, 0)).backward()
    opt.model.finish_grad_sync()
    assert opt.step()[0]
    del opt
    still = live_bytes()
    assert (still["params"], still["grads"]) == (held["params"], held["grads"]), \
        "the module's wrapper was freed while the module still views its buffers"
    del module
    assert not live_bytes()


@pytest.mark.parametrize("kind", ["DistributedDataParallel", "FullyShardedDataParallel"])
def test_a_module_wrapped_already_is_refused(ranks, kind):
    """The module itself (which keeps its wrapper alive, even once the script dropped it), and a module
    containing it (naming the param)."""
    module = make_lm()
    model = mxt.DistributedDataParallel(module, config())
    wrap = {"DistributedDataParallel": lambda m: mxt.DistributedDataParallel(m, config()),
            "FullyShardedDataParallel": lambda m: mxt.FullyShardedDataParallel(
                m, fsdp_config("optim_grads_params", overlap=False, fine_grained=False))}[kind]
    with pytest.raises(ValueError, match=r"this TinyLM is wrapped by an open mxddp.torch DistributedDataParallel"):
        wrap(module)
    with pytest.raises(ValueError, match=r"param '0.embed.weight' is held by an open mxddp.torch DistributedDataParallel"):
        wrap(torch.nn.Sequential(module))
    del model
    with pytest.raises(ValueError, match="wrapped by an open"):  # dropped, but the module keeps it open
        wrap(module)
    module._mxddp_wrapper.wrapper.close()  # closed: the module is a plain one again
    assert "_mxddp_wrapper" not in vars(module)
    again = wrap(module)
    again.close()
    del again, module
    assert not live_bytes()


def test_copies_of_a_wrapped_module_do_not_hold_its_wrapper(ranks):
    """An EMA copy (copy.deepcopy) and a torch.save of the whole module carry no reference to the
    wrapper (test_module_copies.py has the rest of what a copy leaves out), and the wrapper is freed
    with the original."""
    rank, _ = ranks
    module = make_lm().float()
    model = mxt.DistributedDataParallel(module)
    ema = copy.deepcopy(module)
    assert not hasattr(ema, "_mxddp_wrapper")
    saved = io.BytesIO()
    torch.save(module, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert not hasattr(loaded, "_mxddp_wrapper")
    ids = batch(rank, 0)
    torch.testing.assert_close(loaded(ids[:, :-1]), module(ids[:, :-1]), rtol=0, atol=0)
    del model, module
    assert not live_bytes(), "a copy of the module kept its wrapper alive"


def test_what_outlives_a_dropped_model_becomes_plain(ranks):
    """A param or a submodule the script kept when it dropped the model and its module: once the
    wrapper is collected, the param holds its values in storage of its own (no main_grad, torch's
    Parameter class), the fused Linear its class's forward, and mxddp's buffers are freed."""
    rank, _ = ranks
    module = make_lm().float()
    model = mxt.DistributedDataParallel(module)
    fc1, norm_weight = module.fc1, module.norm.weight
    assert "forward" in vars(fc1)  # fused: its dW goes into main_grad
    values = {"fc1": fc1.weight.detach().clone(), "norm": norm_weight.detach().clone()}
    del model, module
    assert not live_bytes()
    assert type(norm_weight) is torch.nn.Parameter and not hasattr(norm_weight, "main_grad")
    assert "forward" not in vars(fc1) and not hasattr(fc1.weight, "main_grad")
    torch.testing.assert_close(norm_weight.detach(), values["norm"], rtol=0, atol=0)
    torch.testing.assert_close(fc1.weight.detach(), values["fc1"], rtol=0, atol=0)
    x = torch.randn(3, fc1.in_features, generator=torch.Generator().manual_seed(rank))
    fc1(x).sum().backward()
    torch.testing.assert_close(fc1.weight.grad, torch.ones(3, fc1.out_features).t() @ x)


@pytest.mark.parametrize("kind", ["DistributedDataParallel", "FullyShardedDataParallel"])
def test_a_closed_model_collected_later_leaves_the_module_alone(ranks, kind):
    """close() undid the wrap: collecting the closed wrapper later neither copies the params the
    script keeps into new storage nor touches the module."""
    module = make_lm()
    model = mxt.DistributedDataParallel(module, config()) if kind == "DistributedDataParallel" else \
        mxt.FullyShardedDataParallel(module, fsdp_config("optim_grads_params", overlap=False, fine_grained=False))
    model.close()
    pointers = [p.data_ptr() for p in module.parameters()]
    del model
    gc.collect()
    assert [p.data_ptr() for p in module.parameters()] == pointers
    assert not live_bytes()


def test_one_module_wrapped_twice_over_disjoint_params_is_refused(ranks):
    """Two wrappers of one module would share its hold on its wrapper (and one's close() would drop
    the other's): the second is refused even where the trainable params differ."""
    module = make_lm()
    for p in module.parameters():
        p.requires_grad_(False)
    module.fc1.weight.requires_grad_(True)
    model = mxt.DistributedDataParallel(module, config())
    module.fc1.weight.requires_grad_(False)
    module.fc2.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="this TinyLM is wrapped by an open mxddp.torch DistributedDataParallel"):
        mxt.DistributedDataParallel(module, config())
    model.close()


def _module_state(module: torch.nn.Module) -> dict:
    """What a wrap changes in a module: each param's class, storage, values and attributes, each
    module's forward and hooks, and what the module holds."""
    return {
        "params": [(name, type(p), p.data_ptr(), p.detach().clone(), hasattr(p, "main_grad"),
                    len(p._post_accumulate_grad_hooks or {})) for name, p in module.named_parameters()],
        "modules": [(name, "forward" in vars(m), len(m._forward_pre_hooks), len(m._forward_hooks),
                     "__getstate__" in vars(m)) for name, m in module.named_modules()],
        "held": "_mxddp_wrapper" in vars(module)}


def _assert_same_state(before: dict, after: dict) -> None:
    assert after["held"] == before["held"]
    assert after["modules"] == before["modules"]
    assert [p[0] for p in after["params"]] == [p[0] for p in before["params"]]
    for (name, *was), (_, *now) in zip(before["params"], after["params"]):
        assert (was[0], was[1], was[3], was[4]) == (now[0], now[1], now[3], now[4]), name
        torch.testing.assert_close(now[2], was[2], rtol=0, atol=0, msg=name)


def _fail_broadcast(model):
    raise RuntimeError("injected: rank 0's broadcast failed")


def _fail_last_step(params):
    raise RuntimeError("injected: the wrap's last step failed")


def _fail_second_install(install):
    """grad_fusion.install that raises at its second call: the first fused module's forward is replaced
    and its param views the buffers by then, the others not yet."""
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected: the second fused module's install failed")
        return install(*args, **kwargs)
    return failing


FAILED_WRAPS = {
    # A refusal inside the constructor once the C++ DDP exists: an MXFP8 weight with a gradient hook.
    "MXFP8 weight with a hook": (lambda m: mxt.DistributedDataParallel(m, config(fp8_param_gather=True)),
                                 None, "MXFP8 weight with a gradient hook"),
    # torch's form broadcasts rank 0's params and buffers last (every rank fails alike here).
    "torch DDP's broadcast": (lambda m: mxt.DistributedDataParallel(m),
                              ("mxddp.torch.ddp.DistributedDataParallel._broadcast_at_wrap", lambda: _fail_broadcast),
                              "rank 0's broadcast failed"),
    # Part way through giving the params their buffers and the fused modules their forwards.
    "torch DDP form, mid-way": (lambda m: mxt.DistributedDataParallel(m),
                                ("mxddp.torch.grad_fusion.install", lambda: _fail_second_install(grad_fusion.install)),
                                "second fused module's install failed"),
    "DDP, MXFP8 in the grad buffer": (
        lambda m: mxt.DistributedDataParallel(m, config(fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True,
                                                        overlap_param_gather=True)),
        ("mxddp.torch.watched_params.watch", lambda: _fail_last_step), "last step failed"),
    "FSDP optim_grads_params": (
        lambda m: mxt.FullyShardedDataParallel(m, fsdp_config("optim_grads_params", overlap=True, fine_grained=False)),
        ("mxddp.torch.watched_params.watch", lambda: _fail_last_step), "last step failed"),
    "FSDP, MXFP8 weights": (
        lambda m: mxt.FullyShardedDataParallel(
            m, fsdp_config("optim_grads_params", overlap=True, fine_grained=False, fp8_param_gather=True)),
        ("mxddp.torch.watched_params.watch", lambda: _fail_last_step), "last step failed"),
}


@pytest.mark.parametrize("case", FAILED_WRAPS)
def test_a_wrap_that_failed_part_way_leaves_the_module_as_it_was(ranks, monkeypatch, case):
    """A constructor that raised once the C++ wrapper existed (its own refusal, a broadcast that
    failed, any later step) frees what it allocated and leaves the module as it found it: each param
    the same tensor with the same values, no hook, forward or hold of mxddp's. The module can then be
    wrapped again, and trains."""
    rank, _ = ranks
    wrap, inject, message = FAILED_WRAPS[case]
    module = make_lm()
    if inject is None:
        hook = module.fc1.weight.register_hook(lambda grad: grad)
    else:
        target, make_failing = inject
        monkeypatch.setattr(target, make_failing())
    before = _module_state(module)
    with pytest.raises((RuntimeError, ValueError), match=message):
        wrap(module)
    _assert_same_state(before, _module_state(module))
    assert not live_bytes(), f"{case}: the failed wrap kept {live_bytes()}"
    if inject is None:
        hook.remove()
    else:
        monkeypatch.undo()
    model = wrap(module)
    opt = optimizer(model)
    train_two_steps(model, opt, rank)
    opt.close()
    model.close()
    del model, opt
    assert not live_bytes()
