"""pycomm.reduce_scatter and pycomm.alltoall against numpy (float64) and mpi4py references."""
import numpy as np
import pytest
import torch

import pycomm
from refdata import magnitude, rank_data, reference, tolerance

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def parts(rows, n):
    """torch.tensor_split's row counts: sizes differ by at most one, the first parts larger."""
    return [len(p) for p in np.array_split(np.arange(rows), n)]


@pytest.mark.parametrize("algorithm", ["ring", "mpi", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_reduce_scatter_matches_numpy(algorithm, dtype, op):
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg is for floating point")
    rank, size = pycomm.rank(), pycomm.size()
    # Sizes 0, 1, odd and not divisible by the world size; rows of width 3 for one case.
    for rows, width in ((0, 1), (1, 1), (7, 1), (1001, 1), (37, 3), (size * 5 + 1, 2)):
        count = rows * width
        x = rank_data(rank, count, dtype, seed=31).reshape(rows, width)
        before = x.clone()
        y = pycomm.reduce_scatter(x, op=op, algorithm=algorithm)
        assert torch.equal(x, before), "the input must stay unchanged"
        split = parts(rows, size)
        begin = sum(split[:rank]) * width
        assert y.shape == (split[rank], width) and y.dtype == dtype
        ref = reference(op, size, count, dtype, seed=31)[begin:begin + split[rank] * width]
        got = y.double().numpy().reshape(-1)
        if op in ("min", "max") or not dtype.is_floating_point:
            np.testing.assert_array_equal(got, ref)
        else:
            # An N-term sum in `dtype` is off by at most 2N eps sum|x_k| plus the final rounding
            # (refdata.tolerance), the same bound the allreduce tests use.
            mag = magnitude(size, count, dtype, seed=31)[begin:begin + split[rank] * width]
            bound = tolerance(dtype, size) * mag / (size if op == "avg" else 1) + np.abs(ref) * tolerance(dtype, 1)
            assert np.all(np.abs(got - ref) <= bound), f"rows={rows}: max error {np.max(np.abs(got - ref))}"


def test_reduce_scatter_matches_mpi4py_and_async(comm):
    from mpi4py import MPI

    rank, size = pycomm.rank(), pycomm.size()
    x = torch.from_numpy(np.random.default_rng([5, rank]).integers(-50, 50, size=size * 4 + 3)).to(torch.int64)
    counts = parts(x.numel(), size)
    ref = np.empty(counts[rank], dtype=np.int64)
    comm.Reduce_scatter(x.numpy(), ref, recvcounts=counts, op=MPI.SUM)
    handles = [pycomm.reduce_scatter_async(x, algorithm=a) for a in ("ring", "mpi")]
    for h in handles:
        np.testing.assert_array_equal(h.wait().numpy(), ref)


def test_reduce_scatter_large_ring_chunks():
    # More than one pipeline chunk per segment: 3 MiB of float32 with 512 KiB chunks.
    rank, size = pycomm.rank(), pycomm.size()
    n = (3 << 20) // 4 + 13
    x = rank_data(rank, n, torch.float64, seed=7)
    y = pycomm.reduce_scatter(x, algorithm="ring")
    split = parts(n, size)
    begin = sum(split[:rank])
    ref = reference("sum", size, n, torch.float64, seed=7)[begin:begin + split[rank]]
    # float64 sums of N terms of magnitude <= 100: 2N eps relative to the magnitude (refdata.tolerance).
    assert np.allclose(y.numpy(), ref, rtol=0, atol=tolerance(torch.float64, size) * 100 * size * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_alltoall_uneven_splits_match_mpi4py(comm, dtype):
    rank, size = pycomm.rank(), pycomm.size()
    # rank r sends (r + 2 j) % 3 rows to rank j: zero-row blocks included; rows of shape (2, 3).
    sends = [(rank + 2 * j) % 3 for j in range(size)]
    x = rank_data(rank, sum(sends) * 6, dtype, seed=41).reshape(sum(sends), 2, 3)
    y = pycomm.alltoall(x, splits=sends)
    # reference: mpi4py's Alltoallv on the raw bytes
    recvs = [(j + 2 * rank) % 3 for j in range(size)]
    item = x.element_size() * 6
    sbuf = x.view(torch.uint8).numpy().reshape(-1) if x.numel() else np.empty(0, np.uint8)
    rbuf = np.empty(sum(recvs) * item, np.uint8)
    comm.Alltoallv([sbuf, [s * item for s in sends]], [rbuf, [r * item for r in recvs]])
    assert y.shape == (sum(recvs), 2, 3)
    assert np.array_equal(y.contiguous().view(torch.uint8).numpy().reshape(-1), rbuf)


def test_alltoall_equal_splits_and_async():
    rank, size = pycomm.rank(), pycomm.size()
    x = torch.arange(size * 5, dtype=torch.int32) + 1000 * rank
    y = pycomm.alltoall_async(x).wait()
    expected = torch.cat([torch.arange(rank * 5, rank * 5 + 5, dtype=torch.int32) + 1000 * j for j in range(size)])
    assert torch.equal(y, expected)


def test_bad_input_is_named():
    size = pycomm.size()
    with pytest.raises(ValueError, match="not divisible"):
        if size == 1:
            raise ValueError("not divisible")  # every row count divides by 1
        pycomm.alltoall(torch.ones(size + 1))
    with pytest.raises(ValueError, match="splits"):
        pycomm.alltoall(torch.ones(4), splits=[5] * size)
    with pytest.raises(ValueError, match="unknown algorithm 'shm'"):
        pycomm.reduce_scatter(torch.ones(4), algorithm="shm")
    with pytest.raises(TypeError, match="op='avg' needs a floating-point"):
        pycomm.reduce_scatter(torch.ones(4, dtype=torch.int32), op="avg")
    with pytest.raises(ValueError, match="scalar"):
        pycomm.reduce_scatter(torch.tensor(1.0))


def test_disagreement_raises_on_every_rank():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(pycomm.CommError, match=r"reduce_scatter float32\[10\].*reduce_scatter float32\[11\]|"
                                               r"reduce_scatter float32\[11\].*reduce_scatter float32\[10\]"):
        pycomm.reduce_scatter(torch.ones(10 + (rank == 1)))
    with pytest.raises(pycomm.CommError, match="op=max"):
        pycomm.reduce_scatter(torch.ones(6), op="max" if rank == 0 else "sum")
    with pytest.raises(pycomm.CommError, match=r"alltoall float32\[\*, 4\].*alltoall float32\[\*, 5\]"):
        pycomm.alltoall(torch.ones(size, 4 if rank == 0 else 5))
    pycomm.barrier()
    y = pycomm.reduce_scatter(torch.ones(size * 2))  # the engine still works afterwards
    assert torch.equal(y, torch.full((2,), float(size)))
