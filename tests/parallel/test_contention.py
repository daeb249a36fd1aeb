"""The shared window's fence (a counter barrier in the window, csrc/comm/shm_window.cpp) and the
waits of csrc/comm/wait_policy.h: fences back to back keep every call's data apart, and a rank that
arrives late -- busy elsewhere, or descheduled because ranks outnumber cores -- is waited for, not
raced past. tests/test_parallel.py runs this at 3 and 4 ranks on 2 cores: oversubscribed.
"""
import time

import numpy as np
import pytest
import torch

import pycomm

# Odd element counts across shm's forms: one fence (<= 32 KiB), reduce-scatter + allgather
# (3 fences), and from 1.5 M float32 elements (6 MiB) upwards usually the chunked pipeline.
COUNTS = [1, 3, 17, 1001, 8191, 8193, 65537, 250_003]


def reference(comm, a):
    from mpi4py import MPI

    out = np.empty_like(a)
    comm.Allreduce(a, out, op=MPI.SUM)
    return out


def single_node():
    return pycomm.topology().num_nodes == 1


@pytest.mark.parametrize("dtype", [np.int64, np.float32])
def test_back_to_back_fences_keep_data_ordered(dtype, comm):
    """Many small shm allreduces in a row on fresh data, against MPI's Allreduce of the same data.

    A fence that let a rank through early would show here as a peer's stale or next-call values:
    the one-fence form alternates window halves call by call, so a rank one fence ahead writes the
    half its peers are still reading.
    """
    if not single_node():
        pytest.skip("shm reduces within one node")
    rng = np.random.default_rng(1000 + comm.rank)
    for i in range(300):
        n = COUNTS[i % len(COUNTS)] + (i % 7)
        if dtype is np.int64:
            a = rng.integers(-1000, 1000, size=n, dtype=np.int64)
        else:
            a = rng.standard_normal(n).astype(np.float32)
        t = torch.from_numpy(a.copy())
        pycomm.allreduce(t, algorithm="shm")
        ref = reference(comm, a)
        if dtype is np.int64:
            np.testing.assert_array_equal(t.numpy(), ref, err_msg=f"call {i}, {n} elements")
        else:
            # MPI's float32 sum of the same N <= 4 values in another order: at most N-1 roundings of
            # 2^-24 relative to a partial sum below about 20 (|x| < 5 for these normals), under 4e-6.
            np.testing.assert_allclose(t.numpy(), ref, rtol=1e-5, atol=1e-5, err_msg=f"call {i}, {n} elements")


def test_chunked_pipeline_fences(comm):
    """The chunked form (many fences per call) on 8 M int32 elements, three calls with fresh data."""
    if not single_node():
        pytest.skip("shm reduces within one node")
    rng = np.random.default_rng(2000 + comm.rank)
    for i in range(3):
        a = rng.integers(-1000, 1000, size=(8 << 20) + 2 * i + 1, dtype=np.int32)
        t = torch.from_numpy(a.copy())
        pycomm.allreduce(t, algorithm="shm")
        np.testing.assert_array_equal(t.numpy(), reference(comm, a), err_msg=f"call {i}")


@pytest.mark.parametrize("algorithm", ["shm", "ring", "hierarchical"])
def test_late_rank_is_waited_for(algorithm, comm):
    """One rank at a time arrives 30 ms late (busy on the CPU); every rank still gets the full sum,
    so no wait gives up or returns early, and the waiting ranks sleep rather than fail."""
    if algorithm == "shm" and not single_node():
        pytest.skip("shm reduces within one node")
    if algorithm == "hierarchical" and not pycomm.topology().homogeneous:
        pytest.skip("hierarchical needs the same number of ranks on every node")
    for late in range(comm.size):
        comm.Barrier()
        if comm.rank == late:
            end = time.perf_counter() + 0.03
            while time.perf_counter() < end:
                pass
        for n in (5, 40_000, 300_001):
            t = torch.full((n,), float(comm.rank + 1))
            pycomm.allreduce(t, algorithm=algorithm)
            assert torch.all(t == comm.size * (comm.size + 1) / 2), (late, n)


def test_many_fences_finish_under_oversubscription(comm):
    """2,000 one-fence calls complete, and in bounded time (about 50x what 2 quiet ranks need): with
    more ranks than cores, a fence whose waiters kept the cores would crawl at the scheduler's time
    slices."""
    if not single_node():
        pytest.skip("shm reduces within one node")
    t = torch.ones(16)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(2000):
        t.fill_(1.0)
        pycomm.allreduce(t, algorithm="shm")
    elapsed = time.perf_counter() - t0
    assert torch.all(t == comm.size)
    assert elapsed < 10.0, f"2000 fenced allreduces took {elapsed:.1f} s"
