"""mxddp.torch.dcp under mpirun: torch.distributed.checkpoint save and load of a model and its
DistributedOptimizer at the same dp (the resume continues exactly), into a model wrapped another
way (DDP and FSDP, sharded or replicated optimizer: keys are the module's names), BF16 params with
buffers and a frozen param, a user's torch AdamW with two param groups, and refusals that leave the
run as it was: a corrupted file, a value changed after the read (the checksum), a model of other
shapes, a model with fewer params than the checkpoint, an optimizer of another kind, a failure on
one rank only. Resharding to dp 1 and 4 is run_dcp_reshard.sh's (three launches)."""
import os
import re
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import mxddp.torch as mxt
from mxddp.torch import dcp as mxdcp

from checkpoint_reshard import SAVE_AT, STEPS, batch, make_model, train_steps
from conftest import needs_ranks

BUCKET = 700  # elements: buckets end inside params, so the ranks hold uneven parts of them


@pytest.fixture(autouse=True)
def _needs_the_protocol(request):
    """Every test but the refusal's needs a torch whose DCP reads CheckpointableTensor."""
    if request.function is not test_a_torch_without_the_protocol_is_refused and not mxdcp.has_checkpointable_tensors():
        pytest.skip(f"torch {torch.__version__}'s DCP has no CheckpointableTensor protocol; mxddp.torch.dcp refuses it "
                    "(test_a_torch_without_the_protocol_is_refused)")


@pytest.fixture
def ckpt_dir(ranks):
    path = [tempfile.mkdtemp(prefix="mxddp_dcp_") if ranks[0] == 0 else None]
    dist.broadcast_object_list(path, src=0)
    yield path[0]
    dist.barrier()
    if ranks[0] == 0:
        shutil.rmtree(path[0], ignore_errors=True)


def _snapshot(model, opt):
    """Every value a load could change: params, buffers, optimizer views, step count, lr."""
    model.finish_param_sync()
    views = [opt._cpp.main_params(b).clone() for b in range(opt._cpp.num_buckets)]
    views += [opt._cpp.state(i, b).clone()
              for i in range(len(opt._cpp.state_names)) for b in range(opt._cpp.num_buckets)]
    return ([t.detach().clone() for t in model.module.state_dict().values()], views, opt.step_count, opt.lr)


def _assert_same(a, b):
    assert a[2:] == b[2:]
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)


def _close(*objs):
    for o in objs:
        o.close()


def test_save_and_resume_at_same_size_continues_exactly(ranks, ckpt_dir):
    rank, world = ranks
    model, opt = make_model(rank, world, BUCKET)
    train_steps(model, opt, 0, SAVE_AT, rank, world)
    dcp.save({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    expected = train_steps(model, opt, SAVE_AT, STEPS, rank, world)
    _close(opt, model)

    model, opt = make_model(rank, world, BUCKET)  # the initial values again: the load must replace them
    opt.lr = 1.0  # and the checkpoint's lr comes back, as torch's load_state_dict restores it
    dcp.load({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    assert opt.step_count == SAVE_AT and opt.lr == pytest.approx(3e-3)
    assert train_steps(model, opt, SAVE_AT, STEPS, rank, world) == expected
    _close(opt, model)


def _make(rank, world, kind):
    """make_model's pair, or (kind "replicated") a DDP whose optimizer every rank runs whole."""
    if kind != "replicated":
        return make_model(rank, world, kind)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.LayerNorm(48),
                                 torch.nn.Linear(48, 5))
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        use_distributed_optimizer=False, bucket_size=BUCKET))
    return model, mxt.DistributedOptimizer(model, mxt.OptimizerConfig(
        optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0))


# FSDP no_shard and a DDP without the distributed optimizer keep a replicated optimizer: every rank
# holds (and loads) all of it, and owns (writes) a part.
@pytest.mark.parametrize("saved_as, loaded_as", [(BUCKET, "fsdp:optim_grads_params"), (BUCKET, "fsdp:no_shard"),
                                                 ("fsdp:no_shard", BUCKET), (BUCKET, "replicated"),
                                                 ("replicated", "fsdp:optim_grads_params")])
def test_plain_dicts_load_into_another_wrapper(ranks, ckpt_dir, saved_as, loaded_as):
    rank, world = ranks
    model, opt = _make(rank, world, saved_as)
    train_steps(model, opt, 0, SAVE_AT, rank, world)
    state = mxdcp.state_dict(model, opt)
    assert set(state["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"}
    dcp.save(state, checkpoint_id=ckpt_dir)
    expected = train_steps(model, opt, SAVE_AT, STEPS, rank, world)
    _close(opt, model)

    model, opt = _make(rank, world, loaded_as)
    state = mxdcp.state_dict(model, opt)
    dcp.load(state, checkpoint_id=ckpt_dir)
    mxdcp.load_state_dict(model, opt, state)
    got = train_steps(model, opt, SAVE_AT, STEPS, rank, world)
    assert got == pytest.approx(expected, abs=1e-6)
    _close(opt, model)


class _WithBuffers(torch.nn.Module):
    """BF16 params (the optimizer's F32 main params are copies, not the param shards), a BatchNorm
    (buffers, one of them int64) and a frozen param: what the model entries of a load carry."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 5)
        self.scale = torch.nn.Parameter(torch.rand(32), requires_grad=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))) * self.scale)


def _bf16_run(rank, world, model, opt, first, last):
    losses = []
    for step in range(first, last):
        g = torch.Generator().manual_seed(900 + step)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        share = 8 // world
        # Buffers from rank 0, as torch DDP's broadcast_buffers: DCP writes a replicated entry from
        # one rank, so only buffers the ranks agree on come back as every rank had them.
        for b in model.module.buffers():
            dist.broadcast(b, 0)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[rank * share:(rank + 1) * share].bfloat16()).float(),
                                                 y[rank * share:(rank + 1) * share])
        loss.backward()
        model.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    for b in model.module.buffers():  # and after the last forward (before the save)
        dist.broadcast(b, 0)
    return losses


def _bf16_model():
    model = mxt.DistributedDataParallel(_WithBuffers().to(torch.bfloat16), mxt.DistributedDataParallelConfig(
        use_distributed_optimizer=True, bucket_size=300))
    return model, mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2, clip_grad=0.0))


def test_bf16_params_buffers_and_frozen_params_resume_exactly(ranks, ckpt_dir):
    rank, world = ranks
    model, opt = _bf16_model()
    _bf16_run(rank, world, model, opt, 0, 3)
    dcp.save({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    expected = _bf16_run(rank, world, model, opt, 3, 6)
    expected_state = {k: v.clone() for k, v in model.module.state_dict().items()}
    _close(opt, model)

    model, opt = _bf16_model()
    with torch.no_grad():  # the load must bring back the buffers and the frozen param too
        model.module.scale.fill_(2.0)
        model.module.bn.running_mean.fill_(5.0)
        model.module.bn.num_batches_tracked.fill_(100)
    dcp.load({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    assert int(model.module.bn.num_batches_tracked) == 3
    assert _bf16_run(rank, world, model, opt, 3, 6) == expected
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, expected_state[k]), k
    _close(opt, model)


def test_a_save_holds_values_written_into_bf16_params_since_the_last_step(ranks, ckpt_dir):
    rank, world = ranks
    model, opt = _bf16_model()
    _bf16_run(rank, world, model, opt, 0, 1)
    with torch.no_grad():  # taken into the F32 main params, which are what DCP saves
        model.module.fc2.bias.fill_(0.25)
    dcp.save({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    _close(opt, model)
    model, opt = _bf16_model()
    dcp.load({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    assert torch.all(model.module.fc2.bias == 0.25)
    _close(opt, model)


@pytest.mark.parametrize("entry", ["bn.running_var", "bn.num_batches_tracked", "scale"])
def test_a_changed_buffer_or_frozen_param_is_refused_by_checksum(ranks, ckpt_dir, entry):
    """Buffers (F32, int64) and a frozen param, which a load copies into the module as they are: a
    value changed after the read is refused on every rank, naming it, with the run as it was."""
    rank, world = ranks
    model, opt = _bf16_model()
    _bf16_run(rank, world, model, opt, 0, 2)
    dcp.save({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    state = mxdcp.state_dict(model, opt)
    dcp.load({"app": state}, checkpoint_id=ckpt_dir)
    with torch.no_grad():
        state["model"][entry].view(-1)[-1] += 1  # one element (an int64 count: by one)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=rf"model.{re.escape(entry)}: checksum .* corrupted"):
        mxdcp.load_state_dict(model, opt, state)
    _assert_same(before, _snapshot(model, opt))
    _close(opt, model)


def test_buffers_the_ranks_disagree_on_are_named_at_save(ranks, ckpt_dir):
    """DCP writes one rank's copy of a replicated entry: a buffer that differs across ranks is named
    in a warning, and the load gives every rank the saved copy (no checksum refuses it)."""
    rank, world = ranks
    needs_ranks(world, 2, "buffers that differ across ranks")
    model, opt = _bf16_model()
    _bf16_run(rank, world, model, opt, 0, 1)
    with torch.no_grad():
        model.module.bn.running_mean.fill_(float(rank))
    with pytest.warns(RuntimeWarning, match=r"different values of \['bn.running_mean'\]"):
        dcp.save({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    dcp.load({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    saved = model.module.bn.running_mean.clone()
    every = [torch.empty_like(saved) for _ in range(world)]
    dist.all_gather(every, saved)
    assert all(torch.equal(e, every[0]) for e in every) and float(saved[0]) in [float(r) for r in range(world)]
    _close(opt, model)


def _saved(rank, world, ckpt_dir):
    model, opt = make_model(rank, world, BUCKET)
    train_steps(model, opt, 0, SAVE_AT, rank, world)
    dcp.save({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    _close(opt, model)


def _refused(model, opt, ckpt_dir, match, error=Exception):
    before = _snapshot(model, opt)
    with pytest.raises(error, match=match):
        dcp.load({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    _assert_same(before, _snapshot(model, opt))


def test_truncated_file_refused_run_untouched(ranks, ckpt_dir):
    rank, world = ranks
    _saved(rank, world, ckpt_dir)
    if rank == 0:
        data = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".distcp"))[0]
        path = os.path.join(ckpt_dir, data)
        os.truncate(path, os.path.getsize(path) // 2)
    dist.barrier()
    model, opt = make_model(rank, world, BUCKET)
    train_steps(model, opt, 0, 1, rank, world)
    _refused(model, opt, ckpt_dir, r"corrupted", CheckpointException)
    _close(opt, model)


def test_changed_value_refused_by_checksum_on_every_rank(ranks, ckpt_dir):
    rank, world = ranks
    _saved(rank, world, ckpt_dir)
    model, opt = make_model(rank, world, BUCKET)
    state = mxdcp.state_dict(model, opt)
    dcp.load({"app": state}, checkpoint_id=ckpt_dir)  # _saved saved an AppState as "app"
    # One element of one rank's chunk of one state (the last param of which the last rank holds a part).
    held = [n for n, e in state["optimizer"]["state"].items() if e["exp_avg_sq"].numel() > 0]
    changed = held[-1] if held else None
    if rank == world - 1:
        chunk = state["optimizer"]["state"][changed]["exp_avg_sq"]
        chunk[chunk.numel() // 2] += 1e-3
    changed = [changed]
    dist.broadcast_object_list(changed, src=world - 1)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=rf"optimizer.state.{changed[0]}.exp_avg_sq: checksum .* corrupted"):
        mxdcp.load_state_dict(model, opt, state)  # every rank: the checksum is global
    _assert_same(before, _snapshot(model, opt))
    _close(opt, model)


def _wrap(module, kind="adam"):
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        use_distributed_optimizer=True, bucket_size=BUCKET))
    return model, mxt.DistributedOptimizer(model, mxt.OptimizerConfig(optimizer=kind, lr=3e-3, clip_grad=0.0))


def test_other_shapes_refused_run_untouched(ranks, ckpt_dir):
    rank, world = ranks
    _saved(rank, world, ckpt_dir)
    torch.manual_seed(0)
    model, opt = _wrap(torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.GELU(), torch.nn.LayerNorm(40),
                                           torch.nn.Linear(40, 5)))
    _refused(model, opt, ckpt_dir, r"Size mismatch", CheckpointException)
    _close(opt, model)


def test_model_with_fewer_params_refused_naming_them(ranks, ckpt_dir):
    rank, world = ranks
    _saved(rank, world, ckpt_dir)
    torch.manual_seed(0)
    model, opt = _wrap(torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.LayerNorm(48)))
    _refused(model, opt, ckpt_dir, r"not in this model \['3.weight', '3.bias'\]")
    _close(opt, model)


def test_other_optimizer_kind_refused(ranks, ckpt_dir):
    rank, world = ranks
    _saved(rank, world, ckpt_dir)
    torch.manual_seed(0)
    model, opt = _wrap(torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.LayerNorm(48),
                                           torch.nn.Linear(48, 5)), kind="sgd")
    # DCP itself: the key is not in the checkpoint.
    _refused(model, opt, ckpt_dir, r"Missing key .*momentum_buffer", CheckpointException)
    _close(opt, model)


def test_a_torch_without_the_protocol_is_refused(ranks, monkeypatch):
    """Without the protocol DCP would take each rank's shards for replicated tensors and write one
    rank's only: state_dict and load_state_dict refuse before DCP sees anything."""
    rank, world = ranks
    model, opt = make_model(rank, world, BUCKET)
    real = mxdcp.has_checkpointable_tensors()
    monkeypatch.setattr(mxdcp, "has_checkpointable_tensors", lambda: False)
    refusal = re.escape(f"torch {torch.__version__}'s DCP has no CheckpointableTensor")
    with pytest.raises(NotImplementedError, match=refusal):
        mxdcp.state_dict(model, opt)
    with pytest.raises(NotImplementedError, match="mxt.save_checkpoint"):
        mxdcp.load_state_dict(model, opt, {})
    if real:  # and with the protocol the same pair gives a state dict
        monkeypatch.undo()
        assert set(mxdcp.state_dict(model, opt)) == {"model", "optimizer"}
    _close(opt, model)


def test_needs_the_wrapped_pair(ranks):
    rank, world = ranks
    model, opt = make_model(rank, world, BUCKET)
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        mxdcp.state_dict(model, object())
    _close(opt, model)


def test_a_failure_on_one_rank_is_refused_on_every_rank(ranks, ckpt_dir):
    rank, world = ranks
    needs_ranks(world, 2, "a failure on rank 1 alone")
    _saved(rank, world, ckpt_dir)
    model, opt = make_model(rank, world, BUCKET)
    state = mxdcp.state_dict(model, opt)
    dcp.load({"app": state}, checkpoint_id=ckpt_dir)
    if rank == 1:
        state["optimizer"]["mxddp"] = "{not json"
    before = _snapshot(model, opt)
    with pytest.raises(ValueError if rank == 1 else RuntimeError,
                       match=r"not mxddp's checkpoint metadata" if rank == 1 else r"failed on rank\(s\) \[1\]"):
        mxdcp.load_state_dict(model, opt, state)
    _assert_same(before, _snapshot(model, opt))
    _close(opt, model)


def _torch_optimizer_pair(lrs):
    """checkpoint_reshard's MLP with a user's torch AdamW of two groups (own lr and decay each)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.LayerNorm(48),
                                 torch.nn.Linear(48, 5))
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
        use_distributed_optimizer=True, bucket_size=BUCKET))
    weights = [p for n, p in module.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in module.named_parameters() if not n.endswith("weight")]
    user = torch.optim.AdamW([{"params": weights, "lr": lrs[0], "weight_decay": 0.1},
                              {"params": rest, "lr": lrs[1], "weight_decay": 0.0}], betas=(0.9, 0.95))
    return model, mxt.DistributedOptimizer(model, user)


def _torch_steps(model, opt, first, last, rank, world):
    """checkpoint_reshard's steps the torch way (step() returns None; grads synced by backward)."""
    losses = []
    for step in range(first, last):
        opt.zero_grad()
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        model.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    return losses


def test_user_torch_optimizer_groups_and_state_come_back(ranks, ckpt_dir):
    rank, world = ranks
    model, opt = _torch_optimizer_pair((3e-3, 1e-3))
    _torch_steps(model, opt, 0, SAVE_AT, rank, world)
    dcp.save({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    expected = _torch_steps(model, opt, SAVE_AT, STEPS, rank, world)
    _close(opt, model)

    model, opt = _torch_optimizer_pair((1.0, 1.0))  # the checkpoint's lrs come back, as torch's load restores them
    dcp.load({"app": mxdcp.AppState(model, opt)}, checkpoint_id=ckpt_dir)
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 1e-3]
    assert [g["betas"] for g in opt.param_groups] == [(0.9, 0.95)] * 2
    assert _torch_steps(model, opt, SAVE_AT, STEPS, rank, world) == expected
    _close(opt, model)
