"""Writes through a wrapped param's ``.data`` (watched_params.py: it shares the Parameter's version
counter): with BF16 params the next step starts from them, as it does from a ``p.copy_``, instead of
the F32 main params writing the old values back (WGAN's ``p.data.clamp_``, pruning's
``p.data.mul_(mask)``), also through a ``.data`` kept across iterations; a ``.data`` read changes no
main param and is refused nowhere, wherever the params stand (a gather pending, MXFP8 reuse before
``zero_grad``, FSDP stand-ins, gathered units read in forward hooks and recompute); the writes
``p.copy_`` would have refused are refused through ``.data`` too, on every rank (one the overlapped
gather would overwrite, one before ``zero_grad`` stages the step under MXFP8 reuse, one into a NaN
stand-in or into a unit's gathered values); and the watched params look and copy as plain
Parameters, and are plain again after ``close()``."""
import copy
import io

import pytest
import torch

import mxddp.torch as mxt
from mxddp.torch import watched_params
from test_param_writes import assert_main_took, assert_main_unchanged, built, main_pieces, not_bf16_exact, train


def write_through_data(param, how):
    """The write `how` through param.data; returns the values it leaves (what the next step must keep)."""
    with torch.no_grad():
        if how == "clamp_":  # WGAN's weight clipping
            param.data.clamp_(-0.01, 0.01)
        elif how == "mul_":  # magnitude pruning's mask
            param.data.mul_((param.detach().abs() > param.detach().abs().median()).to(param.dtype))
        else:
            param.data.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)))
    return param.detach().clone()


def every_main(opt, model):
    return {i: main_pieces(opt, i) for i in range(len(model._names))}


def assert_every_main_unchanged(opt, model, before):
    for i, pieces in before.items():
        assert_main_unchanged(opt, i, pieces)


@pytest.mark.parametrize("how", ["clamp_", "mul_", "copy_"])
@pytest.mark.parametrize("kw", [dict(), dict(use_distributed_optimizer=False), dict(fsdp="optim"),
                                dict(fsdp="optim_grads")], ids=["dist", "repl", "optim", "optim_grads"])
def test_a_write_through_data_is_what_the_next_step_starts_from(ranks, how, kw):
    rank, _ = ranks
    overlap = kw.get("use_distributed_optimizer", True)  # the replicated optimizer has no gather to overlap
    with built(overlap_param_gather=overlap, **kw) as (module, model, opt):
        train(model, opt, rank, 2)
        model.finish_param_sync()
        index, other = model._names.index("0.weight"), model._names.index("2.weight")
        kept, was = main_pieces(opt, other), main_pieces(opt, index)
        assert not_bf16_exact(opt, [other])
        unwritten = module[0].weight.detach().clone()
        written = write_through_data(module[0].weight, how)
        assert not torch.equal(written, unwritten)  # the write changed some values (of the whole param: every rank's)
        opt.state_dict()  # reads the main params: takes the write first
        assert_main_took(opt, index, written, was)
        assert_main_unchanged(opt, other, kept)  # only the written param, F32 precision kept elsewhere
        train(model, opt, rank, 1, lr=0.0)  # AdamW with lr 0 changes nothing
        model.finish_param_sync()
        assert torch.equal(module[0].weight.detach(), written)


def test_a_data_write_moves_the_params_version_counter(ranks):
    rank, _ = ranks
    with built() as (module, model, opt):
        train(model, opt, rank, 1)
        w = module[2].bias
        old = main_pieces(opt, model._names.index("2.bias"))
        version = w._version
        with torch.no_grad():
            w.data.zero_()
        assert w._version > version  # what torch's .data, a counter of its own, would not move
        train(model, opt, rank, 1, lr=0.0)
        assert w.detach().abs().sum() == 0
        assert_main_took(opt, model._names.index("2.bias"), torch.zeros(w.shape, dtype=w.dtype), old)


@pytest.mark.parametrize("case", ["ddp_pending_gather", "mxfp8_reuse_before_zero_grad", "fsdp_stand_ins",
                                  "fsdp_optim_pending_gather", "f32"])
def test_reading_data_changes_no_main_param(ranks, case):
    """A .data read between iterations, where the params are not all current: it moves no version
    counter, so nothing is taken or refused, and the main params stay bit for bit."""
    rank, _ = ranks
    kw = {"ddp_pending_gather": dict(overlap_param_gather=True, bucket_size=200),
          "mxfp8_reuse_before_zero_grad": dict(fp8_param_gather=True, grad_reduce_in_fp32=True,
                                               reuse_grad_buf_for_mxfp8_param_ag=True),
          "fsdp_stand_ins": dict(fsdp="optim_grads_params"),
          "fsdp_optim_pending_gather": dict(fsdp="optim", overlap_param_gather=True),
          "f32": dict(dtype=torch.float32)}[case]
    with built(**kw) as (module, model, opt):
        train(model, opt, rank, 2)
        before = every_main(opt, model)
        for p in module.parameters():
            p.data.float().norm()
        opt.state_dict()  # takes the params' writes, whatever state they are in
        assert_every_main_unchanged(opt, model, before)
        opt.zero_grad()  # MXFP8 reuse: takes them before its staging
        assert_every_main_unchanged(opt, model, before)
        model.finish_param_sync()
        opt.state_dict()  # and again once the pending gathers landed
        assert_every_main_unchanged(opt, model, before)
        train(model, opt, rank, 1)  # and training goes on


@pytest.mark.parametrize("kw", [dict(fp8_param_gather=True, grad_reduce_in_fp32=True),
                                dict(fsdp="optim_grads_params")], ids=["mxfp8", "fsdp_optim_grads_params"])
def test_a_data_write_into_a_stand_in_is_refused(ranks, kw):
    rank, _ = ranks
    with built(**kw) as (module, model, opt):
        train(model, opt, rank, 1)
        with torch.no_grad():
            module[0].weight.data.zero_()  # reaches only the NaN stand-in
        with pytest.raises(RuntimeError, match=r"param\(s\) '0.weight' were written in place .*\.data.* NaN stand-ins"):
            train(model, opt, rank, 1)
        assert torch.isnan(module[0].weight).all()  # the stand-in as it was
        train(model, opt, rank, 1)


def test_watched_params_look_and_copy_as_plain_parameters(ranks):
    rank, _ = ranks

    class Own(torch.nn.Parameter):
        pass

    with built() as (module, model, opt):
        module[0].bias.__class__ = Own  # a script's own class: kept (its .data writes stay unseen)
        w = module[0].weight
        assert type(w) is watched_params.WatchedParameter and isinstance(w, torch.nn.Parameter)
        plain = torch.nn.Parameter(w.detach().clone())
        assert repr(w) == repr(plain)
        assert type(type(w)(w.detach().clone())) is torch.nn.Parameter  # as loaders copy a param
        copied = copy.deepcopy(module)
        assert all(type(p) is torch.nn.Parameter for n, p in copied.named_parameters() if n != "0.bias")
        assert torch.equal(copied[0].weight.detach(), w.detach())
        buf = io.BytesIO()
        w.tag = "kept"  # a script's own attribute is pickled, DDP's main_grad (a view of its grad buffer) is not
        torch.save(module[0], buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False).weight
        assert type(loaded) is torch.nn.Parameter and torch.equal(loaded.detach(), w.detach())
        assert loaded.tag == "kept" and not hasattr(loaded, "main_grad") and hasattr(w, "main_grad")
        train(model, opt, rank, 1)
        opt.close()
        model.close()
        assert type(w) is torch.nn.Parameter
        assert type(module[0].bias) is Own
        with torch.no_grad():
            w.data.zero_()  # after close: the module's own tensor, nothing to take
        assert w.abs().sum() == 0


@pytest.mark.parametrize("fsdp", [None, "optim"])
def test_a_data_write_the_overlapped_gather_would_overwrite_is_refused(ranks, fsdp):
    rank, _ = ranks
    with built(fsdp=fsdp, overlap_param_gather=True, **({} if fsdp else dict(bucket_size=200))) \
            as (module, model, opt):
        train(model, opt, rank, 1)
        with torch.no_grad():
            module[0].weight.data.add_(1.0)  # every element, so every rank's shard tells it
        with pytest.raises(RuntimeError, match=r"param '0.weight' was written in place after "
                                               r"DistributedOptimizer.step\(\) while its all-gather was still to land "
                                               r"\(overlap_param_gather; the gather has landed\)"):
            model(torch.randn(4, 16).to(model.param_dtype))
        train(model, opt, rank, 1)  # said once, and training goes on
        with torch.no_grad():
            module[2].bias.data.add_(1.0)
        with pytest.raises(RuntimeError, match=r"param '2.bias' was written in place after .*the optimizer was "
                                               r"about to take it"):
            opt.force_param_sync()
        opt.force_param_sync()


def test_a_data_write_before_zero_grad_stages_the_step_is_refused_under_mxfp8_reuse(ranks):
    """WGAN's loop under MXFP8 reuse: step(), then p.data.clamp_(), then the next zero_grad(). The
    params hold the values from before the step there: refused as p.clamp_ is, not lost."""
    rank, _ = ranks
    with built(fp8_param_gather=True, grad_reduce_in_fp32=True, reuse_grad_buf_for_mxfp8_param_ag=True) \
            as (module, model, opt):
        train(model, opt, rank, 2)
        with torch.no_grad():
            module[2].bias.data.clamp_(-0.05, 0.05)
        with pytest.raises(RuntimeError, match=r"param '2.bias' was written in place between "
                                               r"DistributedOptimizer.step\(\) and zero_grad\(\)"):
            opt.zero_grad()
        train(model, opt, rank, 1)


def test_fsdp_gathered_units_read_in_forward_hooks_are_not_taken_for_writes(ranks):
    """optim_grads_params: a unit's params read through .data in forward hooks, a module called twice
    in one forward, and recompute (torch.utils.checkpoint) gather them more than once."""
    rank, _ = ranks
    with built(fsdp="optim_grads_params") as (module, model, opt):
        reads = []
        # Registered after wrapping: runs after FSDP's own pre-forward hook gathered the unit.
        hook = module[0].register_forward_pre_hook(lambda m, i: reads.append(float(m.weight.data.float().norm())))
        train(model, opt, rank, 1)
        before = every_main(opt, model)
        for step in range(2):
            opt.zero_grad()
            x = torch.randn(4, 16).to(model.param_dtype)
            y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
            y.float().square().mean().backward()
            model.finish_grad_sync()
            opt.state_dict()  # takes the params' writes: none, and nothing refused
            assert_every_main_unchanged(opt, model, before)
            opt.step()
            before = every_main(opt, model)
        hook.remove()
        assert len(reads) >= 3 and all(r == r for r in reads)  # the gathered values, not NaN stand-ins


def test_a_data_write_into_a_units_gathered_values_is_refused(ranks):
    rank, _ = ranks
    with built(fsdp="optim_grads_params") as (module, model, opt):
        train(model, opt, rank, 1)

        def clip(m, args):
            with torch.no_grad():
                m.weight.data.clamp_(-0.01, 0.01)  # into the gathered values, freed after the unit

        hook = module[0].register_forward_pre_hook(clip)
        with pytest.raises(RuntimeError, match=r"param\(s\) '0.weight' were written in place .* freed after it"):
            train(model, opt, rank, 1)
        hook.remove()
        train(model, opt, rank, 1)


def test_a_refused_write_leaves_the_other_writes_to_take(ranks):
    rank, _ = ranks
    with built(fp8_param_gather=True, grad_reduce_in_fp32=True) as (module, model, opt):
        train(model, opt, rank, 1)
        with torch.no_grad():
            module[2].bias.data.zero_()  # kept
            module[0].weight.data.zero_()  # into an MXFP8 weight's stand-in: refused
        with pytest.raises(RuntimeError, match=r"param\(s\) '0.weight' were written in place"):
            opt.state_dict()
        train(model, opt, rank, 1, lr=0.0)
        assert module[2].bias.detach().abs().sum() == 0


def test_a_data_tensor_kept_across_iterations_still_counts(ranks):
    rank, _ = ranks
    with built() as (module, model, opt):
        kept = module[2].bias.data  # taken once, written every iteration
        for step in range(3):
            train(model, opt, rank, 1)
            with torch.no_grad():
                kept.clamp_(-0.01, 0.01)
            opt.state_dict()
            for _, _, now in main_pieces(opt, model._names.index("2.bias")):
                assert now.abs().max() <= 0.0101


def test_a_data_write_between_forward_and_backward_is_torchs_error_where_the_op_saved_the_param(ranks):
    """The one difference from torch's .data: a backward that reads a param its forward saved (here
    LayerNorm's weight) refuses, naming it, where torch's .data would compute with the new values."""
    rank, _ = ranks
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)).to(torch.bfloat16)
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True))
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    try:
        opt.zero_grad()
        loss = model(torch.randn(4, 16).to(torch.bfloat16)).float().square().mean()
        with torch.no_grad():
            module[1].weight.data.mul_(0.5)
        with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
            loss.backward()
    finally:
        opt.close()
        model.close()
