"""Bad input gets a clear error naming what is wrong and what would do."""
import copy
import io
import os
import subprocess
import sys

import pytest
import torch

import mxddp
import mxddp.torch as mxt


def ddp_config(**kw):
    return mxt.DistributedDataParallelConfig(use_distributed_optimizer=True, **kw)


def test_module_without_trainable_params(ranks):
    with pytest.raises(ValueError, match="has no trainable parameters"):
        mxt.DistributedDataParallel(torch.nn.ReLU(), ddp_config())
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="has no trainable parameters.*2 frozen"):
        mxt.DistributedDataParallel(frozen, ddp_config())


@pytest.mark.parametrize("field,value,message", [
    ("fp8_param_gather", True, "fp8_param_gather=True needs use_distributed_optimizer=True"),
    ("reuse_grad_buf_for_mxfp8_param_ag", True, "reuse_grad_buf_for_mxfp8_param_ag=True needs fp8_param_gather=True"),
    ("overlap_param_gather", True, "overlap_param_gather=True needs use_distributed_optimizer=True"),
    ("align_param_gather", True, "align_param_gather=True is not supported.*pipeline"),
    ("use_megatron_fsdp", True, "use_megatron_fsdp=True needs use_distributed_optimizer=True"),
    ("data_parallel_sharding_strategy", "optim_grads", "data_parallel_sharding_strategy='optim_grads'"),
    ("num_distributed_optimizer_instances", 2, "num_distributed_optimizer_instances=2"),
    ("nccl_ub", True, "nccl_ub=True"),
    ("bucket_size", 0, r"bucket_size must be None or an int in \[1, 2\*\*63 - 1\] \(elements\); got 0"),
    ("bucket_size", 2 ** 63, r"bucket_size must be None or an int in \[1, 2\*\*63 - 1\].*; got 9223372036854775808"),
    ("buckets_per_group", 0, r"buckets_per_group must be an int in \[1, 2\*\*31 - 1\]; got 0"),
    ("buckets_per_group", 2 ** 31, r"buckets_per_group must be an int in \[1, 2\*\*31 - 1\]; got 2147483648"),
])
def test_unsupported_ddp_config_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        mxt.DistributedDataParallelConfig(**{field: value})


def test_ddp_config_types_and_unknown_fields():
    with pytest.raises(TypeError, match="overlap_grad_reduce must be a bool"):
        mxt.DistributedDataParallelConfig(overlap_grad_reduce="yes")
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_field'"):
        mxt.DistributedDataParallelConfig(no_such_field=1)


def test_optimizer_config_values(ranks):
    with pytest.raises(ValueError, match="lr must be set"):
        mxt.OptimizerConfig()
    with pytest.raises(ValueError, match="optimizer='lamb' is not supported; valid: 'adam', 'sgd'"):
        mxt.OptimizerConfig(optimizer="lamb", lr=1.0)
    # Beyond a double: named by its size (Python prints no int of more than 4300 digits), not an
    # OverflowError once the C++ optimizer takes it.
    with pytest.raises(TypeError, match="lr must be a number a float holds; got an int of 1329 bits"):
        mxt.OptimizerConfig(lr=10**400)
    with pytest.raises(TypeError, match="min_lr must be None or a number a float holds; got an int of 16610 bits"):
        mxt.OptimizerConfig(lr=1.0, min_lr=-10**5000)
    model = mxt.DistributedDataParallel(torch.nn.Linear(4, 4), ddp_config())
    try:
        with pytest.raises(mxddp.Error, match="adam_beta1"):
            mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-3, adam_beta1=1.0))
    finally:
        model.close()
    # Without use_distributed_optimizer the optimizer is replicated (every rank updates every param).
    plain = mxt.DistributedDataParallel(torch.nn.Linear(4, 4), mxt.DistributedDataParallelConfig())
    try:
        mxt.DistributedOptimizer(plain, mxt.OptimizerConfig(lr=1e-3)).close()
    finally:
        plain.close()


def test_non_contiguous_param(ranks):
    lin = torch.nn.Linear(8, 4)
    lin.weight = torch.nn.Parameter(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match=r"param 'weight' is not contiguous \(shape \(4, 8\), strides \(1, 4\)\)"):
        mxt.DistributedDataParallel(lin, ddp_config())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_dtype_not_taken(ranks, dtype):
    with pytest.raises(TypeError, match=f"param 'weight' has dtype {dtype}, which mxddp does not take; "
                                        "valid: torch.float32, torch.bfloat16"):
        mxt.DistributedDataParallel(torch.nn.Linear(4, 4).to(dtype), ddp_config())


def test_mixed_dtypes_and_shared_storage(ranks):
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(TypeError, match="param '1.weight' is torch.bfloat16 but '0.weight' is torch.float32"):
        mxt.DistributedDataParallel(seq, ddp_config())
    whole = torch.randn(2, 4, 4)
    two = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    two[0].weight = torch.nn.Parameter(whole[0])
    two[1].weight = torch.nn.Parameter(whole[1])
    with pytest.raises(ValueError, match="params '0.weight' and '1.weight' share storage"):
        mxt.DistributedDataParallel(two, ddp_config())


def test_step_before_backward_and_before_finish_grad_sync(ranks):
    rank, _ = ranks
    model = mxt.DistributedDataParallel(torch.nn.Linear(4, 4), ddp_config(overlap_grad_reduce=True))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-3))
    try:
        with pytest.raises(RuntimeError, match=r"step\(\) was called before any backward"):
            opt.step()
        model(torch.ones(2, 4) * (rank + 1)).sum().backward()
        with pytest.raises(RuntimeError, match=r"call model.finish_grad_sync\(\)"):
            opt.step()
        model.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok and norm > 0
        opt.zero_grad()
        with pytest.raises(RuntimeError, match=r"step\(\) was called before any backward"):
            opt.step()
        with pytest.raises(RuntimeError, match="close the DistributedOptimizer before"):
            model.close()
    finally:
        opt.close()
        model.close()


def _run_plain_python(code, **env_extra):
    """A child Python outside mpirun: the MPI launcher's variables removed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_"))}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_torchrun_variables_without_master_are_refused_by_name():
    r = _run_plain_python("import mxddp.torch as mxt; mxt.init()", RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    assert r.returncode != 0
    assert "RANK and WORLD_SIZE are set but MASTER_ADDR, MASTER_PORT not" in r.stderr, r.stderr


def test_wrapping_without_init_runs_as_one_rank():
    # torch DDP scripts never call mxt.init(): the first wrapper initializes mxddp (a plain process is
    # one rank), so a port changes its wrap lines only.
    r = _run_plain_python("import torch, mxddp.torch as mxt; m = mxt.DistributedDataParallel(torch.nn.Linear(2, 2)); "
                          "print('world', mxt.world_size(), 'rank', mxt.rank())")
    assert r.returncode == 0, r.stderr
    assert "world 1 rank 0" in r.stdout, r.stdout


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_torch_ddp_api_mxddp_lacks_is_refused_naming_what_to_do(ranks, kind):
    """A torch DDP script's join() (uneven inputs), register_comm_hook, AveragedModel(model) or
    copy.deepcopy(model), and torch.save(model): each names what to do instead (before: a bare
    AttributeError, or "cannot pickle 'Communicator' object")."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model = mxt.DistributedDataParallel(module) if kind == "ddp" else mxt.FullyShardedDataParallel(
        module, mxt.DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True),
        fsdp_unit_modules=[torch.nn.Linear])
    try:
        with pytest.raises(NotImplementedError, match=r"join\(\) \(torch DDP's uneven inputs\) is not supported.*"
                                                      "drop_last=True"):
            model.join()
        with pytest.raises(NotImplementedError, match=r"join\(\)"):
            model.join_hook()
        with pytest.raises(NotImplementedError, match=r"register_comm_hook\(\) is not supported"):
            model.register_comm_hook(None, lambda state, bucket: None)
        with pytest.raises(TypeError, match=r"copy.deepcopy of a mxddp.torch .*AveragedModel\(model.module\)"):
            torch.optim.swa_utils.AveragedModel(model)
        with pytest.raises(TypeError, match=r"pickling a mxddp.torch .*torch.save\(model.module\)"):
            torch.save(model, io.BytesIO())
        copy.deepcopy(model.module)  # the way out works
    finally:
        model.close()
