"""The user's torch optimizer on mxddp's shards (issue 43 item 2): ``mxt.DistributedOptimizer(model,
torch_optimizer)`` against torch DDP (gloo) + the same torch optimizer, F32, 1e-5: param groups
with their own decay and lr, lr schedulers, Adam (with and without L2 decay), SGD with and without
momentum, params no group holds, clip_grad_norm_, every refused setting, and state_dict (round trip
through torch.save, a rank-0-alone call, loading elsewhere refused).
"""
import copy
import io
import warnings

import pytest
import torch

import mxddp.torch as mxt
from conftest import needs_ranks

STEPS = 8


def make_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def two_groups(module, **kw):
    """Weights in group 0, biases and norms in group 1, each with its own settings."""
    weights = [p for p in module.parameters() if p.ndim >= 2]
    rest = [p for p in module.parameters() if p.ndim < 2]
    g0, g1 = kw.pop("g0", {}), kw.pop("g1", {})
    return [{"params": weights, **g0}, {"params": rest, **g1}]


def run_torch(module, make_opt, rank, steps=STEPS, clip=None, scheduler=None, each_step=None):
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    opt = make_opt(module)
    sched = scheduler(opt) if scheduler else None
    losses = []
    for step in range(steps):
        if each_step:
            each_step(opt, step)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(ddp, rank, step)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses


def wrap(module, distributed=True, fsdp=None):
    """mxddp's DDP (sharded or replicated optimizer), or with fsdp=<strategy> its FSDP, one unit per Linear."""
    if fsdp is not None:
        return mxt.FullyShardedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy=fsdp,
            overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True),
            fsdp_unit_modules=[torch.nn.Linear])
    return mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True, bucket_size=600, overlap_grad_reduce=True))


def run_mxddp(module, make_opt, rank, steps=STEPS, clip=None, scheduler=None, each_step=None, before=False,
              fsdp=None, clip_with="optimizer"):
    # before: the torch optimizer is built over the module's params before wrapping (the same objects).
    # clip_with: "optimizer" (opt.clip_grad_norm_) or "torch" (torch.nn.utils.clip_grad_norm_, torch_clip.py).
    torch_opt = make_opt(module) if before else None
    model = wrap(module, fsdp=fsdp)
    opt = mxt.DistributedOptimizer(model, torch_opt if before else make_opt(model.module))
    sched = scheduler(opt) if scheduler else None
    losses = []
    try:
        for step in range(steps):
            if each_step:
                each_step(opt, step)
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, rank, step)
            loss.backward()
            model.finish_grad_sync()
            if clip is not None:
                norm = opt.clip_grad_norm_(clip) if clip_with == "optimizer" else \
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                assert isinstance(norm, torch.Tensor) and norm.item() > 0
            opt.step()
            if sched:
                sched.step()
            losses.append(loss.item())
    finally:
        opt.close()
        model.close()
    return losses


def assert_same(expected, got, what):
    assert abs(expected[-1] - expected[0]) > 1e-3 * abs(expected[0]), "the losses must move"
    for step, (e, g) in enumerate(zip(expected, got)):
        assert abs(g - e) <= 1e-5 * abs(e), f"{what} step {step}: mxddp {g!r}, torch {e!r}"


def compare(rank, make_opt, before=False, fsdp=None, clip_with="optimizer", **kw):
    module = make_mlp()
    reference = copy.deepcopy(module)
    expected = run_torch(reference, make_opt, rank, **kw)
    got = run_mxddp(module, make_opt, rank, before=before, fsdp=fsdp, clip_with=clip_with, **kw)
    assert_same(expected, got, make_opt.__name__ if hasattr(make_opt, "__name__") else "")
    for (n, a), b in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"param {n}: {m}")


@pytest.mark.parametrize("before", [False, True])
def test_two_groups_with_their_own_decay_all_decayed(ranks, before):
    rank, _ = ranks

    def make(m):
        return torch.optim.AdamW(two_groups(m, g0={"weight_decay": 0.1}, g1={"weight_decay": 0.05, "lr": 4e-3}),
                                 lr=1e-2, betas=(0.9, 0.95))
    compare(rank, make, before=before, clip=0.5)


def test_adam_without_and_with_l2_decay(ranks):
    rank, _ = ranks
    compare(rank, lambda m: torch.optim.Adam(m.parameters(), lr=5e-3))
    compare(rank, lambda m: torch.optim.Adam(two_groups(m, g0={"weight_decay": 0.2}), lr=5e-3))


def test_sgd_with_and_without_momentum(ranks):
    rank, _ = ranks
    compare(rank, lambda m: torch.optim.SGD(two_groups(m, g0={"momentum": 0.9, "weight_decay": 1e-2},
                                                        g1={"momentum": 0.0}), lr=5e-2))


SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 1.0 / (1 + s), lambda s: 0.9 ** s]),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[2e-2, 1e-2], total_steps=STEPS),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_per_group_lr_with_a_scheduler(ranks, name):
    """Each scheduler drives mxddp's param_groups as it drives torch's (OneCycle cycles betas too)."""
    rank, _ = ranks

    def make(m):
        return torch.optim.AdamW(two_groups(m, g0={"lr": 1e-2}, g1={"lr": 3e-3}), weight_decay=0.05)
    compare(rank, make, scheduler=SCHEDULERS[name])


def test_a_script_setting_lr_in_param_groups(ranks):
    rank, _ = ranks

    def schedule(opt, step):
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (1 - step / STEPS)

    compare(rank, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), each_step=schedule)


def test_params_no_group_holds_stay_fixed(ranks):
    rank, _ = ranks
    module = make_mlp()
    first, last = module[0], module[5]
    initial = [p.detach().clone() for p in first.parameters()]
    last_initial = last.weight.detach().clone()
    reference = copy.deepcopy(module)

    def make(m):
        return torch.optim.AdamW([p for name, p in m.named_parameters() if not name.startswith("0.")], lr=1e-2)
    expected = run_torch(reference, make, rank)
    got = run_mxddp(module, make, rank)
    assert_same(expected, got, "partial optimizer")
    for p, q in zip(first.parameters(), initial):
        assert torch.equal(p.detach(), q), "a param no group holds moved"
    assert not torch.equal(last.weight.detach(), last_initial), "a param the optimizer holds did not move"
    torch.testing.assert_close(last.weight.detach(), reference[5].weight.detach(), rtol=1e-4, atol=1e-5)


def refused(make, match, rank):
    module = make_mlp()
    model = wrap(module)
    try:
        with pytest.raises((ValueError, TypeError), match=match):
            mxt.DistributedOptimizer(model, make(model.module))
    finally:
        model.close()


class MyAdamW(torch.optim.AdamW):
    pass


REFUSALS = [
    (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad=True"),
    (lambda m: torch.optim.Adam(m.parameters(), maximize=True), "maximize=True"),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True), "nesterov=True"),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.1), "dampening=0.1"),
    (lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.01)), "lr as a Tensor"),
    (lambda m: torch.optim.AdamW(m.parameters(), differentiable=True), "differentiable=True"),
    (lambda m: torch.optim.RMSprop(m.parameters()), "RMSprop is not supported"),
    (lambda m: MyAdamW(m.parameters()), "MyAdamW is not supported"),
    (lambda m: torch.optim.AdamW([{"params": list(m.parameters()), "layer_decay": 0.5}]), r"\['layer_decay'\]"),
    (lambda m: torch.optim.AdamW(list(m.parameters()) + [torch.nn.Parameter(torch.zeros(3))]), "not one the model holds"),
    (lambda m: torch.optim.AdamW([{"params": [m[0].weight, m[3].weight, m[0].weight]}]),
     "param '0.weight' is listed twice in param group 0"),
    (lambda m: set_after(torch.optim.AdamW(m.parameters()), "lr", "0.1"), "param group 0 has lr='0.1'; give a number"),
    (lambda m: set_after(torch.optim.AdamW(m.parameters()), "betas", (0.9,)),
     r"param group 0 has betas=\(0.9,\); give two numbers"),
    # Numbers no double holds: named, not Python's OverflowError when the C++ optimizer takes them.
    (lambda m: set_after(torch.optim.AdamW(m.parameters()), "lr", 10**400),
     "param group 0 has lr=an int of 1329 bits, beyond a float's range; give a number a float holds"),
    (lambda m: set_after(torch.optim.AdamW(m.parameters()), "betas", (0.9, 10**5000)),
     r"param group 0 has betas=\(0.9, an int of 16610 bits, beyond a float's range\)"),
]


def set_after(opt, key, value):
    """The optimizer with group 0's key set after construction (torch checks only there)."""
    opt.param_groups[0][key] = value
    return opt


@pytest.mark.parametrize("case", range(len(REFUSALS)))
def test_what_mxddp_cannot_honour_is_refused_by_name(ranks, case):
    rank, _ = ranks
    make, match = REFUSALS[case]
    refused(make, match, rank)


def test_a_param_in_two_groups_is_refused(ranks):
    rank, _ = ranks

    def make(m):
        opt = torch.optim.AdamW(two_groups(m))
        opt.param_groups[1]["params"].append(opt.param_groups[0]["params"][0])  # torch checks only at construction
        return opt
    refused(make, "is in param groups 0 and 1", rank)


def test_clip_grad_norm_refuses_other_norms(ranks):
    module = make_mlp()
    model = wrap(module)
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(model.module.parameters()))
    try:
        loss_of(model, ranks[0], 0).backward()
        model.finish_grad_sync()
        with pytest.raises(ValueError, match=r"norm_type=1.0 is not supported; valid: 2.0"):
            opt.clip_grad_norm_(1.0, norm_type=1.0)
        # The norm equals torch's over the same grads.
        reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(make_mlp()))
        loss_of(reference, ranks[0], 0).backward()
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
        assert abs(opt.clip_grad_norm_(1e9).item() - want.item()) <= 1e-5 * want.item()
    finally:
        opt.close()
        model.close()


@pytest.mark.parametrize("fsdp", [None, "optim_grads_params"])
def test_torch_s_clip_grad_norm_on_the_model_s_params_clips_by_mxddp_s_norm(ranks, fsdp):
    """nanoGPT's line, torch.nn.utils.clip_grad_norm_(model.parameters(), clip), unchanged: it would
    find no .grad and return 0 without clipping; torch_clip.py has it ask the model's optimizer."""
    rank, _ = ranks

    def make(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    compare(rank, make, clip=0.05, fsdp=fsdp, clip_with="torch")


def test_torch_s_clip_functions_refuse_what_mxddp_cannot_clip_and_pass_the_rest_to_torch(ranks):
    rank, _ = ranks
    module, other = make_mlp(), make_mlp()
    model = wrap(module)
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(model.module.parameters()))
    ema = copy.deepcopy(module)  # a copy of wrapped params (an EMA) is torch's, not mxddp's
    try:
        loss_of(model, rank, 0).backward()
        model.finish_grad_sync()
        params = list(model.parameters())
        last = model._names[-1]
        with pytest.raises(ValueError, match=rf"the params given are 7 of the 8 this mxddp model holds \(missing '{last}'\)"):
            torch.nn.utils.clip_grad_norm_(params[:-1], 1.0)
        loss_of(other, rank, 0).backward()
        with pytest.raises(ValueError, match=r"mix this mxddp model's with 8 others that have gradients"):
            torch.nn.utils.clip_grad_norm_(params + list(other.parameters()), 1.0)
        with pytest.raises(NotImplementedError, match=r"clip_grad_value_ on the params of a mxddp model"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        # Every name torch gives the function routes, but for one bound before mxddp.torch's import.
        norm = opt.clip_grad_norm_(1e9).item()
        assert norm > 0
        assert torch.nn.utils.clip_grad.clip_grad_norm_(model.parameters(), 1e9).item() == norm
        with pytest.warns(FutureWarning):
            assert torch.nn.utils.clip_grad_norm(model.parameters(), 1e9).item() == norm
        with pytest.raises(RuntimeError, match=r"total norm of order 2.0 .* is non-finite"):
            model._cpp.grad_buffer().fill_(float("inf"))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        # Params no mxddp model holds: torch's own functions, as before.
        want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in other.parameters()]))
        assert torch.allclose(torch.nn.utils.clip_grad_norm_(other.parameters(), 1e9, foreach=True), want)
        torch.nn.utils.clip_grad_value_(other.parameters(), 1e-4)
        assert max(p.grad.abs().max().item() for p in other.parameters()) <= 1e-4
        assert torch.nn.utils.clip_grad_norm_(ema.parameters(), 1.0).item() == 0.0  # no grads: torch's 0
    finally:
        opt.close()
        model.close()
    assert torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0).item() == 0.0  # closed: torch's own again


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_fsdp_with_two_groups_and_clipping(ranks, strategy):
    rank, _ = ranks

    def make(m):
        return torch.optim.AdamW(two_groups(m, g0={"weight_decay": 0.1}, g1={"weight_decay": 0.05, "lr": 4e-3}),
                                 lr=1e-2, betas=(0.9, 0.95))
    compare(rank, make, clip=0.5, fsdp=strategy)


def adamw_two_groups(m):
    return torch.optim.AdamW(two_groups(m, g1={"weight_decay": 0.0, "lr": 4e-3}), lr=1e-2)


def test_state_dict_round_trip_resumes_exactly(ranks):
    """torch.save of the state dicts after 4 steps, a fresh model and optimizer loading them, 4
    more steps: the losses equal an uninterrupted run's."""
    rank, world = ranks
    expected = run_mxddp(make_mlp(), adamw_two_groups, rank, steps=STEPS)

    module = make_mlp()
    model = wrap(module)
    opt = mxt.DistributedOptimizer(model, adamw_two_groups(model.module))
    for step in range(STEPS // 2):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        model.finish_grad_sync()
        opt.step()
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    sd = opt.state_dict()
    if world > 1:  # this rank's shard: the params it holds elements of
        assert sd["mxddp"]["sharded"] and sd["mxddp"]["rank"] == rank
    else:  # one rank holds every param: torch's own form
        assert not sd["mxddp"]["sharded"] and len(sd["state"]) == len(model.registered_params())
    assert len(sd["param_groups"]) == 2
    assert sd["state"] and all(s["step"].item() == STEPS // 2 for s in sd["state"].values())
    opt.close()
    model.close()

    saved.seek(0)
    ckpt = torch.load(saved, weights_only=False)
    module = make_mlp()
    module.load_state_dict({k.removeprefix("module."): v for k, v in ckpt["model"].items()})
    model = wrap(module)
    opt = mxt.DistributedOptimizer(model, adamw_two_groups(model.module))
    got = []
    try:
        opt.load_state_dict(ckpt["opt"])
        for step in range(STEPS // 2, STEPS):
            opt.zero_grad()
            loss = loss_of(model, rank, step)
            loss.backward()
            model.finish_grad_sync()
            opt.step()
            got.append(loss.item())
        if world > 1:  # a shard loads only where it was saved
            elsewhere = copy.deepcopy(ckpt["opt"])
            elsewhere["mxddp"]["rank"] = rank + 1
            with pytest.raises(ValueError, match=f"saved on rank {rank + 1} of"):
                opt.load_state_dict(elsewhere)
    finally:
        opt.close()
        model.close()
    for e, g in zip(expected[STEPS // 2:], got):
        assert abs(g - e) <= 1e-6 * abs(e), (expected, got)


def test_state_dict_hooks_run_as_torchs(ranks):
    """register_state_dict_pre/post_hook and register_load_state_dict_pre/post_hook: called in
    torch's order with torch's arguments; a post-hook's dict replaces the state dict, a load pre-hook
    edits a shallow copy (the caller's dict stays as it was) or returns a replacement."""
    rank, _ = ranks
    module = make_mlp()
    model = wrap(module)
    opt = mxt.DistributedOptimizer(model, adamw_two_groups(model.module))
    events = []
    try:
        opt.zero_grad()
        loss_of(model, rank, 0).backward()
        model.finish_grad_sync()
        opt.step()
        opt.register_state_dict_pre_hook(lambda o: events.append(("sd_pre", o is opt)))
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": "post"})
        sd = opt.state_dict()
        assert sd["tag"] == "post" and events == [("sd_pre", True)]

        def load_pre(o, state):
            events.append(("load_pre", o is opt, state is sd, state.pop("tag")))
            state["param_groups"] = [dict(g, lr=0.5) for g in state["param_groups"]]

        opt.register_load_state_dict_pre_hook(load_pre)
        opt.register_load_state_dict_post_hook(lambda o: events.append(("load_post", o.param_groups[0]["lr"])))
        opt.load_state_dict(sd)
        assert events[1:] == [("load_pre", True, False, "post"), ("load_post", 0.5)]
        assert sd["tag"] == "post" and sd["param_groups"][0]["lr"] != 0.5  # the caller's dict, untouched
        assert all(g["lr"] == 0.5 for g in opt.param_groups)
        # A pre-hook's returned dict is the one loaded.
        opt.register_load_state_dict_pre_hook(lambda o, state: {**state, "param_groups": [
            dict(g, lr=0.25) for g in state["param_groups"]]})
        opt.load_state_dict(sd)
        assert all(g["lr"] == 0.25 for g in opt.param_groups)
    finally:
        opt.close()
        model.close()


def test_state_dict_on_rank_0_alone_returns(ranks):
    rank, world = ranks
    model = wrap(make_mlp())
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(model.module.parameters()))
    try:
        opt.zero_grad()
        loss_of(model, rank, 0).backward()
        model.finish_grad_sync()
        opt.step()
        if rank == 0:  # the others go straight on: no collective may be inside
            sd = opt.state_dict()
            buffer = io.BytesIO()
            torch.save(sd, buffer)
            assert (sd["mxddp"]["rank"] == 0 if world > 1 else not sd["mxddp"]["sharded"]) and len(sd["state"]) > 0
    finally:
        opt.close()
        model.close()


def sgd_two_groups(m):
    return torch.optim.SGD(two_groups(m, g0={"momentum": 0.9}, g1={"momentum": 0.0}), lr=5e-2, weight_decay=1e-3)


@pytest.mark.parametrize("make", [adamw_two_groups, sgd_two_groups])
def test_replicated_optimizer_matches_torch_and_its_state_dict_is_torchs(ranks, make):
    """use_distributed_optimizer=False: every rank updates the whole model, the state is full, and
    state_dict() is torch's own format: the same keys, shapes and (within rounding) values as the
    reference torch optimizer's after the same steps (SGD: momentum_buffer only, none for a group
    without momentum)."""
    rank, _ = ranks
    module = make_mlp()
    reference = copy.deepcopy(module)
    ref_opt_holder = []

    def make_ref(m):
        ref_opt_holder.append(make(m))
        return ref_opt_holder[-1]
    expected = run_torch(reference, make_ref, rank, steps=4)
    model = wrap(module, distributed=False)
    opt = mxt.DistributedOptimizer(model, make(model.module))
    got = []
    try:
        for step in range(4):
            opt.zero_grad()
            loss = loss_of(model, rank, step)
            loss.backward()
            model.finish_grad_sync()
            opt.step()
            got.append(loss.item())
        sd, want = opt.state_dict(), ref_opt_holder[0].state_dict()
    finally:
        opt.close()
        model.close()
    assert_same(expected, got, "replicated")
    assert not sd["mxddp"]["sharded"]
    assert sorted(sd["state"]) == sorted(want["state"])
    for k, s in want["state"].items():
        assert sorted(sd["state"][k]) == sorted(s), k
        for name, t in s.items():
            if name == "step":
                assert sd["state"][k]["step"].item() == t.item()
            else:
                torch.testing.assert_close(sd["state"][k][name], t, rtol=1e-4, atol=1e-7)
    for g, h in zip(sd["param_groups"], want["param_groups"]):
        assert g["params"] == h["params"] and g["lr"] == h["lr"] and g["weight_decay"] == h["weight_decay"]


def test_replicated_state_saved_on_rank_0_resumes_on_every_rank(ranks):
    """A script's resume: torch.save(opt.state_dict()) on rank 0 only, every rank loads that file;
    the losses after the resume equal an uninterrupted run's."""
    rank, _ = ranks

    def train(model, opt, steps):
        losses = []
        for step in steps:
            opt.zero_grad()
            loss = loss_of(model, rank, step)
            loss.backward()
            model.finish_grad_sync()
            opt.step()
            losses.append(loss.item())
        return losses

    module = make_mlp()
    model = wrap(module, distributed=False)
    opt = mxt.DistributedOptimizer(model, adamw_two_groups(model.module))
    expected = train(model, opt, range(STEPS))
    opt.close()
    model.close()

    model = wrap(make_mlp(), distributed=False)
    opt = mxt.DistributedOptimizer(model, adamw_two_groups(model.module))
    train(model, opt, range(STEPS // 2))
    saved = torch.zeros(0, dtype=torch.uint8)
    if rank == 0:
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
        saved = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    opt.close()
    model.close()
    # Rank 0's file reaches every rank (as a shared file system would carry it).
    size = torch.tensor([saved.numel()])
    torch.distributed.broadcast(size, 0)
    data = saved if rank == 0 else torch.zeros(int(size.item()), dtype=torch.uint8)
    torch.distributed.broadcast(data, 0)
    ckpt = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)

    module = make_mlp()
    module.load_state_dict({k.removeprefix("module."): v for k, v in ckpt["model"].items()})
    model = wrap(module, distributed=False)
    opt = mxt.DistributedOptimizer(model, adamw_two_groups(model.module))
    try:
        opt.load_state_dict(ckpt["opt"])
        got = train(model, opt, range(STEPS // 2, STEPS))
    finally:
        opt.close()
        model.close()
    for e, g in zip(expected[STEPS // 2:], got):
        assert abs(g - e) <= 1e-6 * abs(e), (expected, got)


@pytest.mark.parametrize("distributed", [True, False])
def test_bf16_params_state_dict_round_trips_the_f32_main_params(ranks, distributed):
    """With BF16 params the F32 main params are copies: they travel in the state dict
    ("main_param") and a load restores them bit for bit (and re-stages the params)."""
    rank, _ = ranks
    module = make_mlp().to(torch.bfloat16)
    model = wrap(module, distributed=distributed)
    opt = mxt.DistributedOptimizer(model, adamw_two_groups(model.module))
    try:
        for step in range(2):
            opt.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
            model.finish_grad_sync()
            opt.step()
        saved = copy.deepcopy(opt.state_dict())
        assert all("main_param" in s for s in saved["state"].values())
        with torch.no_grad():
            for b in range(opt._cpp.num_buckets):
                opt._cpp.main_params(b).zero_()
                opt._cpp.state(0, b).zero_()
        opt.load_state_dict(saved)
        again = opt.state_dict()
        for k, s in saved["state"].items():
            for name, t in s.items():
                if isinstance(t, torch.Tensor):
                    assert torch.equal(again["state"][k][name], t), (k, name)
        # The params were re-staged from the restored main params.
        if not distributed:  # every rank holds every param's state
            want = saved["state"][0]["main_param"]
            assert torch.equal(model.module[0].weight.detach(), want.to(torch.bfloat16))
    finally:
        opt.close()
        model.close()


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; head b runs only on even steps (an unused branch otherwise)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(16, 32)
        self.a = torch.nn.Linear(32, 4)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x, use_b):
        h = torch.tanh(self.trunk(x))
        return self.a(h) + (self.b(h) if use_b else 0)


def test_params_unused_this_iteration_are_left_untouched(ranks):
    """torch leaves a param whose grad is None alone (no decay, no moments, no step count); mxddp
    does the same for the params model._unused_params names."""
    rank, _ = ranks
    module = TwoHeads()
    reference = copy.deepcopy(module)
    ddp = torch.nn.parallel.DistributedDataParallel(reference, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(model.module.parameters(), lr=1e-2, weight_decay=0.1))
    b_params = [i for i, (name, _) in enumerate(model.registered_params()) if name.startswith("b.")]
    try:
        for step in range(6):
            use_b = step % 2 == 0
            x, y = batch(rank, step)
            ref_opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x, use_b), y).backward()
            ref_opt.step()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x, use_b), y).backward()
            model.finish_grad_sync()
            model._unused_params = [] if use_b else b_params
            opt.step()
        for (n, a), b in zip(module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"param {n}: {m}")
        assert all(opt._cpp.param_step(i) == 3 for i in b_params)
    finally:
        opt.close()
        model.close()


@pytest.mark.parametrize("fsdp", [None, "optim_grads_params"])
@pytest.mark.parametrize("zero", ["model.zero_grad", "model.zero_grad_buffer"])
def test_a_clip_is_dropped_with_the_grads_it_measured(ranks, fsdp, zero):
    """Clip, then skip the step by zeroing the grads through the model (as a loop that drops a bad
    batch does): the next iteration's norm and update are unscaled, as torch's."""
    rank, _ = ranks
    model = wrap(make_mlp(), fsdp=fsdp)
    opt = mxt.DistributedOptimizer(model, torch.optim.SGD(model.module.parameters(), lr=0.1))
    try:
        loss_of(model, rank, 0).backward()
        model.finish_grad_sync()
        first = opt.clip_grad_norm_(1e-3).item()
        getattr(model, zero.split(".")[1])()
        loss_of(model, rank, 0).backward()
        model.finish_grad_sync()
        assert abs(opt.clip_grad_norm_(1e9).item() - first) <= 1e-6 * first  # the same grads, unclipped
    finally:
        opt.close()
        model.close()


def test_max_norm_zero_zeroes_the_grads_as_torch_and_a_negative_one_is_refused(ranks):
    rank, _ = ranks
    # Zero grads: AdamW's update is its decay alone (which moves the losses).
    compare(rank, lambda m: torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5), clip=0.0)
    model = wrap(make_mlp())
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(model.module.parameters()))
    try:
        loss_of(model, rank, 0).backward()
        model.finish_grad_sync()
        for bad in (-1.0, float("nan")):
            with pytest.raises(ValueError, match=f"max_norm={bad!r} is not valid; valid: a number >= 0"):
                opt.clip_grad_norm_(bad)
    finally:
        opt.close()
        model.close()


def test_a_param_frozen_at_wrap_time_in_the_optimizer_is_refused_by_name(ranks):
    module = make_mlp()
    module[3].bias.requires_grad_(False)
    model = wrap(module)
    try:
        with pytest.raises(ValueError, match="param group 0's param 5 '3.bias' .* was frozen .* when the model was "
                                             "wrapped"):
            mxt.DistributedOptimizer(model, torch.optim.AdamW(module.parameters()))
    finally:
        model.close()


class TwoHeads(torch.nn.Module):
    """Head b is used only while use_b: an unused param from then on (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x, use_b):
        h = torch.tanh(self.trunk(x))
        return self.a(h) + (self.b(h) if use_b else 0)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_set_to_none_decides_whether_a_param_unused_later_steps_as_torch(ranks, set_to_none):
    """torch's zero_grad(set_to_none=False) keeps a zero .grad on head b after it stops being used,
    and AdamW keeps stepping it (decay, moments, step count); with True its grad is None and it
    stays put."""
    rank, _ = ranks
    finals = []
    for kind in ("torch", "mxddp"):
        module = TwoHeads()
        if kind == "torch":
            model = torch.nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
            opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            model = mxt.DistributedDataParallel(module, find_unused_parameters=True)
            opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1))
        for step in range(5):
            opt.zero_grad(set_to_none=set_to_none)
            x, y = batch(rank, step)
            torch.nn.functional.cross_entropy(model(x, step < 2), y).backward()
            opt.step()
            if step == 1:
                b_after_use = module.b.weight.detach().clone()
        assert torch.equal(module.b.weight.detach(), b_after_use) == set_to_none, kind
        steps = {k: s["step"].item() for k, s in opt.state_dict()["state"].items()}
        finals.append((module.b.weight.detach().clone(), steps))
        if kind == "mxddp":
            opt.close()
            model.close()
    torch.testing.assert_close(finals[1][0], finals[0][0], rtol=1e-5, atol=1e-6)
    assert finals[1][1] == finals[0][1]  # per-param step counts


def test_a_sharded_state_dict_restores_the_step_count_of_params_held_elsewhere(ranks):
    """A sharded state dict has state only for the params this rank holds a part of; the others'
    step counts come back too (a DCP save after the load writes every param's)."""
    rank, world = ranks
    needs_ranks(world, 2, "params this rank holds no part of")
    counts = []
    state = None
    for _ in range(2):
        module = make_mlp()
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                                       bucket_size=64))
        opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(module.parameters(), lr=1e-2))
        try:
            held = {p for b in range(opt._cpp.num_buckets) for (p, start, end, _, _) in opt._cpp.update_ranges(b)
                    if end > start}
            assert len(held) < len(model.registered_params()), "the test needs params this rank holds no part of"
            if state is None:
                for step in range(3):
                    opt.zero_grad()
                    loss_of(model, rank, step).backward()
                    model.finish_grad_sync()
                    opt.step()
                state = opt.state_dict()
            else:
                opt.load_state_dict(state)
            counts.append([opt._cpp.param_step(i) for i in range(len(model.registered_params()))])
        finally:
            opt.close()
            model.close()
    assert counts[0] == [3] * len(counts[0]) and counts[1] == counts[0]


def test_a_group_whose_params_change_after_construction_is_refused_at_the_step(ranks):
    rank, _ = ranks
    model = wrap(make_mlp())
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(two_groups(model.module)))
    try:
        opt.param_groups[1]["params"].pop()  # torch would stop updating that param
        loss_of(model, rank, 0).backward()
        model.finish_grad_sync()
        with pytest.raises(RuntimeError, match="param group 1's params changed after the optimizer was built"):
            opt.step()
    finally:
        opt.close()
        model.close()


@pytest.mark.parametrize("built", ["before", "after"])
def test_a_scheduler_or_lr_edit_on_the_wrapped_torch_optimizer_drives_the_step(ranks, built):
    """The torch optimizer given shares its param_groups with the DistributedOptimizer: a StepLR built
    on it (before or after wrapping) and a script's lr edit on it reach the step, with no warning
    from torch's scheduler. Before, they wrote a torch optimizer nobody read: lr stayed 1e-2."""
    rank, _ = ranks
    model = wrap(make_mlp())
    base = torch.optim.AdamW(model.module.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5) if built == "before" else None
    opt = mxt.DistributedOptimizer(model, base)
    try:
        if scheduler is None:
            scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" would raise
            for step in range(2):
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                model.finish_grad_sync()
                opt.step()
                scheduler.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(2.5e-3) and base.param_groups is opt.param_groups
        base.param_groups[0]["lr"] = 0.125  # a script's edit on the torch optimizer
        assert opt._hyper(opt.param_groups[0], 0)[0] == 0.125
    finally:
        opt.close()
        model.close()


def test_the_wrapped_torch_optimizers_methods_name_the_wrapper(ranks):
    """Its state moved into the DistributedOptimizer: its zero_grad left mxddp's grads summing over
    steps, its step and state_dict did nothing or saved nothing. Each now raises naming the fix."""
    model = wrap(make_mlp())
    base = torch.optim.SGD(model.module.parameters(), lr=1e-2)
    opt = mxt.DistributedOptimizer(model, base)
    try:
        for method in ("step", "zero_grad", "state_dict"):
            with pytest.raises(RuntimeError, match=rf"SGD.{method}\(\): this torch optimizer was wrapped by "
                                                   rf"mxddp.torch.DistributedOptimizer.*call {method}\(\) on the "
                                                   "DistributedOptimizer"):
                getattr(base, method)()
        with pytest.raises(RuntimeError, match=r"SGD.load_state_dict\(\)"):
            base.load_state_dict({})
    finally:
        opt.close()
        model.close()
    with pytest.raises(RuntimeError, match="it has since been closed"):
        base.step()
