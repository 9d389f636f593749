"""Hybrid sharding (HSDP) for mxddp.torch.FullyShardedDataParallel: which torch process groups
shard and which replicate.

FSDP shards within a shard group (e.g. one host's ranks) and keeps one replica of the sharded
state per group; each reduced gradient shard is then all-reduced across the replica group (the
ranks holding the same shard index in the other groups). The C++ side is fsdp.h's replica
communicator; this module turns what a user gives into the two groups, refusing what cannot work:

- ``device_mesh``: FSDP2's 2-D ``DeviceMesh`` of shape (replicas, shard), dims named
  ("replicate", "shard") (or unnamed, in that order), over every rank;
- ``num_distributed_optimizer_instances`` (Megatron's name, in the config): that many replica
  groups, each a contiguous block of world / it ranks as the shard group (a host's ranks under
  torchrun's and mpirun's rank order), the replica groups strided across them.

``hsdp_groups`` gives (shard group, replica group), or None where the request is plain FSDP;
``hsdp_communicators`` the two mxddp communicators over them (``process_group.communicator_for``).
"""
from __future__ import annotations

from typing import Optional

_MESH_DIMS = ("replicate", "shard")
# (world size, instances) -> (shard group, replica group) of this rank: dist.new_group is
# collective over the world, so each grid's groups are made once per process.
_instance_groups: dict[tuple[int, int], tuple[object, object]] = {}


def _dist():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("hybrid sharding needs torch.distributed: call torch.distributed.init_process_group('gloo') "
                           "(torchrun sets its environment) before wrapping with device_mesh= or "
                           "num_distributed_optimizer_instances")
    return dist


def check_mesh(mesh, world_size: int) -> tuple[int, int]:
    """(replicas, shard size) of an HSDP mesh over world_size ranks; ValueError naming what is
    wrong otherwise (not 2-D, other dim names, not every rank, a shard group of one rank)."""
    ndim = getattr(mesh, "ndim", None)
    if ndim != 2:
        raise ValueError(f"device_mesh must be 2-D (replicate, shard) for hybrid sharding; got a {ndim}-D mesh. "
                         "For FSDP over one group pass its process group, not a 1-D mesh")
    names = tuple(mesh.mesh_dim_names) if getattr(mesh, "mesh_dim_names", None) else None
    if names is not None and names != _MESH_DIMS:
        raise ValueError(f"device_mesh's dims are named {names}; hybrid sharding's are {_MESH_DIMS} "
                         "(dim 0 the replicas, dim 1 the shard group), as FSDP2's HSDP mesh")
    replicas, shard = int(mesh.size(0)), int(mesh.size(1))
    if replicas * shard != world_size:
        raise ValueError(f"device_mesh covers {replicas} x {shard} = {replicas * shard} ranks, but the world has "
                         f"{world_size}: the mesh must hold every rank")
    if shard < 2:
        raise ValueError(f"device_mesh's shard dim has size {shard}: a shard group of one rank shards nothing "
                         "(that is DDP: use mxddp.torch.DistributedDataParallel); valid: at least 2")
    return replicas, shard


def check_instances(instances, world_size: int) -> int:
    """The shard group's size for num_distributed_optimizer_instances over world_size ranks;
    ValueError naming the value and what is valid otherwise."""
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise ValueError(f"num_distributed_optimizer_instances {instances!r} is not valid: an int of at least 1")
    if world_size % instances != 0:
        raise ValueError(f"num_distributed_optimizer_instances {instances} does not divide the world size "
                         f"{world_size}: each instance is a shard group of world / instances ranks")
    shard = world_size // instances
    if instances > 1 and shard < 2:
        raise ValueError(f"num_distributed_optimizer_instances {instances} at world size {world_size} leaves shard "
                         "groups of one rank, which shard nothing (that is DDP); valid: a divisor of the world size "
                         "up to half of it")
    return shard


def _groups_for_instances(instances: int, world_size: int):
    dist = _dist()
    key = (world_size, instances)
    cached = _instance_groups.get(key)
    if cached is not None:
        return cached
    shard = world_size // instances
    rank = dist.get_rank()
    mine_shard = mine_replica = None
    # Every rank creates every group, in the same order (new_group is collective over the world).
    for g in range(instances):
        group = dist.new_group(list(range(g * shard, (g + 1) * shard)), backend="gloo")
        if rank // shard == g:
            mine_shard = group
    for s in range(shard):
        group = dist.new_group(list(range(s, world_size, shard)), backend="gloo")
        if rank % shard == s:
            mine_replica = group
    _instance_groups[key] = (mine_shard, mine_replica)
    return mine_shard, mine_replica


def hsdp_groups(device_mesh=None, num_distributed_optimizer_instances: Optional[int] = None):
    """(shard group, replica group) of this rank, or None where the request is plain FSDP (no
    mesh, and instances None or 1). Collective over the world the first time a grid is asked for."""
    if device_mesh is not None and num_distributed_optimizer_instances not in (None, 1):
        raise ValueError("give hybrid sharding's layout once: device_mesh or num_distributed_optimizer_instances "
                         f"({num_distributed_optimizer_instances}), not both")
    if device_mesh is None and num_distributed_optimizer_instances in (None, 1):
        if num_distributed_optimizer_instances is not None:
            check_instances(num_distributed_optimizer_instances, 1)
        return None
    dist = _dist()
    world = dist.get_world_size()
    if device_mesh is not None:
        check_mesh(device_mesh, world)
        return device_mesh.get_group(1), device_mesh.get_group(0)
    check_instances(num_distributed_optimizer_instances, world)
    return _groups_for_instances(num_distributed_optimizer_instances, world)


def hsdp_communicators(device_mesh=None, num_distributed_optimizer_instances: Optional[int] = None):
    """mxddp's (shard communicator, replica communicator) for the C++ FSDP, or None for plain FSDP."""
    groups = hsdp_groups(device_mesh, num_distributed_optimizer_instances)
    if groups is None:
        return None
    from mxddp.torch.process_group import communicator_for

    shard_group, replica_group = groups
    return communicator_for(shard_group), communicator_for(replica_group)
