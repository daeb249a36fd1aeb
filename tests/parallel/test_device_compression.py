"""Compressed allreduce (fp16, bf16, onebit) of device tensors, on both device paths.

The device form (csrc/comm/device_compressed_allreduce.cpp) runs every kernel on the tensor's
memory through a table of device operations and sends only compressed bytes:
  staged -- through the engine's pinned host chunks (an MPI that cannot read device memory);
  direct -- device pointers handed to MPI (a CUDA-aware MPI).
Here host tensors stand in for device memory (force_staging / force_device_direct: the table of
CPU kernels, the host mover); on a machine with a GPU the same tests also run on CUDA tensors
(the CUDA kernels). Every result is compared with the plain host compressed path of the same
inputs, value by value.

tests/test_parallel.py also runs this file on virtual nodes (PYCOMM_RANKS_PER_NODE): 4 ranks as 2x2
and 4x1, 3 ranks as 2+1, 2 ranks as 2x1. Across nodes of equal size with several ranks each (2x2)
the host path runs the hierarchical form, and so do both device paths
(device_hierarchical_compressed_allreduce); elsewhere both run the flat form. Every comparison with
the host path above then compares like with like.
"""
import contextlib
import io

import numpy as np
import pytest
import torch

import pycomm
import pycomm.compression
from pycomm import _C
from pycomm.compression import OneBit
from compression_ref import layout
from refdata import rank_data

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PATHS = ["staged", "direct"]
COUNTS = (1, 7, 1001, 30_011)  # odd, and not multiples of the world size or of 8N


def on(device, t):
    return t.to(f"cuda:{torch.cuda.current_device()}") if device == "cuda" else t.clone()


@contextlib.contextmanager
def device_path(path, device, staging_chunk_bytes=1 << 20):
    """Run the block on `path`; a CUDA tensor on the direct path needs a CUDA-aware MPI
    (callers check direct_applies first)."""
    old = pycomm.get_options()
    options = ({"force_staging": True, "staging_chunk_bytes": staging_chunk_bytes} if path == "staged"
               else {"force_device_direct": True, "ring_chunk_bytes": 4096})  # several ring chunks per segment
    pycomm.set_options(**options)
    try:
        yield
    finally:
        pycomm.set_options(**{k: old[k] for k in options})


def direct_applies(path, device):
    return not (path == "direct" and device == "cuda" and not _C.mpi_cuda_aware())


def skip_unless_applies(path, device):
    if not direct_applies(path, device):
        pytest.skip("this MPI cannot read device memory: the direct path's refusal is "
                    "test_cuda_combinations_that_cannot_apply")


def hierarchical_form(topo):
    """The choice rule of the host path, which the device paths follow: nodes of equal size with several
    ranks each."""
    return topo.num_nodes > 1 and topo.homogeneous and topo.local_size > 1


def expected_wire_bytes(compression, count, topo):
    """Bytes this rank sends between ranks: the hierarchical form sends only its slice's compressed
    bytes among the M ranks of its cross communicator; the flat form sends over all N ranks."""
    if hierarchical_form(topo):
        L, l = topo.local_size, topo.local_rank
        begin, end = (j * (count // L) + min(j, count % L) for j in (l, l + 1))
        return _C.compressed_wire_bytes(compression, end - begin, topo.num_nodes, pycomm.cross_comm().rank)
    return _C.compressed_wire_bytes(compression, count, topo.size, topo.rank)


def half_sums_alike(path, staging_chunk_bytes, count, topo):
    """Whether the device path adds the fp16/bf16 terms in the host path's order: always direct (the
    same ring over the whole half buffer); staged when each slice's half buffer fits one staging chunk
    (else one ring per chunk), or when the ring has two ranks (one addition, commutative)."""
    ring = topo.num_nodes if hierarchical_form(topo) else topo.size
    elems = -(-count // topo.local_size) if hierarchical_form(topo) else count
    return path == "direct" or ring <= 2 or 2 * elems <= staging_chunk_bytes


def bitwise(device):
    """Host stand-ins run the same CPU kernels in the same order as the host path: bitwise equal.
    CUDA: fp16/bf16 too (the same round-to-nearest-even cast, partial sums widened to fp32, added
    and rounded once per hop in the same ring order); onebit's scales sum their squares in float64
    in another order on the GPU, so they may differ in the last bit."""
    return device == "cpu"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_half_compression_matches_the_host_path(compression, path, device):
    skip_unless_applies(path, device)
    rank = pycomm.rank()
    for count in COUNTS:
        for op in ("avg", "sum"):
            x = rank_data(rank, count, torch.float32, seed=300 + count)
            want = pycomm.allreduce(x.clone(), op=op, compression=compression)
            with device_path(path, device):
                got = pycomm.allreduce(on(device, x), op=op, compression=compression)
                out = torch.full_like(on(device, x), -7.0)
                h = pycomm.allreduce_async(on(device, x), op=op, compression=compression, out=out)
                h.wait()
            what = f"{compression} {op} {path} {device} [{count}]"
            assert got.device.type == device and out.device.type == device, what
            # Bitwise on the stand-ins and on CUDA alike (see bitwise()): the half buffer fits one staging chunk.
            assert torch.equal(got.cpu(), want), what
            assert torch.equal(out.cpu(), want), what


@pytest.mark.parametrize("device", DEVICES)
def test_staged_half_compression_over_many_chunks(device):
    """The staged pipeline cuts the half buffer into chunks, one ring each. Integers below 64 in
    bf16 with op=sum add exactly in any order (sums of up to 4 ranks stay below 256, bf16's exact
    integer range), so the result equals the exact sum bitwise whatever the chunking."""
    rank, size = pycomm.rank(), pycomm.size()
    for count, chunk in ((13, 2), (5001, 46), (5001, 1000)):  # chunk bytes of bf16: 1, 23 and 500 elements
        ints = [torch.from_numpy(np.random.default_rng(400 + r).integers(-63, 64, count).astype(np.float32))
                for r in range(size)]
        exact = torch.stack(ints).sum(0)
        with device_path("staged", device, staging_chunk_bytes=chunk):
            got = pycomm.allreduce(on(device, ints[rank]), op="sum", compression="bf16")
        assert torch.equal(got.cpu(), exact), f"staged bf16 chunk {chunk} [{count}]"


def onebit_steps(c, device, path, counts, steps, mask=False):
    """`steps` onebit allreduces per count, fresh data each step (the residuals carry over);
    device None: host tensors on the plain host path. mask: every third element masked out."""
    results, wire = [], []
    rank = pycomm.rank()
    ctx = device_path(path, device) if path else contextlib.nullcontext()
    with ctx:
        for s in range(steps):
            for count in counts:
                x = rank_data(rank, count, torch.float32, seed=500 + 17 * s + count)
                m = on(device, (torch.arange(count) % 3 != 0).to(torch.uint8)) if mask and count > 1 else None
                h = c.allreduce_async(on(device, x), op="avg" if s % 2 == 0 else "sum", name=f"t{count}", mask=m)
                results.append(h.wait().cpu().clone())
                wire.append(h.wire_bytes)
    return results, wire


def assert_same(a, b, device, what):
    if bitwise(device):
        assert torch.equal(a.cpu(), b.cpu()), what
    else:
        # The CUDA scales may differ in the last bit (float64 sums of squares in another order):
        # tests/unit/test_kernels_onebit.py bounds CUDA against CPU at 1e-6 (scales) and 1e-5
        # (residuals); not yet measured through a whole collective on a GPU.
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-5, msg=what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("masked", [False, True])
def test_onebit_matches_the_host_path(masked, path, device):
    skip_unless_applies(path, device)
    host, dev = OneBit(), OneBit()
    want, want_wire = onebit_steps(host, None, None, COUNTS, 3, mask=masked)
    got, got_wire = onebit_steps(dev, device, path, COUNTS, 3, mask=masked)
    for i, (a, b) in enumerate(zip(want, got)):
        assert_same(b, a, device, f"onebit {path} {device} call {i}")
    assert got_wire == want_wire
    assert got_wire[-1] == expected_wire_bytes("onebit", COUNTS[-1], pycomm.topology())
    for count in COUNTS:
        (hw, hs), (dw, ds) = host.residuals(f"t{count}"), dev.residuals(f"t{count}")
        assert dw.device.type == device and ds.device.type == device, "residuals stay on the tensor's device"
        assert_same(dw, hw, device, f"worker residual [{count}]")
        assert_same(ds, hs, device, f"server residual [{count}]")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_onebit_device_residuals_round_trip_through_state_dict(path, device):
    skip_unless_applies(path, device)
    counts = (9, 3001)
    c = OneBit()
    onebit_steps(c, device, path, counts, 2)
    state = c.state_dict()
    for count in counts:
        r = state["residuals"][f"t{count}"]
        assert r["worker"].device.type == device and r["server"].device.type == device
        assert r["worker"].abs().sum() > 0, "two steps leave a nonzero worker residual"
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored = OneBit()
    restored.load_state_dict(torch.load(buf))
    to_host = OneBit()  # the same state on the plain host path
    to_host.load_state_dict({**state, "residuals": {k: {n: t.cpu() for n, t in v.items()}
                                                    for k, v in state["residuals"].items()}})
    a, _ = onebit_steps(c, device, path, counts, 1)
    b, _ = onebit_steps(restored, device, path, counts, 1)
    h, _ = onebit_steps(to_host, None, None, counts, 1)
    for i in range(len(counts)):
        assert torch.equal(a[i], b[i]), "the same state on the same path: bitwise"
        assert_same(a[i], h[i], device, "device path after loading, against the host path")
    for count in counts:
        for x, y in zip(c.residuals(f"t{count}"), restored.residuals(f"t{count}")):
            assert torch.equal(x.cpu(), y.cpu())
            assert y.device.type == device, "loaded residuals follow the tensor to its device"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_bad_input_is_reported_on_the_device_paths(path, device):
    """inf/NaN on one rank: every rank raises CommError naming it; nothing is written, no
    residual changes; a float16 sum that overflows on the way is an error, never an inf."""
    skip_unless_applies(path, device)
    rank, size = pycomm.rank(), pycomm.size()
    x = rank_data(rank, 1001, torch.float32, seed=600)
    if rank == size - 1:
        x[500] = float("nan")
    c = OneBit()
    with device_path(path, device):
        c.allreduce_async(on(device, rank_data(rank, 1001, torch.float32, seed=601)), name="g").wait()
        before = [t.clone() for t in c.residuals("g")]
        for compression in ("fp16", "bf16", c):
            out = torch.zeros(1001, device=on(device, x).device)
            with pytest.raises(pycomm.CommError, match=f"rank {size - 1} passed a tensor with inf or NaN"):
                if compression is c:
                    c.allreduce_async(on(device, x), name="g", out=out).wait()
                else:
                    pycomm.allreduce(on(device, x), compression=compression, out=out)
            assert torch.all(out == 0), "nothing may be written"
        for a, b in zip(before, c.residuals("g")):
            assert torch.equal(a, b), "no residual may change"
        if size >= 2:
            big = on(device, torch.full((333,), 60000.0))
            with pytest.raises(pycomm.CommError, match="the sum overflowed float16; nothing was written"):
                pycomm.allreduce(big, op="sum", compression="fp16")
            assert torch.all(big == 60000.0)
        y = pycomm.allreduce(on(device, torch.ones(5)), op="sum", compression="fp16")  # the engine goes on
    assert torch.equal(y.cpu(), torch.full((5,), float(size)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_no_allocation_per_call(path, device):
    """The device form's working memory is kept between calls (pycomm.stats(): compressed_cache_* and,
    for the ring's slots, device_cache_*): after the first call of a size, more calls of that size
    allocate nothing."""
    skip_unless_applies(path, device)
    rank = pycomm.rank()
    c = OneBit()
    with device_path(path, device):
        for compression in ("bf16", c):
            x = on(device, rank_data(rank, 20_001, torch.float32, seed=700))
            for i in range(4):
                if compression is c:
                    c.allreduce_async(x.clone(), name="w").wait()
                else:
                    pycomm.allreduce(x.clone(), compression=compression)
                if i == 0:
                    first = pycomm.stats()
            after = pycomm.stats()
            assert after["device_cache_allocations"] == first["device_cache_allocations"], compression
            assert after["compressed_cache_allocations"] == first["compressed_cache_allocations"], compression
            assert after["compressed_cache_bytes"] >= 2 * 20_001, "the half buffer at least"


def test_tensors_on_other_devices_are_refused():
    # A compressor used directly (pycomm.allreduce checks the device before it gets there).
    with pytest.raises(ValueError, match="handles CPU and CUDA tensors; tensor 'm' is on meta"):
        pycomm.compression.FP16().allreduce_async(torch.empty(4, device="meta"), name="m")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA tensors")
def test_cuda_combinations_that_cannot_apply():
    """Mixed devices are refused, not copied behind the caller's back; the direct path with an MPI
    that cannot read device memory is refused, not attempted."""
    dev = torch.device(f"cuda:{torch.cuda.current_device()}")
    x = torch.ones(100, device=dev)
    with pytest.raises(ValueError, match=r"out 'x' is torch.float32\[100\] on cpu, expected .* on cuda"):
        pycomm.allreduce(x, compression="fp16", out=torch.zeros(100), name="x")
    with pytest.raises(ValueError, match="out is on cpu but tensor 'x' on cuda"):
        pycomm.compression.FP16().allreduce_async(x, out=torch.zeros(100), name="x")
    c = OneBit()
    with pytest.raises(ValueError, match="mask 'x' is on cpu, the tensor on cuda"):
        c.allreduce_async(x, name="x", mask=torch.ones(100, dtype=torch.uint8))
    if not _C.mpi_cuda_aware():
        with device_path("direct", "cuda"):
            with pytest.raises(pycomm.CommError, match="force_device_direct.*cannot read device memory"):
                pycomm.allreduce(x, compression="bf16")


# ---------------------------------------------------------------- across nodes

@pytest.mark.parametrize("device", DEVICES)
# staged with 4 KiB chunks: the node stage's copies and the cross-node ring in many pieces
@pytest.mark.parametrize("path,staging_chunk_bytes", [("staged", 1 << 20), ("staged", 4096), ("direct", 1 << 20)])
def test_the_device_paths_take_the_host_form(path, staging_chunk_bytes, device):
    """Across nodes (2x2) the device paths run the hierarchical form like the host path: the wire bytes
    (the cross-node stage's only) show which form ran, and the results and residuals equal the host
    form's. Bitwise on the stand-ins for all three (the same CPU kernels; the node's float32 sum in the
    window's order on both device paths; at 2x2 each cross-node sum has two terms, so even the staged
    ring cut into 4 KiB chunks adds them alike) and on CUDA for fp16/bf16; CUDA onebit within
    assert_same's bound; the staged flat form over 3-4 ranks in 4 KiB chunks within a measured bound. 4x1, 2x1, 2+1 and one node: the flat form on every path (2+1: nodes of unequal
    size, as the host path chooses)."""
    skip_unless_applies(path, device)
    topo = pycomm.topology()
    rank = topo.rank
    for compression in ("fp16", "bf16", "onebit"):
        host_c, dev_c = OneBit(), OneBit()
        for step, count in enumerate(COUNTS * 2):  # twice: the onebit residuals of the first round feed the second
            x = rank_data(rank, count, torch.float32, seed=1000 + 31 * step + count)
            op = "avg" if step % 2 == 0 else "sum"
            name = f"form.{count}"
            if compression == "onebit":
                host = host_c.allreduce_async(x.clone(), op=op, name=name)
            else:
                host = pycomm.allreduce_async(x.clone(), op=op, compression=compression)
            want = host.wait()
            with device_path(path, device, staging_chunk_bytes=staging_chunk_bytes):
                if compression == "onebit":
                    h = dev_c.allreduce_async(on(device, x), op=op, name=name)
                else:
                    h = pycomm.allreduce_async(on(device, x), op=op, compression=compression)
                got = h.wait()
            what = f"{compression} {op} {path} {device} [{count}] step {step}"
            assert host.wire_bytes == expected_wire_bytes(compression, count, topo), what
            assert h.wire_bytes == host.wire_bytes, f"{what}: the device path took another form"
            if compression == "onebit":
                assert_same(got, want, device, what)
            elif half_sums_alike(path, staging_chunk_bytes, count, topo):
                assert torch.equal(got.cpu(), want), what  # bitwise on CUDA too (see bitwise())
            else:
                # The staged ring of the flat form over 3-4 ranks, cut into 4 KiB chunks: one ring per
                # chunk, the same terms added in another order. Tolerance: twice the bound of each result
                # against the exact one (hops + casts, as test_hierarchical.py), 2 (R+1) eps sum_k |w x_k|
                # for R ranks in the ring; measured spread at most 3.8 eps sum_k |w x_k| at 4 ranks and
                # 3.1 at 3 (fp16 and bf16, counts 1001-200003, 3 seeds each), against 10 and 8 allowed.
                eps = 2.0 ** -11 if compression == "fp16" else 2.0 ** -8
                w = 1.0 / topo.size if op == "avg" else 1.0
                mag = sum(rank_data(r, count, torch.float32, seed=1000 + 31 * step + count).double().abs() * w
                          for r in range(topo.size))
                ring = topo.num_nodes if hierarchical_form(topo) else topo.size
                diff = (got.cpu().double() - want.double()).abs()
                assert bool(torch.all(diff <= 2 * (ring + 1) * eps * mag)), what
        for count in COUNTS if compression == "onebit" else ():
            (hw, hs), (dw, ds) = host_c.residuals(f"form.{count}"), dev_c.residuals(f"form.{count}")
            assert dw.shape == (count,) and ds.shape == (layout(count, topo.size)[1],), \
                "the residuals keep the flat layout's shapes"
            assert dw.device.type == device and ds.device.type == device
            assert_same(dw, hw, device, f"{path} worker residual [{count}]")
            assert_same(ds, hs, device, f"{path} server residual [{count}]")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", [None] + PATHS)
def test_node_sums_out_of_range_across_nodes(path, device):
    """The hierarchical form sums each node in float32 before compressing: a node sum beyond float32
    (onebit) or a cross-node sum beyond the half format is reported on every rank, on the host path
    and on both device paths alike, before any output or residual is written."""
    topo = pycomm.topology()
    if not hierarchical_form(topo):
        pytest.skip("the node sums exist in the hierarchical form only (nodes of equal size, several ranks each)")
    if path is None and device == "cuda":
        pytest.skip("path None is the host path, on host tensors")
    if path:
        skip_unless_applies(path, device)
    dev = device if path else "cpu"
    c = OneBit()
    ctx = device_path(path, device) if path else contextlib.nullcontext()
    with ctx:
        c.allreduce_async(on(dev, torch.ones(1001)), op="sum", name="big").wait()
        before = [t.clone() for t in c.residuals("big")]
        # Every input is finite (and fits the half format); two of them on one node are not.
        cases = (("onebit", 2e38, "the sum of a node's inputs overflowed float32"),
                 ("bf16", 2e38, "the sum overflowed bfloat16; nothing was written"),
                 ("fp16", 40000.0, "the sum overflowed float16; nothing was written"))
        for compression, value, message in cases:
            x = on(dev, torch.full((1001,), value))
            out = on(dev, torch.zeros(1001))
            with pytest.raises(pycomm.CommError, match=message):
                if compression == "onebit":
                    c.allreduce_async(x, op="sum", name="big", out=out).wait()
                else:
                    pycomm.allreduce(x, op="sum", compression=compression, out=out)
            assert torch.all(out == 0), f"{compression}: nothing may be written"
        for a, b in zip(before, c.residuals("big")):
            assert torch.equal(a, b), "no residual may change"
