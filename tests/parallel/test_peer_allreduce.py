"""The peer path (csrc/comm/peer_allreduce.cpp): device memory reduced inside the node by peer reads
of blocks the other local ranks have mapped, with no CUDA-aware MPI.

On CPU machines force_peer runs the whole control flow on host tensors, with POSIX shared-memory
objects standing in for CUDA IPC handles: the probe and its agreement, the blocks' regrowth, passes
through alternating halves, the cross-node shards (tests/test_parallel.py runs this file on virtual
nodes too), fused batches, the average's scaling. The CUDA cases run real CUDA tensors where a GPU is
visible (two ranks may share one device).

The stand-in's passes are 512 KiB here (peer_chunk_bytes), so calls above that run in several passes.
"""
import os

import pytest
import torch

import pycomm
from cuda_cases import needs_cuda, rank_device
from refdata import assert_close, assert_not_grown_past, rank_data

HALF_LIMIT = 1 << 19  # bytes: peer_chunk_bytes in these tests, the most a block's half grows to


@pytest.fixture
def peer():
    """Host tensors on the peer path (collective: every rank sets the same options in order)."""
    old = pycomm.get_options()
    pycomm.set_options(force_peer=True, peer_chunk_bytes=HALF_LIMIT)
    yield
    pycomm.set_options(**{k: old[k] for k in ("force_peer", "peer_chunk_bytes", "cycle_time_ms",
                                              "fusion_threshold_bytes")})


def _delta(before, key):
    return pycomm.stats()[key] - before[key]


def _takes_peer_path() -> bool:
    """What the executor decides for this job's shape (the same on every rank)."""
    return not pycomm._C.peer_verdict().startswith("staged")


def _same_on_every_rank(comm, y, what):
    copies = comm.allgather(y.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert all(c == copies[0] for c in copies), f"{what}: ranks hold different bits"


# Odd sizes, sizes below the number of ranks, and sizes above one half (several passes).
COUNTS = [1, 2, 3, 1001, 40_003, HALF_LIMIT // 4 * 2 + 17]


@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.float32, "avg"), (torch.float64, "sum"),
                                      (torch.bfloat16, "avg"), (torch.float16, "sum"), (torch.int32, "max"),
                                      (torch.int64, "sum"), (torch.float64, "min")])
def test_matches_the_float64_reference(dtype, op, peer, comm):
    rank, size = pycomm.rank(), pycomm.size()
    before = pycomm.stats()
    for count in COUNTS:
        x = rank_data(rank, count, dtype, seed=31)
        y = pycomm.allreduce(x.clone(), op=op)
        assert_close(y, op, size, dtype, seed=31, what=f"peer {op} {dtype} [{count}]")
        _same_on_every_rank(comm, y, f"peer {op} {dtype} [{count}]")
    if size > 1 and _takes_peer_path():
        assert _delta(before, "peer_allreduces") == len(COUNTS)
        assert pycomm.stats()["peer_block_bytes"] >= 2 * 4 * min(COUNTS[-1], HALF_LIMIT // 4) - 128
        assert_not_grown_past(before["peer_block_bytes"], pycomm.stats()["peer_block_bytes"], 2 * HALF_LIMIT,
                              "peer block")
    else:
        assert _delta(before, "peer_allreduces") == 0


def test_out_of_place_leaves_the_input(peer):
    rank, size = pycomm.rank(), pycomm.size()
    x = rank_data(rank, 70_001, torch.float64, seed=32)
    before = x.clone()
    out = torch.full_like(x, float("nan"))
    y = pycomm.allreduce(x, op="avg", out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(x, before)
    assert_close(out, "avg", size, torch.float64, seed=32, what="peer out=")


def test_blocks_grow_collectively_and_then_stay(peer):
    """Regrowth is collective and the same on every rank: afterwards calls of any size up to the half
    limit allocate nothing."""
    rank, size = pycomm.rank(), pycomm.size()
    if size == 1 or not _takes_peer_path():
        pytest.skip(f"no peer path here: {pycomm._C.peer_verdict() or 'one rank'}")
    big = HALF_LIMIT // 4 * 3  # three passes
    grown_before = pycomm.stats()["peer_block_bytes"]  # another file in this process may have grown it
    pycomm.allreduce(rank_data(rank, big, torch.float32, seed=33))
    allocations = pycomm.stats()["peer_allocations"]
    assert pycomm.stats()["peer_block_bytes"] == max(2 * HALF_LIMIT, grown_before)
    for count in (5, big, 1000, HALF_LIMIT // 4):
        y = pycomm.allreduce(rank_data(rank, count, torch.float32, seed=34))
        assert_close(y, "sum", size, torch.float32, seed=34, what=f"after growth [{count}]")
    assert pycomm.stats()["peer_allocations"] == allocations


def test_fused_batch_runs_as_one_peer_allreduce(peer, comm):
    rank, size = pycomm.rank(), pycomm.size()
    pycomm.set_options(cycle_time_ms=300.0, fusion_threshold_bytes=1 << 20)
    counts = [3, 1000, 17, 4099, 1]
    before = pycomm.stats()
    hs = [pycomm.allreduce_async(rank_data(rank, n, torch.float32, seed=35 + i), op="avg", name=f"peer.f{i}")
          for i, n in enumerate(counts)]
    comm.Barrier()  # every rank has queued the whole batch before any waits
    for i, h in enumerate(hs):
        assert_close(h.wait(), "avg", size, torch.float32, seed=35 + i, what=f"peer fused {i}")
    if size > 1:
        assert _delta(before, "fused_tensors") == len(counts)
        assert _delta(before, "peer_allreduces") == (1 if _takes_peer_path() else 0)


def test_a_named_algorithm_is_staged(peer):
    """The peer path replaces "auto" only: a named algorithm runs as named, on staged host chunks."""
    rank, size = pycomm.rank(), pycomm.size()
    before = pycomm.stats()
    y = pycomm.allreduce(rank_data(rank, 5003, torch.float32, seed=36), algorithm="ring")
    assert_close(y, "sum", size, torch.float32, seed=36, what="named ring under force_peer")
    assert _delta(before, "peer_allreduces") == 0


def test_a_joined_rank_turns_the_peer_path_off_until_all_contribute(peer):
    """A joined rank answers with host memory (pycomm.join), so while one has joined the others' device
    allreduces are staged; afterwards the peer path takes them again."""
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs a second rank to join")
    x = torch.full((1001,), float(rank + 1))
    pycomm.allreduce(x.clone())  # probed by now
    before = pycomm.stats()
    if rank == 0:
        assert pycomm.join() == size - 1
    else:
        out = pycomm.allreduce(x.clone(), op="avg", name="joined.avg")
        assert torch.equal(out, torch.full((1001,), sum(range(2, size + 1)) / (size - 1)))  # exact: small integers
        assert _delta(before, "peer_allreduces") == 0
        assert pycomm.join() == size - 1
    y = pycomm.allreduce(x.clone(), name="all.again")
    assert torch.equal(y, torch.full((1001,), float(size * (size + 1) // 2)))
    assert _delta(before, "peer_allreduces") == (1 if _takes_peer_path() else 0)


def test_the_verdict_names_the_path(peer):
    rank, size = pycomm.rank(), pycomm.size()
    pycomm.allreduce(torch.ones(8))
    verdict = pycomm._C.peer_verdict()
    per_node = int(os.environ.get("PYCOMM_RANKS_PER_NODE", "0")) or size  # one machine: one real node
    if size == 1:
        assert verdict == "staged: one rank"
    elif size % per_node:
        assert verdict == "staged: nodes with different numbers of ranks"
    elif per_node == 1:
        assert verdict == "staged: one rank per node: no peers inside a node"
    else:
        assert verdict == "peer: host shared memory"
        assert pycomm.stats()["device_path"] == "peer"


def test_no_shared_memory_object_outlives_the_exchange(peer):
    """The stand-in's objects are unlinked once every peer has mapped them, so nothing is left in
    /dev/shm even if a rank dies."""
    rank = pycomm.rank()
    pycomm.allreduce(rank_data(rank, HALF_LIMIT // 4, torch.float32, seed=37))
    mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"pycomm-peer-{os.getpid()}-")]
    assert mine == []


# ---- real CUDA tensors

@needs_cuda
@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.float32, "avg"), (torch.bfloat16, "avg"),
                                      (torch.int64, "max")])
def test_cuda_tensors_take_the_peer_path(dtype, op, comm):
    rank, size = pycomm.rank(), pycomm.size()
    dev = rank_device()
    torch.cuda.set_device(dev)
    before = pycomm.stats()
    for count in COUNTS:
        x = rank_data(rank, count, dtype, seed=38).to(dev)
        y = pycomm.allreduce(x, op=op)
        assert_close(y.cpu(), op, size, dtype, seed=38, what=f"cuda peer {op} {dtype} [{count}]")
        _same_on_every_rank(comm, y.cpu(), f"cuda peer {op} {dtype} [{count}]")
    if size > 1 and pycomm.local_size() > 1 and not pycomm._C.mpi_cuda_aware():
        path = pycomm.stats()["device_path"]
        assert path == "peer" or path.startswith("staged: "), path
        if path == "peer":
            assert _delta(before, "peer_allreduces") == len(COUNTS)


@needs_cuda
def test_cuda_fused_batch_and_stream_order(comm):
    """A fused batch of CUDA tensors through the peer path, read on the caller's stream after wait()."""
    rank, size = pycomm.rank(), pycomm.size()
    dev = rank_device()
    torch.cuda.set_device(dev)
    old = pycomm.get_options()
    pycomm.set_options(cycle_time_ms=300.0, fusion_threshold_bytes=1 << 20)
    try:
        counts = [3, 1000, 17, 4099, 1]
        hs = [pycomm.allreduce_async(rank_data(rank, n, torch.float32, seed=39 + i).to(dev), name=f"cuda.peer.{i}")
              for i, n in enumerate(counts)]
        comm.Barrier()
        for i, h in enumerate(hs):
            assert_close(h.wait().cpu(), "sum", size, torch.float32, seed=39 + i, what=f"cuda peer fused {i}")
    finally:
        pycomm.set_options(cycle_time_ms=old["cycle_time_ms"], fusion_threshold_bytes=old["fusion_threshold_bytes"])
