"""Device tensors through the engine: stream order, device fusion, the DDP hooks.

Each test runs on every device path this machine has:
- "staging", "direct" and "peer": host tensors standing in for device memory (force_staging:
  pinned-host staging; force_device_direct: a CUDA-aware MPI; force_peer: allreduces by peer reads
  inside the node, with shared-memory objects for CUDA IPC handles). They run the device control flow -- the
  ready/done events (host stand-in events, same pool and counters), the device fusion buffer
  with the CPU pack/unpack kernels, the movers' caches -- on CPU machines.
- "cuda": real CUDA tensors on torch.cuda.current_device() (local rank modulo the GPUs), through
  whichever path the MPI gives (peer or staged, or CUDA-aware), wherever torch sees a GPU.
Results are compared with the host path on the same inputs and with float64 references.
"""
import time
import zlib

import numpy as np
import pytest
import torch

import pycomm
from torch_worlds import gloo_world
from refdata import assert_close, rank_data

MODES = ["staging", "direct", "peer"] + (["cuda"] if torch.cuda.is_available() else [])


def _device(mode):
    if mode != "cuda":
        return torch.device("cpu")
    index = pycomm.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@pytest.fixture(params=MODES)
def mode(request):
    """Switches the engine to the mode's path (collective: every rank runs the same parameters in order)."""
    old = pycomm.get_options()
    m = request.param
    # One staging chunk per fused buffer here, so the staged reduction is the host one element by element.
    pycomm.set_options(force_staging=m == "staging", force_device_direct=m == "direct", force_peer=m == "peer",
                       staging_chunk_bytes=1 << 22, ring_chunk_bytes=4096)
    yield m
    pycomm.set_options(**{k: old[k] for k in ("force_staging", "force_device_direct", "force_peer", "staging_chunk_bytes",
                                              "ring_chunk_bytes", "fusion_threshold_bytes", "cycle_time_ms")})
    if m == "cuda":
        torch.cuda.synchronize()


def _host_options():
    return dict(force_staging=False, force_device_direct=False, force_peer=False)


def _all_submitted():
    """Handle.wait() ends the fusion cycle; every rank queues its whole batch first, so the batch the
    ranks agree on does not depend on which rank waits first."""
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()


def _delta(before, after, key):
    return after[key] - before[key]


@pytest.mark.parametrize("how", ["wait", "synchronize"])
def test_wait_and_synchronize_give_the_result_in_order(mode, how):
    rank, size = pycomm.rank(), pycomm.size()
    dev = _device(mode)
    counts = [1, 17, 4099, 0, 333, 70_001, 5, 1024]
    before = pycomm.stats()
    hs = [pycomm.allreduce_async(rank_data(rank, n, torch.float32, seed=300 + i).to(dev), name=f"so.{i}")
          for i, n in enumerate(counts)]
    last = getattr(hs[-1], how)()
    # The engine runs operations in submission order: once the last is done, so are all before it.
    assert all(h.done() for h in hs)
    for i, h in enumerate(hs):
        y = getattr(h, how)()
        assert y.device == dev
        assert_close(y.cpu(), "sum", size, torch.float32, seed=300 + i, what=f"{mode} {how} so.{i}")
    assert last.data_ptr() == hs[-1].wait().data_ptr()
    after = pycomm.stats()
    # Every operation carried a ready event that the engine waited on, and got a done event.
    assert _delta(before, after, "ready_waits") == len(counts)
    assert 1 <= _delta(before, after, "done_events") <= len(counts)
    if how == "synchronize":  # the host waited on the done event of each handle
        assert _delta(before, after, "event_host_waits") >= len(counts)


def test_events_come_from_a_pool(mode):
    """50 allreduces in a row create a handful of events (the pool), and record two per call."""
    rank, size = pycomm.rank(), pycomm.size()
    dev = _device(mode)
    x = rank_data(rank, 257, torch.float64, seed=310).to(dev)
    pycomm.allreduce(x.clone(), name="pool.warm")
    before = pycomm.stats()
    for _ in range(50):
        y = pycomm.allreduce(x.clone(), name="pool")
    assert_close(y.cpu(), "sum", size, torch.float64, seed=310, what=f"{mode} pool")
    after = pycomm.stats()
    assert _delta(before, after, "events_recorded") >= 2 * 50  # ready + done per call (+ a lane join on CUDA)
    # At most a few in flight at once (the submitter's, the engine's, one held by the live handle).
    assert _delta(before, after, "events_created") <= 4


def test_submit_does_not_block_on_the_producer_stream(mode):
    """CUDA: the producer's kernel is still running when the submit returns; the engine waits for it
    on the device, and the result is the sum of what the kernel wrote. Host stand-in: the same calls,
    the value checked."""
    rank, size = pycomm.rank(), pycomm.size()
    dev = _device(mode)
    x = torch.zeros(100_003, dtype=torch.float32, device=dev)
    t0 = time.perf_counter()
    if mode == "cuda":
        torch.cuda._sleep(int(5e8))  # ~0.25-0.5 s of spinning on the current stream (clock dependent)
    x.fill_(float(rank + 1))  # queued behind the sleep
    h = pycomm.allreduce_async(x, name="producer")
    submit_s = time.perf_counter() - t0
    y = h.wait() * 1.0  # on the current stream, after pycomm's done event
    expect = size * (size + 1) / 2
    assert torch.equal(y.cpu(), torch.full((100_003,), expect, dtype=torch.float32))
    if mode == "cuda":
        # The old submit blocked until the sleep ended (>= 0.25 s); an event record takes microseconds.
        # 0.1 s leaves room for a loaded machine.
        assert submit_s < 0.1, f"submit blocked the host for {submit_s:.3f} s"


def test_errors_reach_wait_and_synchronize(mode):
    rank, size = pycomm.rank(), pycomm.size()
    if size < 2:
        pytest.skip("two ranks are needed to disagree")
    dev = _device(mode)
    names = ["layer1.weight", "layer1.bias"]
    if rank == 1:
        names.reverse()
    hs = [pycomm.allreduce_async(torch.ones(8, device=dev), name=n) for n in names]
    for h, call in zip(hs, ("wait", "synchronize")):
        with pytest.raises(pycomm.CommError, match="layer1"):
            getattr(h, call)()
    # The engine goes on: the next allreduce is right.
    y = pycomm.allreduce(torch.full((5,), float(rank), device=dev), name="after.error")
    assert torch.equal(y.cpu(), torch.full((5,), float(sum(range(size)))))


# Mixed small sizes, one fused batch per call: the threshold is exactly their total, so the batch
# leaves as soon as the last is queued, and the cycle time is long enough that every rank has
# queued them all by then (fewer than 128 tensors).
MIXED = [1, 7, 64, 999, 3, 257, 0, 1234, 33, 4097, 2, 511, 100, 17, 2048, 9]


def _fused_run(dev, dtype, op, seed, algorithm):
    rank = pycomm.rank()
    xs = [rank_data(rank, n, dtype, seed=seed + i).to(dev) for i, n in enumerate(MIXED)]
    before = pycomm.stats()
    hs = [pycomm.allreduce_async(x, op=op, algorithm=algorithm, name=f"mix.{i}") for i, x in enumerate(xs)]
    _all_submitted()
    ys = [h.wait().cpu() for h in hs]
    after = pycomm.stats()
    return ys, before, after


@pytest.mark.parametrize("dtype,op,algorithm", [
    (torch.float32, "sum", "ring"), (torch.float32, "avg", "auto"), (torch.float64, "avg", "ring"),
    (torch.bfloat16, "sum", "ring"), (torch.int64, "sum", "auto"), (torch.int32, "max", "mpi")])
def test_device_fusion_matches_the_host_path(mode, dtype, op, algorithm):
    size = pycomm.size()
    dev = _device(mode)
    seed = 400 + zlib.crc32(f"{dtype} {op} {algorithm}".encode()) % 1000  # the same on every rank
    total = sum(MIXED) * torch.tensor([], dtype=dtype).element_size()
    pycomm.set_options(cycle_time_ms=300.0, fusion_threshold_bytes=total)
    ys, before, after = _fused_run(dev, dtype, op, seed, algorithm)
    assert _delta(before, after, "operations") == len(MIXED)
    assert _delta(before, after, "fused_tensors") == len(MIXED), "the batch did not fuse whole"
    assert _delta(before, after, "rounds") == 1
    assert after["device_fusion_bytes"] > 0
    for i, y in enumerate(ys):
        assert_close(y, op, size, dtype, seed=seed + i, what=f"{mode} fused {algorithm} {op} {dtype} mix.{i}")
    # The host path on the same inputs, also fused in one batch.
    pycomm.set_options(**_host_options())
    host, hb, ha = _fused_run(torch.device("cpu"), dtype, op, seed, algorithm)
    assert _delta(hb, ha, "fused_tensors") == len(MIXED)
    exact = algorithm == "ring" or dtype in (torch.int32, torch.int64) or op == "max"
    for i, (y, h) in enumerate(zip(ys, host)):
        if exact:
            # Same ring (or exact arithmetic) over the same fused buffer: bitwise the host's values.
            assert torch.equal(y, h), f"{mode} mix.{i}: differs from the host path"
        else:
            # auto picks shm on the host and MPI/ring on the device paths: a different summation
            # order, each within the N-term rounding bound of the float64 reference (checked above).
            np.testing.assert_allclose(y.double().numpy(), h.double().numpy(), rtol=0,
                                       atol=4 * size * 2 ** -24 * 100 * size)


def test_fusion_threshold_and_the_cached_buffer(mode):
    rank, size = pycomm.rank(), pycomm.size()
    dev = _device(mode)
    pycomm.set_options(cycle_time_ms=300.0, fusion_threshold_bytes=4096)
    # 5000 floats (20 KB) are above the threshold: they travel alone, the small ones around them fuse.
    counts = [10, 11, 5000, 12, 13]
    before = pycomm.stats()
    hs = [pycomm.allreduce_async(rank_data(rank, n, torch.float32, seed=500 + i).to(dev), name=f"th.{i}")
          for i, n in enumerate(counts)]
    _all_submitted()
    for i, h in enumerate(hs):
        assert_close(h.wait().cpu(), "sum", size, torch.float32, seed=500 + i, what=f"{mode} th.{i}")
    after = pycomm.stats()
    assert _delta(before, after, "fused_tensors") == 4
    assert _delta(before, after, "rounds") == 3

    # The fusion buffer grows geometrically and is then reused: batches of 2^k KiB for k = 0..9,
    # then the largest ten times more, allocate at most 11 blocks (one per doubling, plus the first).
    before = pycomm.stats()
    for k in list(range(10)) + [9] * 10:
        n = (1 << k) * 256 // 2  # two float32 tensors of half the batch each
        pycomm.set_options(fusion_threshold_bytes=(1 << k) * 1024)  # the batch leaves once both are queued
        xs = [torch.full((n,), float(rank + j), device=dev) for j in range(2)]
        hs = [pycomm.allreduce_async(x, name=f"grow.{j}") for j, x in enumerate(xs)]
        _all_submitted()
        for j, h in enumerate(hs):
            assert torch.equal(h.wait().cpu(), torch.full((n,), float(sum(range(size)) + size * j)))
    after = pycomm.stats()
    grown = _delta(before, after, "device_fusion_allocations")
    assert grown <= 11, f"{grown} fusion-buffer allocations for 20 batches"
    assert after["device_fusion_bytes"] >= 512 * 1024
    assert _delta(before, after, "fused_tensors") == 40


@pytest.fixture(scope="module")
def gloo():
    with gloo_world():
        yield


@pytest.mark.parametrize("mode", [m for m in MODES if m != "staging"], indirect=True)
def test_ddp_hook_on_device_buckets(mode, gloo):
    """allreduce_hook on the device's buckets gives the averaged gradient of every rank's batch (the
    hook's code does not depend on the engine's path: the staged one is left to the tests above)."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm import ddp_hooks as hooks

    rank, size = pycomm.rank(), pycomm.size()
    dev = _device(mode)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(9, 40), nn.Tanh(), nn.Linear(40, 3)).to(dev)
    ref = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model, bucket_cap_mb=0.001, device_ids=[dev.index] if mode == "cuda" else None)
    ddp.register_comm_hook(hooks.AllreduceState(prefix="devddp"), hooks.allreduce_hook)
    rng = np.random.default_rng([21, size])
    xs = torch.from_numpy(rng.normal(size=(size, 5, 9)).astype(np.float32))
    ddp(xs[rank].to(dev)).square().sum().backward()
    got = [p.grad.detach().cpu() for p in model.parameters()]
    # Reference: the mean over ranks of each rank's gradient, computed here on the CPU.
    grads = []
    for r in range(size):
        m = nn.Sequential(nn.Linear(9, 40), nn.Tanh(), nn.Linear(40, 3))
        with torch.no_grad():
            for p, q in zip(m.parameters(), ref):
                p.copy_(q.cpu())
        m(xs[r]).square().sum().backward()
        grads.append([p.grad.double() for p in m.parameters()])
    for k, g in enumerate(got):
        want = sum(gr[k] for gr in grads) / size
        # float32 gradients of the same math on CPU and device, averaged in float32: measured
        # differences here are below 1e-5 of the largest gradient entry; 1e-4 relative leaves margin.
        scale = float(want.abs().max()) or 1.0
        assert float((g.double() - want).abs().max()) <= 1e-4 * scale, f"{mode} grad {k}"


# ---------------------------------------------------------------- compressed and c10d submits

def _mode_options(mode):
    return dict(force_staging=mode == "staging", force_device_direct=mode == "direct", force_peer=mode == "peer")


def _same_as_host(got, want, compression, mode, what):
    """Stand-ins run the CPU kernels in the host path's order: bitwise. CUDA: fp16/bf16 bitwise too (the
    same rounding, sums widened to fp32 in the same ring order); onebit's scales may differ in the last
    bit (float64 sums of squares in another order on the GPU; tests/unit/test_kernels_onebit.py's bound)."""
    if mode != "cuda" or compression != "onebit":
        assert torch.equal(got.cpu(), want.cpu()), what
    else:
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5, msg=what)


def _stand_in_waits(before, after, ops, synchronized):
    """The host stand-in's event counters, exactly: per operation the engine orders its lanes after the
    ready event (one stream wait) and blocks on it (one host wait); wait() adds one stream wait (the
    caller's stream after the done event), synchronize() one host wait instead."""
    assert _delta(before, after, "event_stream_waits") == 2 * ops - synchronized
    assert _delta(before, after, "event_host_waits") == ops + synchronized


COMPRESSED_COUNTS = (1, 999, 30_011)


@pytest.mark.parametrize("compression", ["fp16", "bf16", "onebit"])
def test_compressed_submits_are_stream_ordered(mode, compression):
    """pycomm.allreduce_async(compression=...) records a ready event at submit (no host block), the engine
    waits on it and records a done event: ready_waits and done_events move by one per call (compressed
    allreduces never fuse). wait() orders the caller's stream, synchronize() blocks the host. The
    results equal the plain host path's on the same inputs."""
    from pycomm.compression import OneBit

    rank = pycomm.rank()
    dev = _device(mode)
    xs = [rank_data(rank, n, torch.float32, seed=800 + n) for n in COMPRESSED_COUNTS]
    pycomm.set_options(**_host_options())
    host_c = OneBit()
    want = []
    for i, x in enumerate(xs):
        if compression == "onebit":
            want.append(host_c.allreduce_async(x.clone(), name=f"cs.{i}").wait())
        else:
            want.append(pycomm.allreduce(x.clone(), compression=compression))
    pycomm.set_options(**_mode_options(mode))
    dev_c = OneBit()
    before = pycomm.stats()
    synchronized = 0
    for i, x in enumerate(xs):
        xd = x.to(dev, copy=True)  # in place: never the reference's input
        if compression == "onebit":
            h = dev_c.allreduce_async(xd, name=f"cs.{i}")
        else:
            h = pycomm.allreduce_async(xd, compression=compression)
        if i % 2:
            got = h.synchronize()
            synchronized += 1
        else:
            got = h.wait()
        assert got.device == dev
        _same_as_host(got, want[i], compression, mode, f"{mode} {compression} [{xs[i].numel()}]")
    # The blocking form (pycomm.allreduce) carries the events too.
    y = pycomm.allreduce(xs[0].to(dev, copy=True), compression=compression) if compression != "onebit" else None
    after = pycomm.stats()
    calls = len(xs) + (y is not None)
    assert _delta(before, after, "ready_waits") == calls
    assert _delta(before, after, "done_events") == calls
    if y is not None:
        _same_as_host(y, want[0], compression, mode, f"{mode} {compression} blocking")
    if mode != "cuda":
        # pycomm.allreduce returns after the handle's wait().
        _stand_in_waits(before, after, calls, synchronized)


@pytest.mark.parametrize("compression", ["bf16", "onebit"])
def test_compressed_submit_does_not_block_on_the_producer_stream(mode, compression):
    """CUDA: the submit returns while the producer's kernel still runs; the engine waits for it, and the
    result is the compressed allreduce of what the kernel wrote (the host path's on the same values)."""
    from pycomm.compression import OneBit

    rank = pycomm.rank()
    dev = _device(mode)
    n = 100_003
    pycomm.set_options(**_host_options())
    if compression == "onebit":
        want = OneBit().allreduce_async(torch.full((n,), float(rank + 1)), op="sum", name="producer").wait()
    else:
        want = pycomm.allreduce(torch.full((n,), float(rank + 1)), op="sum", compression=compression)
    pycomm.set_options(**_mode_options(mode))
    x = torch.zeros(n, dtype=torch.float32, device=dev)
    t0 = time.perf_counter()
    if mode == "cuda":
        torch.cuda._sleep(int(5e8))  # ~0.25-0.5 s of spinning on the current stream
    x.fill_(float(rank + 1))  # queued behind the sleep
    if compression == "onebit":
        h = OneBit().allreduce_async(x, op="sum", name="producer")
    else:
        h = pycomm.allreduce_async(x, op="sum", compression=compression)
    submit_s = time.perf_counter() - t0
    y = h.wait() * 1.0  # on the current stream, after pycomm's done event
    _same_as_host(y, want, compression, mode, f"{mode} {compression} behind the producer")
    if mode == "cuda":
        # The old submit synchronised the current stream (>= 0.25 s here); an event record takes microseconds.
        assert submit_s < 0.1, f"compressed submit blocked the host for {submit_s:.3f} s"


_BACKENDS = {}


def _world_backend(compression):
    """The torch.distributed backend object over the world engine (group 0), without a default process
    group (this file's DDP test uses gloo for that): its submits count in pycomm.stats()."""
    from mpi4py import MPI

    if compression not in _BACKENDS:
        p2p = MPI.COMM_WORLD.Dup()
        pg = pycomm._C.ProcessGroupPycomm(pycomm.rank(), pycomm.size(), 0, p2p.py2f(), compression)
        _BACKENDS[compression] = (pg, p2p)
    return _BACKENDS[compression][0]


def test_c10d_submits_are_stream_ordered(mode):
    """The c10d backend records a ready event at every submit instead of synchronising the current
    stream; the engine waits on it and records a done event; Work.wait() orders the caller's stream, and
    the future completes as before. One ready wait and one done event per operation, exactly."""
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    rank, size = pycomm.rank(), pycomm.size()
    dev = _device(mode)
    plain, fp16, onebit = _world_backend(""), _world_backend("fp16"), _world_backend("onebit")
    x = rank_data(rank, 10_007, torch.float32, seed=900)
    pycomm.set_options(**_host_options())
    want_fp16 = pycomm.allreduce(x.clone(), op="avg", compression="fp16")
    from pycomm.compression import OneBit
    want_onebit = OneBit().allreduce_async(x.clone(), op="sum", name="c10d").wait()  # fresh residuals, as a new site
    pycomm.set_options(**_mode_options(mode))
    onebit.reset_compression()
    before = pycomm.stats()
    ops = 0

    t = x.to(dev, copy=True)
    plain.allreduce([t], c10d.AllreduceOptions()).wait()
    ops += 1
    assert_close(t.cpu(), "sum", size, torch.float32, seed=900, what=f"{mode} c10d allreduce")

    t = x.to(dev, copy=True)
    opts = c10d.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    fp16.allreduce([t], opts).wait()
    ops += 1
    _same_as_host(t, want_fp16, "fp16", mode, f"{mode} c10d fp16")

    t = x.to(dev, copy=True)
    fut = onebit.allreduce([t], c10d.AllreduceOptions()).get_future()
    got = fut.wait()[0]  # the future completes as before, with the tensor
    ops += 1
    assert got.data_ptr() == t.data_ptr()
    _same_as_host(t, want_onebit, "onebit", mode, f"{mode} c10d onebit")
    worker, server = next(iter(onebit.compression_state()["residuals"].values()))
    assert worker.device == dev and server.device == dev, "the residuals stay on the tensor's device"

    b = torch.full((33,), float(rank), device=dev)
    bopts = c10d.BroadcastOptions()
    bopts.rootRank = size - 1
    plain.broadcast([b], bopts).wait()
    ops += 1
    assert torch.equal(b.cpu(), torch.full((33,), float(size - 1)))

    g_in = torch.full((5,), float(rank), device=dev)
    g_out = torch.empty(5 * size, device=dev)
    plain._allgather_base(g_out, g_in, c10d.AllgatherOptions()).wait()
    ops += 1
    assert torch.equal(g_out.cpu(), torch.arange(size, dtype=torch.float32).repeat_interleave(5))

    r = x.to(dev, copy=True)
    ropts = c10d.ReduceOptions()
    ropts.rootRank = 0
    plain.reduce([r], ropts).wait()
    ops += 1
    if rank == 0:
        assert_close(r.cpu(), "sum", size, torch.float32, seed=900, what=f"{mode} c10d reduce")

    after = pycomm.stats()
    assert _delta(before, after, "ready_waits") == ops
    assert _delta(before, after, "done_events") == ops
    if mode != "cuda":
        # Work.wait() made the caller's stream wait on each done event except the future's op, whose
        # wait orders the stream through torch's future instead.
        assert _delta(before, after, "event_stream_waits") == 2 * ops - 1
        # An allreduce on the peer path is read only on the device: its ready event needs no host wait.
        assert _delta(before, after, "event_host_waits") == ops - _delta(before, after, "peer_allreduces")


@pytest.mark.parametrize("compression", ["", "bf16"])
def test_c10d_submit_does_not_block_on_the_producer_stream(mode, compression):
    from torch._C import _distributed_c10d as c10d

    rank, size = pycomm.rank(), pycomm.size()
    dev = _device(mode)
    pg = _world_backend(compression)
    x = torch.zeros(100_003, dtype=torch.float32, device=dev)
    t0 = time.perf_counter()
    if mode == "cuda":
        torch.cuda._sleep(int(5e8))
    x.fill_(float(rank + 1))
    work = pg.allreduce([x], c10d.AllreduceOptions())
    submit_s = time.perf_counter() - t0
    work.wait()
    y = x * 1.0  # on the current stream, ordered after pycomm's done event
    assert torch.equal(y.cpu(), torch.full((100_003,), float(size * (size + 1) // 2))), f"{mode} {compression!r}"
    if mode == "cuda":
        assert submit_s < 0.1, f"c10d submit blocked the host for {submit_s:.3f} s"


def test_c10d_bodies_do_not_own_their_tensors(mode):
    """reduce, gather and scatter run a body of their own on the engine thread. Their tensors belong to
    the operation's keepalive, dropped after it outside the engine's lock: an op body owning them was
    destroyed under that lock, and dropping a tensor with a Python object takes the GIL, while
    pycomm.stats() here holds the GIL and waits for the lock (a deadlock seen in this file before)."""
    from torch._C import _distributed_c10d as c10d

    rank, size = pycomm.rank(), pycomm.size()
    dev = _device(mode)
    plain = _world_backend("")
    for i in range(20):
        r = torch.full((7,), float(rank + i), device=dev)
        ropts = c10d.ReduceOptions()
        ropts.rootRank = i % size
        plain.reduce([r], ropts).wait()
        pycomm.stats()
        if rank == i % size:
            assert torch.equal(r.cpu(), torch.full((7,), float(sum(range(size)) + size * i)))
        g_in = torch.full((3,), float(rank), device=dev)
        outs = [[torch.empty(3, device=dev) for _ in range(size)]] if rank == 0 else []
        plain.gather(outs, [g_in], c10d.GatherOptions()).wait()
        pycomm.stats()
        if rank == 0:
            for j, o in enumerate(outs[0]):
                assert torch.equal(o.cpu(), torch.full((3,), float(j)))
        s_out = torch.empty(4, device=dev)
        ins = [[torch.full((4,), float(j + i), device=dev) for j in range(size)]] if rank == 0 else []
        plain.scatter([s_out], ins, c10d.ScatterOptions()).wait()
        pycomm.stats()
        assert torch.equal(s_out.cpu(), torch.full((4,), float(rank + i)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the lanes are CUDA streams")
def test_cuda_tensors_outlive_the_engine_that_recorded_them():
    """The bindings record a submitted CUDA tensor on the engine's lanes (recordStream), and torch's
    caching allocator records an event on those streams when the tensor is freed. Freed after its
    engine stopped (here a group's, destroyed; in the field, a residual freed at interpreter exit),
    the tensor once met destroyed streams: `CUDA error: context is destroyed` and an abort at exit,
    first seen on a GPU in bench/gpu_allreduce.py. The lanes now outlive every engine."""
    dev = _device("cuda")
    size = pycomm.size()
    kept = []
    for round_ in range(3):  # each group's engine takes lanes from the pool and gives them back
        group = pycomm.new_group(list(range(size)))
        x = torch.full((1 << 16,), float(round_ + 1), device=dev)
        pycomm.allreduce(x, op="sum", group=group)
        assert torch.equal(x.cpu(), torch.full((1 << 16,), float(size * (round_ + 1))))
        kept.append(x)
        pycomm.destroy_group(group)
    kept.clear()  # freed after their engines stopped: the allocator records on the lanes here
    torch.cuda.synchronize()
    y = torch.ones(5, device=dev)
    pycomm.allreduce(y, op="sum")
    assert torch.equal(y.cpu(), torch.full((5,), float(size)))
