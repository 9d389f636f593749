"""mxddp under torchrun at 2 ranks (run_torchrun.sh basics): the runtime on torch.distributed's default
group, its collectives, the GIL left free while gloo works, overlap with backward, a refused mismatch,
and DDP + DistributedOptimizer against torch DDP + AdamW."""
import copy
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import mxddp.torch as mxt
from mxddp import _C


def test_init_runs_on_torch_distributed(torchrun_ranks):
    rank, world = torchrun_ranks
    assert (rank, world) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    assert mxt.launch.backend() == "torch" and dist.is_initialized() and dist.get_backend() == "gloo"
    assert (mxt.rank(), mxt.world_size()) == (rank, world)
    assert mxt.init(timeout_s=60) == (rank, world)  # again: the same runtime


def test_all_reduce_and_broadcast(torchrun_ranks):
    rank, world = torchrun_ranks
    t = torch.tensor([1.0, 2.0, float(rank)])
    mxt.all_reduce(t, "sum")
    assert t.tolist() == [world, 2.0 * world, sum(range(world))]
    t = torch.tensor([float(rank)] * 3)
    mxt.all_reduce(t, "avg")
    assert torch.allclose(t, torch.full((3,), sum(range(world)) / world))
    t = torch.tensor([float(rank), float("nan") if rank == world - 1 else 0.0])
    mxt.all_reduce(t, "max")  # NaN wins, as on the other backends
    assert t[0].item() == world - 1 and t[1].isnan()
    b = torch.tensor([1.0 + rank, 3.0], dtype=torch.bfloat16)
    mxt.all_reduce(b, "sum")
    assert b.tolist() == [float(sum(range(1, world + 1))), 3.0 * world]
    t = torch.full((5,), float(rank))
    mxt.broadcast(t, root=world - 1)
    assert t.tolist() == [float(world - 1)] * 5
    mxt.launch._C.barrier()


def test_mismatched_call_is_refused_on_every_rank(torchrun_ranks):
    rank, _ = torchrun_ranks
    t = torch.zeros(4 + rank)
    with pytest.raises(_C.Error, match=r"all_reduce #\d+: ranks disagree: rank 0 vs rank 1: element count 4 vs 5"):
        mxt.all_reduce(t)
    u = torch.ones(3)
    mxt.all_reduce(u)  # the group still agrees on what comes next
    assert u.tolist() == [2.0] * 3


def test_gil_is_free_while_a_collective_runs(torchrun_ranks):
    """Rank 1 enters a collective a second late; meanwhile rank 0's is in flight on its progress
    thread (and its main thread waits in it). A Python thread of rank 0 must keep running: it
    would stop if the collective held the GIL while gloo waits."""
    rank, _ = torchrun_ranks
    counts = []
    stop = threading.Event()

    def count():
        n = 0
        while not stop.is_set():
            n += 1
            if n % 1000 == 0:
                counts.append((time.perf_counter(), n))

    thread = threading.Thread(target=count)
    thread.start()
    if rank == 1:
        time.sleep(1.0)
    t0 = time.perf_counter()
    x = torch.ones(1 << 20)
    mxt.all_reduce(x)
    t1 = time.perf_counter()
    stop.set()
    thread.join()
    assert x[0].item() == 2.0
    if rank == 0:
        assert t1 - t0 > 0.8, f"rank 0's collective took {t1 - t0:.3f} s; it should have waited ~1 s for rank 1"
        during = [n for t, n in counts if t0 + 0.1 < t < t1 - 0.1]
        assert len(during) > 20, f"the Python thread ran only {len(during)} thousand-iteration rounds in " \
                                 f"{t1 - t0:.2f} s of collective: the GIL was held"


class _Probe(torch.autograd.Function):
    """Identity at the model's input: its backward runs last in backward, and waits there (GIL
    free) for the last layer's reduced gradient to appear in the grad buffer."""
    seen = None

    @staticmethod
    def forward(ctx, x, check):
        ctx.check = check
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        deadline = time.monotonic() + 10
        _Probe.seen = False
        while time.monotonic() < deadline:
            if ctx.check():
                _Probe.seen = True
                break
            time.sleep(0.002)
        return grad, None


def test_collective_completes_during_backward(torchrun_ranks):
    rank, world = torchrun_ranks
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(4)])
    reference = copy.deepcopy(layers)
    x = torch.randn(8, 16)
    reference(x).sum().backward()
    expected = reference[3].weight.grad * (sum(range(1, world + 1)) / world)  # mean of (r + 1) * G
    model = mxt.DistributedDataParallel(layers, mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=False, bucket_size=256))  # a bucket per layer
    assert model._cpp.num_buckets == 4
    last = model.module[3].weight
    check = lambda: torch.allclose(last.main_grad, expected, rtol=1e-5, atol=1e-6)  # noqa: E731
    model.zero_grad_buffer()
    out = model(_Probe.apply(x.requires_grad_(), check))
    (out.sum() * (rank + 1)).backward()
    seen = _Probe.seen
    model.finish_grad_sync()
    assert check(), "the reduced gradient is wrong after finish_grad_sync"
    assert seen, "the last layer's all-reduce had not completed by the end of backward: no overlap"
    model.close()


def _train(model, step, steps, world, rank):
    losses = []
    for i in range(steps):
        g = torch.Generator().manual_seed(100 * i + rank)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(step(loss))
    return losses


def test_ddp_and_distributed_optimizer_match_torch_ddp(torchrun_ranks):
    rank, world = torchrun_ranks
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref_net = copy.deepcopy(net)
    model = mxt.DistributedDataParallel(net, mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=600))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0))

    def mx_step(loss):
        model.zero_grad_buffer()
        loss.backward()
        model.finish_grad_sync()
        opt.step()
        return loss.item()

    ref = torch.nn.parallel.DistributedDataParallel(ref_net)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)

    def ref_step(loss):
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        return loss.item()

    ours = _train(model, mx_step, 6, world, rank)
    theirs = _train(ref, ref_step, 6, world, rank)
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (ours, theirs)
    opt.close()
    model.close()


def _quarters(rank, n):
    """Quarter-integers in [-8, 8): their sums over a few ranks are exact in f32, in any order."""
    i = torch.arange(n, dtype=torch.int64)
    return (((rank * 37 + i * 11 + (i >> 7)) % 64) - 32).to(torch.float32) * 0.25


def test_large_sums_and_gathers_run_on_the_ring_exactly(torchrun_ranks):
    """f32 sums and gathers of 1 MiB or more run on src/comm/ring.h (twice and five times faster
    than gloo's all_reduce and _allgather_base): exact against the reference, over blocks that do
    not split evenly; through shared memory here, summing out of its slots, so with no scratch (over
    gloo's send/recv the ring's two 1 MiB chunks would be charged as comm)."""
    rank, world = torchrun_ranks
    n = (1 << 20) * 2 + 7  # 8 MiB of f32: several slots per block at 2 ranks, and a ragged end
    want = sum(_quarters(r, n) for r in range(world))
    for op, expected in (("sum", want), ("avg", want / world)):
        t = _quarters(rank, n)
        mxt.all_reduce(t, op)
        assert torch.equal(t, expected), f"all_reduce {op}: {(t != expected).sum().item()} elements differ"
    # A reduce-scatter and a gather of the same size: DDP + distributed optimizer's gradient sync and
    # param all-gather of a 2.8M-param model against torch DDP + AdamW.
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(16, 1 << 17), torch.nn.Tanh(), torch.nn.Linear(1 << 17, 4))
    ref_net = copy.deepcopy(net)
    model = mxt.DistributedDataParallel(net, mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True))
    assert model._cpp.num_buckets == 1 and model._cpp.numel * 4 >= 10 << 20  # blocks of many slots
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0))
    ref = torch.nn.parallel.DistributedDataParallel(ref_net)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    for i in range(3):
        g = torch.Generator().manual_seed(100 * i + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        model.zero_grad_buffer()
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.finish_grad_sync()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for p, q in zip(net.parameters(), ref_net.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    from mxddp.torch import process_group
    assert process_group.ring_transport() == "shm"
    assert mxt.memory_usage()["comm"][0] == 0, "f32 sums through shared memory need no scratch"
    opt.close()
    model.close()


def test_the_ring_runs_through_shared_memory_on_one_host_or_else_gloo(torchrun_ranks):
    """torchrun --standalone puts every rank on this host: the ring's messages go through /dev/shm
    (src/comm/shm_ring.h). A group where one rank sets MXDDP_TORCH_SHM=0 agrees on gloo on every
    rank, and its sums are as exact."""
    from mxddp.torch import process_group

    rank, world = torchrun_ranks
    assert process_group.ring_transport() == "shm"
    if rank == 1:
        os.environ["MXDDP_TORCH_SHM"] = "0"
    try:
        group = dist.new_group(list(range(world)))
        n = (1 << 20) + 5
        t = _quarters(rank, n)
        mxt.all_reduce(t, "sum", process_group=group)
    finally:
        os.environ.pop("MXDDP_TORCH_SHM", None)
    assert process_group.ring_transport(group) == "gloo (the ranks are not all on one host, or MXDDP_TORCH_SHM=0)"
    assert torch.equal(t, sum(_quarters(r, n) for r in range(world)))
