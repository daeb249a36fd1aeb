"""allreduce against float64 numpy references and mpi4py's own Allreduce."""
import numpy as np
import pytest
import torch

import pycomm
from refdata import assert_close, assert_not_grown_past, rank_data

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
# 0, 1, odd, not divisible by 1..4 ranks nor by 8/32, larger than one ring chunk.
COUNTS = [0, 1, 2, 3, 7, 13, 1001, 65537, 300_007]


def gather_bytes(comm, t: torch.Tensor):
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return comm.allgather(raw)


def test_shm_window_grows_geometrically():
    """32 growing requests over a 16x range reallocate the shared window at most log2(16) + 1 times.

    First in the file so the window starts small (it never shrinks). Before the fix every larger
    request reallocated (collectively, over the node): 16 or more times here.
    """
    rank, size = pycomm.rank(), pycomm.size()
    if size == 1 or pycomm.num_nodes() > 1:
        pytest.skip("the shm window is used on one node of several ranks")
    s0 = pycomm.stats()
    start = max(4096, s0["shm_segment_bytes"] + 4096)
    requests = [(start + start * 15 * k // 31) // 4 for k in range(32)]  # float32 counts, growing to 16x
    for i, n in enumerate(requests):
        x = rank_data(rank, n, torch.float32, seed=700 + i)
        assert_close(pycomm.allreduce(x, algorithm="shm"), "sum", size, torch.float32, seed=700 + i,
                     what=f"shm request {i} ({4 * n} bytes)")
    s1 = pycomm.stats()
    grown = s1["shm_allocations"] - s0["shm_allocations"]
    assert 1 <= grown <= 5, f"{grown} reallocations for a 16x range (doubling allows log2(16) + 1 = 5)"
    assert 4 * requests[-1] <= s1["shm_segment_bytes"] < 2 * 4 * requests[-1] + 4096, s1
    for _ in range(5):  # settled: the same sizes again reallocate nothing
        pycomm.allreduce(torch.ones(requests[-1]), algorithm="shm")
    assert pycomm.stats()["shm_allocations"] == s1["shm_allocations"]


def test_shm_window_growth_stops_at_the_fusion_threshold():
    """Doubling does not overshoot the fusion threshold (no fused batch is larger), so the window settles there."""
    rank, size = pycomm.rank(), pycomm.size()
    if size == 1 or pycomm.num_nodes() > 1:
        pytest.skip("the shm window is used on one node of several ranks")
    pycomm.allreduce(torch.ones(16384), algorithm="shm")  # a window of at least 64 KiB
    cap = pycomm.stats()["shm_segment_bytes"]
    old = pycomm.get_options()["fusion_threshold_bytes"]
    limit = cap + 40960  # below 2 * cap: plain doubling would overshoot it
    pycomm.set_options(fusion_threshold_bytes=limit)
    try:
        for i, n in enumerate(((cap + 4096) // 4, limit // 4)):
            x = rank_data(rank, n, torch.float32, seed=710 + i)
            assert_close(pycomm.allreduce(x, algorithm="shm"), "sum", size, torch.float32, seed=710 + i)
        assert pycomm.stats()["shm_segment_bytes"] == limit
        pycomm.allreduce(torch.ones(limit // 4 + 1024), algorithm="shm")  # above the limit: doubles again
        assert pycomm.stats()["shm_segment_bytes"] == 2 * limit
    finally:
        pycomm.set_options(fusion_threshold_bytes=old)


def test_shm_one_fence_and_three_fence_forms_interleave(comm):
    """Small shm allreduces (one fence, alternating window halves) between large ones and fused batches.

    A one-fence call leaves peers possibly still reading this rank's segment; the next small call
    uses the other half and anything else fences first. Fresh data every call, checked against the
    float64 reference and bitwise across ranks.
    """
    rank, size = pycomm.rank(), pycomm.size()
    if size == 1 or pycomm.num_nodes() > 1:
        pytest.skip("the shm window is used on one node of several ranks")
    # float32 counts: 4 KB, 36 KB (three fences), exactly 32 KiB (one fence), 400 B, 80 KB, 32 KiB + 4 B, 4 B
    counts = [1000, 9000, 8192, 100, 20000, 8193, 1, 7, 7]
    for rep in range(3):
        for i, n in enumerate(counts):
            seed = 900 + 20 * rep + i
            y = pycomm.allreduce(rank_data(rank, n, torch.float32, seed=seed), algorithm="shm")
            assert_close(y, "sum", size, torch.float32, seed=seed, what=f"rep {rep} shm [{n}]")
            copies = gather_bytes(comm, y)
            assert all(c == copies[0] for c in copies), f"ranks hold different results (rep {rep} shm [{n}])"
        xs = [rank_data(rank, n, torch.float32, seed=960 + 20 * rep + i) for i, n in enumerate(counts)]
        hs = [pycomm.allreduce_async(x, algorithm="shm", name=f"f{rep}.{i}") for i, x in enumerate(xs)]
        for i, h in enumerate(hs):
            assert_close(h.wait(), "sum", size, torch.float32, seed=960 + 20 * rep + i, what=f"fused f{rep}.{i}")


def test_every_rank_uses_rank_zeros_tune_table(tmp_path, monkeypatch, comm):
    """Ranks that find different tune tables (own home directories) all resolve "auto" from rank 0's."""
    import json
    import warnings

    from pycomm import runtime
    from pycomm.tools import tune

    rank, size = pycomm.rank(), pycomm.size()
    topo = pycomm.topology()
    mine = [(2 ** 62, "ring")] if rank == 0 else [(1000, "mpi"), (2 ** 62, "ring" if rank % 2 else "mpi")]
    monkeypatch.setenv("PYCOMM_TUNE_DIR", str(tmp_path))  # a directory of this rank's own
    with open(tune.table_path(topo), "w") as f:
        json.dump(dict(version=tune.TUNE_VERSION, virtual_nodes=topo.virtual_nodes, table=mine), f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = runtime.agreed_tune_table(topo, pycomm.world_comm())
    assert table == [(2 ** 62, "ring")]
    differs = [w for w in caught if "differs from rank 0's" in str(w.message)]
    assert len(differs) == (1 if rank else 0), [str(w.message) for w in caught]
    old = pycomm.get_options()["auto_table"]
    pycomm.set_options(auto_table=table)
    try:
        picks = comm.allgather([pycomm.resolve_algorithm("auto", b) for b in (100, 1 << 20)])
        assert picks == [["ring", "ring"]] * size, picks
        x = rank_data(rank, 5003, torch.float32, seed=77)
        assert_close(pycomm.allreduce(x), "sum", size, torch.float32, seed=77, what="auto from rank 0's table")
    finally:
        pycomm.set_options(auto_table=[tuple(e) for e in old])


def test_ranks_setting_different_auto_tables_all_raise():
    if pycomm.size() == 1:
        pytest.skip("needs two ranks to disagree")
    old = pycomm.get_options()["auto_table"]
    table = [(2 ** 62, "ring" if pycomm.rank() == 0 else "mpi")]
    with pytest.raises(pycomm.CommError, match="ranks disagree on the call.*engine options"):
        pycomm.set_options(auto_table=table)
    assert pycomm.get_options()["auto_table"] == old  # nothing changed, on any rank


@pytest.mark.parametrize("algorithm", pycomm.collectives.ALLREDUCE_ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_matches_reference_and_is_identical_on_all_ranks(algorithm, dtype, comm):
    rank, size = pycomm.rank(), pycomm.size()
    for count in COUNTS:
        x = rank_data(rank, count, dtype, seed=1)
        y = pycomm.allreduce(x.clone(), op="sum", algorithm=algorithm)
        assert y.dtype == dtype and y.shape == x.shape
        assert_close(y, "sum", size, dtype, seed=1, what=f"{algorithm} {dtype} [{count}]")
        copies = gather_bytes(comm, y)
        assert all(c == copies[0] for c in copies), f"ranks hold different results ({algorithm} {dtype} [{count}])"


@pytest.mark.parametrize("op", ["avg", "min", "max"])
@pytest.mark.parametrize("algorithm", ["ring", "mpi", "shm"])
def test_other_ops(op, algorithm):
    rank, size = pycomm.rank(), pycomm.size()
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    if op != "avg":
        dtypes += [torch.int32, torch.int64]
    for dtype in dtypes:
        for count in (1, 999, 70_001):
            x = rank_data(rank, count, dtype, seed=2)
            y = pycomm.allreduce(x, op=op, algorithm=algorithm)
            assert_close(y, op, size, dtype, seed=2, what=f"{op} {algorithm} {dtype}")


def test_ring_equals_mpi4py_allreduce(comm):
    from mpi4py import MPI

    rank = pycomm.rank()
    for count in (17, 123_457):
        x = rank_data(rank, count, torch.float64, seed=3)
        ref = np.empty(count)
        comm.Allreduce(x.numpy(), ref, op=MPI.SUM)
        y = pycomm.allreduce(x.clone(), algorithm="ring")
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-13, atol=1e-11)
        ymax = pycomm.allreduce(x.clone(), op="max", algorithm="ring")
        comm.Allreduce(x.numpy(), ref, op=MPI.MAX)
        np.testing.assert_array_equal(ymax.numpy(), ref)


def test_out_of_place_leaves_input_untouched():
    rank, size = pycomm.rank(), pycomm.size()
    x = rank_data(rank, 4097, torch.float32, seed=4).reshape(17, 241)
    before = x.clone()
    out = torch.full_like(x, float("nan"))
    y = pycomm.allreduce(x, out=out, algorithm="ring")
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(x, before)
    assert_close(out, "sum", size, torch.float32, seed=4, what="out=")


def test_multidimensional_and_small_chunks():
    """Many pipeline chunks per ring step: a chunk of 64 bytes over 100k elements."""
    rank, size = pycomm.rank(), pycomm.size()
    old = pycomm.get_options()["ring_chunk_bytes"]
    pycomm.set_options(ring_chunk_bytes=64)
    try:
        x = rank_data(rank, 100_003, torch.float32, seed=5)
        y = pycomm.allreduce(x.clone(), algorithm="ring")
    finally:
        pycomm.set_options(ring_chunk_bytes=old)
    assert_close(y, "sum", size, torch.float32, seed=5, what="64-byte chunks")


def test_async_handles_complete_in_submission_order():
    rank, size = pycomm.rank(), pycomm.size()
    xs = [rank_data(rank, n, torch.float32, seed=6 + i) for i, n in enumerate((5, 50_000, 3, 200_001))]
    handles = [pycomm.allreduce_async(x, algorithm="ring") for x in xs]
    results = [h.wait() for h in reversed(handles)][::-1]
    for i, (h, y) in enumerate(zip(handles, results)):
        assert h.done()
        assert_close(y, "sum", size, torch.float32, seed=6 + i, what=f"async #{i}")


def test_fp16_average_of_large_values_does_not_overflow():
    size = pycomm.size()
    x = torch.full((1000,), 60000.0, dtype=torch.float16)  # N * 60000 > fp16 max 65504
    y = pycomm.allreduce(x, op="avg", algorithm="ring")
    assert torch.isfinite(y).all()
    np.testing.assert_allclose(y.float().numpy(), 60000.0, rtol=2e-3)
    assert size >= 1


def test_large_tensor_256mib():
    """A 256 MiB float32 tensor (64 Mi elements) through the ring."""
    rank, size = pycomm.rank(), pycomm.size()
    n = 64 * 1024 * 1024
    x = torch.full((n,), float(rank + 1), dtype=torch.float32)
    x[rank::7919] = 0.5
    y = pycomm.allreduce(x, algorithm="ring")
    expected = torch.full((n,), float(size * (size + 1) // 2), dtype=torch.float32)
    for r in range(size):
        expected[r::7919] -= (r + 1) - 0.5
    assert torch.equal(y, expected)


def test_measured_auto_table_drives_auto():
    pycomm.set_options(auto_table=[(100, "ring"), (2 ** 62, "mpi")])
    try:
        assert pycomm.resolve_algorithm("auto", 50) == "ring"
        assert pycomm.resolve_algorithm("auto", 10 ** 6) == "mpi"
        rank, size = pycomm.rank(), pycomm.size()
        x = rank_data(rank, 20, torch.float32, seed=9)
        assert_close(pycomm.allreduce(x.clone()), "sum", size, torch.float32, seed=9, what="auto via table")
    finally:
        pycomm.set_options(auto_table=[])
    assert pycomm.get_options()["auto_table"] == []


def test_bandwidth_table_counts_wrong_results():
    # pycomm-train's table: 0 wrong for real allreduces, and a no-op (data left
    # as they were) is counted wrong on every rank but a middle one.
    from mpi4py import MPI

    from pycomm.tools.train import bandwidth

    rows = bandwidth.measure(sizes=(4 << 10, 12 << 10), iters=2, warmup=0)
    assert rows and all(r["wrong"] == 0 for r in rows), rows
    rank, size = pycomm.rank(), pycomm.size()
    expected, data = bandwidth.rank_dependent(1001, rank, size)
    noop = MPI.COMM_WORLD.allreduce(bandwidth.count_wrong(data, expected), op=MPI.SUM)
    assert noop == (0 if size == 1 else 1001 * (size - size % 2)), noop


@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.float64, "avg"), (torch.bfloat16, "sum"),
                                      (torch.int32, "min")])
def test_shm_chunk_by_chunk(dtype, op, comm):
    """Messages above shm_pipeline_min_bytes run chunk by chunk through two window halves; odd chunk
    sizes (not a multiple of the element size, of L or of a cache line) and a last chunk shorter than
    the others, checked against the float64 reference and bitwise across ranks, and the window stays
    two chunks long."""
    rank, size, L = pycomm.rank(), pycomm.size(), pycomm.local_size()
    if size == 1 or pycomm.num_nodes() > 1:
        pytest.skip("the shm window is used on one node of several ranks")
    old = pycomm.get_options()["shm_chunk_bytes"]
    esize = torch.tensor([], dtype=dtype).element_size()
    try:
        for chunk in (40_003, old):
            pycomm.set_options(shm_chunk_bytes=chunk)
            n = pycomm._C.shm_pipeline_min_bytes(L, chunk) // esize + 12_345  # several chunks, a short last one
            seed = 1200 + chunk % 97 + esize
            window_before = pycomm.stats()["shm_segment_bytes"]
            y = pycomm.allreduce(rank_data(rank, n, dtype, seed=seed), op=op, algorithm="shm")
            assert_close(y, op, size, dtype, seed=seed, what=f"shm in chunks of {chunk} B [{n}] {dtype} {op}")
            copies = gather_bytes(comm, y)
            assert all(c == copies[0] for c in copies), f"ranks hold different results (chunks of {chunk} B)"
            # The window holds two (cache-line rounded) chunks, not the message.
            assert_not_grown_past(window_before, pycomm.stats()["shm_segment_bytes"], n * esize - 1, "shm window")
    finally:
        pycomm.set_options(shm_chunk_bytes=old)


@pytest.mark.parametrize("stores", ["cached", "streaming", "auto"])
def test_shm_window_stores(stores, comm):
    """The copies into the shm window with ordinary or streaming stores (pycomm._C.set_window_stores), and
    the measured choice between them: sums against the float64 reference and bitwise across ranks, at
    counts that leave unaligned heads and tails (a view one element into its storage, odd counts), in one
    fence, in one pass and chunk by chunk (odd chunk size)."""
    rank, size, L = pycomm.rank(), pycomm.size(), pycomm.local_size()
    if size == 1 or pycomm.num_nodes() > 1:
        pytest.skip("the shm window is used on one node of several ranks")
    old = pycomm.get_options()["shm_chunk_bytes"]
    before = pycomm._C.window_copy_totals()
    pycomm._C.set_window_stores(stores)
    try:
        pycomm.set_options(shm_chunk_bytes=40_003)
        chunked = pycomm._C.shm_pipeline_min_bytes(L, 40_003) // 4 + 1_001
        for n in (5_001, 70_001, chunked):
            for call in range(12 if stores == "auto" else 1):  # auto tries the other stores on its 4th call
                seed = 1400 + n % 89 + call
                x = torch.cat([torch.zeros(1), rank_data(rank, n, torch.float32, seed=seed)])[1:]
                y = pycomm.allreduce(x, algorithm="shm")
                assert_close(y, "sum", size, torch.float32, seed=seed, what=f"shm, {stores} stores [{n}]")
                copies = gather_bytes(comm, y)
                assert all(c == copies[0] for c in copies), f"ranks hold different results ({stores} stores, {n})"
    finally:
        pycomm._C.set_window_stores("auto")
        pycomm.set_options(shm_chunk_bytes=old)
    after = pycomm._C.window_copy_totals()
    cached, streamed = (after[k] - before[k] for k in ("cached_bytes", "streamed_bytes"))
    if stores == "cached":
        assert cached > 0 and streamed == 0, (cached, streamed)
    elif stores == "streaming":
        assert streamed > 0 and cached == 0, (cached, streamed)
    else:
        assert cached > 0 and streamed > 0, (cached, streamed)  # both measured
    with pytest.raises(ValueError, match="choose auto, cached or streaming"):
        pycomm._C.set_window_stores("uncached")


def test_shm_in_one_pass_and_in_chunks_agree_for_two_ranks(comm):
    """With 2 ranks each element is a + b either way, so both forms give bitwise the same sum."""
    if pycomm.size() != 2 or pycomm.num_nodes() > 1:
        pytest.skip("two ranks on one node")
    old = pycomm.get_options()["shm_chunk_bytes"]
    n = pycomm._C.shm_pipeline_min_bytes(2, 65536) // 4 + 999
    x = rank_data(pycomm.rank(), n, torch.float32, seed=1300)
    try:
        pycomm.set_options(shm_chunk_bytes=65536)
        chunked = pycomm.allreduce(x.clone(), algorithm="shm")
        pycomm.set_options(shm_chunk_bytes=0)
        one_pass = pycomm.allreduce(x.clone(), algorithm="shm")
    finally:
        pycomm.set_options(shm_chunk_bytes=old)
    assert torch.equal(chunked, one_pass)
