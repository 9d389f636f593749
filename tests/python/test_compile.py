"""torch.compile of a wrapped model (nanoGPT's train.py compiles by default): compiled training
computes what eager training computes, and the model's own math is in the graphs dynamo captured.

- DistributedDataParallel (torch's form and Megatron's, MXFP8 weights) and FullyShardedDataParallel
  with unsharded params (`no_shard`, `optim`, `optim_grads`) compile as they are: their hooks call the
  C++ layer and leave the params' storage alone.
- FSDP `optim_grads_params` swaps each param's `.data` between a gathered view and a stand-in, which
  dynamo would trace as mutations of graph inputs (AOTAutograd refuses them): `torch.compile(model)`
  runs its forward eagerly, with a warning that says so, and the module compiled before wrapping
  (`torch.compile(module)`, `module.compile()`) compiles, the units' hooks running eagerly between
  its graphs.

Most cases compile with the `aot_eager` backend (dynamo and AOTAutograd, which are what meet mxddp's
hooks, without generating code: F32 results equal eager's bit for bit); the DDP form a script uses and
the FSDP modules compiled before wrapping use inductor, whose graphs also check their inputs' strides.
"""
import warnings

import pytest
import torch

import mxddp.torch as mxt

STEPS = 3


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.norm(self.fc1(x))))


class Lm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Graphs:
    """A dynamo backend that records what it was given, then runs it as `inner` (aot_eager or inductor),
    counting the runs of the graphs that hold a block's math (its relu): dynamo gives up compiling a
    frame whose guards keep failing (a param's strides changing from call to call, say) and runs it
    eagerly from then on, which only these counts show."""

    def __init__(self, inner: str):
        self.inner = torch._dynamo.lookup_backend(inner)
        self.targets: set[str] = set()
        self.block_runs = 0

    def __call__(self, gm, example_inputs):
        targets = {str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
        self.targets |= targets
        compiled = self.inner(gm, example_inputs)
        if not any("relu" in t for t in targets):
            return compiled

        def run(*args):
            self.block_runs += 1
            return compiled(*args)
        return run

    def captured_the_blocks(self) -> bool:
        return any("relu" in t for t in self.targets) and any("layer_norm" in t for t in self.targets)


@pytest.fixture(autouse=True)
def dynamo_never_gives_up():
    """A frame whose guards keep failing would be recompiled up to the limit, then run eagerly for
    good; here that is an error, as is anything dynamo cannot trace."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def config(**kw):
    return mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True, **kw)


def fsdp(strategy, **kw):
    return lambda m: mxt.FullyShardedDataParallel(
        m, config(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True,
                  overlap_param_gather=True, **kw), fsdp_unit_modules=[Block])


def mxt_adamw(model):
    return mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2, weight_decay=0.1))


WRAPS = {
    # (wrap, optimizer, the params' dtype)
    "torch DDP form, torch AdamW": (lambda m: mxt.DistributedDataParallel(m),
                                    lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2), torch.float32),
    "Megatron DDP, overlapped": (lambda m: mxt.DistributedDataParallel(
        m, config(overlap_grad_reduce=True, overlap_param_gather=True)), mxt_adamw, torch.float32),
    "DDP, MXFP8 weights": (lambda m: mxt.DistributedDataParallel(m, config(fp8_param_gather=True)), mxt_adamw,
                           torch.bfloat16),
    "FSDP no_shard": (fsdp("no_shard"), mxt_adamw, torch.float32),
    "FSDP optim": (fsdp("optim"), mxt_adamw, torch.float32),
    "FSDP optim_grads": (fsdp("optim_grads"), mxt_adamw, torch.float32),
}


def make(dtype=torch.float32):
    torch.manual_seed(0)
    return Lm().to(dtype)


def train(model, opt, rank, graphs=None):
    """STEPS iterations on this rank's batches; returns the losses. With `graphs`, the last step must
    run the blocks' math in compiled graphs (both blocks', or one graph holding both)."""
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(STEPS):
        if graphs is not None and step == STEPS - 1:
            runs_before = graphs.block_runs
        ids = torch.randint(0, 64, (4, 9), generator=generator)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        if isinstance(opt, mxt.DistributedOptimizer):
            model.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    if graphs is not None:
        assert graphs.block_runs > runs_before, "the last step ran the blocks eagerly: dynamo gave up compiling them"
    return losses


def run(wrap, make_opt, dtype, rank, compile_model=None, compile_module=None, graphs=None):
    module = make(dtype)
    if compile_module is not None:
        module = compile_module(module)
    model = wrap(module)
    opt = make_opt(model)
    losses = train(compile_model(model) if compile_model is not None else model, opt, rank, graphs)
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    opt.close() if hasattr(opt, "close") else None
    model.close()
    return losses, state


def assert_same_training(eager, compiled):
    assert compiled[0] == eager[0], "losses differ from eager training"
    for name, value in eager[1].items():
        torch.testing.assert_close(compiled[1][name], value, rtol=0, atol=0, msg=name)


def assert_close_training(eager, compiled, rtol, params_atol=None):
    """Losses within rtol, and the params after the steps within 10 rtol or params_atol (a module
    compiled before wrapping names its params under ``_orig_mod``)."""
    torch.testing.assert_close(compiled[0], eager[0], rtol=rtol, atol=0)
    params = {name.replace("_orig_mod.", ""): value for name, value in compiled[1].items()}
    assert sorted(params) == sorted(eager[1])
    atol = 10 * rtol if params_atol is None else params_atol
    for name, value in eager[1].items():
        torch.testing.assert_close(params[name], value, rtol=10 * rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", WRAPS)
def test_a_compiled_model_trains_as_eager(ranks, name):
    rank, _ = ranks
    wrap, make_opt, dtype = WRAPS[name]
    graphs = Graphs("aot_eager")
    eager = run(wrap, make_opt, dtype, rank)
    compiled = run(wrap, make_opt, dtype, rank, compile_model=lambda m: torch.compile(m, backend=graphs), graphs=graphs)
    assert graphs.captured_the_blocks(), f"{name}: dynamo captured no block math: {sorted(graphs.targets)}"
    assert_same_training(eager, compiled)


@pytest.mark.parametrize("order", ["compiled, then wrapped", "wrapped, then compiled"])
def test_compiled_with_inductor_as_a_script_would(ranks, order):
    """torch's DDP form, the user's AdamW, torch.compile's default backend; nanoGPT's train.py compiles
    the module and then wraps it. Inductor's kernels round otherwise than eager's: within 1e-5."""
    rank, _ = ranks
    wrap, make_opt, dtype = WRAPS["torch DDP form, torch AdamW"]
    graphs = Graphs("inductor")
    compiling = lambda m: torch.compile(m, backend=graphs)  # noqa: E731
    eager = run(wrap, make_opt, dtype, rank)
    compiled = run(wrap, make_opt, dtype, rank, graphs=graphs,
                   **{"compile_module" if order.startswith("compiled") else "compile_model": compiling})
    assert graphs.captured_the_blocks()
    assert_close_training(eager, compiled, rtol=1e-5)


def test_fsdp_with_sharded_params_compiled_whole_runs_eagerly_and_says_so(ranks):
    rank, _ = ranks
    wrap = fsdp("optim_grads_params")
    graphs = Graphs("aot_eager")
    eager = run(wrap, mxt_adamw, torch.float32, rank)
    with pytest.warns(UserWarning, match=r"FullyShardedDataParallel whose params are sharded .*runs eagerly"):
        compiled = run(wrap, mxt_adamw, torch.float32, rank, compile_model=lambda m: torch.compile(m, backend=graphs))
    assert not graphs.captured_the_blocks()
    assert_same_training(eager, compiled)


@pytest.mark.parametrize("how", ["torch.compile(module)", "module.compile()", "torch.compile(module), MXFP8 weights"])
def test_fsdp_with_sharded_params_compiles_the_module_compiled_before_wrapping(ranks, how):
    """With inductor, whose graphs check their inputs' strides: traced, the unit hooks' swaps gave a
    graph a param's stand-in (strides 0) where it then got the gathered view, and the saved-tensor
    hooks' look-up by storage address made dynamo recompile until it gave up. F32 within 1e-5, as
    above; MXFP8 (BF16 arithmetic, which inductor rounds otherwise) within 1e-3."""
    rank, _ = ranks
    mxfp8 = how.endswith("MXFP8 weights")
    wrap = fsdp("optim_grads_params", fp8_param_gather=True) if mxfp8 else fsdp("optim_grads_params")
    dtype = torch.bfloat16 if mxfp8 else torch.float32
    graphs = Graphs("inductor")

    def compile_module(m):
        if how == "module.compile()":
            m.compile(backend=graphs)
            return m
        return torch.compile(m, backend=graphs)

    eager = run(wrap, mxt_adamw, dtype, rank)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs eagerly")  # not the whole-model warning
        compiled = run(wrap, mxt_adamw, dtype, rank, compile_module=compile_module, graphs=graphs)
    assert graphs.captured_the_blocks(), sorted(graphs.targets)
    # MXFP8: a param whose gradient is near 0 may take AdamW's step (lr 1e-2) the other way.
    assert_close_training(eager, compiled, rtol=1e-3 if mxfp8 else 1e-5, params_atol=3e-2 if mxfp8 else None)
