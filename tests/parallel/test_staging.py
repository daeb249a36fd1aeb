"""The staging pipeline that carries device memory through host chunks, exercised on host memory.

With force_staging, host tensors take the same path device tensors take
without a CUDA-aware MPI: double-buffered chunks copied out on two ordered
lanes, reduced across ranks on the host, copied back.
"""
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
    pick shm (engine.cpp, run_device_allreduce), bitwise the ring's result; naming shm is an error."""
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
