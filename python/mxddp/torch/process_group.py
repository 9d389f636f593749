"""mxddp's communicators over torch.distributed process groups (gloo, on the CPU).

Under torchrun, srun or a script's own ``torch.distributed.init_process_group``, mxddp's world
communicator runs on the default group, and ``process_group=`` of DistributedDataParallel and
FullyShardedDataParallel takes any other group (a ``dist.new_group`` sub-group, a DeviceMesh
dimension's ``mesh.get_group(d)``): ``communicator_for(group)`` gives the C++ handle, one per group,
cached.

Each communicator runs on a private gloo group over the same ranks as the user's group (built from
the default store under a prefix of its own), not on the user's group itself: mxddp issues its
collectives from a progress thread, while the script may issue its own on the main thread at any
time (a loss all-reduce, a barrier); on one shared group the two streams would interleave in a
different order on each rank and pair the wrong collectives. The private group also uses gloo
whatever the user's group runs on, since mxddp's buffers are host memory.

The C++ engine (``python/src/torch_backend.cc``) calls a ``GroupRunner``'s methods from the
progress thread with the GIL; each waits for its torch Work, which releases the GIL while gloo
moves the data.
"""
from __future__ import annotations

import datetime

from mxddp import _C

# Per user group name: how many private duplicates this process made of it, so that each new one
# gets a store prefix no earlier one used (every member makes them in the same order).
_duplicates: dict[str, int] = {}
# id(user group) -> (the group, kept alive so its id is not reused, its handle)
_handles: dict[int, tuple[object, "_C.Communicator"]] = {}
# id(user group) -> what its communicator's ring runs on (ring_transport())
_ring_transports: dict[int, str] = {}


class GroupRunner:
    """One collective at a time on a gloo ProcessGroup, waited for: what the C++ engine calls.
    Tensors are CPU views of mxddp's buffers (f32, f64, i32, i64, u8); ops "sum" or "max"."""

    def __init__(self, pg):
        import torch.distributed as dist

        self._pg = pg
        self._all_reduce = {}
        self._reduce_scatter = {}
        for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
            ar = dist.AllreduceOptions()
            ar.reduceOp = op
            rs = dist.ReduceScatterOptions()
            rs.reduceOp = op
            self._all_reduce[name] = ar
            self._reduce_scatter[name] = rs
        self._broadcast = {}
        self._dist = dist

    def all_reduce(self, tensor, op: str) -> None:
        self._pg.allreduce([tensor], self._all_reduce[op]).wait()

    def reduce_scatter(self, output, input, op: str) -> None:  # noqa: A002 (torch's name)
        self._pg._reduce_scatter_base(output, input, self._reduce_scatter[op]).wait()

    def all_gather(self, output, input) -> None:  # noqa: A002
        self._pg._allgather_base(output, input).wait()

    def broadcast(self, tensor, root: int) -> None:
        opts = self._broadcast.get(root)
        if opts is None:
            opts = self._broadcast[root] = self._dist.BroadcastOptions()
            opts.rootRank = root
        self._pg.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        self._pg.barrier().wait()

    # Point to point, for the engine's ring (src/comm/ring.h): each returns the torch Work, which
    # the engine waits for. Messages between a pair of ranks match in the order they are posted.
    def isend(self, tensor, peer: int):
        return self._pg.send([tensor], peer, 0)

    def irecv(self, tensor, peer: int):
        return self._pg.recv([tensor], peer, 0)


def _dist():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group('gloo') "
                           "(torchrun sets its environment) before giving mxddp a process group")
    return dist


def private_runner(group, timeout_s: float) -> tuple[GroupRunner, int, int]:
    """A GroupRunner over a new private gloo group with group's ranks, and this process's (rank,
    size) in it. Collective over group's members (each builds its end of the gloo mesh)."""
    dist = _dist()
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        # dist.new_group returns the NON_GROUP_MEMBER marker on the ranks it leaves out.
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of process_group "
                         f"{group!r}: torch.distributed.new_group gave it no group; only the group's members may "
                         "wrap a model on it")
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    name = group.group_name
    _duplicates[name] = _duplicates.get(name, 0) + 1
    store = dist.PrefixStore(f"mxddp/{name}/{_duplicates[name]}", dist.distributed_c10d._get_default_store())
    pg = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))
    runner = GroupRunner(pg)
    runner.timeout_s = float(timeout_s)
    runner.shm_token = _shm_token(pg, rank, size)
    return runner, rank, size


def boot_id() -> str:
    """This kernel's boot id ("?" where it cannot be read): with the host name, what tells this
    machine's processes from another's."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _shm_token(pg, rank: int, size: int):
    """Collective over pg. A token unique to this group in this job (the name prefix of the shared-
    memory ring's channels, src/comm/shm_ring.h) when every rank runs on this host (the same host
    name and boot id) and none set MXDDP_TORCH_SHM=0; else None, and the ring runs on gloo."""
    import os
    import socket

    import torch
    import torch.distributed as dist

    if size == 1:
        return None
    boot = boot_id()
    allowed = os.environ.get("MXDDP_TORCH_SHM", "1") != "0"
    me = f"{int(allowed)}|{socket.gethostname()}|{boot}".encode()[:255]
    mine = torch.zeros(256, dtype=torch.uint8)
    mine[:len(me)] = torch.frombuffer(bytearray(me), dtype=torch.uint8)
    everyone = torch.zeros(256 * size, dtype=torch.uint8)
    pg._allgather_base(everyone, mine).wait()
    rows = everyone.view(size, 256)
    if not allowed or not all(torch.equal(rows[r], mine) for r in range(size)):
        return None
    token = torch.frombuffer(bytearray(os.urandom(8)), dtype=torch.uint8).clone()
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([token], opts).wait()
    return "mxddp-" + bytes(token.tolist()).hex()


def communicator_for(process_group=None) -> "_C.Communicator":
    """The handle of mxddp's communicator over process_group, for the C++ DDP and FSDP. None, or
    torch.distributed's default group when mxddp runs on it: the world communicator. mxddp is
    initialized first if it is not (``mxddp.torch.init()``: on the default group once
    torch.distributed is initialized), so a torch DDP script needs no call of its own.
    Collective over the group's members the first time a group is seen."""
    from mxddp.torch import launch

    if not _C.is_initialized():
        launch.init()
    if process_group is None:
        return _C.world_communicator()
    dist = _dist()
    if _C.backend() == "torch" and process_group is dist.distributed_c10d._get_default_group():
        return _C.world_communicator()
    cached = _handles.get(id(process_group))
    if cached is not None:
        return cached[1]
    runner, rank, size = private_runner(process_group, launch.timeout_s())
    handle = _C.add_torch_group(runner, rank, size)
    _handles[id(process_group)] = (process_group, handle)
    note_ring_transport(process_group, runner)
    return handle


def note_ring_transport(group, runner) -> None:
    """Records what the communicator built on runner chose for its ring (its C++ constructor set
    runner.ring_transport; a world of one rank has no runner and no ring)."""
    _ring_transports[id(group)] = getattr(runner, "ring_transport", "none (one rank)")


def ring_transport(process_group=None) -> str:
    """How the large collectives of mxddp's communicator over process_group (None: the world) move
    their data under torch.distributed: "shm" (shared memory: every rank on this host) or
    "gloo (why not shm)". Under MPI: "mpi"."""
    if _C.backend() == "mpi":
        return "mpi"
    dist = _dist()
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    if id(group) not in _ring_transports:
        raise ValueError(f"mxddp has no communicator over process_group {group!r} yet (a wrap on it makes one)")
    return _ring_transports[id(group)]


def forget_communicators() -> None:
    """The runtime is being finalized (launch.shutdown): its communicators go with it."""
    _handles.clear()
    _ring_transports.clear()
