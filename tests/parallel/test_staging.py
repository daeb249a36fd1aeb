"""The staging pipeline that carries device memory through host chunks, exercised on host memory.

With force_staging, host tensors take the same path device tensors take
without a CUDA-aware MPI: double-buffered chunks copied out on two ordered
lanes, reduced across ranks on the host, copied back.
"""
import numpy as np
import pytest
import torch

import pycomm
from refdata import assert_close, rank_data


@pytest.fixture
def staging():
    old = pycomm.get_options()
    yield lambda chunk: pycomm.set_options(force_staging=True, staging_chunk_bytes=chunk)
    pycomm.set_options(force_staging=old["force_staging"], staging_chunk_bytes=old["staging_chunk_bytes"])


@pytest.mark.parametrize("algorithm", ["ring", "mpi", "auto"])
@pytest.mark.parametrize("chunk", [4, 36, 1000, 1 << 20])  # bytes: one element up to a single chunk
def test_staged_allreduce_matches_reference(algorithm, chunk, staging, comm):
    rank, size = pycomm.rank(), pycomm.size()
    staging(chunk)
    counts = (1, 2, 9, 1001) if chunk < 1000 else (1, 9, 40_003)  # tiny chunks: one allreduce per element
    for count in counts:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            x = rank_data(rank, count, dtype, seed=70)
            y = pycomm.allreduce(x.clone(), algorithm=algorithm)
            assert_close(y, "sum", size, dtype, seed=70, what=f"staged {algorithm} chunk {chunk} {dtype} [{count}]")
            copies = comm.allgather(y.reshape(-1).view(torch.uint8).numpy().tobytes())
            assert all(c == copies[0] for c in copies)


def test_staged_out_of_place_average_and_async(staging):
    rank, size = pycomm.rank(), pycomm.size()
    staging(4096)
    x = rank_data(rank, 30_001, torch.float64, seed=71)
    before = x.clone()
    out = torch.full_like(x, float("nan"))
    pycomm.allreduce(x, op="avg", out=out)
    assert torch.equal(x, before)
    assert_close(out, "avg", size, torch.float64, seed=71, what="staged out=")
    hs = [pycomm.allreduce_async(rank_data(rank, 5000 + i, torch.float32, seed=72 + i), name=f"g{i}") for i in range(6)]
    for i, h in enumerate(hs):
        assert_close(h.wait(), "sum", size, torch.float32, seed=72 + i, what=f"staged async g{i}")


@pytest.mark.parametrize("algorithm", ["ring", "mpi"])
@pytest.mark.parametrize("dtype,op", [(torch.float32, "avg"), (torch.bfloat16, "avg"), (torch.int32, "max"),
                                      (torch.float64, "sum")])
def test_device_direct_path(algorithm, dtype, op):
    """The CUDA-aware path (device pointers to MPI, the ring's slots and reductions from the buffer's
    MemoryMover), run here on host memory through the host mover."""
    rank, size = pycomm.rank(), pycomm.size()
    old = pycomm.get_options()
    pycomm.set_options(force_device_direct=True, ring_chunk_bytes=4096)
    try:
        for count in (1, 13, 50_001):
            x = rank_data(rank, count, dtype, seed=90)
            out = torch.full_like(x, -3)
            y = pycomm.allreduce(x, op=op, algorithm=algorithm, out=out)
            assert y.data_ptr() == out.data_ptr()
            assert_close(y, op, size, dtype, seed=90, what=f"direct {algorithm} {op} {dtype} [{count}]")
    finally:
        pycomm.set_options(force_device_direct=False, ring_chunk_bytes=old["ring_chunk_bytes"])


def test_device_direct_auto_maps_shm_to_the_ring(comm):
    """shm needs host shared memory: on the device-direct path `auto` runs the ring where it would
    pick shm (executor.cpp, Executor::device_allreduce), bitwise the ring's result; naming shm is an error."""
    rank, size = pycomm.rank(), pycomm.size()
    old = pycomm.get_options()
    x = rank_data(rank, 50_001, torch.float32, seed=91)  # 200 KB: above auto's switch from mpi
    try:
        pycomm.set_options(force_device_direct=True, ring_chunk_bytes=4096)
        via_auto = pycomm.allreduce(x.clone(), algorithm="auto")
        via_ring = pycomm.allreduce(x.clone(), algorithm="ring")
        with pytest.raises(pycomm.CommError, match="'shm' needs a host shared-memory window"):
            pycomm.allreduce(x.clone(), algorithm="shm")
    finally:
        pycomm.set_options(force_device_direct=False, ring_chunk_bytes=old["ring_chunk_bytes"])
    assert_close(via_auto, "sum", size, torch.float32, seed=91, what="direct auto")
    assert torch.equal(via_auto, via_ring)


def test_device_direct_working_memory_is_cached():
    """The ring's device working memory is kept between calls (no cudaMalloc/cudaFree per call on a
    GPU): a steady stream of allreduces allocates once; larger slots regrow it, at least doubling."""
    rank, size = pycomm.rank(), pycomm.size()
    if size == 1:
        pytest.skip("one rank runs no ring")
    old = pycomm.get_options()
    try:
        pycomm.set_options(force_device_direct=True, ring_chunk_bytes=4096)
        x = rank_data(rank, 100_003, torch.float32, seed=93)
        pycomm.allreduce(x.clone(), algorithm="ring")
        first = pycomm.stats()
        assert first["device_cache_bytes"] > 0 and first["device_cache_allocations"] >= 1
        for _ in range(5):
            y = pycomm.allreduce(x.clone(), algorithm="ring")
        steady = pycomm.stats()
        assert steady["device_cache_allocations"] == first["device_cache_allocations"]
        assert steady["device_cache_bytes"] == first["device_cache_bytes"]
        assert_close(y, "sum", size, torch.float32, seed=93, what="cached direct ring")
        pycomm.set_options(ring_chunk_bytes=4096 * 3)  # slots 3x larger: one regrowth
        pycomm.allreduce(x.clone(), algorithm="ring")
        grown = pycomm.stats()
        assert grown["device_cache_allocations"] == first["device_cache_allocations"] + 1
        assert grown["device_cache_bytes"] >= 2 * first["device_cache_bytes"]
    finally:
        pycomm.set_options(force_device_direct=False, ring_chunk_bytes=old["ring_chunk_bytes"])


# ---- real CUDA tensors (skipped without a GPU; the cases above are their host stand-ins) ------------

from cuda_cases import needs_cuda, rank_device  # noqa: E402


@needs_cuda
@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.float16, "avg"), (torch.int64, "max")])
def test_cuda_allreduce_matches_reference(dtype, op, comm):
    """CUDA tensors by the path `auto` takes on this MPI (staged without a CUDA-aware one), odd sizes
    across several staging chunks; every rank bitwise alike; the caller's current device unchanged."""
    rank, size = pycomm.rank(), pycomm.size()
    dev = rank_device()
    old = pycomm.get_options()
    pycomm.set_options(staging_chunk_bytes=4096)
    try:
        before = torch.cuda.current_device()
        for count in (1, 13, 50_001):
            x = rank_data(rank, count, dtype, seed=95).to(dev)
            y = pycomm.allreduce(x, op=op)
            assert torch.cuda.current_device() == before
            assert_close(y.cpu(), op, size, dtype, seed=95, what=f"cuda {op} {dtype} [{count}]")
            copies = comm.allgather(y.cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            assert all(c == copies[0] for c in copies)
    finally:
        pycomm.set_options(staging_chunk_bytes=old["staging_chunk_bytes"])


@needs_cuda
def test_forced_direct_cuda_refused():
    """force_device_direct on CUDA tensors under an MPI that cannot read device memory: a CommError on
    every rank before any data moves, and the engine goes on."""
    if pycomm.size() == 1:
        pytest.skip("one rank hands nothing to MPI")
    from pycomm import _C

    if _C.mpi_cuda_aware():
        pytest.skip("this MPI reads device memory: the direct path runs")
    rank, size = pycomm.rank(), pycomm.size()
    x = rank_data(rank, 1001, torch.float32, seed=96).to(rank_device())
    pycomm.set_options(force_device_direct=True)
    try:
        with pytest.raises(pycomm.CommError, match=r"force_device_direct.*cannot read device memory"):
            pycomm.allreduce(x.clone())
    finally:
        pycomm.set_options(force_device_direct=False)
    assert_close(pycomm.allreduce(x.clone()).cpu(), "sum", size, torch.float32, seed=96, what="after the refusal")


@needs_cuda
@pytest.mark.parametrize("collective", ["allgather", "alltoall"])
def test_cuda_outputs_belong_to_the_callers_stream(collective, comm):
    """The output pycomm allocates (on its engine thread) belongs to the stream that was current at the
    call: dropped, its memory is handed out again on that stream (torch's caching allocator pools
    blocks per stream; allocated with the engine thread's default stream current, it would not be)."""
    rank, size = pycomm.rank(), pycomm.size()
    dev = rank_device()
    torch.cuda.set_device(dev)
    side = torch.cuda.Stream(dev)
    rows = 3 * size + 1
    x = rank_data(rank, rows * 5, torch.float32, seed=99).reshape(rows, 5).to(dev)
    with torch.cuda.stream(side):
        if collective == "allgather":
            y = pycomm.allgather(x)
        else:
            splits = [rows // size] * (size - 1) + [rows - (rows // size) * (size - 1)]
            y = pycomm.alltoall(x, splits)
        got = y.cpu()  # on `side`, after wait() ordered it on pycomm's done event
        ptr, numel = y.data_ptr(), y.numel()
        del y
        again = torch.empty(numel, device=dev)  # same size, same stream: the same block
        assert again.data_ptr() == ptr
    side.synchronize()
    if collective == "allgather":
        expect = torch.cat([rank_data(q, rows * 5, torch.float32, seed=99).reshape(rows, 5) for q in range(size)])
        assert torch.equal(got, expect)


@needs_cuda
def test_cuda_call_gives_the_callers_device_back():
    """A blocking call on an idle engine runs on the caller's thread: on a tensor of another device
    than the current one, pycomm's CUDA code sets its device and gives the caller's back."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (a tensor off the current device)")
    rank, size = pycomm.rank(), pycomm.size()
    torch.cuda.set_device(0)
    x = rank_data(rank, 10_001, torch.float32, seed=100).to("cuda:1")
    y = pycomm.allreduce(x)
    assert torch.cuda.current_device() == 0
    assert_close(y.cpu(), "sum", size, torch.float32, seed=100, what="cuda:1 with cuda:0 current")


@pytest.mark.parametrize("chunk", [4, 36, 1 << 20])
def test_staged_broadcast_in_chunks(chunk, staging):
    """force_staging: broadcasts go through the staging chunks as device memory does (the root copies
    chunk k down while chunk k-1 is broadcast; the others copy each up), from every root."""
    rank, size = pycomm.rank(), pycomm.size()
    staging(chunk)
    for root in range(size):
        for count, dtype in ((1, torch.float32), (1001, torch.int64), (30_001, torch.bfloat16)):
            x = rank_data(rank, count, dtype, seed=110 + root)
            y = pycomm.broadcast(x.clone(), root=root)
            assert torch.equal(y, rank_data(root, count, dtype, seed=110 + root)), (chunk, root, count, dtype)


@pytest.mark.parametrize("force", ["force_staging", "force_device_direct"])
def test_other_collectives_on_the_standin_paths(force, comm):
    """Every collective takes its memory path from one rule (Executor::path_of): with force_staging,
    allgather, reduce_scatter and alltoall copy host stand-ins through the host mover, as they copy
    device memory without a CUDA-aware MPI; with force_device_direct, allgather hands the memory to
    MPI and the other two still copy (they reduce or rearrange on the host). Each result matches
    mpi4py's collective on the same bytes."""
    from mpi4py import MPI

    rank, size = pycomm.rank(), pycomm.size()
    old = pycomm.get_options()
    pycomm.set_options(**{force: True})
    try:
        rows = 3 + 2 * rank  # differs per rank: the gather's first dimension
        x = rank_data(rank, rows * 5, torch.float64, seed=120).reshape(rows, 5)
        gathered = pycomm.allgather(x)
        ref = np.concatenate(comm.allgather(x.numpy()))
        np.testing.assert_array_equal(gathered.numpy(), ref)

        ints = torch.from_numpy(np.random.default_rng([121, rank]).integers(-50, 50, size=size * 4 + 3))
        counts = [len(p) for p in np.array_split(np.arange(ints.numel()), size)]
        part = np.empty(counts[rank], dtype=np.int64)
        comm.Reduce_scatter(ints.numpy(), part, recvcounts=counts, op=MPI.SUM)
        np.testing.assert_array_equal(pycomm.reduce_scatter(ints).numpy(), part)

        sends = [(rank + j) % 3 for j in range(size)]  # zero-row blocks included
        y = rank_data(rank, sum(sends) * 2, torch.int64, seed=122).reshape(sum(sends), 2)
        got = pycomm.alltoall(y, splits=sends)
        recvs = [(j + rank) % 3 for j in range(size)]
        rbuf = np.empty(sum(recvs) * 2, np.int64)
        comm.Alltoallv([y.numpy().reshape(-1), [s * 2 for s in sends]], [rbuf, [r * 2 for r in recvs]])
        np.testing.assert_array_equal(got.numpy().reshape(-1), rbuf)
    finally:
        pycomm.set_options(**{force: old[force]})
