"""One launch of run_dcp_reshard.sh: torch.distributed.checkpoint (DCP) of a mxddp model and
DistributedOptimizer saved at one dp and loaded at another (mxddp.torch.dcp).

`dcp_job.py save DIR` trains checkpoint_reshard's MLP (a fixed global batch per step, each rank its
share, so every dp computes the same losses up to the reduction order) for SAVE_AT steps as a DDP
and saves it with dcp.save into DIR.
`dcp_job.py resume DIR` does, at this launch's dp, for a DDP and for an FSDP: the uninterrupted run
(STEPS steps from the start), then a fresh model loaded from DIR with dcp.load trained from SAVE_AT
to STEPS; the two must give the same losses within 1e-6 (F32) and the same step count. Rank 0 prints
"resumed at dp N: OK" when both do.
"""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import mxddp.torch as mxt
from mxddp.torch import dcp as mxdcp

from checkpoint_reshard import SAVE_AT, STEPS, make_model, train_steps

BUCKET = 700  # elements: buckets end inside params, so the ranks hold uneven parts of them
TOLERANCE = 1e-6


def _init():
    """mxddp over MPI, and a gloo group of the same ranks for DCP (rank 0 picks the port)."""
    rank, world = mxt.init(timeout_s=120)
    port = 0
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    value = torch.tensor([float(port)])
    mxt.broadcast(value, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(value.item())}", rank=rank, world_size=world)
    return rank, world


def save(path):
    rank, world = _init()
    model, opt = make_model(rank, world, BUCKET)
    train_steps(model, opt, 0, SAVE_AT, rank, world)
    dcp.save({"app": mxdcp.AppState(model, opt)}, checkpoint_id=path)
    opt.close()
    model.close()
    if rank == 0:
        print(f"saved at dp {world}", flush=True)


def resume(path):
    rank, world = _init()
    worsts = []
    for kind in (BUCKET, "fsdp:optim_grads_params"):
        model, opt = make_model(rank, world, kind)
        expected = train_steps(model, opt, 0, STEPS, rank, world)[SAVE_AT:]
        expected_steps = opt.step_count
        opt.close()
        model.close()

        model, opt = make_model(rank, world, kind)
        dcp.load({"app": mxdcp.AppState(model, opt)}, checkpoint_id=path)
        if opt.step_count != SAVE_AT:
            sys.exit(f"rank {rank}: {kind}: step count {opt.step_count} after the load; the save's was {SAVE_AT}")
        got = train_steps(model, opt, SAVE_AT, STEPS, rank, world)
        worst = max(abs(a - b) for a, b in zip(got, expected))
        if worst > TOLERANCE or opt.step_count != expected_steps:
            sys.exit(f"rank {rank}: {kind} at dp {world}: losses after the load {got} differ from the uninterrupted "
                     f"run's {expected} by {worst} (> {TOLERANCE}), or step count {opt.step_count} != "
                     f"{expected_steps}")
        worsts.append(worst)
        opt.close()
        model.close()
    if rank == 0:
        print(f"resumed at dp {world}: OK (largest loss difference: DDP {worsts[0]:.3g}, FSDP {worsts[1]:.3g})",
              flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("save", "resume"):
        sys.exit("usage: dcp_job.py save|resume DIR")
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    (save if sys.argv[1] == "save" else resume)(sys.argv[2])
    dist.destroy_process_group()
