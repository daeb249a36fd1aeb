"""compression="topk" and "threshold" (error feedback, (index, value) allgather) against numpy references."""
import math

import numpy as np
import pytest
import torch

import pycomm
from pycomm.compressors.threshold import Threshold
from pycomm.compressors.topk import TopK
from refdata import rank_data
from sparse_ref import sparse_step, threshold_k

COUNTS = [0, 1, 2, 7, 13, 1001, 65537]


def gather(comm, a):
    return [np.asarray(x) for x in comm.allgather(np.ascontiguousarray(a))]


def same_on_all_ranks(comm, t):
    raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return all(c == raw for c in comm.allgather(raw))


def check_step(comm, c, x, name, k_expected=None, average=True, what=""):
    n = x.numel()
    e0 = c.residual(name)
    e0 = e0.numpy().copy() if e0 is not None else np.zeros(n, np.float32)
    xs, es = gather(comm, x.reshape(-1).numpy()), gather(comm, e0)
    k = k_expected if k_expected is not None else threshold_k(xs, es, c.value)
    ref, ref_es = sparse_step(xs, es, k, average)
    got = c.allreduce_async(x.clone(), op="avg" if average else "sum", name=name).wait()
    assert got.shape == x.shape
    assert c.last_k(name) == k, f"{what}: sent {c.last_k(name)} elements per rank, expected {k}"
    # The result is a float32 sum of at most N values per element, in rank order, times fl(1/N):
    # error <= (N + 1) 2^-24 sum_k |v_k|; the bound below is that with a factor 2.
    mag = np.sum([np.abs(a.astype(np.float64)) for a in xs + es], axis=0) if n else np.zeros(0)
    err = np.abs(got.reshape(-1).numpy().astype(np.float64) - ref)
    assert np.all(err <= 2 * (len(xs) + 1) * 2.0 ** -24 * mag + 1e-30), f"{what}: result off by {err.max():.3g}"
    # The residual is exact: acc in float32, the sent elements zeroed.
    np.testing.assert_array_equal(c.residual(name).numpy(), ref_es[pycomm.rank()], err_msg=f"{what}: residual")
    assert same_on_all_ranks(comm, got), f"{what}: ranks hold different results"
    return got


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0])
def test_topk_matches_reference(count, ratio, comm):
    c = TopK(ratio)
    k = min(count, max(1, math.ceil(ratio * count))) if count else 0
    for step in range(3):
        x = rank_data(pycomm.rank(), count, torch.float32, seed=10 + step, scale=1.0)
        check_step(comm, c, x, "w", k, what=f"topk {ratio} [{count}] step {step}")


def test_topk_sum_and_shapes(comm):
    c = TopK(0.05)
    for step in range(2):
        x = rank_data(pycomm.rank(), 7 * 11 * 3, torch.float32, seed=20 + step).reshape(7, 11, 3)
        check_step(comm, c, x, "s", math.ceil(0.05 * 231), average=False, what=f"topk sum step {step}")


def test_topk_ties_go_to_the_lower_index(comm):
    # integer-valued data: many equal magnitudes, so the tie rule decides the selection
    g = np.random.default_rng([3, pycomm.rank()])
    c = TopK(0.2)
    for step in range(3):
        x = torch.from_numpy(g.integers(-3, 4, size=257).astype(np.float32))
        check_step(comm, c, x, "t", math.ceil(0.2 * 257), what=f"topk ties step {step}")


@pytest.mark.parametrize("value", [0.0, 0.5, 0.97, 5.0])
@pytest.mark.parametrize("count", [0, 1, 13, 4099])
def test_threshold_matches_reference(value, count, comm):
    c = Threshold(value)
    for step in range(3):
        # ranks draw at different scales, so their counts above the threshold differ and K is agreed
        x = rank_data(pycomm.rank(), count, torch.float32, seed=30 + step, scale=0.5 + 0.25 * pycomm.rank())
        check_step(comm, c, x, "w", what=f"threshold {value} [{count}] step {step}")


def test_threshold_nothing_above_sends_nothing(comm):
    c = Threshold(10.0)
    x = rank_data(pycomm.rank(), 100, torch.float32, seed=1, scale=1.0)
    got = c.allreduce_async(x.clone(), name="z").wait()
    assert c.last_k("z") == 0 and torch.count_nonzero(got) == 0
    assert torch.equal(c.residual("z"), x)  # everything waits in the residual


@pytest.mark.parametrize("make", [lambda: TopK(0.1), lambda: Threshold(0.6)])
def test_state_dict_resumes_bitwise(make, comm):
    a = make()
    data = [rank_data(pycomm.rank(), 3001, torch.float32, seed=40 + s, scale=1.0) for s in range(6)]
    for s in range(3):
        a.allreduce_async(data[s].clone(), name="b").wait()
    saved = a.state_dict()
    b = make()
    b.load_state_dict(saved)
    for s in range(3, 6):
        ra = a.allreduce_async(data[s].clone(), name="b").wait()
        rb = b.allreduce_async(data[s].clone(), name="b").wait()
        assert torch.equal(ra, rb), f"{a.name} step {s}: resumed result differs"
    assert torch.equal(a.residual("b"), b.residual("b"))


@pytest.mark.parametrize("spec", ["topk", "threshold"])
def test_refusals(spec, comm):
    c = pycomm.compression.by_name(spec)
    x = torch.ones(12)
    with pytest.raises(TypeError, match=f"compression='{spec}' cannot reduce tensor 'w' of dtype float64"):
        pycomm.allreduce(x.double(), op="avg", compression=c, name="w")
    with pytest.raises(ValueError, match=f"compression='{spec}' supports op 'avg' or 'sum', got 'min'"):
        pycomm.allreduce(x, op="min", compression=c, name="w")
    with pytest.raises(ValueError, match=f"compression='{spec}' handles CPU and CUDA tensors; tensor 'w' is on meta"):
        c.allreduce_async(torch.empty(12, device="meta"), op="avg", name="w")
    with pytest.raises(ValueError, match=f"compression='{spec}'\\) needs name="):
        pycomm.allreduce(x, op="avg", compression=c)
    pycomm.allreduce(x.clone(), op="avg", compression=c, name="w")
    with pytest.raises(ValueError, match="tensor 'w' has 5 elements but its residual was made for 12"):
        pycomm.allreduce(torch.ones(5), op="avg", compression=c, name="w")
    # nothing was sent by the refused calls: a good call still pairs up on every rank
    pycomm.allreduce(x.clone(), op="avg", compression=c, name="w")


def test_bad_parameters():
    with pytest.raises(ValueError, match=r"topk: ratio must be in \(0, 1\], got 0"):
        TopK(0)
    with pytest.raises(ValueError, match=r"topk: ratio must be in \(0, 1\], got 1.5"):
        pycomm.compression.by_name("topk:1.5")
    with pytest.raises(ValueError, match="topk: the parameter after ':' is the ratio"):
        pycomm.compression.by_name("topk:a")
    with pytest.raises(ValueError, match="threshold: value must be a finite number >= 0, got -1"):
        Threshold(-1)
    with pytest.raises(ValueError, match="threshold: the parameter after ':' is the value"):
        pycomm.compression.by_name("threshold:")
    with pytest.raises(ValueError, match="unknown compression 'onebit:3'"):
        pycomm.compression.by_name("onebit:3")
    assert pycomm.compression.by_name("topk:0.25").ratio == 0.25
    assert pycomm.compression.by_name("threshold:0.125").value == 0.125


@pytest.mark.parametrize("spec", ["topk:0.2", "threshold:0.05"])
def test_distributed_optimizer_matches_reference(spec, comm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    pycomm.broadcast_parameters(model.state_dict(), root=0)
    opt = pycomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                      compression=spec, bucket_mb=2e-4)
    params = dict(model.named_parameters())
    c = opt.compressor
    names = [f"DistributedOptimizer.bucket{bi}" for bi in range(len(opt.buckets))]
    for step in range(3):
        g = np.random.default_rng([step, pycomm.rank()])
        x = torch.from_numpy(g.normal(size=(8, 10)).astype(np.float32))
        y = torch.from_numpy(g.integers(0, 3, size=8))
        opt.zero_grad()
        # the buckets start during backward and update the residuals: take them before
        before = [c.residual(n).numpy().copy() if c.residual(n) is not None else None for n in names]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        refs = []
        for bi, pnames in enumerate(opt.buckets):
            flat = torch.cat([params[n].grad.reshape(-1) for n in pnames]).numpy()
            xs = gather(comm, flat)
            es = gather(comm, before[bi] if before[bi] is not None else np.zeros(flat.size, np.float32))
            k = c.k_for(flat.size) if spec.startswith("topk") else threshold_k(xs, es, c.value)
            refs.append((pnames, k, *sparse_step(xs, es, k)))
        opt.synchronize()
        for bi, (pnames, k, ref, ref_es) in enumerate(refs):
            what = f"{spec} DistributedOptimizer step {step} bucket {pnames}"
            got = torch.cat([params[n].grad.reshape(-1) for n in pnames]).numpy().astype(np.float64)
            assert c.last_k(names[bi]) == k, what
            # float32 scatter-average against the float64 reference: measured at 1 and 4 ranks, at most
            # 7.5e-9 absolute (4e-7 relative only near zero, within atol)
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7, err_msg=what)
            np.testing.assert_array_equal(c.residual(names[bi]).numpy(), ref_es[pycomm.rank()], err_msg=what)
        with opt.skip_synchronize():
            opt.step()
    assert set(opt.state_dict()["pycomm_compression"]["residuals"]) == set(names)
