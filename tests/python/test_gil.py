"""The GIL is released while C++ works: a rank that waits inside a collective C++ call (its peers
come late) lets the process's other Python threads run meanwhile, so Python work (the rest of the
backward, a data loader) goes on while mxddp's collectives do. Rank 0 calls at once and the other
ranks LATE_S later, so rank 0 spends about LATE_S in C++; a Python thread of rank 0 that ticks
about every millisecond must tick many times during that call, as it cannot while a C call holds
the GIL (the control, a libc sleep called with the GIL held, shows the probe sees that).
"""
import ctypes
import threading
import time

import torch

import mxddp.torch as mxt
from conftest import needs_ranks
from test_parity import make_mlp, mlp_batch, mlp_loss

LATE_S = 1.0
# A thread that sleeps 1 ms between ticks makes ~LATE_S / 1 ms = 1000 of them while the GIL is
# free, fewer on a loaded machine; with the GIL held it makes at most the one or two it was about
# to make when the call began.
MIN_TICKS = 20


class Ticker:
    """A Python thread counting ticks: each one a 1 ms sleep (no GIL) then an increment (the GIL)."""

    def __init__(self):
        self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            time.sleep(0.001)
            self.ticks += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def ticks_during(call):
    """(seconds in call(), ticks another Python thread made meanwhile)."""
    with Ticker() as ticker:
        time.sleep(0.02)  # the thread is running before the call starts
        before, start = ticker.ticks, time.perf_counter()
        call()
        elapsed, after = time.perf_counter() - start, ticker.ticks
    return elapsed, after - before


def test_the_probe_sees_a_held_gil(ranks):
    """The control: a C call that holds the GIL (ctypes.PyDLL keeps it, as a binding without
    gil_scoped_release does) for LATE_S lets the ticker make almost no ticks. Without it the test
    below could pass with a probe that sees nothing."""
    usleep = ctypes.PyDLL(None).usleep  # libc's, looked up in the process
    usleep.argtypes = [ctypes.c_uint]
    elapsed, ticks = ticks_during(lambda: usleep(int(LATE_S * 1e6)))
    assert elapsed >= LATE_S
    assert ticks < MIN_TICKS, f"{ticks} ticks while a C call held the GIL for {elapsed:.2f} s"


def lined_up_then(rank, call):
    """Lines the ranks up (an all-reduce), then rank 0 calls at once and every other rank LATE_S
    later. Returns rank 0's (seconds in call(), ticks meanwhile); None elsewhere."""
    mxt.all_reduce(torch.zeros(1))
    if rank == 0:
        return ticks_during(call)
    time.sleep(LATE_S)
    call()
    return None


def check(rank, what, measured):
    if rank != 0:
        return
    elapsed, ticks = measured
    # Rank 0 must really have waited for the late rank inside the call, or the ticks prove nothing.
    # (Most of LATE_S: rank 0 may leave the lining-up all-reduce late on a loaded machine.)
    assert elapsed >= 0.3 * LATE_S, f"{what} returned after {elapsed:.2f} s without waiting for the late rank"
    assert ticks >= MIN_TICKS, (f"{what}: another Python thread ticked {ticks} times in the {elapsed:.2f} s rank 0 "
                                "waited in C++ for a late rank (~1 per ms when the GIL is free): the call holds "
                                "the GIL")
    print(f"{what}: {ticks} ticks of another thread in {elapsed:.2f} s in C++")


def make_model():
    torch.manual_seed(0)
    # Overlap off: backward issues nothing, finish_grad_sync issues the reduce-scatter and waits.
    return mxt.DistributedDataParallel(make_mlp(), mxt.DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=True, grad_reduce_in_fp32=True))


def test_finish_grad_sync_and_step_release_the_gil(ranks):
    """The two blocking calls of a training step: finish_grad_sync (the grads' reduce-scatter) and
    the optimizer's step (the global grad norm's all-reduce, the params' all-gather)."""
    rank, world = ranks
    needs_ranks(world, 2, "rank 0 waiting in C++ for a late rank")
    model = make_model()
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-3))
    try:
        opt.zero_grad()
        mlp_loss(model, mlp_batch(rank, 0, 0)).backward()
        check(rank, "finish_grad_sync", lined_up_then(rank, model.finish_grad_sync))
        steps = []
        check(rank, "DistributedOptimizer.step", lined_up_then(rank, lambda: steps.append(opt.step())))
        assert steps[0][0]  # the step went through: it did the work that was waited for
    finally:
        opt.close()
        model.close()


def test_all_reduce_releases_the_gil(ranks):
    rank, world = ranks
    needs_ranks(world, 2, "rank 0 waiting in C++ for a late rank")
    t = torch.full((4,), float(rank))
    check(rank, "all_reduce", lined_up_then(rank, lambda: mxt.all_reduce(t)))
    assert torch.equal(t, torch.full((4,), float(sum(range(world)))))
