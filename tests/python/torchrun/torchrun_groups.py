"""mxddp's communicators over the user's torch.distributed sub-groups, at 4 ranks under torchrun
(run_torchrun.sh groups): a DDP per 2-rank group reduces within its group only, DeviceMesh dimension
groups work side by side with the world, handles are cached per group, non-members are refused."""
import pytest
import torch
import torch.distributed as dist

import mxddp.torch as mxt
from mxddp import _C
from mxddp.torch import process_group


@pytest.fixture(scope="module")
def four(torchrun_ranks):
    rank, world = torchrun_ranks
    if world != 4:
        pytest.skip(f"needs 4 ranks; got {world}")
    return rank


def _ddp_mean_of_group(handle, rank):
    cfg = _C.DdpConfig()
    ddp = _C.DistributedDataParallel([("w", [8], False)], cfg, [], [torch.zeros(8)], comm=handle)
    ddp.zero_grad_buffer()
    ddp.main_grad(0).fill_(float(rank + 1))
    ddp.grad_ready(0)
    ddp.finish_grad_sync()
    out = ddp.main_grad(0).clone()
    ddp.close()
    return out


def test_ddp_on_a_sub_group_reduces_within_it(four):
    rank = four
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both (torch's rule)
    mine = groups[rank // 2]
    handle = process_group.communicator_for(mine)
    assert (handle.rank, handle.size, handle.backend) == (rank % 2, 2, "torch")
    assert process_group.communicator_for(mine).id == handle.id  # cached per group
    got = _ddp_mean_of_group(handle, rank)
    first = 2 * (rank // 2) + 1  # the group's ranks hold first and first + 1
    assert got.tolist() == [first + 0.5] * 8
    # The world's communicator is untouched by it: a world DDP averages over all 4.
    assert _ddp_mean_of_group(None, rank).tolist() == [2.5] * 8


def test_device_mesh_dimension_groups(four):
    rank = four
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    across = process_group.communicator_for(mesh.get_group("replicate"))  # ranks {0, 2} and {1, 3}
    within = process_group.communicator_for(mesh.get_group("shard"))  # ranks {0, 1} and {2, 3}
    for _ in range(3):  # interleaved with each other and the world
        a = torch.tensor([float(rank)])
        _C.all_reduce(a, "sum", comm=across)
        w = torch.tensor([float(rank)])
        _C.all_reduce(w, "sum", comm=within)
        t = torch.tensor([float(rank)])
        mxt.all_reduce(t)
        assert (a.item(), w.item(), t.item()) == ({0: 2.0, 1: 4.0}[rank % 2], {0: 1.0, 1: 5.0}[rank // 2], 6.0)
    # A sub-group's gather goes in the group's rank order.
    got = _C.all_gather_bytes(bytes([rank]), comm=within)
    assert got == [bytes([2 * (rank // 2)]), bytes([2 * (rank // 2) + 1])]


def test_a_group_this_rank_is_not_in_is_refused(four):
    rank = four
    pair = dist.new_group([0, 1])
    if rank >= 2:
        with pytest.raises(ValueError, match=r"global rank [23]\) is not a member of process_group"):
            process_group.communicator_for(pair)
    else:
        assert process_group.communicator_for(pair).size == 2
    mxt.launch._C.barrier()


def _fsdp_sgd_step(rank, strategy, comm, replica=None):
    """One FSDP unit of one param (zeros), grad rank + 1 everywhere, SGD lr 1: the param after
    the step is minus the mean gradient over the ranks the reduction spans."""
    cfg = _C.FsdpConfig()
    cfg.data_parallel_sharding_strategy = strategy
    fsdp = _C.FullyShardedDataParallel([("w", [4, 8], False)], [[0]], cfg, [], [torch.zeros(4, 8)], comm=comm,
                                       replica=replica)
    oc = _C.OptimizerConfig()
    oc.optimizer, oc.lr, oc.weight_decay, oc.clip_grad, oc.sgd_momentum = "sgd", 1.0, 0.0, 0.0, 0.0
    opt = _C.DistributedOptimizer(fsdp, oc)
    opt.zero_grad()
    fsdp.before_forward([0])
    fsdp.after_forward([0])
    fsdp.before_backward([0])
    fsdp.main_grad(0).fill_(float(rank + 1))
    fsdp.grad_ready(0)
    fsdp.after_backward([0])
    fsdp.finish_grad_sync()
    opt.step()
    fsdp.before_forward([0])
    values = fsdp.param(0).clone()
    fsdp.after_forward([0])
    opt.close()
    fsdp.close()
    return values


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def test_fsdp_on_a_sub_group_shards_within_it(four):
    rank = four
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    handle = process_group.communicator_for(groups[rank // 2])
    for strategy in STRATEGIES:
        got = _fsdp_sgd_step(rank, strategy, handle)
        assert got.eq(-(2 * (rank // 2) + 1.5)).all(), (strategy, got)


def test_hsdp_on_a_device_mesh(four):
    """A 2 x 2 DeviceMesh ("replicate", "shard"): FSDP within the shard group, its reductions
    all-reduced across the replicate group: the mean over all 4 ranks, as DDP over them gives."""
    rank = four
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard = process_group.communicator_for(mesh.get_group("shard"))
    replica = process_group.communicator_for(mesh.get_group("replicate"))
    for strategy in STRATEGIES:
        got = _fsdp_sgd_step(rank, strategy, shard, replica)
        assert got.eq(-2.5).all(), (strategy, got)
