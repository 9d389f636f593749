"""Any torch optimizer on ``mxt.DistributedDataParallel(module)`` (torch_grads.py): a torch DDP
script that changes only its wrap line keeps its optimizer, whatever its class, and trains as under
torch DDP (gloo), F32, within 1e-5: ``.grad`` is each param's synchronized gradient, a view of
mxddp's grad buffer, and what the script does to it (drop it, zero it, keep it to accumulate,
replace it, unscale or clip it) is what the next backward starts from. Where the gradients cannot be
in ``.grad`` (Megatron's form, FSDP, a ``DistributedOptimizer`` open), a torch optimizer's step is
refused, naming why, and changes nothing.
"""
import copy
import dataclasses

import pytest
import torch

import mxddp.torch as mxt

STEPS = 6


@dataclasses.dataclass
class Output:
    """An output torch's pytree does not look into: the wrapper's output hook never sees its tensor."""
    logits: torch.Tensor


class Net(torch.nn.Module):
    """An MLP with a LayerNorm (a param on the hook path), a head only some steps use, and
    optionally its logits inside an Output."""

    def __init__(self, wrapped_output=False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
        self.extra = torch.nn.Linear(32, 4)
        self.wrapped_output = wrapped_output

    def forward(self, x, use_extra=False):
        h = self.norm(torch.tanh(self.fc1(x)))
        y = self.fc2(h) + (self.extra(h) if use_extra else 0)
        return Output(y) if self.wrapped_output else y


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def loss_of(model, module, rank, step, use_extra=True, regularize=False):
    x, y = batch(rank, step)
    out = model(x, use_extra)
    loss = torch.nn.functional.cross_entropy(out.logits if isinstance(out, Output) else out, y)
    if regularize:  # params read outside the wrapper's forward (one on the hook path, one fused): first to arrive
        loss = loss + 0.01 * (module.norm.weight.pow(2).sum() + module.fc1.weight.pow(2).sum())
    return loss


def adagrad(ps):
    return torch.optim.Adagrad(ps, lr=0.05, weight_decay=0.01)


def rmsprop(ps):
    return torch.optim.RMSprop(ps, lr=0.01, momentum=0.9)


def sgd_nesterov(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)


def adamw_foreach(ps):
    return torch.optim.AdamW(ps, lr=0.01, foreach=True)


def train(model, module, make_opt, rank, loop):
    opt = make_opt(module.parameters())
    losses = []
    for step in range(STEPS):
        losses.append(loop(model, module, opt, rank, step))
    return losses


def plain(model, module, opt, rank, step):
    opt.zero_grad()
    loss = loss_of(model, module, rank, step)
    loss.backward()
    opt.step()
    return loss.item()


def accumulate(model, module, opt, rank, step):
    """Two micro-batches, the first under no_sync; the grads zeroed in place (set_to_none=False)."""
    opt.zero_grad(set_to_none=False)
    with model.no_sync():
        loss_of(model, module, rank, 2 * step + 100).backward()
    loss = loss_of(model, module, rank, step)
    loss.backward()
    opt.step()
    return loss.item()


def zeroed_every_other_step(model, module, opt, rank, step):
    """Grads zeroed only every other step (the others add onto the last step's), halved by hand,
    clipped by torch's function, and a param read outside the forward."""
    if step % 2 == 0:
        opt.zero_grad()
    loss = loss_of(model, module, rank, step, regularize=True)
    loss.backward()
    for p in module.parameters():
        if p.grad is not None:
            p.grad = p.grad * 0.5  # a new tensor: the next backward adds onto it
    torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
    opt.step()
    return loss.item()


def partly_unused(model, module, opt, rank, step):
    """A head some ranks use in a step and others not, or none; grads zeroed every third step."""
    if step % 3 == 0:
        opt.zero_grad()
    loss = loss_of(model, module, rank, step, use_extra=step % 4 != 3 and (step + rank) % 2 == 0)
    loss.backward()
    opt.step()
    return loss.item()


def grad_scaler(model, module, opt, rank, step):
    if not hasattr(opt, "test_scaler"):  # one scaler per run, kept beside its optimizer
        opt.test_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler = opt.test_scaler
    opt.zero_grad()
    loss = loss_of(model, module, rank, step)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    return loss.item()



def compare(rank, make_opt, loop, wrapped_output=False, **wrap_kw):
    module = Net(wrapped_output)
    reference = copy.deepcopy(module)
    initial = [p.detach().clone() for p in module.parameters()]
    expected = train(torch.nn.parallel.DistributedDataParallel(reference, **wrap_kw), reference, make_opt, rank, loop)
    model = mxt.DistributedDataParallel(module, **wrap_kw)
    try:
        got = train(model, module, make_opt, rank, loop)
        moved = max((a.detach() - b).abs().max().item() for a, b in zip(module.parameters(), initial))
        assert moved > 1e-3, f"the params must move (by {moved})"
        for step, (e, g) in enumerate(zip(expected, got)):
            assert abs(g - e) <= 1e-5 * abs(e), f"step {step}: mxddp {g!r}, torch {e!r}"
        for (n, a), b in zip(module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"param {n}: {m}")
            assert (a.grad is None) == (b.grad is None), n
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {n}: {m}")
    finally:
        model.close()


@pytest.mark.parametrize("make_opt", [adagrad, rmsprop, sgd_nesterov, adamw_foreach], ids=lambda f: f.__name__)
def test_an_unwrapped_torch_optimizer_trains_as_under_torch_ddp(ranks, make_opt):
    compare(ranks[0], make_opt, plain)


@pytest.mark.parametrize("loop", [accumulate, zeroed_every_other_step, grad_scaler], ids=lambda f: f.__name__)
@pytest.mark.parametrize("wrapped_output", [False, True], ids=["tensor_output", "dataclass_output"])
def test_what_the_script_does_to_grad_is_what_the_next_backward_starts_from(ranks, loop, wrapped_output):
    compare(ranks[0], adagrad, loop, wrapped_output)


def test_params_some_ranks_leave_unused_get_grad_as_under_torch_ddp(ranks):
    compare(ranks[0], torch.optim.Adam, partly_unused, find_unused_parameters=True)


def test_grad_is_the_synchronized_main_grad_with_no_memory_of_its_own(ranks):
    rank, _ = ranks
    module = Net()
    model = mxt.DistributedDataParallel(module, find_unused_parameters=True)
    try:
        loss_of(model, module, rank, 0, use_extra=False).backward()
        for name, p in module.named_parameters():
            if name.startswith("extra."):
                assert p.grad is None, name  # no rank used it: torch leaves it None too
            else:
                assert p.grad is p.main_grad, name
                assert p.grad.data_ptr() == p.main_grad.data_ptr()
        # torch's zero_grad(set_to_none=True) drops them; the next backward starts from nothing.
        module.zero_grad()
        loss = loss_of(model, module, rank, 1, use_extra=False)
        loss.backward()
        once = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        module.fc1.weight.grad = None
        loss_of(model, module, rank, 1, use_extra=False).backward()  # the same batch again
        for name, p in module.named_parameters():
            if name in once:
                factor = 1 if name == "fc1.weight" else 2  # dropped, or kept and added onto
                torch.testing.assert_close(p.grad, factor * once[name], msg=lambda m: f"{name}: {m}")
        held = {n: (p.grad, p.grad.clone()) for n, p in module.named_parameters() if p.grad is not None}
    finally:
        model.close()
    # close(): each param keeps its gradient, in storage of its own, and a reference the script
    # took before close() is that same tensor, still holding its values.
    for name, p in module.named_parameters():
        if name in held:
            assert p.grad is held[name][0] and not hasattr(p, "main_grad"), name
            assert torch.equal(held[name][0], held[name][1]), name


def refusal_cases():
    def megatron(module):
        return mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig()), "Megatron's form"

    def megatron_sharded(module):
        return mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_distributed_optimizer=True)), "Megatron's form"

    def fsdp(module):
        return mxt.FullyShardedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy="no_shard"),
            fsdp_unit_modules=[torch.nn.Linear]), "FullyShardedDataParallel keeps"

    return [megatron, megatron_sharded, fsdp]


@pytest.mark.parametrize("make", refusal_cases(), ids=lambda f: f.__name__)
def test_a_torch_optimizer_that_would_step_no_gradient_is_refused_by_name(ranks, make):
    rank, _ = ranks
    module = Net()
    model, why = make(module)
    try:
        opt = adagrad(module.parameters())
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(model(x, True), y).backward()
        model.finish_grad_sync()
        before = [p.detach().clone() for p in module.parameters()]
        with pytest.raises(RuntimeError, match=rf"Adagrad.step\(\) on the params of a mxddp.torch .*: their gradients "
                                               rf"are not in .grad, so it would step nothing: .*{why}"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    finally:
        model.close()


def test_with_a_distributed_optimizer_open_grad_stays_none_and_a_torch_step_is_refused(ranks):
    rank, _ = ranks
    module = Net()
    model = mxt.DistributedDataParallel(module)
    opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(module.parameters(), lr=0.01))
    other = torch.optim.SGD(module.parameters(), lr=0.1)
    try:
        loss_of(model, module, rank, 0).backward()
        assert all(p.grad is None for p in module.parameters())  # mxddp's optimizer reads main_grad
        with pytest.raises(RuntimeError, match=r"SGD.step\(\) .*a mxt.DistributedOptimizer is open on it"):
            other.step()
        opt.step()
    finally:
        opt.close()
        model.close()


def test_bf16_params_get_bf16_grads_a_torch_optimizer_steps(ranks):
    """torch's form keeps the grads in the params' dtype, as torch DDP: BF16 .grad on BF16 params."""
    rank, world = ranks
    module = Net().to(torch.bfloat16)
    model = mxt.DistributedDataParallel(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    try:
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16), True).float(), y).backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        opt.step()
        for n, p in module.named_parameters():
            assert grads[n].dtype == torch.bfloat16 and p.grad is p.main_grad, n
            assert torch.equal(p.detach(), before[n].add_(grads[n], alpha=-0.1)), n  # SGD's own update
    finally:
        model.close()


def test_a_backward_that_bypasses_the_wrapper_starts_from_what_the_script_left(ranks):
    """module(x) instead of model(x): nothing sees the wrapper's output, and the fused weights'
    backward is the first to reach their gradients; they are taken back before it adds. (torch
    DDP does not synchronize such a backward; mxddp does, so the reference is a plain copy's
    gradient averaged over the ranks, added onto what the script left.)"""
    rank, world = ranks
    module = Net()
    model = mxt.DistributedDataParallel(module)
    try:
        loss_of(model, module, rank, 0).backward()
        left = {n: p.grad.clone() for n, p in module.named_parameters()}
        left["fc1.weight"].zero_()
        left["fc2.weight"] *= 0.5
        module.fc1.weight.grad = None
        module.fc2.weight.grad = module.fc2.weight.grad * 0.5
        x, y = batch(rank, 1)
        plain = copy.deepcopy(module)
        torch.nn.functional.cross_entropy(plain(x, True), y).backward()
        torch.nn.functional.cross_entropy(module(x, True), y).backward()
        for (n, p), q in zip(module.named_parameters(), plain.parameters()):
            mean = q.grad.clone()
            torch.distributed.all_reduce(mean)
            torch.testing.assert_close(p.grad, left[n] + mean / world, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"grad {n}: {m}")
    finally:
        model.close()


def test_a_megatron_script_that_puts_main_grad_in_grad_itself_steps_it(ranks):
    """The refusal is for a step that would find no gradient: a script that bridges by hand
    (p.grad = p.main_grad, Megatron's form) steps what it put there, as before."""
    rank, _ = ranks
    module = Net()
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    try:
        loss_of(model, module, rank, 0).backward()
        model.finish_grad_sync()
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        for p in module.parameters():
            p.grad = p.main_grad
        opt.step()
        for n, p in module.named_parameters():
            assert torch.equal(p.detach(), before[n].add_(p.main_grad, alpha=-0.1)), n
    finally:
        model.close()
