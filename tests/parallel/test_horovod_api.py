"""pycomm.horovod (Horovod's torch API) against numpy float64 and mpi4py references."""
import numpy as np
import pytest
import torch

import pycomm.horovod as hvd
from refdata import magnitude, rank_data, reference, tolerance

FLOATS = [torch.float32, torch.float64]


def close(got, ref, mag, dtype, size, what):
    # N-term sum in `dtype`: error <= 2 N eps sum|x| plus the final rounding (refdata.tolerance).
    bound = tolerance(dtype, size) * mag + np.abs(ref) * tolerance(dtype, 1)
    err = np.abs(got.double().numpy().reshape(-1) - ref)
    assert np.all(err <= bound), f"{what}: max error {err.max()}"


def test_basics(comm):
    hvd.init()
    assert hvd.is_initialized()
    assert hvd.rank() == comm.rank and hvd.size() == comm.size
    node = comm.Split_type(__import__("mpi4py").MPI.COMM_TYPE_SHARED)
    assert hvd.local_rank() == node.rank and hvd.local_size() == node.size
    assert hvd.cross_size() * hvd.local_size() == hvd.size() and hvd.cross_rank() == 0
    assert hvd.is_homogeneous()
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert not hvd.nccl_built() and not hvd.gloo_built()
    assert hvd.cuda_built() in (True, False)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("count", [1, 7, 1001, 4099])
def test_allreduce_average_out_of_place(dtype, count):
    x = rank_data(hvd.rank(), count, dtype, seed=3)
    before = x.clone()
    y = hvd.allreduce(x)  # Horovod's default: Average, out of place
    assert torch.equal(x, before), "hvd.allreduce must not modify its input"
    ref = reference("avg", hvd.size(), count, dtype, seed=3)
    close(y, ref, magnitude(hvd.size(), count, dtype, seed=3) / hvd.size(), dtype, hvd.size(), "average")


@pytest.mark.parametrize("op,name", [(hvd.Sum, "sum"), (hvd.Min, "min"), (hvd.Max, "max")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_allreduce_ops(op, name, dtype):
    count = 513
    x = rank_data(hvd.rank(), count, dtype, seed=4)
    y = hvd.allreduce(x, op=op)
    ref = reference(name, hvd.size(), count, dtype, seed=4)
    if name == "sum" and dtype.is_floating_point:
        close(y, ref, magnitude(hvd.size(), count, dtype, seed=4), dtype, hvd.size(), name)
    else:
        np.testing.assert_array_equal(y.double().numpy(), ref)
    assert hvd.allreduce(x, average=False).equal(hvd.allreduce(x, op=hvd.Sum))


def test_allreduce_product_and_scales():
    n, r = hvd.size(), hvd.rank()
    x = torch.tensor([1.0 + r, -0.5, 2.0], dtype=torch.float64)
    prod = hvd.allreduce(x, op=hvd.Product)
    ref = np.prod(np.stack([[1.0 + k, -0.5, 2.0] for k in range(n)]), axis=0)
    np.testing.assert_allclose(prod.numpy(), ref, rtol=1e-15)  # products of small exact values: exact in float64
    y = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    ref = 1.5 * np.stack([[1.0 + k, -0.5, 2.0] for k in range(n)]).sum(0)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-15)  # dyadic scales: exact in float64
    with pytest.raises(ValueError, match="prescale_factor/postscale_factor apply to hvd.Sum"):
        hvd.allreduce(x, op=hvd.Max, prescale_factor=2.0)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(x, op=hvd.Adasum)
    with pytest.raises(ValueError, match="either op= or the deprecated average="):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    # Integer Average is Horovod's: the sum times 1/N in float64, truncated (tests/parallel/test_dtypes.py).
    assert torch.equal(hvd.allreduce(torch.full((3,), 7, dtype=torch.int32)), torch.full((3,), 7, dtype=torch.int32))


def test_allreduce_inplace_async_poll_synchronize():
    n = hvd.size()
    x = torch.full((5, 3), float(hvd.rank() + 1))
    h = hvd.allreduce_async_(x, op=hvd.Sum, name="inplace")
    out = hvd.synchronize(h)
    assert out is x and torch.all(x == n * (n + 1) / 2)
    a = torch.arange(6, dtype=torch.float32) * (hvd.rank() + 1)
    h = hvd.allreduce_async(a, name="async")
    while not hvd.poll(h):
        pass
    np.testing.assert_allclose(hvd.synchronize(h).numpy(), np.arange(6) * (n + 1) / 2, rtol=1e-6)  # 1 rounding
    assert hvd.synchronize(h) is None  # Horovod: an unknown handle gives None
    y = hvd.allreduce_(torch.ones(4), op=hvd.Sum)
    assert torch.all(y == n)


@pytest.mark.parametrize("count", [1003, 70001])  # both sides of the handle's inline division (1 << 16)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int32])
def test_allreduce_inplace_average_is_the_sum_divided(dtype, count, comm):
    """allreduce_async_ with hvd.Average (its in-place fast path) is Horovod's Average bit for bit: the
    sum divided by N (fp16: pycomm's pre-divided average, the same as op="avg"), on contiguous,
    non-contiguous (the checked path) and grad-requiring tensors alike."""
    n = hvd.size()
    base = rank_data(hvd.rank(), count, torch.float64 if dtype.is_floating_point else torch.int64, seed=41)
    base = base.to(dtype) if dtype.is_floating_point else (base * 100).to(dtype)
    summed = hvd.allreduce(base.clone(), op=hvd.Sum, name="avg_ref")
    if dtype == torch.float16:
        expected = pycomm_avg(base)
    elif dtype.is_floating_point:
        expected = summed / n
    else:
        expected = (summed.to(torch.float64) / n).to(dtype)  # truncated toward zero, as Horovod
    contiguous = base.clone()
    assert hvd.synchronize(hvd.allreduce_async_(contiguous, name="avg_c")) is contiguous
    assert torch.equal(contiguous, expected)
    strided = torch.stack([base, base], dim=1)[:, 0]  # every other element: not contiguous
    hvd.synchronize(hvd.allreduce_async_(strided, name="avg_s"))
    assert torch.equal(strided, expected)
    if dtype.is_floating_point:
        leaf = base.clone().requires_grad_()
        hvd.synchronize(hvd.allreduce_async_(leaf, name="avg_g"))
        assert torch.equal(leaf.detach(), expected)


def test_inplace_average_divides_by_the_set_size_while_a_rank_has_joined():
    """Horovod's Average counts joined ranks (they add zeros), on the in-place path too."""
    n = hvd.size()
    if n == 1:
        pytest.skip("needs a rank that joins while others allreduce")
    x = torch.full((7,), float(hvd.rank() + 1))
    if hvd.rank() < n - 1:
        hvd.synchronize(hvd.allreduce_async_(x, name="avg_joined"))
        # small integers: the sum is exact, the quotient one correct rounding (torch's division)
        assert torch.equal(x, torch.full((7,), float(sum(range(1, n)))) / n)
    assert 0 <= hvd.join() < n - 1  # the last rank to join: one of those that allreduced


def pycomm_avg(t):
    import pycomm

    return pycomm.allreduce(t.clone(), op="avg")


def test_allreduce_differentiable():
    n = hvd.size()
    w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    y = hvd.allreduce(w * (hvd.rank() + 1), op=hvd.Sum)
    (y * torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)).sum().backward()
    # d/dw of sum_k (k+1) w, seen through the backward allreduce (sum over ranks of the same dy).
    np.testing.assert_allclose(w.grad.numpy(), (hvd.rank() + 1) * n * np.array([1.0, 10.0, 100.0]), rtol=1e-15)
    w2 = torch.ones(4, dtype=torch.float64, requires_grad=True)
    hvd.allreduce(w2 * 2).sum().backward()  # Average forward, Average backward
    np.testing.assert_allclose(w2.grad.numpy(), np.full(4, 2.0), rtol=1e-15)


def test_grouped_allreduce():
    ts = [rank_data(hvd.rank(), c, torch.float64, seed=9 + c) for c in (3, 17, 1)]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum)
    for t, o in zip(ts, outs):
        ref = reference("sum", hvd.size(), t.numel(), torch.float64, seed=9 + t.numel())
        close(o, ref, magnitude(hvd.size(), t.numel(), torch.float64, seed=9 + t.numel()), torch.float64,
              hvd.size(), "grouped")
    h = hvd.grouped_allreduce_async(ts)
    assert len(hvd.synchronize(h)) == 3


def test_compression_fp16():
    x = rank_data(hvd.rank(), 257, torch.float32, seed=12, scale=1.0)
    y = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert y.dtype == torch.float32
    stack = np.stack([rank_data(k, 257, torch.float32, seed=12, scale=1.0).double().numpy()
                      for k in range(hvd.size())])
    ref = stack.mean(0)
    # fp16 wire: each input rounded to fp16 (2^-11 relative) and N-term sums in fp16 (refdata bound).
    bound = tolerance(torch.float16, hvd.size()) * np.abs(stack).sum(0) / hvd.size()
    assert np.all(np.abs(y.double().numpy() - ref) <= bound + 2 ** -11 * np.abs(ref))
    c, ctx = hvd.Compression.fp16.compress(torch.ones(3, dtype=torch.float64))
    assert c.dtype == torch.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype == torch.float64


def test_compression_onebit_needs_name():
    with pytest.raises(ValueError, match="pass name="):
        hvd.allreduce(torch.ones(16), compression=hvd.Compression.onebit)
    y = hvd.allreduce(torch.ones(64), compression=hvd.Compression.onebit, name="ones")
    # Equal inputs of equal magnitude: one-bit scale ||c||/sqrt(n) = 1 reproduces them exactly.
    assert torch.all(y == 1.0)


def test_allgather_and_gradient():
    r, n = hvd.rank(), hvd.size()
    x = torch.full((r + 1, 2), float(r), dtype=torch.float64, requires_grad=True)
    y = hvd.allgather(x)
    ref = np.concatenate([np.full((k + 1, 2), float(k)) for k in range(n)])
    np.testing.assert_array_equal(y.detach().numpy(), ref)
    weights = torch.arange(y.shape[0], dtype=torch.float64).unsqueeze(1)
    (y * weights).sum().backward()
    # Horovod: the gradient is the average over ranks of dy (the same on every rank here), cut to our rows.
    off = sum(k + 1 for k in range(r))
    np.testing.assert_array_equal(x.grad.numpy(), np.repeat(np.arange(off, off + r + 1.0)[:, None], 2, axis=1))


def test_broadcast_forms_and_gradient():
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    x = torch.arange(5, dtype=torch.float32) + 10 * r
    before = x.clone()
    y = hvd.broadcast(x, root_rank=root)
    assert torch.equal(x, before) and torch.equal(y, torch.arange(5, dtype=torch.float32) + 10 * root)
    hvd.broadcast_(x, root_rank=root)
    assert torch.equal(x, y)
    z = torch.zeros(3) + r
    assert torch.all(hvd.synchronize(hvd.broadcast_async(z, 0)) == 0) and torch.all(z == r)
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (hvd.broadcast(w * (r + 1), root_rank=root) * 2).sum().backward()
    expect = 2.0 * (r + 1) if r == root else 0.0  # averaged dy (2 everywhere), kept on the root only
    np.testing.assert_array_equal(w.grad.numpy(), np.full(3, expect))
    with pytest.raises(ValueError, match="root_rank=.* is not a rank"):
        hvd.broadcast(x, root_rank=n)


def test_broadcast_and_allgather_object():
    obj = {"rank": hvd.rank(), "payload": list(range(hvd.rank() * 7))}
    got = hvd.broadcast_object(obj, root_rank=0)
    assert got == {"rank": 0, "payload": []}
    every = hvd.allgather_object(obj)
    assert every == [{"rank": k, "payload": list(range(k * 7))} for k in range(hvd.size())]


def test_alltoall(comm):
    n, r = hvd.size(), hvd.rank()
    rng = np.random.default_rng([21, r])
    splits = rng.integers(0, 4, size=n)
    x = torch.from_numpy(rng.standard_normal((int(splits.sum()), 3)))
    out, received = hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32))
    assert received.dtype == torch.int32
    # Reference: mpi4py's alltoall of the pieces.
    pieces = np.split(x.numpy(), np.cumsum(splits)[:-1])
    ref = comm.alltoall(pieces)
    np.testing.assert_array_equal(out.numpy(), np.concatenate(ref))
    assert received.tolist() == [len(p) for p in ref]
    even = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    got = hvd.alltoall(even)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * k
                                                               for k in range(n)]))
    # Gradient: the alltoall back with the received splits.
    xg = x.clone().requires_grad_(True)
    o, _ = hvd.alltoall(xg, splits=splits.tolist())
    (o * 3).sum().backward()
    np.testing.assert_array_equal(xg.grad.numpy(), np.full(x.shape, 3.0))


@pytest.mark.parametrize("splits", ["float32 tensor", "float list", "bool tensor"])
def test_alltoall_refuses_splits_that_are_not_whole_numbers(splits):
    # Horovod's test_horovod_alltoall_splits_type_error passes torch.empty(size, dtype=float32):
    # garbage that int() turned into different counts on each rank, or into an error on some ranks
    # only, which left the others in the alltoall until the stall watchdog ended the job.
    n, r = hvd.size(), hvd.rank()
    x = torch.ones(n, 2)
    bad = {"float32 tensor": torch.full((n,), float("nan") if r == 0 else 1.0),
           "float list": [1.0] * n,
           "bool tensor": torch.ones(n, dtype=torch.bool)}[splits]
    with pytest.raises(ValueError, match="splits must be"):
        hvd.alltoall(x, bad)
    # Nothing was queued: the next alltoall pairs as usual, with int32 and int64 splits.
    for dtype in (torch.int32, torch.int64):
        out, received = hvd.alltoall(x * r, torch.ones(n, dtype=dtype))
        assert received.tolist() == [1] * n
        np.testing.assert_array_equal(out.numpy(), np.repeat(np.arange(n, dtype=np.float32), 2).reshape(n, 2))


@pytest.mark.parametrize("op,name", [(hvd.Average, "avg"), (hvd.Sum, "sum")])
def test_reducescatter(op, name):
    n, r = hvd.size(), hvd.rank()
    rows = 3 * n + 1
    x = rank_data(r, rows * 2, torch.float64, seed=40).reshape(rows, 2)
    y = hvd.reducescatter(x, op=op)
    parts = [len(p) for p in np.array_split(np.arange(rows), n)]
    begin = sum(parts[:r]) * 2
    ref = reference(name, n, rows * 2, torch.float64, seed=40)[begin:begin + parts[r] * 2]
    mag = magnitude(n, rows * 2, torch.float64, seed=40)[begin:begin + parts[r] * 2]
    close(y, ref, mag, torch.float64, n, "reducescatter")
    xg = x.clone().requires_grad_(True)
    hvd.reducescatter(xg, op=op).sum().backward()
    # Horovod's gradient: ones allgathered (every row), times N for Sum (as its allreduce gradient sums).
    np.testing.assert_allclose(xg.grad.numpy(), np.full((rows, 2), float(n if op == hvd.Sum else 1)),
                               rtol=1e-15)


def test_process_sets(comm):
    n, r = hvd.size(), hvd.rank()
    evens = hvd.add_process_set(hvd.ProcessSet(list(range(0, n, 2))))
    try:
        assert evens.included() == (r % 2 == 0)
        if evens.included():
            assert evens.size() == (n + 1) // 2 and evens.rank() == r // 2
            y = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=evens)
            assert y.item() == sum(range(0, n, 2))
            # root_rank is a world rank, as in Horovod (here the set's last member).
            b = hvd.broadcast(torch.tensor([float(r)]), root_rank=2 * (evens.size() - 1), process_set=evens)
            assert b.item() == 2 * (evens.size() - 1)
            if n > 1:
                with pytest.raises(ValueError, match="root_rank=1 is not a rank of the process set"):
                    hvd.broadcast(torch.ones(1), root_rank=1, process_set=evens)
            assert hvd.allgather_object(r, process_set=evens) == list(range(0, n, 2))
            assert hvd.broadcast_object(r, root_rank=0, process_set=evens) == 0
        else:
            with pytest.raises(ValueError, match="not a member"):
                hvd.allreduce(torch.ones(1), process_set=evens)
        with pytest.raises(ValueError, match="already registered"):
            hvd.add_process_set(list(range(0, n, 2)))
    finally:
        assert hvd.remove_process_set(evens)
    assert not hvd.remove_process_set(evens)
    with pytest.raises(ValueError, match="not registered"):
        evens.size()


@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 6), (3, 3, 4, 5)])
def test_sync_batch_norm_matches_full_batch(comm, shape):
    """Rank r holds rows of one global batch (different counts per rank); compare with torch on the whole batch."""
    n, r = hvd.size(), hvd.rank()
    C = shape[1]
    counts = [shape[0] + k for k in range(n)]
    g = torch.Generator().manual_seed(5)
    full = torch.randn((sum(counts),) + shape[1:], generator=g, dtype=torch.float64) * 3 + 1
    dy_full = torch.randn(full.shape, generator=g, dtype=torch.float64)
    lo = sum(counts[:r])
    mine = full[lo:lo + counts[r]].clone().requires_grad_(True)
    bn = hvd.SyncBatchNorm(C, momentum=0.3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2.0, C, dtype=torch.float64))
        bn.bias.copy_(torch.linspace(-1.0, 1.0, C, dtype=torch.float64))
    ref = torch.nn.BatchNorm1d(C, momentum=0.3).double() if len(shape) < 4 else \
        torch.nn.BatchNorm2d(C, momentum=0.3).double()
    ref.load_state_dict(bn.state_dict())
    full = full.clone().requires_grad_(True)
    y_ref = ref(full)
    (y_ref * dy_full).sum().backward()
    y = bn(mine)
    (y * dy_full[lo:lo + counts[r]]).sum().backward()
    # float64 throughout; sums over a few hundred values in different orders: measured spread < 1e-13.
    np.testing.assert_allclose(y.detach().numpy(), y_ref.detach()[lo:lo + counts[r]].numpy(), atol=1e-12)
    np.testing.assert_allclose(mine.grad.numpy(), full.grad[lo:lo + counts[r]].numpy(), atol=1e-12)
    np.testing.assert_allclose(bn.running_mean.numpy(), ref.running_mean.numpy(), atol=1e-12)
    np.testing.assert_allclose(bn.running_var.numpy(), ref.running_var.numpy(), atol=1e-12)
    # Weight/bias gradients stay local (the optimizer reduces them): their sum over ranks is the full one.
    wsum = comm.allreduce(bn.weight.grad.numpy())
    np.testing.assert_allclose(wsum, ref.weight.grad.numpy(), atol=1e-11)


def test_grouped_allreduce_scales_in_place_and_product():
    """hvd.grouped_allreduce(_)(_async) in one submission: pre/post scaling, the in-place form, a
    non-contiguous member, and hvd.Product (tensor by tensor) against float64 references."""
    n = hvd.size()
    ts = [rank_data(hvd.rank(), c, torch.float64, seed=70 + c) for c in (5, 64, 1)]
    refs = [reference("sum", n, t.numel(), torch.float64, seed=70 + t.numel()) for t in ts]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    for o, r in zip(outs, refs):
        np.testing.assert_allclose(o.numpy(), 2.0 * r, rtol=1e-12, atol=1e-9)
    inplace = [t.clone() for t in ts] + [torch.arange(6, dtype=torch.float64).reshape(2, 3).t()]
    got = hvd.grouped_allreduce_(inplace, op=hvd.Average)
    assert all(g is t for g, t in zip(got, inplace))
    for g, r in zip(got[:3], refs):
        np.testing.assert_allclose(g.numpy(), r / n, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(got[3].numpy(), np.arange(6.0).reshape(2, 3).T)
    small = [torch.full((3,), float(hvd.rank() + 2), dtype=torch.float64)]
    prod = hvd.grouped_allreduce(small, op=hvd.Product)
    np.testing.assert_allclose(prod[0].numpy(), np.full(3, float(np.prod(np.arange(2, n + 2)))))
