"""Values a script writes into a DDP's params outside the optimizer (param_writes.py): with BF16
params the next step starts from them, as torch's optimizers do, instead of the optimizer's F32 main
params writing the old values back; a failed load is not taken for a write (the main params keep
their F32 precision); a write the overlapped param all-gather would overwrite is refused; a write
into an MXFP8 weight's stand-in is refused; Megatron's ``reload_model_params``.

Each check reads this rank's main params directly (the optimizer's update ranges), so the
distributed and the replicated optimizer are both covered at any world size."""
import contextlib

import pytest
import torch

import mxddp.torch as mxt

W_SEED = 77


def build(dtype=torch.bfloat16, seed=3, use_distributed_optimizer=True, fsdp=None, **kw):
    """(module, model, optimizer): DDP, or with fsdp= a sharding strategy FSDP with a unit per Linear."""
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(dtype)
    cfg = mxt.DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                            overlap_grad_reduce=True, **kw)
    if fsdp is None:
        model = mxt.DistributedDataParallel(module, cfg)
    else:
        cfg.use_megatron_fsdp, cfg.data_parallel_sharding_strategy = True, fsdp
        model = mxt.FullyShardedDataParallel(module, cfg, fsdp_unit_modules=[torch.nn.Linear])
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return module, model, opt


@contextlib.contextmanager
def built(**kw):
    """build(**kw), closed after."""
    module, model, opt = build(**kw)
    try:
        yield module, model, opt
    finally:
        opt.close()
        model.close()


def train(model, opt, rank, steps, lr=None):
    if lr is not None:
        opt.lr = lr
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)).to(model.param_dtype)
        model(x).float().square().mean().backward()
        model.finish_grad_sync()
        opt.step()


def main_pieces(opt, index):
    """[(start, end, values)] of param `index`'s main params on this rank (its update ranges)."""
    cpp = opt._cpp
    return [(ps, pe, cpp.main_params(b)[ss:se].clone())
            for b in range(cpp.num_buckets) for (p, ps, pe, ss, se) in cpp.update_ranges(b) if p == index]


def assert_main_is(opt, index, values):
    flat = values.detach().reshape(-1).float()
    for ps, pe, v in main_pieces(opt, index):  # none where another rank holds all of it
        assert torch.equal(v, flat[ps:pe]), f"param {index}'s main params [{ps}, {pe}) are not the values written"


def assert_main_took(opt, index, written, before):
    """Param `index`'s main params took `written` where it differs from their BF16 rounding `before`
    the write (main_pieces() then), and kept their F32 values elsewhere: a write that left an
    element as it was, or wrote the value it had in BF16 (one element in ~256 of random values)."""
    flat = written.detach().reshape(-1)
    for (ps, pe, now), (_, _, was) in zip(main_pieces(opt, index), before):
        changed = flat[ps:pe] != was.to(written.dtype)
        assert torch.equal(now[changed], flat[ps:pe][changed].float()), f"param {index}: a written element was lost"
        assert torch.equal(now[~changed], was[~changed]), f"param {index}: an unwritten element lost its F32 value"


def assert_main_unchanged(opt, index, before):
    for (ps, pe, v), (_, _, w) in zip(main_pieces(opt, index), before):
        assert torch.equal(v, w), f"param {index}'s main params [{ps}, {pe}) changed"


def not_bf16_exact(opt, indices):
    """Whether some of these params' main params, on some rank, would change by a round trip through
    BF16: what makes a lost F32 precision visible. Collective."""
    flag = torch.tensor([float(any(not torch.equal(v, v.bfloat16().float())
                                   for i in indices for _, _, v in main_pieces(opt, i)))])
    mxt.all_reduce(flag, "max")
    return bool(flag.item())


def written_values(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(W_SEED))


@pytest.mark.parametrize("overlap_param_gather", [False, True])
@pytest.mark.parametrize("how", ["module.load_state_dict", "model.load_state_dict", "copy_"])
def test_values_written_into_bf16_params_are_what_the_next_step_starts_from(ranks, how, overlap_param_gather):
    rank, _ = ranks
    with built(overlap_param_gather=overlap_param_gather, bucket_size=200) as (module, model, opt):
        train(model, opt, rank, 2)
        model.finish_param_sync()  # a write must follow the step's gathers (the next test)
        index = model._names.index("0.weight")
        other = model._names.index("2.weight")
        kept = main_pieces(opt, other)
        old = main_pieces(opt, index)
        assert not_bf16_exact(opt, [other])
        w = written_values(module[0].weight.shape)
        if how == "copy_":
            with torch.no_grad():
                module[0].weight.copy_(w)
        elif how == "module.load_state_dict":
            module.load_state_dict({**module.state_dict(), "0.weight": w})
        else:
            model.load_state_dict({**model.state_dict(), "0.weight": w})  # Megatron's form: the module's keys
        opt.state_dict()  # reads the main params: takes the write first
        assert_main_took(opt, index, w.bfloat16(), old)
        assert_main_unchanged(opt, other, kept)  # not rounded through the BF16 param
        train(model, opt, rank, 1, lr=0.0)  # AdamW with lr 0 changes nothing
        model.finish_param_sync()
        assert torch.equal(module[0].weight.detach(), w.bfloat16())


def test_a_replicated_optimizer_takes_written_values_too(ranks):
    rank, _ = ranks
    with built(use_distributed_optimizer=False) as (module, model, opt):
        train(model, opt, rank, 1)
        index = model._names.index("2.bias")
        old = main_pieces(opt, index)
        w = written_values(module[2].bias.shape)
        with torch.no_grad():
            module[2].bias.copy_(w)
        train(model, opt, rank, 1, lr=0.0)
        assert torch.equal(module[2].bias.detach(), w.bfloat16())
        assert_main_took(opt, index, w.bfloat16(), old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_write_the_overlapped_gather_would_overwrite_is_refused(ranks, dtype):
    rank, _ = ranks
    with built(dtype=dtype, overlap_param_gather=True, bucket_size=200) as (module, model, opt):
        train(model, opt, rank, 1)
        assert model._cpp.param_sync_pending
        with torch.no_grad():
            module[0].weight.add_(1.0)
        x = torch.randn(4, 16).to(dtype)
        with pytest.raises(RuntimeError, match=r"param '0.weight' was written in place after "
                                               r"DistributedOptimizer.step\(\) while its all-gather was still to land "
                                               r"\(overlap_param_gather; the gather has landed\)"):
            model(x)
        # Said once, and training goes on.
        train(model, opt, rank, 1)
        # finish_param_sync() waits for every pending gather, and checks every param.
        with torch.no_grad():
            module[2].bias.zero_()
        with pytest.raises(RuntimeError, match=r"param '2.bias' was written in place"):
            model.finish_param_sync()
        model.finish_param_sync()
        with torch.no_grad():
            module[2].bias.zero_()  # after the gathers landed: a write the next step keeps
        train(model, opt, rank, 1, lr=0.0)
        model.finish_param_sync()
        assert module[2].bias.abs().sum() == 0


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_fsdp_takes_written_values_where_its_params_hold_them(ranks, strategy):
    rank, _ = ranks
    with built(fsdp=strategy, overlap_param_gather=True) as (module, model, opt):
        train(model, opt, rank, 2)
        model.finish_param_sync()
        w = written_values(module[0].weight.shape)
        with torch.no_grad():
            module[0].weight.copy_(w)
        train(model, opt, rank, 1, lr=0.0)
        model.finish_param_sync()
        assert torch.equal(module[0].weight.detach(), w.bfloat16())
        if strategy != "no_shard":  # the overlapped gather is still to land after a step
            train(model, opt, rank, 1)
            with torch.no_grad():
                module[2].bias.zero_()
            with pytest.raises(RuntimeError, match=r"param '2.bias' was written in place after"):
                model.finish_param_sync()


def test_a_failed_load_is_not_taken_for_a_write(ranks):
    rank, _ = ranks
    with built() as (module, model, opt):
        train(model, opt, rank, 2)
        before = {i: main_pieces(opt, i) for i in range(len(model._names))}
        assert not_bf16_exact(opt, list(before))
        bad = {**model.state_dict(), "2.weight": torch.zeros(3, 3)}
        with pytest.raises(RuntimeError, match="Error.s. in loading state_dict"):
            model.load_state_dict(bad)
        opt.state_dict()
        for i, pieces in before.items():
            assert_main_unchanged(opt, i, pieces)


def test_broadcast_params_reaches_the_main_params(ranks):
    rank, world = ranks
    # Megatron's form does not broadcast at wrap: every rank starts from its own values.
    with built(seed=3 + rank) as (module, model, opt):
        model.broadcast_params()
        rank0 = [p.detach().clone() for p in module.parameters()]
        train(model, opt, rank, 1, lr=0.0)
        for p, q in zip(module.parameters(), rank0):
            assert torch.equal(p.detach(), q)
        gathered = [torch.zeros(world) for _ in rank0]
        for p, g in zip(module.parameters(), gathered):
            g[rank] = p.detach().float().sum()
            mxt.all_reduce(g)
            assert torch.all(g == g[0]), "the ranks' params differ after broadcast_params and a step"


def test_a_write_into_an_mxfp8_weight_is_refused(ranks):
    rank, _ = ranks
    with built(fp8_param_gather=True, grad_reduce_in_fp32=True) as (module, model, opt):
        train(model, opt, rank, 1)
        torch.nn.init.zeros_(module[0].weight)  # reaches only the NaN stand-in
        with pytest.raises(RuntimeError, match=r"param\(s\) '0.weight' were written in place .* kept as MXFP8"):
            train(model, opt, rank, 1)
        assert torch.isnan(module[0].weight).all()  # the stand-in as it was
        train(model, opt, rank, 1)


def test_a_write_before_zero_grad_stages_the_step_is_refused_under_mxfp8_reuse(ranks):
    """reuse_grad_buf_for_mxfp8_param_ag: the params hold the values from before the step until
    zero_grad() stages it. A partial write there was taken whole, undoing the step for the rest."""
    rank, _ = ranks
    with built(fp8_param_gather=True, grad_reduce_in_fp32=True, reuse_grad_buf_for_mxfp8_param_ag=True) \
            as (module, model, opt):
        train(model, opt, rank, 2)
        index = model._names.index("2.bias")
        stepped = main_pieces(opt, index)
        with torch.no_grad():
            module[2].bias[0] = 5.0
        with pytest.raises(RuntimeError, match=r"param '2.bias' was written in place between "
                                               r"DistributedOptimizer.step\(\) and zero_grad\(\) with "
                                               r"reuse_grad_buf_for_mxfp8_param_ag"):
            opt.zero_grad()
        assert_main_unchanged(opt, index, stepped)  # the step kept
        opt.zero_grad()  # said once
        with torch.no_grad():
            module[2].bias[0] = 5.0  # after the staging: kept, and only where written
        train(model, opt, rank, 1, lr=0.0)
        for (ps, pe, now), (_, _, was) in zip(main_pieces(opt, index), stepped):
            if ps == 0:
                assert now[0] == 5.0
                now, was = now[1:], was[1:]
            assert torch.equal(now, was)


def test_a_second_optimizer_is_refused_under_mxfp8_reuse(ranks):
    """Each optimizer's zero_grad() stages its step into the one grad buffer: with two, the first one's
    zero_grad() let the model run on while the second's step waited unstaged (and a write then was
    taken against the values from before it)."""
    rank, _ = ranks
    with built(fp8_param_gather=True, grad_reduce_in_fp32=True, reuse_grad_buf_for_mxfp8_param_ag=True) \
            as (module, model, opt):
        with pytest.raises(ValueError, match=r"already has an open DistributedOptimizer, and with "
                                             r"reuse_grad_buf_for_mxfp8_param_ag it takes one"):
            mxt.DistributedOptimizer(model, torch.optim.AdamW(list(module.parameters())[2:], lr=1e-2))
        train(model, opt, rank, 1)  # the first one goes on


def test_megatron_reload_model_params(ranks):
    rank, _ = ranks
    with built() as (module, model, opt):
        train(model, opt, rank, 1)
        index = model._names.index("0.weight")
        # A write torch does not see (the version counter kept): only the explicit reload takes it.
        w = written_values(module[0].weight.shape)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(module[0].weight):
            module[0].weight.copy_(w)
        opt.state_dict()
        assert not_bf16_exact(opt, [index])
        opt.reload_model_params()
        assert_main_is(opt, index, w.bfloat16())
        # From a state dict: its F32 values, more precise than the BF16 params; either key form.
        f32 = {n: written_values(p.shape) + k for k, (n, p) in enumerate(module.named_parameters())}
        opt.reload_model_params({("module." + n if k % 2 else n): v for k, (n, v) in enumerate(f32.items())})
        for i, name in enumerate(model._names):
            assert_main_is(opt, i, f32[name])
        before = {i: main_pieces(opt, i) for i in range(len(model._names))}
        for bad, error, match in (
                ({k: v for k, v in f32.items() if k != "2.bias"}, KeyError, r"no entry for param '2.bias'"),
                ({**f32, "2.bias": torch.zeros(3)}, ValueError, r"entry for param '2.bias' is \(3,\); the param is \(8,\)"),
                ([1, 2], TypeError, r"a dict of name -> tensor; got list")):
            with pytest.raises(error, match=match):
                opt.reload_model_params(bad)
            for i, pieces in before.items():
                assert_main_unchanged(opt, i, pieces)


def test_a_write_the_gather_would_overwrite_is_refused_where_the_optimizer_would_take_it(ranks):
    """A state dict, a reload or a save between the step and the forward would take the write and
    hide it from the forward's check, while the gather still overwrites the part other ranks hold."""
    rank, _ = ranks
    with built(overlap_param_gather=True, bucket_size=200) as (module, model, opt):
        train(model, opt, rank, 1)
        assert model._cpp.param_sync_pending
        with torch.no_grad():
            module[0].weight.add_(1.0)
        with pytest.raises(RuntimeError, match=r"param '0.weight' was written in place after .*still to land "
                                               r"\(overlap_param_gather; the optimizer was about to take it\)"):
            opt.state_dict()
        model.finish_param_sync()  # said once: the gather lands without a second error


class _WithUnusedHead(torch.nn.Module):
    """A module whose forward leaves one submodule out (an auxiliary head used only at evaluation)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.aux = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_write_after_its_own_gather_landed_is_kept_while_another_gather_is_pending(ranks):
    """The module that did not run keeps its group's gather pending after the forward; a write into a
    param whose gather did land (between micro-batches) is legitimate, and kept."""
    rank, _ = ranks
    torch.manual_seed(0)
    module = _WithUnusedHead().to(torch.bfloat16)
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=100))
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    try:
        train(model, opt, rank, 1)
        opt.zero_grad()
        with model.no_sync():
            model(torch.randn(4, 16).bfloat16()).float().sum().backward()  # aux's gather stays pending
        assert model._cpp.param_sync_pending
        with torch.no_grad():
            module.a.weight.fill_(0.5)
        model(torch.randn(4, 16).bfloat16()).float().sum().backward()
        model.finish_grad_sync()
        opt.lr = 0.0
        opt.step()
        model.finish_param_sync()
        assert torch.all(module.a.weight == 0.5)
    finally:
        opt.close()
        model.close()


def test_broadcast_params_leaves_a_replicated_optimizer_alike_on_every_rank(ranks):
    rank, world = ranks
    with built(seed=3 + rank, use_distributed_optimizer=False) as (module, model, opt):
        train(model, opt, rank, 2)
        model.broadcast_params()
        train(model, opt, rank, 2)
        for p in module.parameters():
            spread = p.detach().float().clone()
            low, high = spread.clone(), spread.clone()
            mxt.all_reduce(high, "max")
            low.neg_()
            mxt.all_reduce(low, "max")
            assert torch.equal(high, -low), "the ranks' params differ after broadcast_params and two steps"


@pytest.mark.parametrize("first", ["a", "b"])
def test_every_optimizer_open_on_the_model_takes_a_write(ranks, first):
    """GAN-style: two optimizers over parts of one model; a write into each one's param is kept
    whichever steps first."""
    rank, _ = ranks
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).bfloat16()
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True))
    opt_a = mxt.DistributedOptimizer(model, torch.optim.AdamW(module[0].parameters(), lr=0.0))
    opt_b = mxt.DistributedOptimizer(model, torch.optim.AdamW(module[2].parameters(), lr=0.0))
    try:
        model(torch.randn(4, 16).bfloat16()).float().square().mean().backward()
        model.finish_grad_sync()
        with torch.no_grad():
            module[0].weight.fill_(0.5)
            module[2].weight.fill_(0.25)
        for o in ([opt_a, opt_b] if first == "a" else [opt_b, opt_a]):
            o.step()
        model.finish_param_sync()
        assert torch.all(module[0].weight == 0.5) and torch.all(module[2].weight == 0.25)
    finally:
        opt_b.close()
        opt_a.close()
        model.close()


def test_a_write_into_an_fsdp_shard_stand_in_is_refused(ranks):
    rank, _ = ranks
    with built(fsdp="optim_grads_params") as (module, model, opt):
        train(model, opt, rank, 1)
        torch.nn.init.zeros_(module[0].weight)  # reaches only the NaN stand-in
        with pytest.raises(RuntimeError, match=r"param\(s\) '0.weight' were written in place .* NaN stand-ins .*"
                                               r"optim_grads_params"):
            train(model, opt, rank, 1)
        train(model, opt, rank, 1)
