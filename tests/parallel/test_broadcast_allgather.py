"""broadcast, allgather and barrier against mpi4py and numpy."""
import numpy as np
import pytest
import torch

import pycomm
from refdata import rank_data


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_broadcast_from_every_root(dtype):
    rank, size = pycomm.rank(), pycomm.size()
    for root in range(size):
        for count in (0, 1, 1001):
            x = rank_data(rank, count, dtype, seed=10 + root)
            pycomm.broadcast(x, root=root)
            assert torch.equal(x, rank_data(root, count, dtype, seed=10 + root))


def test_allgather_rows_differ_per_rank():
    rank, size = pycomm.rank(), pycomm.size()
    for width in ((3,), (2, 5), ()):
        rows = [2 * r + 1 for r in range(size)]
        rows[-1] = 0  # one rank contributes nothing
        x = rank_data(rank, rows[rank] * int(np.prod(width)), torch.float64, seed=20).reshape(rows[rank], *width)
        y = pycomm.allgather(x)
        expected = torch.cat([rank_data(r, rows[r] * int(np.prod(width)), torch.float64, seed=20)
                              .reshape(rows[r], *width) for r in range(size)])
        assert y.shape == expected.shape
        assert torch.equal(y, expected)


def test_allgather_matches_mpi4py(comm):
    rank = pycomm.rank()
    x = torch.arange(rank * 10, rank * 10 + rank + 2, dtype=torch.int32)
    y = pycomm.allgather(x)
    ref = np.concatenate(comm.allgather(x.numpy()))
    np.testing.assert_array_equal(y.numpy(), ref)


def test_allgather_zero_width_rows():
    rank, size = pycomm.rank(), pycomm.size()
    y = pycomm.allgather(torch.empty(rank + 1, 0))
    assert y.shape == (size * (size + 1) // 2, 0)


def test_barrier_and_async_broadcast():
    rank, size = pycomm.rank(), pycomm.size()
    pycomm.barrier()
    x = torch.full((10,), float(rank))
    h = pycomm.broadcast_async(x, root=size - 1)
    assert torch.equal(h.wait(), torch.full((10,), float(size - 1)))
