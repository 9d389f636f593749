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
        # 2^-40 parts: lost if a float64 were reduced through float32
        return ((i * 11 + rank * 37) % 64 - 32).to(dtype) / 4 + (rank + 1) * 2.0**-40
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
    with pytest.raises(Exception, match=r"avg is defined for f32 and bf16, and f64 \(floats only\); got"):
        mxt.all_reduce(_input(dtype, ranks[0]), "avg")


@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16], ids=str)
def test_broadcast(ranks, dtype):
    rank, world = ranks
    root = world - 1
    t = _input(dtype, rank)
    mxt.broadcast(t, root=root)
    assert torch.equal(t, _input(dtype, root))


def test_other_dtypes_are_refused_naming_the_valid_ones(ranks):
    with pytest.raises(Exception, match="valid: float32, bfloat16, float64, int64, int32, uint8, bool"):
        mxt.all_reduce(torch.zeros(4, dtype=torch.float16))
