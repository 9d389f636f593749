"""Checkpoints of the package (mxt.save_checkpoint / load_checkpoint): the history layout of
`mxddp train --save`, a round trip, resharding across bucket sizes (bitwise) and dp 1, 2 and 4
(1e-6) between DDP and every FSDP strategy, `mxddp ckpt inspect/export` on the package's saves,
interchange with `mxddp train` (DDP and FSDP, at 1, 2 and 4 ranks) through the torch GPT
(mxddp.torch.gpt), and hostile input that must leave the model and optimizer as they were.

`mxddp train` and `mxddp ckpt` run from the build (MXDDP_CLI, which CTest sets; else
build/release/mxddp under the repository), in child processes without the MPI launcher's
environment; rank 0 runs them while the other ranks wait at a gloo barrier.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import mxddp
import mxddp.torch as mxt
from mxddp.torch.gpt import GPT, GPTConfig

import checkpoint_reshard as reshard
from conftest import needs_ranks

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def plain_env():
    """This environment without the MPI launcher's variables: a child is its own job."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_"))}


def cli_path():
    path = os.environ.get("MXDDP_CLI") or str(REPO / "build" / "release" / "mxddp")
    if not os.access(path, os.X_OK):
        pytest.skip(f"the mxddp command is not built at {path} (set MXDDP_CLI)")
    return path


def run_cli(*args, timeout=300):
    r = subprocess.run([cli_path(), *map(str, args)], env=plain_env(), capture_output=True, text=True, timeout=timeout)
    return r


@pytest.fixture
def shared_dir(ranks):
    """One new directory every rank sees (rank 0 makes it)."""
    rank, _ = ranks
    holder = [tempfile.mkdtemp(prefix="mxddp_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    yield Path(holder[0])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(holder[0], ignore_errors=True)


def on_rank0(ranks, fn):
    """fn() on rank 0 while the others wait; every rank gets its result (or raises its error)."""
    rank, _ = ranks
    box = [None]
    if rank == 0:
        try:
            box = [("ok", fn())]
        except BaseException as e:  # noqa: BLE001 (passed on to every rank)
            box = [("error", repr(e))]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status != "ok":
        raise AssertionError(f"on rank 0: {value}")
    return value


def snapshot(model, opt):
    return [p.detach().clone() for _, p in model.registered_params()], opt.step_count


def assert_unchanged(model, opt, before):
    params, step_count = before
    assert opt.step_count == step_count
    for (name, p), q in zip(model.registered_params(), params):
        assert torch.equal(p.detach(), q), f"{name} changed"


def close(model, opt):
    opt.close()
    model.close()


# ---- history layout and round trip ----

def test_save_writes_the_history_layout_and_load_restores_params_and_step(ranks, shared_dir):
    rank, world = ranks
    model, opt = reshard.make_model(rank, world, None)
    reshard.train_steps(model, opt, 0, 2, rank, world)
    saved = mxt.save_checkpoint(shared_dir / "h", model, opt, 2, metadata={"note": "two steps"})
    assert saved == str(shared_dir / "h" / "iter_0000002")
    assert (shared_dir / "h" / "iter_0000002" / "manifest.json").is_file()
    assert (shared_dir / "h" / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    reshard.train_steps(model, opt, 2, 4, rank, world)
    mxt.save_checkpoint(shared_dir / "h", model, opt, 4, keep_last=1)
    dist.barrier()
    # mxddp.lock: rank 0 holds it from the first save to the end of the run.
    assert sorted(p.name for p in (shared_dir / "h").iterdir()) == ["iter_0000004", "latest_checkpointed_iteration.txt",
                                                                    "mxddp.lock"]
    after_4 = snapshot(model, opt)
    reshard.train_steps(model, opt, 4, 5, rank, world)
    iteration, meta = mxt.load_checkpoint(shared_dir / "h", model, opt)  # the history's newest
    assert (iteration, meta["iteration"]) == (4, "4") and "note" not in meta
    assert_unchanged(model, opt, after_4)
    iteration, meta = mxt.load_checkpoint(shared_dir / "h" / "iter_0000004", model, opt)  # one iter_ directory
    assert iteration == 4
    # The same iteration saved again replaces the earlier save; the metadata comes back.
    mxt.save_checkpoint(shared_dir / "h2", model, opt, 2, metadata={"note": "x"})
    _, meta = mxt.load_checkpoint(shared_dir / "h2", model, opt)
    assert meta == {"iteration": "2", "note": "x"}
    close(model, opt)


# ---- the history's lock: held from the first save to the end of the run ----

SAVE_FROM_ANOTHER_RUN = """
import sys, torch, mxddp, mxddp.torch as mxt
mxt.init()
module = torch.nn.Linear(4, 4)
model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True))
opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-3))
try:
    mxt.save_checkpoint(sys.argv[1], model, opt, 7)
except mxddp.Error as e:
    print("refused:", e)
else:
    print("saved")
"""


def test_another_run_cannot_save_into_a_history_this_run_saved_into(ranks, shared_dir):
    """Between this run's saves, another run (a process of its own, one rank) is refused, named;
    this run's own saves go on, and the history holds only them."""
    rank, world = ranks
    model, opt = reshard.make_model(rank, world, None)
    reshard.train_steps(model, opt, 0, 1, rank, world)
    mxt.save_checkpoint(shared_dir / "h", model, opt, 1)
    pid = [os.getpid()]
    dist.broadcast_object_list(pid, src=0)

    def other_run():
        r = subprocess.run([sys.executable, "-c", SAVE_FROM_ANOTHER_RUN, str(shared_dir / "h")], env=plain_env(),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    out = on_rank0(ranks, other_run)
    assert f"refused: rank 0: save directory '{shared_dir / 'h'}' is being written by another live run (pid " \
           f"{pid[0]} on host" in out, out
    mxt.save_checkpoint(shared_dir / "h", model, opt, 2)
    dist.barrier()
    assert sorted(p.name for p in (shared_dir / "h").iterdir()) == [
        "iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt", "mxddp.lock"]
    close(model, opt)


def test_a_history_removed_under_the_run_is_locked_again_at_the_next_save(ranks, shared_dir):
    rank, world = ranks
    model, opt = reshard.make_model(rank, world, None)
    mxt.save_checkpoint(shared_dir / "h", model, opt, 1)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared_dir / "h")
    dist.barrier()
    mxt.save_checkpoint(str(shared_dir / "h") + "/", model, opt, 2)  # another spelling of the same directory
    dist.barrier()
    assert sorted(p.name for p in (shared_dir / "h").iterdir()) == [
        "iter_0000002", "latest_checkpointed_iteration.txt", "mxddp.lock"]
    out = on_rank0(ranks, lambda: subprocess.run(
        [sys.executable, "-c", SAVE_FROM_ANOTHER_RUN, str(shared_dir / "h")], env=plain_env(), capture_output=True,
        text=True, timeout=300).stdout)
    assert "refused:" in out and "is being written by another live run" in out, out
    close(model, opt)


# ---- resharding ----

@pytest.fixture
def saved_run(ranks, shared_dir):
    """The uninterrupted run's losses, and a save after SAVE_AT steps of the same run at this dp."""
    rank, world = ranks
    model, opt = reshard.make_model(rank, world, 300)  # 1157 params: 2 buckets
    reference = reshard.train_steps(model, opt, 0, reshard.STEPS, rank, world)
    close(model, opt)
    model, opt = reshard.make_model(rank, world, 300)
    assert reshard.train_steps(model, opt, 0, reshard.SAVE_AT, rank, world) == reference[:reshard.SAVE_AT]
    mxt.save_checkpoint(shared_dir / "run", model, opt, reshard.SAVE_AT)
    close(model, opt)
    return shared_dir / "run", reference


@pytest.mark.parametrize("bucket_size", [None, 100, 300, 450])
def test_a_load_at_another_bucket_size_continues_bitwise(ranks, saved_run, bucket_size):
    rank, world = ranks
    ckpt, reference = saved_run
    model, opt = reshard.make_model(rank, world, bucket_size)
    assert model.num_buckets == {None: 1, 100: 3, 300: 2, 450: 2}[bucket_size]  # 450: split elsewhere than 300
    iteration, _ = mxt.load_checkpoint(ckpt, model, opt)
    assert iteration == reshard.SAVE_AT and opt.step_count == reshard.SAVE_AT
    losses = reshard.train_steps(model, opt, iteration, reshard.STEPS, rank, world)
    assert losses == reference[reshard.SAVE_AT:], (losses, reference)  # the same reduction order: bitwise
    close(model, opt)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_ddp_and_fsdp_checkpoints_interchange(ranks, saved_run, shared_dir, strategy):
    """The DDP save loads into FSDP, which continues the run; FSDP's own save of it loads back into
    DDP, which continues it too (another reduction grouping: f32 rounding only)."""
    rank, world = ranks
    ckpt, reference = saved_run
    expected = torch.tensor(reference[reshard.SAVE_AT:], dtype=torch.float64)
    model, opt = reshard.make_model(rank, world, "fsdp:" + strategy)
    assert mxt.load_checkpoint(ckpt, model, opt)[0] == reshard.SAVE_AT
    mxt.save_checkpoint(shared_dir / f"fsdp_{strategy}", model, opt, reshard.SAVE_AT)
    losses = reshard.train_steps(model, opt, reshard.SAVE_AT, reshard.STEPS, rank, world)
    close(model, opt)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), expected, rtol=1e-6, atol=0)
    model, opt = reshard.make_model(rank, world, 300)
    assert mxt.load_checkpoint(shared_dir / f"fsdp_{strategy}", model, opt)[0] == reshard.SAVE_AT
    losses = reshard.train_steps(model, opt, reshard.SAVE_AT, reshard.STEPS, rank, world)
    close(model, opt)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), expected, rtol=1e-6, atol=0)


def reshard_child(mode, ckpt, np, kind):
    """checkpoint_reshard.py `mode` ("resume" or "save") on checkpoint dir `ckpt` as a job of np
    ranks (kind: "none", a bucket size or "fsdp:<strategy>"); its JSON result."""
    out = ckpt.parent / f"{mode}_{ckpt.name}_dp{np}_{kind.replace(':', '_')}.json"
    cmd = [sys.executable, str(HERE / "checkpoint_reshard.py"), mode, str(ckpt), kind, str(out)]
    if np > 1:
        mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np)] + cmd
    r = subprocess.run(cmd, env=plain_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


def assert_continues(losses, reference):
    """Another dp or grouping sums the batch and the gradients in another order: f32 rounding only."""
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(reference[reshard.SAVE_AT:], dtype=torch.float64), rtol=1e-6, atol=0)


def test_a_save_at_dp2_continues_at_dp1_and_dp4(ranks, saved_run):
    rank, world = ranks
    if world != 2:
        pytest.skip("saves at dp 2 (python_mpirun_np2)")
    ckpt, reference = saved_run
    kinds = [(1, "none"), (4, "200"), (1, "fsdp:optim_grads_params"), (4, "fsdp:optim_grads")]
    results = on_rank0(ranks, lambda: [reshard_child("resume", ckpt, np, kind) for np, kind in kinds])
    for r in results:
        assert r["iteration"] == reshard.SAVE_AT and r["step_count"] == reshard.STEPS, r
        assert_continues(r["losses"], reference)
    assert [r["world"] for r in results] == [1, 4, 1, 4]


def test_fsdp_saves_continue_at_other_dps_in_fsdp_and_ddp(ranks, saved_run, shared_dir):
    """Each FSDP strategy's own save at dp 2 continues at dp 1 and 4, under another strategy or
    DDP; a save at dp 4 (FSDP and DDP) continues here at dp 2, in DDP and FSDP."""
    rank, world = ranks
    if world != 2:
        pytest.skip("saves at dp 2 (python_mpirun_np2)")
    ddp_ckpt, reference = saved_run
    # [strategy saved at dp 2] where it continues: (dp, kind)
    plan = {"no_shard": (4, "300"), "optim": (1, "fsdp:optim_grads_params"), "optim_grads": (4, "fsdp:no_shard"),
            "optim_grads_params": (1, "none")}
    for strategy in plan:
        model, opt = reshard.make_model(rank, world, "fsdp:" + strategy)
        assert reshard.train_steps(model, opt, 0, reshard.SAVE_AT, rank, world) == pytest.approx(
            reference[:reshard.SAVE_AT], rel=1e-6)
        mxt.save_checkpoint(shared_dir / f"fsdp_{strategy}", model, opt, reshard.SAVE_AT)
        close(model, opt)
    dist.barrier()
    results = on_rank0(ranks, lambda: [reshard_child("resume", shared_dir / f"fsdp_{s}", np, kind)
                                       for s, (np, kind) in plan.items()])
    for r, (np, _) in zip(results, plan.values()):
        assert (r["world"], r["iteration"], r["step_count"]) == (np, reshard.SAVE_AT, reshard.STEPS), r
        assert_continues(r["losses"], reference)
    # Saved at dp 4, by FSDP (optim_grads_params) and by DDP: here at dp 2 in the other kind.
    saves = on_rank0(ranks, lambda: [reshard_child("save", shared_dir / "dp4_fsdp", 4, "fsdp:optim_grads_params"),
                                     reshard_child("save", shared_dir / "dp4_ddp", 4, "100")])
    for s in saves:
        assert s["world"] == 4
        torch.testing.assert_close(torch.tensor(s["losses"], dtype=torch.float64),
                                   torch.tensor(reference[:reshard.SAVE_AT], dtype=torch.float64), rtol=1e-6, atol=0)
    for saved, kind in (("dp4_fsdp", 300), ("dp4_ddp", "fsdp:optim")):
        model, opt = reshard.make_model(rank, world, kind)
        assert mxt.load_checkpoint(shared_dir / saved, model, opt)[0] == reshard.SAVE_AT
        assert opt.step_count == reshard.SAVE_AT
        assert_continues(reshard.train_steps(model, opt, reshard.SAVE_AT, reshard.STEPS, rank, world), reference)
        close(model, opt)


# ---- mxddp ckpt inspect / export read the package's saves ----

def test_ckpt_inspect_and_export_read_the_package_s_checkpoints(ranks, shared_dir):
    rank, world = ranks
    model, opt = reshard.make_model(rank, world, 2000)
    reshard.train_steps(model, opt, 0, 2, rank, world)
    mxt.save_checkpoint(shared_dir / "h", model, opt, 2, metadata={"run": "pytest"})
    params = {name: p.detach().clone() for name, p in model.registered_params()}
    close(model, opt)

    def inspect_and_export():
        r = run_cli("ckpt", "inspect", "--json", shared_dir / "h")
        assert r.returncode == 0, r.stdout + r.stderr
        out = shared_dir / "export.safetensors"
        e = run_cli("ckpt", "export", shared_dir / "h", "--out", out)
        assert e.returncode == 0, e.stdout + e.stderr
        return json.loads(r.stdout), out

    info, exported = on_rank0(ranks, inspect_and_export)
    assert info["ok"] and info["problems"] == [], info
    assert info["step"] == 2 and info["saved_dp"] == world and info["optimizer"] == "adam"
    assert info["metadata"] == {"iteration": "2", "run": "pytest"}
    assert info["dir"].endswith("iter_0000002")
    assert [p["name"] for p in info["params"]] == list(params)
    from safetensors.torch import load_file
    tensors = load_file(str(exported))
    assert list(tensors) == list(params) or sorted(tensors) == sorted(params)
    for name, value in params.items():
        assert torch.equal(tensors[name], value), name  # F32 params are the main params, bit for bit


# ---- hostile input: an error naming the problem, and nothing changed ----

@pytest.fixture
def trained(ranks, shared_dir):
    rank, world = ranks
    model, opt = reshard.make_model(rank, world, None)
    reshard.train_steps(model, opt, 0, 2, rank, world)
    mxt.save_checkpoint(shared_dir / "good", model, opt, 2)
    reshard.train_steps(model, opt, 2, 3, rank, world)  # now different from the save
    yield model, opt
    close(model, opt)


def copy_checkpoint(ranks, shared_dir, name, damage):
    def make():
        dst = shared_dir / name
        shutil.copytree(shared_dir / "good", dst)
        damage(dst / "iter_0000002")
        return str(dst)
    return on_rank0(ranks, make)


def refused(model, opt, path, *expected, **kw):
    before = snapshot(model, opt)
    with pytest.raises(mxddp.Error) as e:
        mxt.load_checkpoint(path, model, opt, **kw)
    for text in expected:
        assert text in str(e.value), str(e.value)
    assert_unchanged(model, opt, before)
    return str(e.value)


def test_a_truncated_rank_file_is_refused(ranks, shared_dir, trained):
    model, opt = trained

    def truncate(d):
        f = d / "rank_00000.safetensors"
        f.write_bytes(f.read_bytes()[:-16])
    refused(model, opt, copy_checkpoint(ranks, shared_dir, "truncated", truncate), "rank_00000.safetensors")


def test_an_edited_manifest_is_refused(ranks, shared_dir, trained):
    model, opt = trained

    def edit(d):
        m = d / "manifest.json"
        text = m.read_text()
        assert '"step": 2' in text
        m.write_text(text.replace('"step": 2', '"step": 7'))
    refused(model, opt, copy_checkpoint(ranks, shared_dir, "edited", edit), "manifest_crc32")


def test_a_checkpoint_of_another_model_is_refused(ranks, shared_dir, trained):
    rank, world = ranks
    model, opt = trained
    other = mxt.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Linear(40, 5)),
                                        mxt.DistributedDataParallelConfig(use_distributed_optimizer=True))
    other_opt = mxt.DistributedOptimizer(other, mxt.OptimizerConfig(lr=1e-3))
    mxt.save_checkpoint(shared_dir / "other", other, other_opt, 1, model_config={"width": 40})
    close(other, other_opt)
    refused(model, opt, shared_dir / "other", "holds 4 params; this model has 6")
    refused(model, opt, shared_dir / "good", "width: checkpoint (absent), this run 48", model_config={"width": 48})


def test_a_dir_that_is_a_file_or_missing_or_foreign_is_refused(ranks, shared_dir, trained):
    model, opt = trained
    on_rank0(ranks, lambda: (shared_dir / "file").write_text("not a checkpoint"))
    refused(model, opt, shared_dir / "file", "is not a directory")
    refused(model, opt, shared_dir / "missing", "missing")
    before = snapshot(model, opt)
    with pytest.raises(mxddp.Error, match="file"):
        mxt.save_checkpoint(shared_dir / "file", model, opt, 3)
    on_rank0(ranks, lambda: (shared_dir / "foreign").mkdir() or (shared_dir / "foreign" / "notes.txt").write_text("x"))
    with pytest.raises(mxddp.Error, match="holds 'notes.txt', which is not part of an mxddp checkpoint history"):
        mxt.save_checkpoint(shared_dir / "foreign", model, opt, 3)
    assert_unchanged(model, opt, before)
    assert not (shared_dir / "foreign" / "iter_0000003").exists()


def test_bad_arguments_are_refused_naming_them(ranks, shared_dir, trained):
    model, opt = trained
    with pytest.raises(ValueError, match="iteration -1 is not valid"):
        mxt.save_checkpoint(shared_dir / "x", model, opt, -1)
    with pytest.raises(TypeError, match="iteration must be an int"):
        mxt.save_checkpoint(shared_dir / "x", model, opt, 2.0)
    with pytest.raises(ValueError, match="metadata\\['iteration'\\] is set by save_checkpoint"):
        mxt.save_checkpoint(shared_dir / "x", model, opt, 2, metadata={"iteration": "9"})
    with pytest.raises(TypeError, match="metadata must map str to str"):
        mxt.save_checkpoint(shared_dir / "x", model, opt, 2, metadata={"lr": 0.1})
    with pytest.raises(TypeError, match="model_config\\['flag'\\] is bool"):
        mxt.save_checkpoint(shared_dir / "x", model, opt, 2, model_config={"flag": True})
    with pytest.raises(TypeError, match="model must be a mxddp.torch.DistributedDataParallel"):
        mxt.load_checkpoint(shared_dir / "good", model.module, opt)
    with pytest.raises(ValueError, match="iteration 9223372036854775808 is not valid: 0 to 2\\*\\*63 - 1"):
        mxt.save_checkpoint(shared_dir / "x", model, opt, 2 ** 63)
    with pytest.raises(ValueError, match="keep_last 1099511627776 is not valid: an int, 0 .* to 2\\*\\*31 - 1"):
        mxt.save_checkpoint(shared_dir / "x", model, opt, 2, keep_last=2 ** 40)
    with pytest.raises(ValueError, match=r"save_dir '.*/x\\x00y' holds a NUL character"):
        mxt.save_checkpoint(str(shared_dir / "x") + "\0y", model, opt, 2)
    with pytest.raises(ValueError, match=r"load_dir 'good\\x00' holds a NUL character"):
        mxt.load_checkpoint("good\0", model, opt)
    assert not (shared_dir / "x").exists()


@pytest.mark.parametrize("argument", ["save_dir", "metadata", "keep_last", "model_config"])
def test_ranks_that_pass_different_save_arguments_are_refused_before_anything_is_written(ranks, shared_dir, trained,
                                                                                          argument):
    """A rank saving elsewhere would write its part of the checkpoint there, and a prune could then
    remove the last complete one; other metadata, configs or keep_last would be silently rank 0's."""
    rank, world = ranks
    needs_ranks(world, 2, "ranks that pass different arguments")
    model, opt = trained
    kwargs = {"metadata": None, "keep_last": 0, "model_config": None}
    directory = shared_dir / ("r" if argument != "save_dir" else f"r{rank}")
    if argument != "save_dir":
        kwargs[argument] = {"metadata": {"who": f"rank{rank}"}, "keep_last": 1 + rank,
                            "model_config": {"width": 16 + rank}}[argument]
    before = snapshot(model, opt)
    with pytest.raises(mxddp.Error, match=f"save_checkpoint: the {world} ranks do not pass the same arguments: {argument} "):
        mxt.save_checkpoint(directory, model, opt, 3, **kwargs)
    assert_unchanged(model, opt, before)
    assert not directory.exists()
    if argument == "save_dir":
        with pytest.raises(mxddp.Error, match=f"load_checkpoint: the {world} ranks do not pass the same arguments: load_dir "):
            mxt.load_checkpoint(directory, model, opt)


def test_load_before_init_is_refused():
    code = "import mxddp.torch as mxt; mxt.load_checkpoint('ckpt', None, None)"
    r = subprocess.run([sys.executable, "-c", code], env=plain_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "mxddp is not initialized: call mxddp.torch.init() first (before load_checkpoint)" in r.stderr, r.stderr


# ---- interchange with `mxddp train` through the torch GPT ----

TINY = ["--model", "tiny", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "0",
        "--lr-decay-style", "constant", "--lr", "0.002"]


def gpt_data(ranks, shared_dir):
    """130 bytes read with --valid-fraction 0.5: a training split and a validation split of exactly
    seq_length + 1 = 65 tokens each, so every sequence mxddp train samples is the split itself."""
    text = ("The cat sees a red house. Two dogs like the green river at night. My friends build a boat. "
            "The king helps some birds again. A teacher watches.")[:130].encode()
    assert len(text) == 130
    path = shared_dir / "data.txt"
    on_rank0(ranks, lambda: path.write_bytes(text))
    seq = torch.tensor(list(text), dtype=torch.int64)
    return path, seq[:65], seq[65:]


def wrapped_gpt(bf16=True, kind="ddp"):
    """kind: "ddp" (the distributed optimizer) or "fsdp" (optim_grads_params, a unit per decoder layer)."""
    torch.manual_seed(0)
    module = GPT(GPTConfig.preset("tiny"))
    if bf16:
        module = module.to(torch.bfloat16)  # what mxddp train keeps its params as (BF16, F32 math)
    if kind == "fsdp":
        model = mxt.FullyShardedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True, grad_reduce_in_fp32=True,
            data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True, overlap_param_gather=True),
            fsdp_unit_modules=[type(module.decoder.layers[0])])
    else:
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, average_in_collective=True))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(optimizer="adam", lr=0.002, weight_decay=0.01,
                                                              adam_beta1=0.9, adam_beta2=0.999, clip_grad=1.0))
    return model, opt


def test_the_torch_gpt_has_mxddp_s_param_list():
    gpt = GPT(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64))
    names = [n for n, _ in gpt.named_parameters()]
    assert names[:3] == ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                         "decoder.layers.0.input_layernorm.weight"]
    assert names[-2:] == ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
    assert len(names) == 4 + 12 * 2 and sum(p.numel() for p in gpt.parameters()) == 120_576  # GptConfig::num_params(): 0.12M (model.md)
    assert dict(gpt.named_parameters())["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (192, 64)
    assert gpt.model_config() == {"vocab_size": 256, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                  "seq_length": 64}


def tiny_with(micro_batch_size):
    """TINY with another micro-batch size."""
    args = list(TINY)
    args[args.index("--micro-batch-size") + 1] = str(micro_batch_size)
    return args


# (the package's wrapper; mxddp train's ranks, micro-batch size and data-parallel flags). 4 ranks
# take a micro-batch of 1 (the global batch is 4); every sequence is the same split, so the
# gradients do not depend on how the batch is cut.
TRAIN_SAVES = [("ddp", 2, 2, []), ("fsdp", 2, 2, []),
               ("ddp", 4, 1, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]),
               ("fsdp", 1, 2, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"])]


@pytest.mark.parametrize("kind,train_ranks,micro_batch_size,train_flags", TRAIN_SAVES)
def test_mxddp_train_s_save_loads_into_the_torch_gpt_with_its_validation_loss(ranks, shared_dir, kind, train_ranks,
                                                                              micro_batch_size, train_flags):
    data, _, valid = gpt_data(ranks, shared_dir)
    save = shared_dir / "train_save"

    def train():
        r = run_cli("train", *tiny_with(micro_batch_size), "--ranks", train_ranks, "--backend", "local",
                    "--train-iters", "3", "--data", data, "--valid-fraction", "0.5", "--eval-iters", "1",
                    "--eval-interval", "0", "--save", save, "--report", shared_dir / "train.json", *train_flags)
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads((shared_dir / "train.json").read_text())

    report = on_rank0(ranks, train)
    assert [e["iteration"] for e in report["validation"]] == [3]
    model, opt = wrapped_gpt(bf16=True, kind=kind)
    iteration, meta = mxt.load_checkpoint(save, model, opt, model_config=model.module.model_config())
    assert iteration == 3 and opt.step_count == 3 and meta["consumed_train_samples"] == "12"
    with torch.no_grad():
        loss = model(valid[None, :]).item()
    # Both sides: BF16 params widened to F32, F32 math; only the order of f32 sums differs.
    assert loss == pytest.approx(report["validation"][0]["loss"], rel=1e-5), (loss, report["validation"])
    close(model, opt)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_torch_gpt_s_save_continues_in_mxddp_train(ranks, shared_dir, kind):
    rank, world = ranks
    data, train_seq, _ = gpt_data(ranks, shared_dir)
    model, opt = wrapped_gpt(bf16=True, kind=kind)
    batch = train_seq[None, :].repeat(4 // world, 1)  # every sequence mxddp train samples is this one
    for _ in range(3):
        opt.zero_grad()
        model(batch).backward()
        model.finish_grad_sync()
        opt.step()
    save = shared_dir / "torch_save"
    mxt.save_checkpoint(save, model, opt, 3, model_config=model.module.model_config(),
                        metadata={"consumed_train_samples": "12"})
    with torch.no_grad():
        next_loss = model(train_seq[None, :]).item()
    close(model, opt)  # the params get their values back (FSDP's were shards until now)
    exported = {name: p.detach().clone() for name, p in model.registered_params()}

    def resume():
        r = run_cli("train", *TINY, "--ranks", "1", "--backend", "local", "--train-iters", "4", "--data", data,
                    "--valid-fraction", "0.5", "--eval-iters", "0", "--load", save, "--report", shared_dir / "resume.json")
        assert r.returncode == 0, r.stdout + r.stderr
        e = run_cli("ckpt", "export", save, "--dtype", "bf16", "--out", shared_dir / "torch_save.safetensors")
        assert e.returncode == 0, e.stdout + e.stderr
        return json.loads((shared_dir / "resume.json").read_text())

    report = on_rank0(ranks, resume)
    assert report["start_iteration"] == 3 and [s["iteration"] for s in report["steps"]] == [4]
    assert report["steps"][0]["loss"] == pytest.approx(next_loss, rel=1e-5), (report["steps"], next_loss)
    from safetensors.torch import load_file
    tensors = load_file(str(shared_dir / "torch_save.safetensors"))
    for name, value in exported.items():
        assert torch.equal(tensors[name], value), name  # the BF16 params, bit for bit


# ---- torch's state_dict / load_state_dict on the DDP wrapper ----

def mlp(dtype):
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(dtype)


def ddp(module, **kw):
    cfg = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, **kw)
    model = mxt.DistributedDataParallel(module, cfg)
    return model, mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2, weight_decay=0.1))


def one_step(model, opt, rank, step):
    opt.zero_grad()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank)).to(model.param_dtype)
    model(x).float().square().mean().backward()
    model.finish_grad_sync()
    assert opt.step()[0]


@pytest.mark.parametrize("overlap_param_gather", [False, True])
def test_state_dict_has_megatron_ddp_s_keys_and_the_params_current_values(ranks, overlap_param_gather):
    rank, _ = ranks
    module = mlp(torch.float32)
    # Buckets of 1000 elements: with the overlapped gather only the first group's gather is issued
    # by the step, the others wait for the next forward (Megatron's order), so until then the
    # params hold other ranks' old values.
    model, opt = ddp(module, overlap_param_gather=overlap_param_gather, bucket_size=1000)
    try:
        one_step(model, opt, rank, 0)
        assert model._cpp.param_sync_pending == overlap_param_gather
        # state_dict finishes those gathers first (its tensors share the params' storage, hence the
        # copies taken before anything else can finish them).
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        # Megatron's DDP passes state_dict through to the module (torch's form: test_ddp_semantics.py).
        assert list(sd) == list(module.state_dict())
        model.finish_param_sync()
        for n, p in module.named_parameters():
            assert torch.equal(sd[n], p.detach()), n
    finally:
        close(model, opt)


def test_megatron_form_state_dicts_inside_a_container_and_with_torch_s_keys(ranks):
    """Megatron's form keys its state dict as the module's own; inside a container (a GAN's
    ModuleDict) the container's save and load agree, and a dict keyed module.<name> (torch's form's,
    or this form's before it followed Megatron) loads too."""
    rank, _ = ranks
    model, opt = ddp(mlp(torch.float32))
    container = torch.nn.ModuleDict({"G": model})
    try:
        one_step(model, opt, rank, 0)
        saved = {k: v.clone() for k, v in container.state_dict().items()}
        assert "G.0.weight" in saved
        with torch.no_grad():
            for p in model.module.parameters():
                p.zero_()
        container.load_state_dict(saved)
        assert all(torch.equal(v, saved[k]) for k, v in container.state_dict().items())
        with torch.no_grad():
            for p in model.module.parameters():
                p.zero_()
        model.load_state_dict({"module." + k.removeprefix("G."): v for k, v in saved.items()})
        assert all(torch.equal(v, saved[k]) for k, v in container.state_dict().items())
    finally:
        close(model, opt)


def test_load_state_dict_reaches_training_or_is_refused_leaving_the_params(ranks):
    rank, _ = ranks
    loaded = {n: torch.randn(v.shape, generator=torch.Generator().manual_seed(i))
              for i, (n, v) in enumerate(mlp(torch.float32).state_dict().items())}
    # F32 params are their own main params: a load with the optimizer open reaches its next step
    # (lr 0 keeps the values, weight decay included).
    model, opt = ddp(mlp(torch.float32))
    try:
        one_step(model, opt, rank, 0)
        # A failed load (torch raises after copying the entries it could) changes nothing.
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for bad in ({**loaded, "2.weight": torch.zeros(3, 3)}, {k: v for k, v in loaded.items() if "2." not in k}):
            with pytest.raises(RuntimeError, match="Error.s. in loading state_dict"):
                model.load_state_dict(bad)
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        model.load_state_dict(loaded)
        opt.lr = 0.0
        one_step(model, opt, rank, 1)
        assert all(torch.equal(v, loaded[k]) for k, v in model.state_dict().items())
    finally:
        close(model, opt)
    # BF16 params: before the optimizer is built a load reaches its main params (taken from the
    # params); while it is open the optimizer takes the loaded values into its F32 main params before
    # its next step (test_param_writes.py has the details).
    bf16 = {k: v.bfloat16() for k, v in loaded.items()}
    module = mlp(torch.bfloat16)
    cfg = mxt.DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = mxt.DistributedDataParallel(module, cfg)
    model.load_state_dict(bf16)
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=0.0))
    try:
        one_step(model, opt, rank, 0)
        assert all(torch.equal(v, bf16[k]) for k, v in model.state_dict().items())
        zeros = {k: torch.zeros_like(v) for k, v in bf16.items()}
        model.load_state_dict(zeros)
        one_step(model, opt, rank, 1)
        assert all(torch.equal(v, zeros[k]) for k, v in model.state_dict().items())
        before = snapshot(model, opt)
        with pytest.raises(ValueError, match=r"assign=True"):
            model.load_state_dict(bf16, assign=True)
        assert_unchanged(model, opt, before)
    finally:
        close(model, opt)


def test_a_save_holds_values_written_into_bf16_params_since_the_last_step(ranks, shared_dir):
    rank, _ = ranks
    model, opt = ddp(mlp(torch.bfloat16))
    try:
        one_step(model, opt, rank, 0)
        written = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items() if k.endswith("bias")}
        model.load_state_dict(written, strict=False)
        expected = model.state_dict()
        mxt.save_checkpoint(shared_dir / "h", model, opt, 1)
    finally:
        close(model, opt)
    model, opt = ddp(mlp(torch.bfloat16))
    try:
        mxt.load_checkpoint(shared_dir / "h", model, opt)
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    finally:
        close(model, opt)


def test_an_mxfp8_weight_s_state_dict_holds_its_values_and_a_load_is_refused(ranks):
    rank, _ = ranks
    module = mlp(torch.bfloat16)
    model, opt = ddp(module, grad_reduce_in_fp32=True, fp8_param_gather=True)
    try:
        one_step(model, opt, rank, 0)
        sd = model.state_dict()
        assert torch.isnan(module[0].weight).all()  # the Parameter's stand-in
        for n in ("0.weight", "2.weight"):
            assert torch.equal(sd[n], model.dequantized_param(n)), n
        assert torch.equal(sd["0.bias"], module[0].bias.detach())
        zeros = {k: torch.zeros_like(v) for k, v in sd.items()}
        with pytest.raises(RuntimeError, match=r"the MXFP8 weights \(0.weight, 2.weight\) are kept only as MXFP8"):
            model.load_state_dict(zeros)
        assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())  # nothing loaded
    finally:
        close(model, opt)
    # After close() the params hold the forward's values themselves: torch's state dict and load.
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, sd[k])] == []
    model.load_state_dict({k: torch.zeros_like(v) for k, v in sd.items()})
    assert all(v.abs().sum() == 0 for v in module.state_dict().values())


def test_a_load_restores_each_params_own_step_count(ranks, shared_dir):
    """A param unused in some steps (find_unused_parameters) took fewer optimizer steps than the
    run; a resume gives each param its own count back, as torch's per-param state['step']."""
    from test_user_optimizer import TwoHeads, batch as two_heads_batch
    rank, _ = ranks
    counts = []
    for load in (False, True):
        module = TwoHeads()
        model = mxt.DistributedDataParallel(module, find_unused_parameters=True)
        opt = mxt.DistributedOptimizer(model, torch.optim.AdamW(module.parameters(), lr=1e-2))
        try:
            if load:
                mxt.load_checkpoint(shared_dir / "steps", model, opt)
            else:
                for step in range(3):
                    opt.zero_grad()
                    x, y = two_heads_batch(rank, step)
                    torch.nn.functional.cross_entropy(model(x, step == 2), y).backward()
                    opt.step()
                mxt.save_checkpoint(shared_dir / "steps", model, opt, 3)
            counts.append([opt._cpp.param_step(i) for i in range(len(model.registered_params()))])
        finally:
            opt.close()
            model.close()
    assert counts[0] == [3, 3, 3, 3, 1, 1]  # trunk and head a every step, head b in the last only
    assert counts[1] == counts[0]
