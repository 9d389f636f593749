"""Shared set-up for the mxddp.torch tests, run under `mpirun -np N python -m pytest tests/python`
(and some files under `torchrun --nproc_per_node N -m pytest ...`: tests/python/torchrun.cmake).

Every rank runs the same tests in the same order, so their collectives match. The session starts
mxddp (MPI) and, for the PyTorch reference, a gloo process group over 127.0.0.1 whose port rank 0
picks and broadcasts through mxddp.
"""
import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist

import mxddp.torch as mxt


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo_beside_mxddp(rank: int, world: int) -> None:
    """The script's own gloo group of mxddp's MPI ranks, over 127.0.0.1 at a port rank 0 picks and
    broadcasts through mxddp (also used by raise_in_backward.py, which runs outside pytest)."""
    port = torch.tensor([float(_free_port() if rank == 0 else 0)])
    mxt.broadcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port.item())}", rank=rank, world_size=world)


@pytest.fixture(scope="session")
def ranks():
    """(rank, world): mxddp's MPI ranks, with a gloo group of the same ranks for the reference."""
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and not torchrun:
        pytest.skip("run under mpirun (mpirun -np 2 python -m pytest tests/python) or torchrun")
    torch.set_num_threads(1)
    if torchrun:
        # mxt.init() starts torch.distributed (gloo) on torchrun's variables: its default group is the
        # reference's, and mxddp runs on a private duplicate of it.
        rank, world = mxt.init(timeout_s=120)
        yield rank, world
        return
    # MXDDP_TEST_COLLECTIVE_DELAY_US="min,max": every collective starts late by a random delay (the
    # injected-delay runs of the FSDP parity tests).
    delay = os.environ.get("MXDDP_TEST_COLLECTIVE_DELAY_US")
    rank, world = mxt.init(timeout_s=120, collective_delay_us=tuple(int(v) for v in delay.split(",")) if delay else None)
    init_gloo_beside_mxddp(rank, world)
    yield rank, world
    dist.destroy_process_group()


def needs_ranks(world: int, ranks_min: int, what: str) -> None:
    """Skips, saying why, a test whose behaviour exists only with ranks_min ranks or more (ranks that
    disagree, a late rank, a shard that is not the whole param); the rest of the suite runs at any
    world size, one rank included."""
    if world < ranks_min:
        pytest.skip(f"{what}: needs {ranks_min} ranks or more, this run has {world}")


@pytest.fixture(scope="module", autouse=True)
def nothing_left_open(request):
    """After each test file, nothing of mxddp's holds memory. A test that leaves a model open (an
    exception or a skip between its wrap and its close) otherwise fails every later test that counts
    live bytes, files away; this names the file that did it."""
    yield
    if not mxt.is_initialized():
        return
    gc.collect()
    # Not "comm": the communicator's staging, which collectives outside any model (mxt.all_reduce)
    # may keep from call to call.
    live = {name: live for name, (live, _) in mxt.memory_usage().items() if live and name != "comm"}
    assert not live, f"{request.module.__name__} left mxddp memory alive (a model or optimizer not closed): {live}"
