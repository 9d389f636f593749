"""One job of CTest's python_save_lock_two_jobs (run_save_lock.sh): two runs saving into one
checkpoint history. A run holds the history's lock from its first save to its end, so a second
run's save is refused on every rank, naming the directory and the holder, and the first run's
checkpoints stay its own; the lock goes with the first run, and a later run saves there.

usage (under mpirun -np 2):
  save_lock_job.py hold DIR READY GO PARAMS   saves iteration 1, writes its rank 0's pid to READY,
                                              waits for GO to exist, saves 2 and 3, writes the
                                              params of 3 to PARAMS
  save_lock_job.py intrude DIR                tries to save into DIR: prints "rank R refused: ..."
                                              and exits 0 when refused, exits 3 when it saved
  save_lock_job.py resume DIR PARAMS          loads DIR (iteration 3, PARAMS' values), saves 4
"""
import os
import sys
import time

import torch

import mxddp
import mxddp.torch as mxt

WAIT_S = 120  # for GO, well within CTest's timeout


def model_and_optimizer():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True))
    return model, mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2))


def train_step(model, opt, rank, step):
    opt.zero_grad()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
    model(x).square().mean().backward()
    model.finish_grad_sync()
    assert opt.step()[0]


def write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def wait_for_file(path, rank):
    """Rank 0 polls; then every rank goes on together."""
    flag = torch.zeros(1)
    if rank == 0:
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        flag[0] = float(os.path.exists(path))
    mxt.broadcast(flag, 0)
    if flag[0] != 1:
        raise RuntimeError(f"{path} did not appear within {WAIT_S} s")


def hold(rank, save_dir, ready, go, params_path):
    model, opt = model_and_optimizer()
    train_step(model, opt, rank, 1)
    mxt.save_checkpoint(save_dir, model, opt, 1)
    if rank == 0:
        write_atomically(ready, str(os.getpid()))
    wait_for_file(go, rank)
    for step in (2, 3):
        train_step(model, opt, rank, step)
        mxt.save_checkpoint(save_dir, model, opt, step)
    if rank == 0:
        torch.save({name: p.detach().clone() for name, p in model.registered_params()}, params_path)
    print(f"rank {rank} held {save_dir} and saved iterations 1, 2 and 3", flush=True)


def intrude(rank, save_dir):
    model, opt = model_and_optimizer()
    train_step(model, opt, rank, 1)
    try:
        mxt.save_checkpoint(save_dir, model, opt, 99)
    except mxddp.Error as e:
        # One write of the whole line: print() writes the text and its newline apart, and mpirun,
        # forwarding both ranks' output, once put rank 1's line between rank 0's text and newline.
        sys.stdout.write(f"rank {rank} refused: {e}\n")
        sys.stdout.flush()
        return 0
    print(f"rank {rank} saved iteration 99 into {save_dir}, which another run holds", flush=True)
    return 3


def resume(rank, save_dir, params_path):
    model, opt = model_and_optimizer()
    iteration, _ = mxt.load_checkpoint(save_dir, model, opt)
    assert iteration == 3, iteration
    saved = torch.load(params_path)
    for name, p in model.registered_params():
        assert torch.equal(p.detach(), saved[name]), f"{name} is not the first run's"
    train_step(model, opt, rank, 4)
    mxt.save_checkpoint(save_dir, model, opt, 4)
    print(f"rank {rank} resumed the first run's iteration 3 and saved 4", flush=True)


def main(argv):
    rank, _ = mxt.init(timeout_s=WAIT_S + 60)
    torch.set_num_threads(1)
    mode, args = argv[1], argv[2:]
    if mode == "hold":
        hold(rank, *args)
    elif mode == "intrude":
        return intrude(rank, *args)
    elif mode == "resume":
        resume(rank, *args)
    else:
        raise SystemExit(f"unknown mode {mode!r}; valid: hold, intrude, resume")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
