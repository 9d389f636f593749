"""gradient_accumulation_fusion (python/mxddp/torch/grad_fusion.py): which params are fused (the
weights of plain nn.Linear, HF Conv1D and nn.Embedding modules, every owner fusable), their
main_grad equal to torch's gradients accumulated over micro-batches with no `.grad` and no dW
tensor ever made, a param reported ready once however many times it is used, unused modules,
no_grad forwards, the fall-backs to the hook (a non-fusable owner, Embedding with padding_idx, BF16
params with an F32 main_grad) and fused weights read outside their modules too. Parity of whole trainings with fusion on and
off is in test_parity.py and test_bf16.py."""
import contextlib
import copy
import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mxddp.torch as mxt
from test_parity import make_gpt2


def config(**kw):
    kw.setdefault("grad_reduce_in_fp32", True)
    return mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, **kw)


def conv1d(nx, nf):
    transformers = pytest.importorskip("transformers")
    return transformers.pytorch_utils.Conv1D(nf, nx)  # HF's order: (out, in); weight [in, out]


class Mixed(torch.nn.Module):
    """Every fusable kind, a tied embedding / head, a Linear used twice, an unused Linear, and
    params the hook keeps: a Linear weight also owned by a module that reads it itself (`Reader`)
    and an Embedding with padding_idx. Shapes differ, so a dW shows by its shape."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(53, 24)
        self.shared = torch.nn.Linear(24, 24)
        self.reader = Reader(self.shared.weight)
        self.padded = torch.nn.Embedding(11, 24, padding_idx=0)
        self.conv = conv1d(24, 56)
        self.twice = torch.nn.Linear(56, 56)
        self.unused = torch.nn.Linear(56, 7)
        self.down = torch.nn.Linear(56, 24)
        self.head = torch.nn.Linear(24, 53, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids) + self.padded(ids % 11)
        h = torch.tanh(self.shared(h) + self.reader(h))
        h = torch.tanh(self.twice(torch.tanh(self.twice(torch.tanh(self.conv(h))))))
        return self.head(self.down(h))


class Reader(torch.nn.Module):
    """Reads a weight it shares outside any nn.Linear's forward: not a fusable owner."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return 0.5 * torch.nn.functional.linear(x, self.weight)


FUSED = ["embed.weight", "conv.weight", "twice.weight", "unused.weight", "down.weight"]


def batch(rank, micro):
    return torch.randint(0, 53, (3, 5), generator=torch.Generator().manual_seed(10 * rank + micro))


def loss_of(model, ids):
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


class NewTensorsOfShapes(TorchDispatchMode):
    """Records every op whose output is a tensor of one of `shapes` that lies in none of `buffers`
    (an in-place accumulation into main_grad is in the grad buffer; a detached view of a weight, in
    the param buffer, allocates nothing)."""

    def __init__(self, shapes, buffers):
        super().__init__()
        self.shapes, self.seen = {tuple(s) for s in shapes}, []
        self.ranges = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and tuple(t.shape) in self.shapes:
                if not any(start <= t.data_ptr() < end for start, end in self.ranges):
                    self.seen.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("fusion", [True, False])
def test_main_grads_equal_torch_grads_over_micro_batches_with_no_dw_tensor(ranks, fusion):
    rank, _ = ranks
    torch.manual_seed(0)
    module = Mixed()
    reference = copy.deepcopy(module)
    # No overlap: the unused module's params are never reported, which overlap_grad_reduce refuses
    # at finish_grad_sync (as without fusion), and main_grad holds the local sums until then.
    model = mxt.DistributedDataParallel(module, config(overlap_grad_reduce=False, bucket_size=1000),
                                        gradient_accumulation_fusion=fusion)
    try:
        names = [n for n, _ in model.registered_params()]
        assert [n for n, f in zip(names, model.fused_params) if f] == (FUSED if fusion else [])
        fused_shapes = [p.shape for (n, p), f in zip(model.registered_params(), model.fused_params) if f]
        watch = NewTensorsOfShapes([p.shape for n, p in model.registered_params() if n in FUSED],
                                  [model.grad_buffer(), model.param_buffer()])
        for micro in range(2):  # two micro-batches accumulate into main_grad, the first under no_sync
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                loss = loss_of(model, batch(rank, micro))
                with watch:
                    loss.backward()
            loss_of(reference, batch(rank, micro)).backward()
        # Fused: no dW of a fused weight's shape was ever made (the embedding's dense [53, 24], the
        # Conv1D's and the down Linear's [24, 56], the Linear's [56, 56]); the hook path makes each.
        if fusion:
            assert watch.seen == [], watch.seen
        else:
            assert {s for _, s in watch.seen} == {tuple(s) for s in [(53, 24), (24, 56), (56, 56)]}, watch.seen
        assert fused_shapes == ([torch.Size(s) for s in [(53, 24), (24, 56), (56, 56), (7, 56), (24, 56)]]
                                if fusion else [])
        ref = dict(reference.named_parameters())
        for n, p in model.registered_params():
            assert p.grad is None, n
            expected = ref[n].grad if ref[n].grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(p.main_grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        assert model.module.unused.weight.main_grad.abs().sum() == 0
        assert model.module.padded.weight.main_grad[0].abs().sum() == 0  # padding_idx kept: the hook path
        assert model.module.embed.weight.main_grad.abs().sum() > 0
        model.finish_grad_sync()
    finally:
        model.close()
    # close() gives the modules their class's forward back.
    assert all("forward" not in vars(m) for m in module.modules())


def test_a_weight_used_twice_and_by_a_tied_head_reports_ready_once(ranks):
    """One bucket, issued when its last param reports: with overlap_grad_reduce a param reported
    twice is an error and one never reported leaves the bucket unissued."""
    rank, _ = ranks
    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Embedding(40, 16), torch.nn.Linear(16, 16),
                                 torch.nn.Linear(16, 40, bias=False))
    module[2].weight = module[0].weight
    model = mxt.DistributedDataParallel(module, config(overlap_grad_reduce=True))
    try:
        assert model.fused_params == [True, True, False]  # the tied weight, the Linear's; its bias
        ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(rank))
        h = module[1](torch.tanh(module[1](module[0](ids))))  # the middle Linear twice
        module[2](h).square().mean().backward()
        assert model._cpp.num_bucket_groups == 1 and model._cpp.bucket_group_issued(0)
        model.finish_grad_sync()
    finally:
        model.close()


def test_no_grad_forward_reports_nothing_and_adds_nothing(ranks):
    rank, _ = ranks
    torch.manual_seed(2)
    module = torch.nn.Sequential(torch.nn.Embedding(30, 8), torch.nn.Linear(8, 30))
    model = mxt.DistributedDataParallel(module, config(overlap_grad_reduce=True))
    try:
        ids = torch.randint(0, 30, (4, 3), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            out = model(ids)
        assert not out.requires_grad and not model.grads_live
        with torch.no_grad():  # the replaced forwards take the classes' argument names
            assert torch.equal(module[1](input=module[0](input=ids)), out)
        assert model.grad_buffer().abs().sum() == 0
        with torch.inference_mode():
            model(ids)
        assert not model.grads_live and model.grad_buffer().abs().sum() == 0
        model(ids).sum().backward()
        assert model.grads_live
        model.finish_grad_sync()
    finally:
        model.close()


def test_hf_gpt2_fuses_its_tied_embedding_conv1d_and_position_weights(ranks):
    module = make_gpt2()
    model = mxt.DistributedDataParallel(module, config())
    try:
        fused = {n for (n, _), f in zip(model.registered_params(), model.fused_params) if f}
        expected = {n for n, p in module.named_parameters() if n.endswith(".weight") and p.ndim == 2}
        assert "transformer.wte.weight" in fused and "transformer.h.0.attn.c_attn.weight" in fused
        assert fused == expected  # every 2-D weight: wte (and through it lm_head), wpe, the Conv1Ds
        assert "forward" in vars(module.lm_head) and "forward" in vars(module.transformer.wte)
    finally:
        model.close()


@pytest.mark.parametrize("grad_reduce_in_fp32,fused", [(True, False), (False, True)])
def test_bf16_params_fuse_gemms_only_into_a_bf16_main_grad_and_embeddings_always(ranks, grad_reduce_in_fp32, fused):
    rank, _ = ranks
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Embedding(20, 32), torch.nn.Linear(32, 32),
                                 torch.nn.Linear(32, 8)).to(torch.bfloat16)
    reference = copy.deepcopy(module).float()
    model = mxt.DistributedDataParallel(module, config(grad_reduce_in_fp32=grad_reduce_in_fp32))
    try:
        assert model.fused_params == [True, fused, False, fused, False]  # weights, never biases
        ids = torch.randint(0, 20, (4, 4), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            with model.no_sync():
                model(ids).float().square().mean().backward()
            reference(ids).square().mean().backward()
        for (n, p), q in zip(model.registered_params(), reference.parameters()):
            assert p.grad is None
            # The BF16 forward's rounding bounds the agreement with the F32 reference.
            torch.testing.assert_close(p.main_grad.float(), q.grad, rtol=3e-2, atol=3e-3, msg=lambda m: f"{n}: {m}")
        model.finish_grad_sync()
    finally:
        model.close()


class ReadsItsWeights(torch.nn.Module):
    """Reads fused weights outside their modules' forward as well: the Linear's weight beside its
    own call, and the embedding table as an LM head by hand (`F.linear(h, table)`, the way many
    models tie their head). `skip_lin` leaves the Linear's own call out, so its weight is read
    only directly in that backward."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(19, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, ids, skip_lin=False):
        h = self.embed(ids)
        direct = h @ self.lin.weight.t()
        h = torch.tanh(direct + (self.lin.bias if skip_lin else self.lin(h)))
        return torch.nn.functional.linear(h, self.embed.weight)


@pytest.mark.parametrize("skip_lin", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_reading_a_fused_weight_elsewhere_adds_its_gradient_and_reports_it_once(ranks, skip_lin, overlap):
    """With overlap_grad_reduce (one bucket) a param reported twice (once by its fused uses, once
    for its direct read) is an error and one never reported leaves the bucket unissued; without it
    main_grad holds the local sums until finish_grad_sync: torch's gradient over both kinds of use.
    No `.grad` is left on the Parameters either way."""
    rank, _ = ranks
    torch.manual_seed(4)
    module = ReadsItsWeights()
    reference = copy.deepcopy(module)
    model = mxt.DistributedDataParallel(module, config(overlap_grad_reduce=overlap))
    try:
        assert model.fused_params == [True, True, False]  # embed.weight, lin.weight; lin.bias
        for micro in range(2):
            ids = batch(rank, micro) % 19
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                model(ids, skip_lin=skip_lin).square().mean().backward()
            reference(ids, skip_lin=skip_lin).square().mean().backward()
        assert all(p.grad is None for p in module.parameters())
        if overlap:
            assert model._cpp.num_bucket_groups == 1 and model._cpp.bucket_group_issued(0)
        else:
            ref = dict(reference.named_parameters())
            for n, p in model.registered_params():
                torch.testing.assert_close(p.main_grad, ref[n].grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        model.finish_grad_sync()
    finally:
        model.close()


def test_the_param_attribute_opts_a_weight_out_of_fusion(ranks):
    module = ReadsItsWeights()
    module.lin.weight.gradient_accumulation_fusion = False
    model = mxt.DistributedDataParallel(module, config())
    try:
        assert model.fused_params == [True, False, False]
    finally:
        model.close()


def test_bad_fusion_arguments_name_the_field(ranks):
    with pytest.raises(TypeError, match="gradient_accumulation_fusion must be True or False; got 1"):
        mxt.DistributedDataParallel(torch.nn.Linear(4, 4), config(), gradient_accumulation_fusion=1)
    lin = torch.nn.Linear(4, 4)
    lin.weight.gradient_accumulation_fusion = "yes"
    with pytest.raises(TypeError, match="param 'weight' has gradient_accumulation_fusion='yes'"):
        mxt.DistributedDataParallel(lin, config())


def test_a_copy_of_a_fused_module_is_a_plain_module(ranks):
    """copy.deepcopy (an EMA or teacher model) and torch.save of the whole module give modules that
    compute with their own weights and leave the wrapper alone: the fused forward stays with the
    live module."""
    rank, _ = ranks
    torch.manual_seed(5)
    module = torch.nn.Sequential(torch.nn.Embedding(30, 8), torch.nn.Linear(8, 30))
    model = mxt.DistributedDataParallel(module, config(overlap_grad_reduce=True))
    try:
        assert model.fused_params == [True, True, False]
        saved = io.BytesIO()
        torch.save(module, saved)
        saved.seek(0)
        for copied in [copy.deepcopy(module), torch.load(saved, weights_only=False)]:
            assert all("forward" not in vars(m) and "__getstate__" not in vars(m) for m in copied.modules())
            with torch.no_grad():
                copied[1].weight.zero_()
            ids = torch.randint(0, 30, (4, 3), generator=torch.Generator().manual_seed(rank))
            out = copied(ids)
            assert torch.equal(out, copied[1].bias.expand_as(out))  # its own (zeroed) weight
            out.square().sum().backward()
            assert copied[0].weight.grad is not None and copied[1].weight.grad is not None
            assert not model.grads_live and model.grad_buffer().abs().sum() == 0
        assert "forward" in vars(module[1])  # the live module keeps its fused forward
    finally:
        model.close()
    assert all("forward" not in vars(m) and "__getstate__" not in vars(m) for m in module.modules())


def test_functional_call_with_other_weights_runs_torch_forward(ranks):
    """torch.func.functional_call swaps other tensors in for the params: the fused modules then run
    their class's forward on those, and every substituted tensor gets its gradient."""
    torch.manual_seed(6)
    module = torch.nn.Sequential(torch.nn.Embedding(30, 8), torch.nn.Linear(8, 30))
    plain = copy.deepcopy(module)
    model = mxt.DistributedDataParallel(module, config())
    try:
        ids = torch.randint(0, 30, (4, 3), generator=torch.Generator().manual_seed(0))
        swapped = {n: torch.randn(p.shape, requires_grad=True) for n, p in module.named_parameters()}
        out = torch.func.functional_call(module, swapped, (ids,))
        torch.testing.assert_close(out, torch.func.functional_call(plain, swapped, (ids,)), rtol=0, atol=0)
        out.sum().backward()
        assert all(t.grad is not None for t in swapped.values()), [n for n, t in swapped.items() if t.grad is None]
        assert not model.grads_live and model.grad_buffer().abs().sum() == 0
    finally:
        model.close()


@pytest.mark.parametrize("frozen", ["0.weight", "1.weight"])
def test_a_fused_weight_frozen_mid_run_gets_no_gradient(ranks, frozen):
    """requires_grad_(False) after wrapping, as fine-tuning scripts do: torch computes no gradient
    for the weight, so with find_unused_parameters it is an unused param; fused or not, its
    main_grad stays zero and the other params' equal torch's (every rank on the same batch, so the
    average over ranks is the reference's own gradient)."""
    torch.manual_seed(7)
    module = torch.nn.Sequential(torch.nn.Embedding(30, 8), torch.nn.Linear(8, 30))
    reference = copy.deepcopy(module)
    model = mxt.DistributedDataParallel(module, find_unused_parameters=True)
    try:
        assert model.fused_params == [True, True, False]
        dict(module.named_parameters())[frozen].requires_grad_(False)
        dict(reference.named_parameters())[frozen].requires_grad_(False)
        ids = torch.randint(0, 30, (4, 3), generator=torch.Generator().manual_seed(0))
        model(ids).square().mean().backward()
        reference(ids).square().mean().backward()
        model.finish_grad_sync()
        ref = dict(reference.named_parameters())
        for n, p in module.named_parameters():
            if n == frozen:
                assert ref[n].grad is None and p.main_grad.abs().sum() == 0, n
            else:
                torch.testing.assert_close(p.main_grad, ref[n].grad, rtol=1e-5, atol=1e-6)
    finally:
        model.close()


def test_user_gradient_hooks_registered_before_wrapping_run_as_torchs(ranks):
    """A tensor hook that masks the gradient and a post-accumulate-grad hook on Linear and
    Embedding weights (fusable): the weights keep the hook path, both hooks run once per backward,
    and main_grad equals torch's gradient with the mask (every rank on the same batch). Before this
    check fusion bypassed both: no call, the unmasked gradient reduced and stepped."""
    torch.manual_seed(7)
    module = torch.nn.Sequential(torch.nn.Embedding(30, 8), torch.nn.Linear(8, 30))
    reference = copy.deepcopy(module)
    calls = {"mask": 0, "post": 0}

    def mask(grad):
        calls["mask"] += 1
        return grad * (torch.arange(grad.shape[0]) % 2 == 0).unsqueeze(1)  # the odd rows' gradient zeroed

    def post(param):
        calls["post"] += 1
        assert param.grad is not None  # torch's contract: the accumulated gradient is there

    for m in (module, reference):
        m[0].weight.register_hook(mask)
        m[1].weight.register_post_accumulate_grad_hook(post)
    model = mxt.DistributedDataParallel(module)
    try:
        assert model.fused_params == [False, False, False]  # 0.weight, 1.weight hooked; 1.bias not fusable
        ids = torch.randint(0, 30, (4, 3), generator=torch.Generator().manual_seed(0))
        model(ids).square().mean().backward()
        assert calls == {"mask": 1, "post": 1}
        reference(ids).square().mean().backward()
        assert calls == {"mask": 2, "post": 2}
        for (n, p), (_, r) in zip(module.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.main_grad, r.grad, rtol=1e-5, atol=1e-6, msg=n)
        assert p.main_grad is not None and module[0].weight.main_grad[1::2].abs().sum() == 0
    finally:
        model.close()


def test_a_gradient_hook_added_after_wrapping_is_refused_at_forward(ranks):
    module = torch.nn.Sequential(torch.nn.Embedding(30, 8), torch.nn.Linear(8, 30))
    model = mxt.DistributedDataParallel(module)
    try:
        assert model.fused_params == [True, True, False]
        model(torch.zeros(2, 3, dtype=torch.long))  # mxddp's own hooks are not the user's
        handle = module[1].weight.register_hook(lambda g: g * 0)
        with pytest.raises(RuntimeError, match="Linear.weight got a gradient hook .* after wrapping: with gradient "
                                               "accumulation fusion its dW goes into main_grad"):
            model(torch.zeros(2, 3, dtype=torch.long))
        handle.remove()
        module[0].weight.register_post_accumulate_grad_hook(lambda p: None)
        with pytest.raises(RuntimeError, match="Embedding.weight got a gradient hook"):
            model(torch.zeros(2, 3, dtype=torch.long))
    finally:
        model.close()


def test_a_gradient_hook_on_an_mxfp8_weight_is_refused_at_wrap(ranks):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    module[1].weight.register_hook(lambda g: g)
    with pytest.raises(ValueError, match="param '1.weight' is an MXFP8 weight with a gradient hook .* "
                                         "param.mxfp8 = False"):
        mxt.DistributedDataParallel(module, config(fp8_param_gather=True))
