"""The torch.distributed backend "pycomm": every supported c10d op against gloo's result on the same data."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import pycomm
import pycomm.distributed  # noqa: F401  (registers "pycomm", provides the rendezvous)
from torch_worlds import pycomm_world

# float32 sums in a different reduction order than gloo's: each element differs by at most
# 2N eps * sum_k |x_k| (refdata.tolerance); with |x| <= 1 and N <= 4 that is < 1e-6.
F32_ATOL = 2 * 4 * 2 ** -24 * 4


@pytest.fixture(scope="module")
def gloo():
    with pycomm_world():
        assert dist.get_backend() == "pycomm"
        assert (dist.get_rank(), dist.get_world_size()) == (pycomm.rank(), pycomm.size())
        yield dist.new_group(backend="gloo")


def data(seed, shape, dtype=torch.float32, rank=None):
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(seed * 101 + rank)
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=dtype)


def same(a, b, dtype=torch.float32, atol=F32_ATOL):
    if dtype.is_floating_point:
        assert torch.allclose(a.double(), b.double(), rtol=0, atol=atol), (a - b).abs().max()
    else:
        assert torch.equal(a, b)


OPS = {"SUM": dist.ReduceOp.SUM, "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX,
       "PRODUCT": dist.ReduceOp.PRODUCT}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("op", ["SUM", "MIN", "MAX", "PRODUCT", "AVG"])
def test_all_reduce(gloo, op, dtype):
    if op == "AVG" and not dtype.is_floating_point:
        pytest.skip("AVG is for floating point")
    for count in (0, 1, 7, 1001, 100003):
        x = data(1, (count,), dtype)
        if op == "PRODUCT" and dtype.is_floating_point:
            x = 1 + x / 4  # products of N factors in [0.75, 1.25] stay well inside float32
        if op == "PRODUCT" and not dtype.is_floating_point:
            x = x % 3 - 1
        mine, ref = x.clone(), x.clone()
        if op == "AVG":
            work = dist.all_reduce(mine, op=dist.ReduceOp.AVG, async_op=True)
            dist.all_reduce(ref, op=dist.ReduceOp.SUM, group=gloo)
            ref /= dist.get_world_size()
        else:
            work = dist.all_reduce(mine, op=OPS[op], async_op=True)
            dist.all_reduce(ref, op=OPS[op], group=gloo)
        assert work.wait()
        assert work.is_completed() and work.is_success()
        same(mine, ref, dtype)


def test_all_reduce_future_and_half_types(gloo):
    x = data(2, (513,))
    fut = dist.all_reduce(x.clone(), async_op=True).get_future()
    ref = x.clone()
    dist.all_reduce(ref, group=gloo)
    same(fut.wait()[0], ref)
    for dtype in (torch.float16, torch.bfloat16):
        h = x.to(dtype)
        href = h.float()
        dist.all_reduce(h)
        dist.all_reduce(href, group=gloo)  # float32 sum of the same rounded inputs
        # pycomm combines in fp32 and rounds each partial sum once to dtype (at most N-1 roundings);
        # partial sums stay below 4 in magnitude, where an ulp is 2**-9 (fp16) or 2**-6 (bf16); bound
        # each rounding by half the ulp of [4, 8) to be safe.
        ulp = (2 ** -10 if dtype == torch.float16 else 2 ** -7) * 4
        same(h, href, dtype, atol=dist.get_world_size() * ulp / 2 + F32_ATOL)


def test_broadcast_every_root(gloo):
    for root in range(dist.get_world_size()):
        x = data(3, (1001,))
        dist.broadcast(x, src=root)
        assert torch.equal(x, data(3, (1001,), rank=root))


def test_all_gather_and_into_tensor(gloo):
    n = dist.get_world_size()
    x = data(4, (5, 3), torch.float64)
    outs, refs = [torch.empty(5, 3, dtype=torch.float64) for _ in range(n)], [torch.empty(5, 3, dtype=torch.float64)
                                                                              for _ in range(n)]
    dist.all_gather(outs, x)
    dist.all_gather(refs, x, group=gloo)
    for a, b in zip(outs, refs):
        assert torch.equal(a, b)
    flat = torch.empty(n * 5, 3, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, x)
    assert torch.equal(flat, torch.cat(refs))


def test_reduce_scatter_and_tensor(gloo):
    n = dist.get_world_size()
    for count in (1, 17):
        inputs = [data(5 + i, (count,)) for i in range(n)]
        out, ref = torch.empty(count), torch.empty(count)
        dist.reduce_scatter(out, [t.clone() for t in inputs])
        dist.reduce_scatter(ref, [t.clone() for t in inputs], group=gloo)
        same(out, ref)
        big = torch.cat(inputs)
        out2 = torch.empty(count)
        dist.reduce_scatter_tensor(out2, big)
        same(out2, ref)
        dist.reduce_scatter_tensor(out2, big, op=dist.ReduceOp.MAX)
        ref_max = torch.empty(count)
        dist.reduce_scatter_tensor(ref_max, big.clone(), op=dist.ReduceOp.MAX, group=gloo)
        assert torch.equal(out2, ref_max)


def test_all_to_all_single_equal_and_uneven(gloo):
    rank, n = dist.get_rank(), dist.get_world_size()
    x = data(6, (n * 3, 2))
    out, ref = torch.empty(n * 3, 2), torch.empty(n * 3, 2)
    dist.all_to_all_single(out, x)
    dist.all_to_all_single(ref, x, group=gloo)
    assert torch.equal(out, ref)
    # uneven: rank r sends (r + j) % 3 rows to rank j (zero rows included)
    send = [(rank + j) % 3 for j in range(n)]
    recv = [(j + rank) % 3 for j in range(n)]
    x = data(7, (sum(send), 4), torch.int64)
    out, ref = torch.empty(sum(recv), 4, dtype=torch.int64), torch.empty(sum(recv), 4, dtype=torch.int64)
    dist.all_to_all_single(out, x, recv, send)
    dist.all_to_all_single(ref, x, recv, send, group=gloo)
    assert torch.equal(out, ref)
    outs = [torch.empty(recv[j], 4, dtype=torch.int64) for j in range(n)]
    dist.all_to_all(outs, list(x.split(send)))
    assert torch.equal(torch.cat(outs), ref)


def test_reduce_gather_scatter(gloo):
    rank, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        x = data(8, (33,))
        mine, ref = x.clone(), x.clone()
        dist.reduce(mine, dst=root)
        dist.reduce(ref, dst=root, group=gloo)
        if rank == root:
            same(mine, ref)
        g = [torch.empty(33) for _ in range(n)] if rank == root else None
        dist.gather(x, g, dst=root)
        if rank == root:
            for r in range(n):
                assert torch.equal(g[r], data(8, (33,), rank=r))
        s = torch.empty(4, dtype=torch.int32)
        dist.scatter(s, [torch.full((4,), 10 * r + root, dtype=torch.int32) for r in range(n)] if rank == root
                     else None, src=root)
        assert torch.equal(s, torch.full((4,), 10 * rank + root, dtype=torch.int32))


def test_send_recv_ring_and_barrier(gloo):
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if n == 1:
        return
    x = data(9, (1000,))
    got = torch.empty(1000)
    reqs = [dist.isend(x, (rank + 1) % n, tag=3), dist.irecv(got, (rank - 1) % n, tag=3)]
    for r in reqs:
        r.wait()
    assert torch.equal(got, data(9, (1000,), rank=(rank - 1) % n))
    if rank == 0:
        dist.send(torch.arange(5.0), dst=n - 1)
    elif rank == n - 1:
        t = torch.empty(5)
        src = dist.recv(t)  # any source
        assert src == 0 and torch.equal(t, torch.arange(5.0))


def test_subgroups_match_gloo(gloo):
    rank, n = dist.get_rank(), dist.get_world_size()
    for ranks in (list(range(0, n, 2)), [n - 1], list(range(n))):
        pg = dist.new_group(ranks)  # the default backend: pycomm
        gg = dist.new_group(ranks, backend="gloo")
        if rank not in ranks:
            continue
        x = data(10, (257,))
        mine, ref = x.clone(), x.clone()
        dist.all_reduce(mine, group=pg)
        dist.all_reduce(ref, group=gg)
        same(mine, ref)
        b = data(11, (9,))
        dist.broadcast(b, src=ranks[-1], group=pg)
        assert torch.equal(b, data(11, (9,), rank=ranks[-1]))
        k = len(ranks)
        out = torch.empty(k * 2)
        dist.all_to_all_single(out, torch.arange(k * 2.0) + 100 * rank, group=pg)
        ref = torch.empty(k * 2)
        dist.all_to_all_single(ref, torch.arange(k * 2.0) + 100 * rank, group=gg)
        assert torch.equal(out, ref)


def test_mismatched_op_raises_on_every_rank(gloo):
    rank, n = dist.get_rank(), dist.get_world_size()
    if n < 2:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(RuntimeError, match="ranks disagree on the call.*op=max|ranks disagree on the call.*op=sum"):
        dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM)
    with pytest.raises(RuntimeError, match="ranks disagree"):
        dist.broadcast(torch.ones(3 + (rank == 1)), src=0)
    x = torch.ones(3)
    dist.all_reduce(x)  # still usable
    assert torch.equal(x, torch.full((3,), float(n)))


def test_unsupported_ops_and_dtypes_name_themselves(gloo):
    with pytest.raises(ValueError, match="does not support ReduceOp.BAND"):
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.BAND)
    with pytest.raises(TypeError, match="allreduce does not support dtype UInt32; supported: float32, float64, "
                                       "float16, bfloat16, int32, int64, uint8, int8, int16, bool"):
        dist.all_reduce(torch.ones(3, dtype=torch.uint32))
    with pytest.raises(TypeError, match="AVG needs a floating-point"):
        dist.all_reduce(torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.AVG)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,))
    with pytest.raises(ValueError, match="pycomm backend: a sparse allreduce sums .ReduceOp.SUM.; got ReduceOp.MAX"):
        dist.all_reduce(sparse, op=dist.ReduceOp.MAX)
    # (torch's dist.all_reduce_coalesced refuses mixed dtypes itself; the backend checks on its own too)
    with pytest.raises(TypeError, match="allreduce_coalesced needs tensors of one dtype"):
        dist.group.WORLD._get_backend(torch.device("cpu")).allreduce_coalesced(
            [torch.ones(2), torch.ones(2, dtype=torch.float64)]).wait()
    with pytest.raises(ValueError, match="contiguous"):
        dist.all_reduce(torch.ones(4, 4).t())
    dist.barrier()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_all_reduce_product_of_half_types(gloo, dtype):
    # 100003 elements: above the 64 KiB 'auto' switch, so the engine's own reduce kernels multiply
    # (fp32 arithmetic, one rounding per partial product).
    x = (1 + data(12, (100003,)) / 4).to(dtype)
    ref = x.float()
    dist.all_reduce(ref, op=dist.ReduceOp.PRODUCT, group=gloo)  # float32 product of the same inputs
    dist.all_reduce(x, op=dist.ReduceOp.PRODUCT)
    # products of N <= 4 factors in [0.75, 1.25] stay below 4; at most N-1 roundings of half the ulp
    # of [4, 8) each (as for the sums above)
    ulp = (2 ** -10 if dtype == torch.float16 else 2 ** -7) * 4
    same(x, ref, dtype, atol=dist.get_world_size() * ulp / 2 + F32_ATOL)


# ---- real CUDA tensors (skipped without a GPU) -----------------------------------------------------

from cuda_cases import needs_cuda, rank_device  # noqa: E402


@needs_cuda
def test_cuda_all_reduce_all_gather_scatter(gloo):
    """The backend on CUDA tensors: results on the tensors' device, equal to gloo's on host copies,
    and ordered on the caller's stream (used right after wait() on that stream)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    for count in (1, 1001, 100003):
        x = data(20, (count,))
        mine, ref = x.to(dev), x.clone()
        work = dist.all_reduce(mine, op=dist.ReduceOp.SUM, async_op=True)
        dist.all_reduce(ref, op=dist.ReduceOp.SUM, group=gloo)
        work.wait()
        same(mine.cpu(), ref)
        out = [torch.empty(count, device=dev) for _ in range(n)]
        dist.all_gather(out, x.to(dev))
        for q in range(n):
            assert torch.equal(out[q].cpu(), data(20, (count,), rank=q))
    for root in range(n):
        s = torch.empty(5, dtype=torch.int32, device=dev)
        src = [torch.full((5,), 10 * q + root, dtype=torch.int32, device=dev) for q in range(n)] if rank == root \
            else None
        dist.scatter(s, src, src=root)
        assert torch.equal(s.cpu(), torch.full((5,), 10 * rank + root, dtype=torch.int32))


def test_coalesced_ops_match_gloo(gloo):
    """all_reduce_coalesced / all_gather_coalesced: one engine operation each, the same results as gloo's."""
    n, r = dist.get_world_size(), dist.get_rank()
    for seed, dtype in enumerate([torch.float32, torch.int64, torch.int8]):
        shapes = [(3,), (0,), (2, 5), (1,), (7, 3)]
        xs = [data(40 + seed, s, dtype) if dtype != torch.int8 else data(40 + seed, s, torch.int64).to(dtype)
              for s in shapes]
        for op in ("SUM", "MAX", "PRODUCT"):
            mine, ref = [x.clone() for x in xs], [x.clone() for x in xs]
            if op == "PRODUCT":
                mine, ref = [x % 3 - 1 for x in mine], [x % 3 - 1 for x in ref]
            with pytest.warns(FutureWarning):
                dist.all_reduce_coalesced(mine, op=OPS[op])
                dist.all_reduce_coalesced(ref, op=OPS[op], group=gloo)
            for a, b in zip(mine, ref):
                same(a, b, dtype)
        outs = [[torch.empty_like(x) for x in xs] for _ in range(n)]
        refs = [[torch.empty_like(x) for x in xs] for _ in range(n)]
        with pytest.warns(FutureWarning):
            dist.all_gather_coalesced(outs, xs)
            dist.all_gather_coalesced(refs, xs, group=gloo)
        for k in range(n):
            for a, b in zip(outs[k], refs[k]):
                assert torch.equal(a, b)
            assert torch.equal(outs[k][2], data(40 + seed, (2, 5), torch.int64, rank=k).to(dtype)
                               if dtype == torch.int8 else data(40 + seed, (2, 5), dtype, rank=k))


def test_sparse_all_reduce_matches_gloo(gloo):
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(97 + r)
    for shape, nnz in (((11,), 4), ((9, 6), 7 + r), ((5, 4, 3), 0 if r == 0 else 3)):
        idx = torch.stack([torch.randint(0, s, (nnz,), generator=g) for s in shape[:1]])
        val = torch.randn((nnz,) + tuple(shape[1:]), generator=g, dtype=torch.float64)
        x = torch.sparse_coo_tensor(idx, val, shape)  # uncoalesced: repeated indices add up
        mine, ref = x.clone(), x.clone()
        dist.all_reduce(mine)
        dist.all_reduce(ref, group=gloo)
        assert mine.is_sparse
        assert torch.allclose(mine.to_dense(), ref.to_dense(), rtol=0, atol=1e-12)
        total = x.to_dense()  # and the dense sum, an independent reference
        dist.all_reduce(total, group=gloo)
        assert torch.allclose(mine.to_dense(), total, rtol=0, atol=1e-12)


def test_sequence_numbers_agree_and_count_collectives(gloo, comm):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    before = backend._get_sequence_number_for_group()
    x = torch.ones(5)
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    dist.barrier()
    after = backend._get_sequence_number_for_group()
    assert after == before + 3
    assert len(set(comm.allgather(after))) == 1


def test_monitored_barrier_names_the_late_rank(gloo):
    """gloo's monitored barrier on pycomm's backend (torch's dist.monitored_barrier accepts gloo only)."""
    import datetime
    import time

    n, r = dist.get_world_size(), dist.get_rank()
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    backend.monitored_barrier(datetime.timedelta(seconds=30))
    backend.monitored_barrier(datetime.timedelta(seconds=30), wait_all_ranks=True)
    if n == 1:
        return
    late = n - 1
    if r == late:
        time.sleep(2.0)
    expected = (f"Rank {late} failed to pass monitoredBarrier in 500 ms" if r == 0 else
                "rank 0 did not release the monitoredBarrier in 500 ms")
    with pytest.raises(RuntimeError, match=expected):
        backend.monitored_barrier(datetime.timedelta(milliseconds=500))
    dist.barrier(group=gloo)
