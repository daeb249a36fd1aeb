"""Tensor fusion: queued allreduces are packed, reduced once and unpacked, identically on every rank."""
import time

import pytest
import torch

import pycomm
from refdata import assert_close, assert_not_grown_past, rank_data, shared_seed


def test_many_small_tensors_are_fused_and_correct():
    rank, size = pycomm.rank(), pycomm.size()
    before = pycomm.stats()
    counts = [1, 7, 64, 999, 3, 4097, 0, 12345] * 8
    xs = [rank_data(rank, n, torch.float32, seed=40 + i) for i, n in enumerate(counts)]
    handles = [pycomm.allreduce_async(x, op="sum", name=f"grad.{i}") for i, x in enumerate(xs)]
    for i, h in enumerate(handles):
        assert_close(h.wait(), "sum", size, torch.float32, seed=40 + i, what=f"grad.{i}")
    after = pycomm.stats()
    assert after["operations"] - before["operations"] == len(counts)
    assert after["fused_tensors"] > before["fused_tensors"], "nothing was fused"
    assert after["rounds"] - before["rounds"] < len(counts)


def test_fusion_keeps_dtypes_and_ops_apart():
    rank, size = pycomm.rank(), pycomm.size()
    specs = [(torch.float32, "sum"), (torch.float64, "sum"), (torch.float32, "max"), (torch.float32, "avg"),
             (torch.bfloat16, "sum"), (torch.int32, "min")] * 3
    xs = [rank_data(rank, 301 + i, dt, seed=50 + i) for i, (dt, _) in enumerate(specs)]
    handles = [pycomm.allreduce_async(x, op=op, name=f"t{i}") for i, (x, (_, op)) in enumerate(zip(xs, specs))]
    for i, (h, (dt, op)) in enumerate(zip(handles, specs)):
        assert_close(h.wait(), op, size, dt, seed=50 + i, what=f"t{i} {dt} {op}")


def test_tensor_above_threshold_travels_alone():
    rank, size = pycomm.rank(), pycomm.size()
    old = pycomm.get_options()["fusion_threshold_bytes"]
    pycomm.set_options(fusion_threshold_bytes=4096)
    try:
        xs = [rank_data(rank, n, torch.float32, seed=60 + i) for i, n in enumerate([10, 5000, 10, 10])]
        hs = [pycomm.allreduce_async(x, name=f"s{i}") for i, x in enumerate(xs)]
        for i, h in enumerate(hs):
            assert_close(h.wait(), "sum", size, torch.float32, seed=60 + i, what=f"s{i}")
    finally:
        pycomm.set_options(fusion_threshold_bytes=old)


def test_different_order_is_an_error_naming_the_tensors():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    names = ["layer1.weight", "layer1.bias"]
    if rank == 1:
        names.reverse()
    hs = [pycomm.allreduce_async(torch.ones(8), name=n) for n in names]
    messages = []
    for h in hs:
        with pytest.raises(pycomm.CommError) as err:
            h.wait()
        messages.append(str(err.value))
    assert "'layer1.weight'" in messages[0] and "'layer1.bias'" in messages[0]
    assert "rank 1 passed allreduce 'layer1.bias'" in messages[0]
    # Nothing is lost: the engine goes on.
    assert torch.equal(pycomm.allreduce(torch.ones(3), name="after"), torch.full((3,), float(size)))


def test_stall_warning_names_missing_ranks(capfd):
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs a late rank")
    old = pycomm.get_options()["stall_warning_s"]
    pycomm.set_options(stall_warning_s=0.5)
    try:
        if rank == size - 1:
            time.sleep(2.5)
        pycomm.allreduce(torch.ones(4), name="late.tensor")
    finally:
        pycomm.set_options(stall_warning_s=old)
    pycomm.barrier()
    err = capfd.readouterr().err
    if rank != size - 1:
        assert f"rank {size - 1} has not submitted it" in err, err
        assert "'late.tensor'" in err


def test_grouped_allreduce_is_one_submission_and_fuses():
    """400 small tensors of odd sizes in one call: correct against the float64 reference, every
    result the tensor itself (in place), and far fewer rounds than tensors."""
    rank, size = pycomm.rank(), pycomm.size()
    counts = [1 + (37 * i) % 1023 for i in range(400)]
    xs = [rank_data(rank, n, torch.float32, seed=2000 + i) for i, n in enumerate(counts)]
    before = pycomm.stats()
    h = pycomm.grouped_allreduce_async(xs, op="avg", name="g")
    assert isinstance(h, pycomm.GroupHandle) and len(h) == len(xs)
    outs = h.wait()
    assert h.done() and len(outs) == len(xs)
    for i, (x, y) in enumerate(zip(xs, outs)):
        assert y.data_ptr() == x.data_ptr()
        assert_close(y, "avg", size, torch.float32, seed=2000 + i, what=f"g.{i}")
    after = pycomm.stats()
    assert after["operations"] - before["operations"] == len(xs)
    if size > 1:
        assert after["rounds"] - before["rounds"] <= 2, "a group of 400 small tensors should run in one batch"


def test_grouped_allreduce_mixed_dtypes_ops_out_and_blocking():
    rank, size = pycomm.rank(), pycomm.size()
    specs = [(torch.float32, 5), (torch.float64, 0), (torch.int64, 33), (torch.bfloat16, 301), (torch.float32, 1)]
    xs = [rank_data(rank, n, dt, seed=2500 + i) for i, (dt, n) in enumerate(specs)]
    outs = [torch.empty_like(x) for x in xs]
    copies = [x.clone() for x in xs]
    got = pycomm.grouped_allreduce(xs, op="max", outs=outs)
    for i, (x, c, o, g) in enumerate(zip(xs, copies, outs, got)):
        assert g is o or g.data_ptr() == o.data_ptr()
        assert torch.equal(x, c), "out= must leave the inputs untouched"
        assert_close(g, "max", size, specs[i][0], seed=2500 + i, what=f"max [{i}]")
    assert pycomm.grouped_allreduce([]) == []


def test_grouped_allreduce_bad_input_names_the_tensor():
    good = torch.ones(4)
    with pytest.raises(ValueError, match=r"tensor 'g.1' is not contiguous"):
        pycomm.grouped_allreduce([good, torch.ones(4, 4).t()], name="g")
    with pytest.raises(TypeError, match=r"'tensors\[1\]'.*op='avg' needs a floating-point|op='avg' needs a floating"):
        pycomm.grouped_allreduce([good, torch.ones(3, dtype=torch.int32)], op="avg")
    with pytest.raises(TypeError, match="expected a list or tuple of tensors"):
        pycomm.grouped_allreduce(good)
    with pytest.raises(ValueError, match="outs must be a list of 2 tensors"):
        pycomm.grouped_allreduce([good, good.clone()], outs=[good])
    with pytest.raises(ValueError, match="unknown algorithm"):
        pycomm.grouped_allreduce([good], algorithm="tree")
    # Nothing was submitted: the engine still serves the next call on every rank.
    assert_close(pycomm.allreduce(rank_data(pycomm.rank(), 9, torch.float32, seed=2600)), "sum", pycomm.size(),
                 torch.float32, seed=2600, what="after the refusals")


def test_grouped_allreduce_disagreement_raises_on_every_rank():
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    xs = [torch.ones(8), torch.ones(9 if rank == 1 else 8)]
    with pytest.raises(pycomm.CommError, match="disagree"):
        pycomm.grouped_allreduce(xs, name="d")


def test_grouped_allreduce_with_compression():
    rank, size = pycomm.rank(), pycomm.size()
    xs = [rank_data(rank, n, torch.float32, seed=2700 + n, scale=1.0) for n in (3, 1000)]
    ref = [torch.stack([rank_data(k, x.numel(), torch.float32, seed=2700 + x.numel(), scale=1.0)
                        for k in range(size)]).double().mean(0) for x in xs]
    h = pycomm.grouped_allreduce_async(xs, op="avg", compression="fp16", name="c")
    assert isinstance(h, pycomm.HandleList)
    for y, r in zip(h.wait(), ref):
        # fp16 wire: inputs rounded to fp16 (2^-11 relative) and N-term sums (refdata's bound), |x| <= 1.
        assert float((y.double() - r).abs().max()) <= 2 * size * 2 ** -11 + 2 ** -11


@pytest.mark.parametrize("blocking", [True, False])
def test_grouped_allreduce_above_the_fusion_threshold_runs_in_several_batches(blocking):
    """A group larger than the threshold (blocking: on the caller's thread; async: on the worker)
    splits into batches by the queue's rule, a tensor above the threshold alone."""
    rank, size = pycomm.rank(), pycomm.size()
    old = pycomm.get_options()["fusion_threshold_bytes"]
    pycomm.set_options(fusion_threshold_bytes=4096)
    try:
        counts = [300, 300, 300, 300, 5000, 7, 300, 0, 999]
        xs = [rank_data(rank, n, torch.float32, seed=2800 + i) for i, n in enumerate(counts)]
        before = pycomm.stats()
        outs = (pycomm.grouped_allreduce(xs, name="b") if blocking
                else pycomm.grouped_allreduce_async(xs, name="b").wait())
        for i, y in enumerate(outs):
            assert_close(y, "sum", size, torch.float32, seed=2800 + i, what=f"b.{i}")
        after = pycomm.stats()
        assert after["operations"] - before["operations"] == len(counts)
        if size > 1:
            # 4096 B holds three tensors of 300 floats: [0-2] [3] [4] [5-7] [8] at least.
            assert after["rounds"] - before["rounds"] >= 5
    finally:
        pycomm.set_options(fusion_threshold_bytes=old)


# Half-precision averages are pre-divided by N in fp16/bf16, summed in fp32 and rounded once: 2^-11
# (fp16) or 2^-8 (bf16) relative per input and on the result, for inputs with |x| <= 1.
HALF_EPS = {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}


def check_fused_result(y, op, dtype, count, seed, what):
    """One result of a fused batch against the float64 reference (half averages: rank_data with scale 1)."""
    size = pycomm.size()
    if dtype in HALF_EPS and op == "avg":
        ref = torch.stack([rank_data(k, count, dtype, seed=seed, scale=1.0) for k in range(size)]).double().mean(0)
        assert float((y.double() - ref).abs().max()) <= 2 * HALF_EPS[dtype], what
    else:
        assert_close(y, op, size, dtype, seed=seed, what=what)


@pytest.mark.parametrize("dtype,op", [(torch.float32, "avg"), (torch.float16, "avg"), (torch.int64, "max")])
def test_fused_batch_above_the_cache_runs_chunk_by_chunk(dtype, op):
    """A fused shm batch larger than shm_pipeline_min_bytes is packed and unpacked chunk by chunk:
    tensors straddle chunk boundaries (odd sizes, an odd chunk size), some results out of place;
    checked against the float64 reference."""
    rank, size = pycomm.rank(), pycomm.size()
    if size == 1 or pycomm.num_nodes() > 1:
        pytest.skip("the shm window is used on one node of several ranks")
    old = pycomm.get_options()
    esize = torch.tensor([], dtype=dtype).element_size()
    chunk = 50_001
    pycomm.set_options(shm_chunk_bytes=chunk)
    try:
        # The threshold follows the last-level cache (min(LLC, 32 MiB) / 2L: 8 MiB at 2 ranks, less on a
        # smaller cache). The tensors grow with it, so the batch stays within the engine's 1024 tensors,
        # and the fusion threshold is raised above it: one batch, one round, on any machine.
        target = pycomm._C.shm_pipeline_min_bytes(pycomm.local_size(), chunk) // esize + 3
        span = max(60_013, target // 250 | 1)
        counts, total = [], 0
        while total < target:
            counts.append(1 + (7919 * len(counts)) % span)
            total += counts[-1]
        pycomm.set_options(fusion_threshold_bytes=max(old["fusion_threshold_bytes"], 2 * total * esize))
        # float16: small values so the pre-divided average stays in range and the N-term bound applies.
        xs = [rank_data(rank, n, dtype, seed=3000 + i, scale=1.0 if dtype == torch.float16 else 100.0)
              for i, n in enumerate(counts)]
        outs = [torch.empty_like(x) if i % 3 == 0 else x for i, x in enumerate(xs)]
        before = pycomm.stats()
        # One group, so that the batch is the whole list whatever the machine's load (tensors queued one by
        # one fuse by the cycle's timing: a rank that loses its core for 2 ms would split the batch).
        got = pycomm.grouped_allreduce(xs, op=op, algorithm="shm", outs=outs, name="big")
        assert pycomm.stats()["rounds"] - before["rounds"] == 1
        for i, y in enumerate(got):
            check_fused_result(y, op, dtype, counts[i], 3000 + i, f"big.{i}")
        assert pycomm.stats()["fused_tensors"] > before["fused_tensors"]
        # The window was not grown to hold the batch.
        assert_not_grown_past(before["shm_segment_bytes"], pycomm.stats()["shm_segment_bytes"], total * esize - 1,
                              "shm window")
    finally:
        pycomm.set_options(shm_chunk_bytes=old["shm_chunk_bytes"], fusion_threshold_bytes=old["fusion_threshold_bytes"])


@pytest.mark.parametrize("stores", ["cached", "streaming"])
def test_fused_batch_packs_with_either_stores(stores):
    """A fused batch packed into the window with ordinary or streaming stores (pycomm._C.set_window_stores),
    on one node with each rank's own slice reduced in place in its result tensors: odd sizes (unaligned
    tensor starts in the window, tensors across slice boundaries), some results out of place, a float32
    average (scaled on the way out), a pre-divided bfloat16 average and an integer sum, against the float64
    reference and bitwise across ranks; on one node the chosen stores carried the bytes."""
    from mpi4py import MPI

    rank, size = pycomm.rank(), pycomm.size()
    counts = [1, 4_099, 17, 30_001, 3]
    before = pycomm._C.window_copy_totals()
    pycomm._C.set_window_stores(stores)
    try:
        for dtype, op in ((torch.float32, "avg"), (torch.bfloat16, "avg"), (torch.int64, "sum")):
            scale = 1.0 if dtype == torch.bfloat16 else 100.0
            xs = [rank_data(rank, n, dtype, seed=3100 + i, scale=scale) for i, n in enumerate(counts)]
            outs = [torch.empty_like(x) if i % 2 else x for i, x in enumerate(xs)]
            got = pycomm.grouped_allreduce(xs, op=op, outs=outs, name=f"packed.{dtype}")
            for i, y in enumerate(got):
                check_fused_result(y, op, dtype, counts[i], 3100 + i, f"{stores} stores, tensor {i} {dtype}")
                raw = y.reshape(-1).view(torch.uint8).numpy().tobytes()
                assert len(set(MPI.COMM_WORLD.allgather(raw))) == 1, f"ranks differ: tensor {i} {dtype}"
    finally:
        pycomm._C.set_window_stores("auto")
    after = pycomm._C.window_copy_totals()
    if size > 1 and pycomm.num_nodes() == 1:
        key = "streamed_bytes" if stores == "streaming" else "cached_bytes"
        assert after[key] > before[key], (before, after)


# ---- real CUDA tensors (skipped without a GPU) -----------------------------------------------------

from cuda_cases import needs_cuda, rank_device  # noqa: E402


@needs_cuda
def test_cuda_small_tensors_are_fused_and_correct():
    """CUDA tensors fuse in the mover's device fusion buffer: one pack kernel, one allreduce, one
    unpack with the average's 1/N fused in."""
    rank, size = pycomm.rank(), pycomm.size()
    dev = rank_device()
    before = pycomm.stats()
    counts = [1, 7, 64, 999, 3, 4097, 0, 12345] * 4
    xs = [rank_data(rank, n, torch.float32, seed=140 + i).to(dev) for i, n in enumerate(counts)]
    handles = [pycomm.allreduce_async(x, op="avg", name=f"cgrad.{i}") for i, x in enumerate(xs)]
    for i, h in enumerate(handles):
        assert_close(h.wait().cpu(), "avg", size, torch.float32, seed=140 + i, what=f"cgrad.{i}")
    after = pycomm.stats()
    assert after["operations"] - before["operations"] == len(counts)
    if size > 1:
        assert after["fused_tensors"] > before["fused_tensors"], "nothing was fused"
        assert after["device_fusion_bytes"] > 0


@pytest.fixture
def long_cycle():
    """A fusion cycle far longer than the tests take: the worker surely still holds the batch back
    (or has not woken yet) when the caller waits."""
    old = pycomm.get_options()["cycle_time_ms"]
    pycomm.set_options(cycle_time_ms=500.0)
    yield
    pycomm.set_options(cycle_time_ms=old)


def test_a_waiter_runs_the_held_back_batch_on_its_own_thread(long_cycle, comm):
    rank, size = pycomm.rank(), pycomm.size()
    seed = shared_seed(comm)  # fresh data each run; every rank computes every rank's
    counts = [1, 3, 17, 255, 1000, 4099, 0, 77] * 5
    before = pycomm.stats()
    xs = [rank_data(rank, n, torch.float32, seed=seed + i) for i, n in enumerate(counts)]
    handles = [pycomm.allreduce_async(x, op="sum", name=f"w.{i}") for i, x in enumerate(xs)]
    t0 = time.perf_counter()
    handles[0].wait()
    waited = time.perf_counter() - t0
    for i, h in enumerate(handles):
        assert_close(h.wait(), "sum", size, torch.float32, seed=seed + i, what=f"w.{i}")
    after = pycomm.stats()
    assert after["operations"] - before["operations"] == len(counts)
    # Summed over the ranks: a rank whose worker was, at the moment of the wait, in its check for
    # stall queries (every 100 ms while idle) leaves the batch to that worker, rightly.
    ran_by_waiters = comm.allreduce(after["waiter_batches"] - before["waiter_batches"])
    assert ran_by_waiters > 0, "the waiters left the batch to the workers"
    # The batch ran when asked for, not at the end of the 500 ms cycle. Measured (20 repetitions at
    # each world size, 2 cores): at most 0.05, 0.43, 1.92 and 0.93 ms at 1-4 ranks; 250 ms leaves
    # room for a rank that loses its core for several time slices.
    assert waited < 0.25, f"the first wait took {waited * 1e3:.0f} ms: the cycle was waited out"


def test_a_waiter_on_one_rank_pairs_with_the_worker_on_another(long_cycle):
    """Rank 0 waits at once (its thread runs the batch); the others poll until their workers run it
    at the cycle's end. One coordination round joins the two paths."""
    rank, size = pycomm.rank(), pycomm.size()
    counts = [5, 300, 2049, 1, 64] * 3
    xs = [rank_data(rank, n, torch.float64, seed=900 + i) for i, n in enumerate(counts)]
    handles = [pycomm.allreduce_async(x, op="max" if i % 2 else "sum", name=f"p.{i}") for i, x in enumerate(xs)]
    if rank != 0:
        deadline = time.monotonic() + 30
        while not all(h.done() for h in handles):
            assert time.monotonic() < deadline, "the worker never ran the batch"
            time.sleep(0.005)
    for i, h in enumerate(handles):
        assert_close(h.wait(), "max" if i % 2 else "sum", size, torch.float64, seed=900 + i, what=f"p.{i}")


def test_a_waiter_runs_batches_paired_by_name_in_any_order(long_cycle, comm):
    """pair_by_name: each rank submits the names in its own order and waits on its first handle; the
    waiting threads run the rounds (parking what others have not submitted yet) and every result is
    right."""
    rank, size = pycomm.rank(), pycomm.size()
    pycomm.set_options(pair_by_name=True)
    try:
        before = pycomm.stats()
        order = list(range(9))
        order = order[rank % len(order):] + order[:rank % len(order)]  # a different order on every rank
        xs = {i: rank_data(rank, 100 + 37 * i, torch.float32, seed=950 + i) for i in order}
        handles = {i: pycomm.allreduce_async(xs[i], name=f"n.{i}") for i in order}
        for i in order:
            assert_close(handles[i].wait(), "sum", size, torch.float32, seed=950 + i, what=f"n.{i}")
        # Summed over the ranks: which rank's thread runs a given round (a waiter, or a worker once its
        # waiter has found its own operation parked) depends on the timing.
        assert comm.allreduce(pycomm.stats()["waiter_batches"] - before["waiter_batches"]) > 0
    finally:
        pycomm.set_options(pair_by_name=False)
