"""Where a wrapped module's buffers live (mxddp/torch/device.py): the checks and the choice of engine
that run before any device is touched, so they hold on a machine without a GPU too. What runs on a
GPU is cuda_job.py's (scripts/gpu_check.sh)."""
import pytest
import torch

import mxddp
import mxddp.torch as mxt
from mxddp import _C
from mxddp.torch import device

GPU_A, GPU_B = b"a" * 32, b"b" * 32


def test_distinct_gpus_take_nccl_and_shared_ones_are_staged():
    assert device.choose_engine([GPU_A, GPU_B], nccl_built=True, requested=None) == "nccl"
    assert device.choose_engine([GPU_A], nccl_built=True, requested=None) == "nccl"
    assert device.choose_engine([GPU_A, GPU_A], nccl_built=True, requested=None) == "staged"
    assert device.choose_engine([GPU_A, GPU_B, GPU_A], nccl_built=True, requested=None) == "staged"
    assert device.choose_engine([GPU_A, GPU_B], nccl_built=False, requested=None) == "staged"


def test_the_requested_engine_wins_where_it_can_run():
    assert device.choose_engine([GPU_A, GPU_B], nccl_built=True, requested="staged") == "staged"
    assert device.choose_engine([GPU_A, GPU_B], nccl_built=True, requested="nccl") == "nccl"
    with pytest.raises(RuntimeError, match="ranks of the group share a GPU.*valid here: staged"):
        device.choose_engine([GPU_A, GPU_A], nccl_built=True, requested="nccl")
    with pytest.raises(RuntimeError, match="has no NCCL communicator.*valid here: staged"):
        device.choose_engine([GPU_A, GPU_B], nccl_built=False, requested="nccl")
    with pytest.raises(ValueError, match="MXDDP_DEVICE_ENGINE='gloo' is not a device engine; valid: nccl, staged"):
        device.choose_engine([GPU_A], nccl_built=True, requested="gloo")


def test_params_on_two_devices_are_refused_naming_both():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, device="meta"))
    with pytest.raises(ValueError, match=r"param '1.weight' is on meta but '0.weight' is on cpu: .*one device"):
        device.params_device(list(module.named_parameters()))
    assert device.params_device(list(torch.nn.Linear(2, 2).named_parameters())) == torch.device("cpu")


def test_a_meta_module_is_refused_by_the_wrapper(ranks):
    module = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="meta device, which holds no values to train"):
        mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(use_distributed_optimizer=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_a_gpu_this_process_cannot_use_is_refused_with_cuda_s_reason():
    count, why = _C.cuda_devices()
    assert count == 0 and why, "with no usable GPU, CUDA's (or the build's) reason is given"
    with pytest.raises(RuntimeError, match="the module is on cuda:0, but") as refused:
        device.check_usable(torch.device("cuda", 0))
    assert why in str(refused.value)


def test_the_device_group_entry_point_checks_its_arguments(ranks):
    with pytest.raises(mxddp.Error, match="device engine 'gloo' is not one of: nccl, staged"):
        _C.add_device_group(None, 0, 0, "gloo")
    if _C.built_with_cuda() and _C.cuda_devices()[0] == 0:
        with pytest.raises(mxddp.Error, match="CUDA device 0 is not usable here: "):
            _C.add_device_group(None, 0, 0, "staged")
    elif not _C.built_with_cuda():
        with pytest.raises(mxddp.Error, match="no CUDA layer"):
            _C.add_device_group(None, 0, 0, "staged")


def test_a_cpu_module_keeps_the_host_communicator(ranks):
    host = _C.world_communicator()
    assert device.communicator_for(None, host, torch.device("cpu")) is host
    assert host.device == "cpu"


def test_ranks_agree_on_the_kind_of_device_and_on_a_gpu_on_its_settings(monkeypatch):
    monkeypatch.setenv("MXDDP_DEVICE_ENGINE", "staged")
    assert device.agreement_items(torch.device("cpu")) == [("device", "cpu")], "the engine is no CPU model's concern"
    items = dict(device.agreement_items(torch.device("cuda", 3)))
    assert items["device"] == "cuda", "the index may differ between ranks (rank r on cuda:r)"
    assert items["MXDDP_DEVICE_ENGINE"] == "'staged'"
