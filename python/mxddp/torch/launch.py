"""Ranks: one MPI process per rank, started by ``mpirun -np N python script.py``.

``init()`` starts MPI and mxddp's world communicator once per process and tears both down at
interpreter exit (after closing every DistributedDataParallel and DistributedOptimizer still open,
since MPI must outlive them, and releasing the checkpoint directory locks the run holds).
"""
from __future__ import annotations

import atexit
import os
import sys
import weakref

from mxddp import _C

# Set by OpenMPI's mpirun (which the package's MPI is) in every rank's environment.
_MPI_LAUNCHER_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK")

# Every open DDP / optimizer wrapper, closed (optimizers first) before MPI is finalized.
_open_optimizers: "weakref.WeakSet" = weakref.WeakSet()
_open_models: "weakref.WeakSet" = weakref.WeakSet()
_atexit_registered = False


def _launched_by_mpi() -> bool:
    return any(name in os.environ for name in _MPI_LAUNCHER_ENV)


def init(timeout_s: float = 300.0, *, collective_delay_us: tuple[int, int] | None = None) -> tuple[int, int]:
    """Starts MPI (once per process) and returns ``(rank, world_size)``.

    timeout_s: how long a collective may make no progress before the watchdog names it and the
    ranks it waits on and ends the job (MPI cannot cancel a stalled collective).
    collective_delay_us: ``(min, max)`` for tests of overlap: every all-reduce, reduce-scatter and
    all-gather starts after a delay drawn uniformly from [min, max] microseconds on each rank (as
    a straggler or a slow link would make it), so ranks reach collectives in varying order.

    Under ``torchrun`` (RANK and WORLD_SIZE set, no MPI launcher) this raises: mxddp's ranks are
    MPI processes. A plain ``python script.py`` is one rank (world size 1).
    """
    global _atexit_registered
    if not _launched_by_mpi() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise RuntimeError(
            "mxddp.torch.init(): this process was started by torchrun or a launcher like it "
            f"(RANK={os.environ['RANK']}, WORLD_SIZE={os.environ['WORLD_SIZE']}) and not by MPI; mxddp's ranks "
            "are MPI processes: launch with `mpirun -np N python script.py` "
            "(as root add --allow-run-as-root; on a machine with fewer cores than N add --oversubscribe)")
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number > 0; got {timeout_s!r}")
    delay = (0, 0) if collective_delay_us is None else collective_delay_us
    if not (isinstance(delay, tuple) and len(delay) == 2 and all(isinstance(d, int) and not isinstance(d, bool)
                                                                  for d in delay) and 0 <= delay[0] <= delay[1]):
        raise ValueError(f"collective_delay_us must be None or (min, max) ints with 0 <= min <= max; got "
                         f"{collective_delay_us!r}")
    rank, world = _C.init_mpi(int(timeout_s * 1000), delay[0], delay[1])
    if not _atexit_registered:
        atexit.register(shutdown)
        _install_abort_on_uncaught_exception()
        _atexit_registered = True
    return rank, world


def _install_abort_on_uncaught_exception() -> None:
    """A rank whose script dies of an exception ends the whole job at once (MPI_Abort), after its
    traceback: otherwise the other ranks would wait in their next collective until the watchdog's
    timeout, and MPI_Finalize at exit could wait on them too."""
    previous = sys.excepthook

    def abort_job(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if _C.is_initialized() and _C.world_size() > 1:
            sys.stderr.write(f"mxddp: rank {_C.rank()} raised {exc_type.__name__}; ending the job (MPI_Abort) "
                             "so that the other ranks do not wait for it\n")
            sys.stderr.flush()
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
    save into each, so that no other run writes them meanwhile) and finalizes MPI. Runs at
    interpreter exit; MPI cannot be started again after it."""
    _C.release_save_locks()
    for opt in list(_open_optimizers):
        opt.close()
    for model in list(_open_models):
        model._close_at_exit()
    _C.finalize()


def _track_model(model) -> None:
    _open_models.add(model)


def _track_optimizer(opt) -> None:
    _open_optimizers.add(opt)
