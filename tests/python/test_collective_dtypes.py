"""mxt.all_reduce and mxt.broadcast take every dtype torch DDP users reduce (issue 44, item 4):
float64 metrics, int64/int32 counts, bool flags, uint8, beside float32/bfloat16. Each result is
checked against torch.distributed over gloo on the same inputs (the conftest's reference group),
and the ops torch refuses for integers (avg) are refused with mxddp's error naming the dtype.

    mpirun -np 2 python -m pytest tests/python/test_collective_dtypes.py
"""
import pytest
import torch
import torch.distributed as dist

import mxddp.torch as mxt

DTYPES = [torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8, torch.float32]


def _input(dtype, rank, n=37):
    i = torch.arange(n)
    if dtype == torch.bool:
        return (i % 3) == rank  # a flag set on one rank, or on none
    if dtype.is_floating_point:
        # float64: 2^-40 parts, lost if it were reduced through float32. Quarters alone otherwise, which
        # sum exactly in any order (gloo's and mxddp's differ from 3 ranks on).
        tiny = (rank + 1) * 2.0**-40 if dtype == torch.float64 else 0.0
        return ((i * 11 + rank * 37) % 64 - 32).to(dtype) / 4 + tiny
    if dtype == torch.uint8:
        return ((i * 11 + rank * 37) % 100).to(dtype)
    big = 2**33 if dtype == torch.int64 else 2**20
    return (((i * 11 + rank * 37) % 64 - 32) * big + rank).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "max"])
def test_all_reduce_matches_gloo(ranks, dtype, op):
    rank, world = ranks
    ours = _input(dtype, rank)
    mxt.all_reduce(ours, op)
    if dtype == torch.bool:
        want = torch.zeros_like(ours)
        for r in range(world):
            want |= _input(dtype, r)  # sum and max of flags: a logical or
    elif dtype == torch.uint8 and op == "sum":
        want = sum(_input(dtype, r).to(torch.int64) for r in range(world)).remainder(256).to(dtype)  # wraps
    else:
        want = _input(dtype, rank)
        dist.all_reduce(want, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    assert ours.dtype == dtype
    assert torch.equal(ours, want), (dtype, op, ours, want)


def test_float64_avg(ranks):
    rank, world = ranks
    ours = _input(torch.float64, rank)
    mxt.all_reduce(ours, "avg")
    want = sum(_input(torch.float64, r) for r in range(world)) / world
    assert torch.equal(ours, want)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8], ids=str)
def test_avg_of_integers_is_refused(ranks, dtype):
    with pytest.raises(ValueError, match=rf"op 'avg' is for floating-point tensors; this one is {dtype}"):
        mxt.all_reduce(_input(dtype, ranks[0]), "avg")


@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16], ids=str)
def test_broadcast(ranks, dtype):
    rank, world = ranks
    root = world - 1
    t = _input(dtype, rank)
    mxt.broadcast(t, root=root)
    assert torch.equal(t, _input(dtype, root))


def test_other_dtypes_are_refused_naming_the_valid_ones(ranks):
    with pytest.raises(TypeError, match="dtype torch.float16 is not taken; valid: torch.float32, torch.bfloat16, "
                                        "torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool"):
        mxt.all_reduce(torch.zeros(4, dtype=torch.float16))


def test_a_non_contiguous_tensor_is_refused_not_reduced_into_a_copy(ranks):
    """Before this check the binding reduced a contiguous copy and the tensor kept its own values."""
    rank, _ = ranks
    base = torch.full((3, 4), float(rank + 1))
    with pytest.raises(ValueError, match=r"all_reduce: the tensor is not contiguous \(shape \[4, 3\], strides \[1, 4\]\)"):
        mxt.all_reduce(base.t())
    with pytest.raises(ValueError, match=r"broadcast: the tensor is not contiguous \(shape \[3, 2\]"):
        mxt.broadcast(base[:, ::2])
    assert torch.equal(base, torch.full((3, 4), float(rank + 1)))
    row = base[1:2]  # contiguous, at an offset: reduced in place
    mxt.all_reduce(row)
    assert base[:, 0].tolist() == [rank + 1, sum(r + 1 for r in range(ranks[1])), rank + 1]


def test_torch_reduce_ops_and_bad_arguments(ranks):
    rank, world = ranks
    total = sum(r + 1 for r in range(world))
    for op, want in ((dist.ReduceOp.SUM, total), (dist.ReduceOp.AVG, total / world), (dist.ReduceOp.MAX, world)):
        t = torch.full((5,), float(rank + 1))
        mxt.all_reduce(t, op)
        assert torch.equal(t, torch.full((5,), float(want))), op
    with pytest.raises(ValueError, match=r"op='min' is not taken; valid: 'sum', 'avg', 'max'"):
        mxt.all_reduce(torch.zeros(2), "min")
    with pytest.raises(ValueError, match="op=.*PRODUCT.* is not taken"):
        mxt.all_reduce(torch.zeros(2), dist.ReduceOp.PRODUCT)
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor; got list"):
        mxt.all_reduce([1.0])
