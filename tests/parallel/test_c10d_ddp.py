"""DDP, ZeroRedundancyOptimizer and FSDP over backend="pycomm" train exactly like over gloo; and
PYCOMM_COMPRESSION on the backend: the float32 SUM/AVG allreduces of a process group created with it set
go through pycomm's compressed allreduce, with onebit error feedback kept per call site
(csrc/c10d/call_sites.h). (One file: the two share one MPI job's start-up.)"""
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import pycomm
import pycomm.distributed  # noqa: F401
from compression_ref import layout, two_phase
from refdata import rank_data
from torch_worlds import pycomm_world

# Both runs start from the same parameters and see the same data; only the reduction order of the
# float32 gradient sums differs (pycomm's ring/shm/mpi vs gloo's), so parameters differ by a few
# float32 ulps. Measured after 10 steps (the train_* functions below, under pycomm-run):
# max |param diff| 0 at 2 ranks and 1.5e-8 at 4 ranks, max |loss diff| 2.4e-7; ZeRO and FSDP at
# 2 ranks: 0. 1e-5 leaves a wide margin while still catching a missing or wrong reduction (which
# moves parameters by ~1e-2 per step).
ATOL = 1e-5


@pytest.fixture(scope="module")
def gloo():
    with pycomm_world():
        yield dist.new_group(backend="gloo")


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def batches(steps=10):
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    return [(torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(steps)]


def train_ddp(group, steps=10):
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = DDP(model(), process_group=group, bucket_cap_mb=0.01)  # several buckets: more allreduces in flight
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in m.module.parameters()], losses


def test_ddp_matches_gloo(gloo):
    p_pycomm, l_pycomm = train_ddp(None)  # default group: pycomm
    p_gloo, l_gloo = train_ddp(gloo)
    for a, b in zip(p_pycomm, p_gloo):
        assert torch.allclose(a, b, rtol=0, atol=ATOL), (a - b).abs().max()
    assert l_pycomm == pytest.approx(l_gloo, abs=ATOL)
    # every rank holds the same parameters
    flat = torch.cat([p.reshape(-1) for p in p_pycomm])
    first = flat.clone()
    dist.broadcast(first, src=0)
    assert torch.equal(flat, first)


def train_zero(group, steps=5):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = DDP(model(1), process_group=group)
    opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam, lr=0.01, process_group=group)
    losses = []
    for x, y in batches(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_zero_redundancy_optimizer_matches_gloo(gloo):
    if dist.get_world_size() != 2:
        pytest.skip("ZeroRedundancyOptimizer is checked at 2 ranks")
    assert train_zero(None) == pytest.approx(train_zero(gloo), abs=ATOL)


def train_fsdp(group, steps=5):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    m = FSDP(model(2), process_group=group, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for x, y in batches(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_fsdp_matches_gloo(gloo):
    if dist.get_world_size() != 2:
        pytest.skip("FSDP is checked at 2 ranks")
    assert train_fsdp(None) == pytest.approx(train_fsdp(gloo), abs=ATOL)


# ---------------------------------------------------------------- PYCOMM_COMPRESSION

def compressed_group(compression):
    """A process group over every rank created with PYCOMM_COMPRESSION=compression."""
    old = os.environ.get("PYCOMM_COMPRESSION")
    os.environ["PYCOMM_COMPRESSION"] = compression
    try:
        g = dist.new_group(backend="pycomm")
    finally:
        if old is None:
            del os.environ["PYCOMM_COMPRESSION"]
        else:
            os.environ["PYCOMM_COMPRESSION"] = old
    return g, g._get_backend(torch.device("cpu"))


@pytest.fixture(scope="module")
def groups(gloo):
    return {c: compressed_group(c) for c in ("fp16", "bf16", "onebit")}


def test_default_group_is_exact(gloo):
    assert dist.group.WORLD._get_backend(torch.device("cpu")).compression == "none"


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_half_equals_pycomm_allreduce(groups, compression):
    g, backend = groups[compression]
    assert backend.compression == compression
    for step, count in enumerate([0, 1, 7, 1001, 65537]):
        for op, name in ((dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.SUM, "sum")):
            x = rank_data(pycomm.rank(), count, torch.float32, seed=step, scale=10.0)
            got = x.clone()
            work = dist.all_reduce(got, op=op, group=g, async_op=(count % 2 == 1))
            if work is not None:
                work.wait()
            ref = pycomm.allreduce(x.clone(), op=name, compression=compression)
            # the same C++ compressed allreduce on the same inputs: bitwise equal
            assert torch.equal(got, ref), f"{compression} {name} [{count}]: max diff {(got - ref).abs().max()}"
            if count >= 1001:  # and it was compressed: half-precision rounding shows against the exact result
                exact = x.clone()
                dist.all_reduce(exact, op=op)
                assert not torch.equal(got, exact)


def snapshot(backend):
    return {k: (w.numpy().copy(), v.numpy().copy()) for k, (w, v) in backend.compression_state()["residuals"].items()}


def check_onebit_call(comm, g, backend, x, average, what):
    """One dist.all_reduce of x, against the numpy two-phase reference built from the residuals every
    rank held, before the call, at the call site the backend used. Returns that site."""
    rank, n = pycomm.rank(), x.numel()
    before = snapshot(backend)
    got = x.clone()
    dist.all_reduce(got, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=g)
    got = got.reshape(-1).numpy()
    state = backend.compression_state()
    site = state["last"]
    assert site is not None and site[1] == tuple(x.shape), (site, x.shape)
    w0, s0 = before.get(site, (np.zeros(n, np.float32), np.zeros(layout(n, pycomm.size())[1], np.float32)))
    xs = [np.asarray(a) for a in comm.allgather(x.reshape(-1).numpy())]
    ws = [np.asarray(a) for a in comm.allgather(w0)]
    ss = [np.asarray(a) for a in comm.allgather(s0)]
    ref, ref_w, ref_s, ambiguous = two_phase(xs, ws, ss, average=average)
    # Tolerances as measured for pycomm.allreduce(compression='onebit') in tests/parallel/test_compression.py:
    # a scale may differ from the reference's in its last bit (float32 vs float64 sum of squares), so
    # |got - ref| <= 1e-6 |ref| away from the elements whose server-side value is within 1e-5 scale of
    # zero (there the sign is decided by rounding; at most max(2, n/10000) of them).
    ok = ~ambiguous
    assert ambiguous.sum() <= max(2, n // 10000), f"{what}: too many near-zero server values"
    err = np.abs(got - ref)[ok]
    assert np.all(err <= 1e-6 * np.abs(ref[ok])), f"{what}: differs from the reference by up to {err.max():.3g}"
    w1 = state["residuals"][site][0].numpy()
    mag = max(float(np.abs(a + b).max()) for a, b in zip(xs, ws))
    # worker residual c - q with q = +-scale: the same last-bit freedom, 1e-6 of max |c|
    np.testing.assert_allclose(w1, ref_w[rank], rtol=0, atol=1e-6 * mag, err_msg=f"{what}: worker residual")
    assert len(set(comm.allgather(site))) == 1, f"{what}: ranks chose different call sites"
    return site


def test_onebit_matches_reference_per_call_site(groups, comm):
    """Three allreduces per step (three shapes, AVG and SUM), six steps: once the period is learned
    every call has a site of its own that carries its residuals from step to step, as in the numpy
    two-phase reference with one residual pair per site."""
    g, backend = groups["onebit"]
    backend.reset_compression()
    calls = [((1001,), True), ((13, 7), False), ((4099,), True)]
    sites = []
    for step in range(6):
        sites.append([check_onebit_call(comm, g, backend,
                                        rank_data(pycomm.rank(), int(np.prod(shape)), torch.float32,
                                                  seed=100 + 10 * step + j, scale=1.0).reshape(shape),
                                        average, f"step {step} call {j}")
                      for j, (shape, average) in enumerate(calls)])
    state = backend.compression_state()
    assert state["period"] == 3, state
    assert sites[-1] == sites[-2] == sites[-3] and len(set(sites[-1])) == 3 and all(p >= 0 for p, _ in sites[-1])


def test_onebit_sites_of_repeated_shapes(groups, comm):
    """Steps of [A, B, A] (two calls of the same shape): once the period (3) is learned the two A's of a
    step have sites of their own, the same every step; a call that breaks the sequence returns to
    learning (its site is its shape alone)."""
    g, backend = groups["onebit"]
    backend.reset_compression()
    shapes = [(64,), (24,), (64,)]
    sites = []
    for step in range(5):
        sites.append([check_onebit_call(comm, g, backend,
                                        rank_data(pycomm.rank(), shape[0], torch.float32, seed=200 + 3 * step + j,
                                                  scale=1.0), True, f"step {step} call {j}")
                      for j, shape in enumerate(shapes)])
    state = backend.compression_state()
    assert state["period"] == 3, state
    last = sites[-1]
    assert last == sites[-2] and len(set(last)) == 3 and last[0][1] == last[2][1] == (64,), sites
    breaks = state["breaks"]
    site = check_onebit_call(comm, g, backend, rank_data(pycomm.rank(), 5, torch.float32, seed=1), True, "extra")
    state = backend.compression_state()
    assert site == (-1, (5,)) and state["breaks"] == breaks + 1 and state["period"] == 0, state
    # the fixed sites' residuals are kept for when the sequence returns
    assert all(p in state["residuals"] for p in last)


def test_uncompressed_ops_warn_once(groups, comm):
    g, _ = groups["fp16"]
    x = rank_data(pycomm.rank(), 1001, torch.int64, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = x.clone()
        dist.all_reduce(got, group=g)
        y = rank_data(pycomm.rank(), 33, torch.float32, seed=6)
        mx = y.clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=g)
        d = y.double()
        dist.all_reduce(d, group=g)
    msgs = [str(w.message) for w in caught if "PYCOMM_COMPRESSION" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "PYCOMM_COMPRESSION=fp16" in msgs[0] and "Long" in msgs[0] and "sent uncompressed (exact)" in msgs[0]
    # and they are exact
    assert np.array_equal(got.numpy(), np.sum(comm.allgather(x.numpy()), axis=0))
    assert np.array_equal(mx.numpy(), np.max(comm.allgather(y.numpy()), axis=0))
    ref = np.sum([np.asarray(a, np.float64) for a in comm.allgather(y.double().numpy())], axis=0)
    # float64 sums in another order: |diff| <= N eps64 sum|x| (|x| <= 100, N <= 4): < 1e-12
    assert np.allclose(d.numpy(), ref, rtol=0, atol=1e-12)


def test_bad_compression_name_is_refused(gloo):
    os.environ["PYCOMM_COMPRESSION"] = "fp8"
    try:
        with pytest.raises(ValueError, match="PYCOMM_COMPRESSION='fp8' is not a compression; choose one of none"):
            dist.new_group(backend="pycomm")
    finally:
        del os.environ["PYCOMM_COMPRESSION"]


def ddp_losses(group, steps=16):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    m = DDP(net, process_group=group, bucket_cap_mb=0.01)  # several buckets
    opt = torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    w = torch.randn(20, 5, generator=torch.Generator().manual_seed(1))  # a learnable target, the same everywhere
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 20, generator=g)
        y = (x @ w).argmax(1)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


def test_ddp_trains_with_fp16(groups):
    g, backend = groups["fp16"]
    exact = ddp_losses(None)
    fp16 = ddp_losses(g)
    assert fp16[-3:].mean() < 0.6 * fp16[:3].mean(), fp16  # the loss falls (1.6 to 0.6-0.9 in 16 steps)
    # fp16 gradients move the losses of 16 steps by at most 8.3e-4 from exact training (measured: 8.3e-4 at
    # 1 rank, where the cast is the only change; 1.9e-5, 3.3e-5 at 2, 4 ranks); bound 3e-3
    assert np.abs(fp16 - exact).max() < 3e-3, np.abs(fp16 - exact).max()


def test_ddp_trains_with_onebit(groups):
    g, backend = groups["onebit"]
    backend.reset_compression()
    losses = ddp_losses(g)
    # the loss falls (measured: 1.60-1.63 to 1.12-1.27 over 16 steps at 1-4 ranks)
    assert losses[-3:].mean() < 0.85 * losses[:3].mean(), losses
    state = backend.compression_state()
    # one site per DDP bucket, learned within the 16 steps
    fixed = [k for k in state["residuals"] if k[0] >= 0]
    assert state["period"] >= 1 and len(fixed) == state["period"], state


# ---- real CUDA tensors (skipped without a GPU) -----------------------------------------------------

from cuda_cases import needs_cuda, rank_device  # noqa: E402


@needs_cuda
def test_cuda_ddp_matches_gloo_on_cpu(gloo):
    """DDP of a CUDA model over backend="pycomm" against DDP of the same CPU model over gloo."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = rank_device()
    runs = {}
    for name, device, group in (("pycomm", dev, None), ("gloo", torch.device("cpu"), gloo)):
        m = DDP(model().to(device), device_ids=[dev.index] if device.type == "cuda" else None, process_group=group)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches(6):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x.to(device)), y.to(device)).backward()
            opt.step()
        runs[name] = torch.cat([p.detach().reshape(-1).cpu() for p in m.module.parameters()])
    err = (runs["pycomm"] - runs["gloo"]).abs().max().item()
    assert err <= 1e-4, f"CUDA DDP over pycomm differs from gloo on CPU by {err:.3g}"
