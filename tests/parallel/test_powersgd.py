"""compression="powersgd" (rank r, warm start, error feedback) against the numpy float64 reference."""
import numpy as np
import pytest
import torch

import pycomm
from lowrank_ref import compressed, powersgd_step
from pycomm.compressors.powersgd import PowerSGD
from refdata import rank_data

# Tolerance: float32 against float64. Measured over 25 runs (the shapes below, 3-4 steps each, data
# in [-1, 1]) at 1 and 4 ranks: the largest error of the result, residual or Q relative to its
# max |reference| was 4.9e-7; the bound is 20x that.
RTOL = 1e-5


def gather(comm, a):
    return [np.asarray(x) for x in comm.allgather(np.ascontiguousarray(a))]


def same_on_all_ranks(comm, t):
    raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return all(c == raw for c in comm.allgather(raw))


def close(got, ref, what):
    scale = max(float(np.abs(ref).max()) if np.size(ref) else 0.0, 1e-30)
    err = float(np.abs(np.asarray(got, np.float64) - ref).max()) if np.size(ref) else 0.0
    assert err <= RTOL * scale, f"{what}: error {err:.3g} against max |ref| {scale:.3g}"


def initial_qs(c, name, shapes):
    qs = []
    for i, s in enumerate(shapes):
        if compressed(s, c.rank):
            rows = s[0]
            cols = int(np.prod(s)) // rows
            qs.append(PowerSGD.initial_q(c.seed, name, i, cols, min(c.rank, rows, cols)).numpy())
        else:
            qs.append(None)
    return qs


def check_steps(comm, c, name, shapes, steps, average=True, seed=0, layout=True):
    n = int(sum(int(np.prod(s)) for s in shapes))
    if layout:
        c.set_layout(name, shapes)
    for step in range(steps):
        x = rank_data(pycomm.rank(), n, torch.float32, seed=seed + step, scale=1.0)
        if not layout:
            x = x.reshape(shapes[0])
        e0 = c.residual(name)
        e0 = e0.numpy().copy() if e0 is not None else np.zeros(n, np.float32)
        q0 = c.qs(name)
        q0 = [None if q is None else q.numpy().copy() for q in q0] if q0 is not None else initial_qs(c, name, shapes)
        xs, es = gather(comm, x.reshape(-1).numpy()), gather(comm, e0)
        ref, ref_es, ref_qs = powersgd_step(xs, es, q0, shapes, c.rank, average)
        got = c.allreduce_async(x.clone(), op="avg" if average else "sum", name=name).wait()
        what = f"powersgd r={c.rank} {shapes} step {step}"
        assert got.shape == x.shape
        close(got.reshape(-1).numpy(), ref, what + " result")
        close(c.residual(name).numpy(), ref_es[pycomm.rank()], what + " residual")
        for i, q in enumerate(ref_qs):
            if q is None:
                assert c.qs(name)[i] is None
            else:
                close(c.qs(name)[i].numpy(), q, f"{what} Q[{i}]")
        assert same_on_all_ranks(comm, got), f"{what}: ranks hold different results"


@pytest.mark.parametrize("shape,rank", [((37, 53), 1), ((37, 53), 2), ((64, 3, 3, 5), 4), ((1, 101), 1),
                                        ((6, 50), 8), ((101,), 2)])
def test_single_tensor_matches_reference(shape, rank, comm):
    check_steps(comm, PowerSGD(rank=rank), "w", [shape], steps=3, seed=100, layout=False)


def test_bucket_layout_matches_reference(comm):
    shapes = [(13, 7), (29,), (5, 3, 4), (1,), (2, 2), (0, 5), (31, 17)]
    check_steps(comm, PowerSGD(rank=2), "bucket0", shapes, steps=4, seed=200)


def test_sum_matches_reference(comm):
    check_steps(comm, PowerSGD(rank=3), "s", [(19, 23), (11,)], steps=2, average=False, seed=300)


def test_rank_one_of_a_rank_one_average_is_exact(comm):
    # avg_k M_k = u v^T has rank 1: after a power iteration from any Q with v^T Q != 0 the result is exact
    # and the residuals sum to zero over ranks.
    rng = np.random.default_rng([5, pycomm.rank()])
    u = np.random.default_rng(1).normal(size=(17, 1))
    v = np.random.default_rng(2).normal(size=(1, 9))
    noise = rng.normal(size=(17, 9))
    noise_avg = np.mean(gather(comm, noise), axis=0)
    m = u @ v + noise - noise_avg  # the noise cancels in the average
    c = PowerSGD(rank=1)
    got = c.allreduce_async(torch.from_numpy(m.astype(np.float32)), op="avg", name="r1").wait().numpy()
    close(got, u @ v, "rank-1 average")


def test_state_dict_resumes_bitwise(comm):
    shapes = [(23, 11), (7,), (9, 2, 5)]
    n = int(sum(int(np.prod(s)) for s in shapes))
    a = PowerSGD(rank=2, seed=3)
    a.set_layout("b", shapes)
    data = [rank_data(pycomm.rank(), n, torch.float32, seed=400 + s, scale=1.0) for s in range(6)]
    for s in range(3):
        a.allreduce_async(data[s].clone(), name="b").wait()
    saved = a.state_dict()
    b = PowerSGD(rank=2)
    b.load_state_dict(saved)
    b.set_layout("b", shapes)  # the same layout keeps the loaded state
    for s in range(3, 6):
        ra = a.allreduce_async(data[s].clone(), name="b").wait()
        rb = b.allreduce_async(data[s].clone(), name="b").wait()
        assert torch.equal(ra, rb), f"step {s}: resumed result differs"
    assert torch.equal(a.residual("b"), b.residual("b"))
    assert all(torch.equal(x, y) for x, y in zip(a.qs("b"), b.qs("b")) if x is not None)
    with pytest.raises(ValueError, match="saved with rank 2, this compressor has rank 1"):
        PowerSGD(rank=1).load_state_dict(saved)
    with pytest.raises(ValueError, match="state_dict is for compression 'powersgd', not 'onebit'"):
        pycomm.compression.OneBit().load_state_dict(saved)


def test_wire_bytes_count_both_allreduces(comm):
    from pycomm import _C

    c = PowerSGD(rank=2)
    c.allreduce_async(torch.ones(37, 53), name="m").wait()
    n, r = pycomm.size(), pycomm.rank()
    ring = [int(_C.ring_wire_bytes(k, 4, n, r)) for k in (2 * 37, 2 * 53)]
    assert c.wire_bytes_named("m", 37 * 53, n, r) == sum(ring)


def test_layout_change_starts_afresh(comm):
    c = PowerSGD(rank=1)
    c.set_layout("x", [(4, 6)])
    c.allreduce_async(rank_data(pycomm.rank(), 24, torch.float32, seed=1, scale=1.0), name="x").wait()
    c.set_layout("x", [(6, 4)])
    assert c.residual("x") is None and c.layout_resets == 1


def test_refusals(comm):
    c = PowerSGD()
    x = torch.ones(4, 3)
    with pytest.raises(TypeError, match="compression='powersgd' cannot reduce tensor 'w' of dtype float64"):
        pycomm.allreduce(x.double(), op="avg", compression=c, name="w")
    with pytest.raises(ValueError, match="compression='powersgd' supports op 'avg' or 'sum', got 'max'"):
        pycomm.allreduce(x, op="max", compression=c, name="w")
    with pytest.raises(ValueError, match="compression='powersgd' handles CPU and CUDA tensors; tensor 'w' is on meta"):
        c.allreduce_async(torch.empty(4, 3, device="meta"), op="avg", name="w")
    with pytest.raises(ValueError, match="needs name="):
        pycomm.allreduce(x, op="avg", compression=c)
    c.set_layout("b", [(2, 2), (3,)])
    with pytest.raises(ValueError, match="tensor 'b' has 12 elements but its layout"):
        c.allreduce_async(x.reshape(-1).clone(), name="b")
    with pytest.raises(ValueError, match="rank must be a positive integer, got 0"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="the parameter after ':' is the rank, an integer; got 'x'"):
        pycomm.compression.by_name("powersgd:x")
    assert pycomm.compression.by_name("powersgd:3").rank == 3
    # nothing was sent by the refused calls: a good call still pairs up on every rank
    y = pycomm.allreduce(torch.ones(4, 3), op="avg", compression=c, name="w")
    assert torch.allclose(y, torch.ones(4, 3))


def test_distributed_optimizer_matches_reference(comm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    pycomm.broadcast_parameters(model.state_dict(), root=0)
    opt = pycomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                      compression="powersgd:2", bucket_mb=2e-4)
    params = dict(model.named_parameters())
    c = opt.compressor
    for step in range(3):
        g = np.random.default_rng([step, pycomm.rank()])
        x = torch.from_numpy(g.normal(size=(8, 10)).astype(np.float32))
        y = torch.from_numpy(g.integers(0, 3, size=8))
        opt.zero_grad()
        before = opt.bytes_sent
        torch.nn.functional.cross_entropy(model(x), y).backward()
        refs = []
        for bi, names in enumerate(opt.buckets):
            name = f"DistributedOptimizer.bucket{bi}"
            shapes = [tuple(params[n].shape) for n in names]
            flat = torch.cat([params[n].grad.reshape(-1) for n in names]).numpy()
            e0 = c.residual(name)
            e0 = e0.numpy().copy() if e0 is not None else np.zeros(flat.size, np.float32)
            q0 = c.qs(name)
            q0 = ([None if q is None else q.numpy().copy() for q in q0] if q0 is not None
                  else initial_qs(c, name, shapes))
            refs.append((names, powersgd_step(gather(comm, flat), gather(comm, e0), q0, shapes, 2)[0]))
        opt.synchronize()
        for names, ref in refs:
            got = torch.cat([params[n].grad.reshape(-1) for n in names]).numpy()
            close(got, ref, f"DistributedOptimizer step {step} bucket {names}")
        if pycomm.size() > 1:  # two ring allreduces per bucket: [exact, P] and [Q]
            assert opt.bytes_sent > before
        with opt.skip_synchronize():
            opt.step()
    sd = opt.state_dict()["pycomm_compression"]
    assert sd["compression"] == "powersgd" and len(sd["state"]) == len(opt.buckets)
