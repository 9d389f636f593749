"""A torch.distributed gloo group over the ranks of an mpirun job, for the Python benchmarks whose
torch or Megatron reference needs one while mxddp runs on MPI (torch_ddp_compare.py,
oversubscribed_wait.py, megatron_compare.py import it from their own folder): rank 0 picks a free
local port and broadcasts it through mxddp."""


def init_gloo_beside_mpi(rank: int, world: int) -> None:
    """torch.distributed.init_process_group("gloo") on 127.0.0.1 over mxddp's MPI ranks (one host)."""
    import socket

    import torch
    import torch.distributed as dist

    import mxddp.torch as mxt

    port = torch.tensor([0.0])
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    mxt.broadcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port.item())}", rank=rank, world_size=world)
