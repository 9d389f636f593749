"""Set-up for the torchrun tests (tests/python/run_torchrun.sh runs each file under torchrun). Under
mpirun (the python_mpirun_np* suites collect this folder too) every test here skips."""
import os

import pytest
import torch


@pytest.fixture(scope="session")
def torchrun_ranks():
    """(rank, world) of mxddp on torch.distributed, started by mxt.init() under torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        pytest.skip("run under torchrun: tests/python/run_torchrun.sh")
    import mxddp.torch as mxt

    torch.set_num_threads(1)
    return mxt.init(timeout_s=60)
