"""Ranks: MPI processes (``mpirun -np N python script.py``) or torch.distributed's
(``torchrun --nproc_per_node N script.py``, ``srun``, or a script's own ``init_process_group``).

``init()`` picks the runtime once per process:
  - torch.distributed already initialized: mxddp's world communicator runs on its default group
    (``process_group.py``: a private gloo duplicate of it);
  - else, started by mpirun (OpenMPI's environment): MPI, as before;
  - else, started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set): init calls
    ``torch.distributed.init_process_group("gloo")`` itself, then as above;
  - else, started by srun without MPI (SLURM_PROCID and SLURM_NTASKS set, more than one task):
    the same, rank and world size taken from SLURM_PROCID and SLURM_NTASKS; MASTER_ADDR and
    MASTER_PORT must be exported by the batch script (e.g. the first host of
    ``scontrol show hostnames $SLURM_JOB_NODELIST`` and a free port). ``srun --mpi=pmix`` is an MPI
    launch (PMIX_RANK set) and takes the MPI path;
  - else a plain ``python script.py``: one MPI rank (world size 1).
A script that never calls ``init()`` gets it from its first DistributedDataParallel (through
``process_group.communicator_for``). The runtime is torn down at interpreter exit (after closing
every DistributedDataParallel and DistributedOptimizer still open, since the communicators must
outlive them, and releasing the checkpoint directory locks the run holds).
"""
from __future__ import annotations

import atexit
import os
import sys
import traceback
import weakref

from mxddp import _C

# Set by OpenMPI's mpirun (which the package's MPI is) in every rank's environment.
_MPI_LAUNCHER_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Every open DDP / optimizer wrapper, closed (optimizers first) before the runtime is finalized.
_open_optimizers: "weakref.WeakSet" = weakref.WeakSet()
_open_models: "weakref.WeakSet" = weakref.WeakSet()
_atexit_registered = False
_timeout_s = 300.0  # the live runtime's (process_group.py gives it to the groups it adds)


def _launched_by_mpi() -> bool:
    return any(name in os.environ for name in _MPI_LAUNCHER_ENV)


def _torch_distributed_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _slurm_tasks() -> int:
    try:
        return int(os.environ.get("SLURM_NTASKS", "1"))
    except ValueError:
        raise ValueError(f"SLURM_NTASKS={os.environ['SLURM_NTASKS']!r} is not an integer") from None


def _start_torch_distributed(timeout_s: float) -> None:
    """init_process_group("gloo") for torchrun or srun, naming what is missing when it cannot."""
    import datetime

    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch has no torch.distributed; mxddp cannot run on torchrun's ranks with it "
                           "(launch with mpirun instead)")
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        missing = [n for n in _TORCHRUN_ENV if n not in os.environ]
        if missing:
            raise RuntimeError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} not: torch.distributed needs "
                               "all of RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun sets them)")
        dist.init_process_group("gloo", timeout=timeout)
        return
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if n not in os.environ]
    if missing:
        raise RuntimeError(f"started by srun with SLURM_NTASKS={_slurm_tasks()} but {', '.join(missing)} not set: "
                           "export MASTER_ADDR (the first host of the job) and MASTER_PORT (a free port) for "
                           "torch.distributed, or launch MPI ranks with srun --mpi=pmix")
    dist.init_process_group("gloo", init_method="env://", rank=int(os.environ["SLURM_PROCID"]),
                            world_size=_slurm_tasks(), timeout=timeout)


def _wants_torch_distributed() -> bool:
    if _torch_distributed_initialized():
        return True
    if _launched_by_mpi():
        return False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return "SLURM_PROCID" in os.environ and _slurm_tasks() > 1


def init(timeout_s: float = 300.0, *, collective_delay_us: tuple[int, int] | None = None) -> tuple[int, int]:
    """Starts mxddp's runtime (once per process; see the module's text for which) and returns
    ``(rank, world_size)``.

    timeout_s: under MPI, how long a collective may make no progress before the watchdog names it
    and the ranks it waits on and ends the job (MPI cannot cancel a stalled collective); under
    torch.distributed, the gloo timeout of mxddp's groups (a collective that long unfinished fails
    with torch's error) and of the default group if init creates it.
    collective_delay_us: ``(min, max)`` for tests of overlap: every all-reduce, reduce-scatter and
    all-gather starts after a delay drawn uniformly from [min, max] microseconds on each rank (as
    a straggler or a slow link would make it), so ranks reach collectives in varying order.
    """
    global _atexit_registered, _timeout_s
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number > 0; got {timeout_s!r}")
    delay = (0, 0) if collective_delay_us is None else collective_delay_us
    if not (isinstance(delay, tuple) and len(delay) == 2 and all(isinstance(d, int) and not isinstance(d, bool)
                                                                  for d in delay) and 0 <= delay[0] <= delay[1]):
        raise ValueError(f"collective_delay_us must be None or (min, max) ints with 0 <= min <= max; got "
                         f"{collective_delay_us!r}")
    timeout_ms = int(timeout_s * 1000)
    if _C.is_initialized():  # the same pair, or the C++ runtime's error naming what differs
        init_again = _C.init_mpi if _C.backend() == "mpi" else (lambda *a: _C.init_torch(None, 0, 1, *a))
        return init_again(timeout_ms, delay[0], delay[1])
    if _wants_torch_distributed():
        from mxddp.torch import process_group

        if not _torch_distributed_initialized():
            _start_torch_distributed(timeout_s)
        import torch.distributed as dist

        default_group = dist.distributed_c10d._get_default_group()
        runner, rank, world = process_group.private_runner(default_group, timeout_s)
        rank, world = _C.init_torch(runner, rank, world, timeout_ms, delay[0], delay[1])
        process_group.note_ring_transport(default_group, runner)
    else:
        rank, world = _C.init_mpi(timeout_ms, delay[0], delay[1])
    _timeout_s = float(timeout_s)
    if not _atexit_registered:
        atexit.register(shutdown)
        _install_abort_on_uncaught_exception()
        _atexit_registered = True
    return rank, world


def timeout_s() -> float:
    """The live runtime's timeout_s (init's)."""
    return _timeout_s


def backend() -> str:
    """What mxddp's world communicator runs on: "mpi" or "torch" (torch.distributed's default group)."""
    return _C.backend()


def _install_abort_on_uncaught_exception() -> None:
    """A rank whose script dies of an exception ends at once, after its traceback: under MPI the
    whole job (MPI_Abort); under torch.distributed this process, without draining its collectives
    (its peers may never come to them), and torchrun ends the other workers when it sees one fail.
    Otherwise the other ranks would wait in their next collective until the timeout, and this
    rank's exit could wait on them too."""
    previous = sys.excepthook

    def abort_job(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if _C.is_initialized() and _C.world_size() > 1:
            err = sys.stderr
            if sys.__stderr__ is not None and err is not sys.__stderr__:
                # A hook installed after this one may have sent stderr to a buffer it prints once
                # this returns (torch.distributed's, from init_process_group): it never will, so the
                # traceback goes to the process's own stderr too.
                err = sys.__stderr__
                err.write("".join(traceback.format_exception(exc_type, exc, tb)))
            how = "ending the job (MPI_Abort)" if _C.backend() == "mpi" else "ending this process (the launcher ends the others)"
            err.write(f"mxddp: rank {_C.rank()} raised {exc_type.__name__}; {how} "
                      "so that the other ranks do not wait for it\n")
            err.flush()
            sys.stdout.flush()
            _C.release_save_locks()
            _C.abort(1)

    sys.excepthook = abort_job


def is_initialized() -> bool:
    return _C.is_initialized()


def rank() -> int:
    return _C.rank()


def world_size() -> int:
    return _C.world_size()


def shutdown() -> None:
    """Closes every open optimizer and DDP (their params keep their values in storage of their
    own), releases the locks of the checkpoint histories this run saved into (held since its first
    save into each, so that no other run writes them meanwhile) and finalizes the runtime: its
    communicators drained (under torch.distributed, while Python still runs: they call it) and MPI
    finalized if it ran. Runs at interpreter exit; MPI cannot be started again after it (a
    torch.distributed runtime can, by init())."""
    from mxddp.torch import device, process_group

    _C.release_save_locks()
    for opt in list(_open_optimizers):
        opt.close()
    for model in list(_open_models):
        model._close_at_exit()
    process_group.forget_communicators()
    device.forget_communicators()
    _C.finalize()


def _track_model(model) -> None:
    _open_models.add(model)


def _track_optimizer(opt) -> None:
    _open_optimizers.add(opt)
