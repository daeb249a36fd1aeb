"""uint8, int8, int16 and bool through every layer, against numpy on data gathered by mpi4py.

Reduction semantics (docs/compatibility.md): integers wrap around as numpy's
fixed-width integers do; bool reduces as logical or (sum, max) and logical
and (min, product). Integer averages and scale factors of pycomm.horovod
follow Horovod: the factor applied in float64, the result truncated toward zero.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import pycomm
import pycomm.horovod as hvd
from torch_worlds import pycomm_world

NEW = [torch.uint8, torch.int8, torch.int16, torch.bool]
NP = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.bool: np.bool_,
      torch.int32: np.int32, torch.int64: np.int64}
# 0, 1, odd, not divisible by 1..4 ranks nor by 8/32 or a SIMD width, and above one ring chunk.
COUNTS = [0, 1, 3, 13, 1001, 300_007]


def fresh(count, dtype, salt=0):
    """Fresh random data of this rank (full range: sums and products wrap)."""
    rng = np.random.default_rng()
    if dtype == torch.bool:
        x = rng.random(count) < 0.5
    else:
        info = np.iinfo(NP[dtype])
        x = rng.integers(info.min, info.max, size=count, endpoint=True, dtype=NP[dtype])
    return torch.from_numpy(np.ascontiguousarray(x))


def reference(comm, x, op):
    """numpy's reduction of every rank's x (fixed width: wraps like C; bool: any / all)."""
    stack = np.stack(comm.allgather(x.numpy()))
    if x.dtype == torch.bool:
        return stack.any(0) if op in ("sum", "max") else stack.all(0)
    if op == "sum":
        return np.add.reduce(stack, axis=0, dtype=stack.dtype)
    if op == "prod":
        return np.multiply.reduce(stack, axis=0, dtype=stack.dtype)
    return stack.min(0) if op == "min" else stack.max(0)


@pytest.fixture(scope="module")
def world():
    with pycomm_world():
        yield


def test_the_dtype_table_is_one_list():
    assert pycomm.collectives.SUPPORTED_DTYPES == tuple(getattr(torch, n) for n in pycomm._C.dtype_names)
    assert set(NEW) <= set(pycomm.collectives.SUPPORTED_DTYPES)


@pytest.mark.parametrize("algorithm", ["auto", "ring", "mpi", "shm"])
@pytest.mark.parametrize("op", ["sum", "min", "max"])
@pytest.mark.parametrize("dtype", NEW)
def test_allreduce_matches_numpy(comm, dtype, op, algorithm):
    if algorithm == "shm" and pycomm.num_nodes() > 1:
        pytest.skip("shm runs inside one node")
    for count in COUNTS:
        x = fresh(count, dtype)
        ref = reference(comm, x, op)
        y = pycomm.allreduce(x.clone(), op=op, algorithm=algorithm)
        assert y.dtype == dtype and np.array_equal(y.numpy(), ref), (dtype, op, algorithm, count)
        # the same bytes on every rank
        assert len({bytes(b) for b in comm.allgather(y.numpy().tobytes())}) == 1


@pytest.mark.parametrize("dtype", NEW)
def test_fused_grouped_allreduce_of_mixed_new_dtypes(comm, dtype):
    xs = [fresh(n, dtype) for n in (5, 1, 77, 0, 4099)]
    refs = [reference(comm, x, "sum") for x in xs]
    ys = pycomm.grouped_allreduce([x.clone() for x in xs], op="sum")
    for y, ref in zip(ys, refs):
        assert np.array_equal(y.numpy(), ref)


@pytest.mark.parametrize("dtype", NEW)
def test_broadcast_allgather_alltoall(comm, dtype):
    n, r = pycomm.size(), pycomm.rank()
    for count in (0, 1, 13, 1001):
        root = count % n
        x = fresh(count, dtype)
        expect = comm.bcast(x.numpy(), root=root)
        assert np.array_equal(pycomm.broadcast(x.clone(), root=root).numpy(), expect)
        rows = fresh(3 * (r + 1), dtype).reshape(-1, 3) if count else fresh(0, dtype).reshape(0, 3)
        assert np.array_equal(pycomm.allgather(rows).numpy(), np.concatenate(comm.allgather(rows.numpy())))
    parts = fresh(2 * n, dtype)
    got = pycomm.alltoall(parts)
    sent = comm.allgather(parts.numpy())
    assert np.array_equal(got.numpy(), np.concatenate([sent[k][2 * r:2 * r + 2] for k in range(n)]))


@pytest.mark.parametrize("dtype", NEW + [torch.int32])
@pytest.mark.parametrize("op", ["SUM", "MIN", "MAX", "PRODUCT"])
def test_c10d_all_reduce_including_product(world, comm, dtype, op):
    name = {"SUM": "sum", "MIN": "min", "MAX": "max", "PRODUCT": "prod"}[op]
    for count in (0, 1, 7, 1001):
        x = fresh(count, dtype)
        ref = reference(comm, x, name)
        y = x.clone()
        dist.all_reduce(y, op=getattr(dist.ReduceOp, op))
        assert np.array_equal(y.numpy(), ref), (dtype, op, count)


def test_c10d_object_collectives_use_uint8(world):
    n, r = dist.get_world_size(), dist.get_rank()
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "pad": "x" * (r * 37)})
    assert objs == [{"rank": k, "pad": "x" * (k * 37)} for k in range(n)]
    box = [f"from {n - 1}"] if r == n - 1 else [None]
    dist.broadcast_object_list(box, src=n - 1)
    assert box == [f"from {n - 1}"]


def trunc(a):
    """float64 -> integer toward zero (C's cast, Horovod's integer scaling)."""
    return np.trunc(a)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
def test_horovod_integer_average_and_scales(comm, dtype):
    n = hvd.size()
    for count in (1, 17, 1001):
        x = torch.from_numpy(np.random.default_rng().integers(-1000, 1000, size=count)).to(dtype)
        stack = np.stack(comm.allgather(x.numpy().astype(np.int64))).astype(np.float64)
        avg = hvd.allreduce(x, op=hvd.Average)
        assert avg.dtype == dtype and np.array_equal(avg.numpy(), trunc(stack.sum(0) * (1.0 / n)))
        f = float(np.random.default_rng(count).uniform(0.1, 3.0))  # the same on every rank
        pre = hvd.allreduce(x, op=hvd.Sum, prescale_factor=f)
        assert np.array_equal(pre.numpy(), trunc(stack * f).sum(0))
        post = hvd.allreduce(x, op=hvd.Sum, postscale_factor=f)
        assert np.array_equal(post.numpy(), trunc(stack.sum(0) * f))
        both = hvd.allreduce(x, op=hvd.Average, prescale_factor=f, postscale_factor=2.5)
        assert np.array_equal(both.numpy(), trunc(trunc(stack * f).sum(0) * (2.5 / n)))
    with pytest.raises(ValueError, match="prescale_factor/postscale_factor apply to hvd.Sum and hvd.Average"):
        hvd.allreduce(torch.ones(3, dtype=dtype), op=hvd.Max, prescale_factor=2.0)


def test_horovod_integer_reducescatter_average(comm):
    n, r = hvd.size(), hvd.rank()
    x = torch.from_numpy(np.random.default_rng().integers(-1000, 1000, size=(4 * n + 3, 5))).to(torch.int32)
    stack = np.stack(comm.allgather(x.numpy())).astype(np.float64)
    parts = np.array_split(trunc(stack.sum(0) * (1.0 / n)), n)
    got = hvd.reducescatter(x, op=hvd.Average)
    assert got.dtype == torch.int32 and np.array_equal(got.numpy(), parts[r])
    g = hvd.grouped_reducescatter([x, x[:n]], op=hvd.Sum, postscale_factor=0.5)
    assert np.array_equal(g[0].numpy(), np.array_split(trunc(stack.sum(0) * 0.5), n)[r])
    assert np.array_equal(g[1].numpy(), np.array_split(trunc(stack[:, :n].sum(0) * 0.5), n)[r])
