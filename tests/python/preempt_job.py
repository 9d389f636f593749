"""One job of CTest's python_preemption_sigusr1_mpirun (run_preempt.sh): docs/python.md's
preemption recipe in a user's training loop. A Python signal handler only sets a flag; after
each iteration every rank agrees on it with a max all-reduce, so all ranks stop after the same
iteration, save it with mxt.save_checkpoint and end normally (exit 0).

usage (under mpirun -np 2):
  preempt_job.py train DIR PARAMS   trains up to MAX_ITERATIONS (rank 0 prints "iteration N done"
                                    after each); on SIGUSR1 or SIGTERM every rank saves the
                                    current iteration into DIR, rank 0 writes its params to
                                    PARAMS, and each prints "rank R stopped after iteration N"
  preempt_job.py resume DIR PARAMS  loads DIR's newest save (its params must equal PARAMS'),
                                    prints "rank R loaded iteration N", trains and saves N + 1
"""
import signal
import sys
import time

import torch

import mxddp.torch as mxt

MAX_ITERATIONS = 600  # far more than the test lets run: it must end by the signal
STEP_SLEEP_S = 0.05   # inside each iteration, so that the signal lands mid-iteration

# The signal this rank received (0: none). The handler only records it: saving inside a handler
# would run collectives at an arbitrary point of the iteration, out of step with the other ranks.
_received_signal = 0


def _record_signal(signum, _frame):
    global _received_signal
    _received_signal = signum


def install_preemption_handler():
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, _record_signal)


def any_rank_signalled() -> bool:
    """Collective: true on every rank when any rank has received a signal (all_reduce takes
    float32 or bfloat16 tensors, so the flag is a float)."""
    flag = torch.tensor([1.0 if _received_signal else 0.0])
    mxt.all_reduce(flag, op="max")
    return flag.item() > 0


def model_and_optimizer():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True))
    return model, mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-2))


def train_iteration(model, opt, rank, iteration):
    opt.zero_grad()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * iteration + rank))
    model(x).square().mean().backward()
    time.sleep(STEP_SLEEP_S)
    model.finish_grad_sync()
    assert opt.step()[0], f"iteration {iteration}: the step was skipped"


def params_of(model):
    return {name: p.detach().clone() for name, p in model.registered_params()}


def train(rank, save_dir, params_path):
    model, opt = model_and_optimizer()
    for iteration in range(1, MAX_ITERATIONS + 1):
        train_iteration(model, opt, rank, iteration)
        if rank == 0:
            print(f"iteration {iteration} done", flush=True)
        if any_rank_signalled():
            mxt.save_checkpoint(save_dir, model, opt, iteration)
            if rank == 0:
                torch.save(params_of(model), params_path)
            name = signal.Signals(_received_signal).name if _received_signal else "no signal here"
            print(f"rank {rank} stopped after iteration {iteration} ({name}) and saved it", flush=True)
            return
    print(f"rank {rank} ran all {MAX_ITERATIONS} iterations without a signal", flush=True)


def resume(rank, save_dir, params_path):
    model, opt = model_and_optimizer()
    iteration, _metadata = mxt.load_checkpoint(save_dir, model, opt)
    expected = torch.load(params_path)
    for name, value in params_of(model).items():
        if not torch.equal(value, expected[name]):
            raise RuntimeError(f"param '{name}' loaded from {save_dir} differs from the params at the stop")
    print(f"rank {rank} loaded iteration {iteration}", flush=True)
    train_iteration(model, opt, rank, iteration + 1)
    mxt.save_checkpoint(save_dir, model, opt, iteration + 1)
    print(f"rank {rank} continued to iteration {iteration + 1}", flush=True)


def main():
    mode, save_dir, params_path = sys.argv[1:4]
    if mode == "train":
        install_preemption_handler()  # first: a signal before it would end the process
    rank, _world = mxt.init()
    {"train": train, "resume": resume}[mode](rank, save_dir, params_path)


if __name__ == "__main__":
    main()
