"""Fusion pack/unpack (one call for many tensors) with the fused scale."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import pycomm
from kernel_targets import DEVICES, ISAS, NO_CUDA, TARGETS, select_target  # noqa: F401
from pycomm import kernels as K

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def make(sizes, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        if dtype.is_floating_point:
            t = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        else:
            t = torch.randint(-2 ** 30, 2 ** 30, (n,), generator=g, dtype=torch.int64).to(dtype)
        out.append(t.to(device))
    return out


def bits(t):
    t = t.cpu()
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.float64:
        return t.view(torch.int64)
    return t


SHAPES = [[0], [1], [3, 0, 5], [7, 1, 9, 33, 64], [1000, 1, 4099, 2], [70000, 5, 300000, 17]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("sizes", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_pack_unpack(device, dtype, sizes):
    ts = make(sizes, dtype, device, sum(sizes))
    total = sum(sizes)
    buf = torch.full((total + 13,), 77, dtype=dtype, device=device)
    flat = K.fusion_pack(ts, out=buf[:total])
    assert total == 0 or flat.data_ptr() == buf.data_ptr()
    want = torch.cat([t.flatten().cpu() for t in ts]) if ts else torch.empty(0, dtype=dtype)
    assert torch.equal(bits(flat), bits(want))
    assert (buf[total:].cpu() == 77).all()
    # unpack into poisoned views of larger buffers, plain copy
    outs = [torch.full((n + 3,), 55, dtype=dtype, device=device) for n in sizes]
    K.fusion_unpack(flat, [o[:n] for o, n in zip(outs, sizes)])
    for o, t, n in zip(outs, ts, sizes):
        assert torch.equal(bits(o[:n]), bits(t)) and (o[n:].cpu() == 55).all()
    if dtype.is_floating_point:
        scale = 1.0 / 3.0
        K.fusion_unpack(flat, [o[:n] for o, n in zip(outs, sizes)], scale=scale)
        for o, t, n in zip(outs, ts, sizes):
            if dtype in (torch.float16, torch.bfloat16):  # scaled in float32, rounded once
                ref = (t.cpu().float() * np.float32(scale)).to(dtype)
            elif dtype == torch.float32:
                ref = t.cpu() * torch.tensor(scale, dtype=torch.float32)
            else:
                ref = t.cpu() * scale
            assert torch.equal(bits(o[:n]), bits(ref)) and (o[n:].cpu() == 55).all()


def test_multidimensional_and_many_tensors():
    ts = [torch.randn(3, 4), torch.randn(2, 2, 2)] + [torch.randn(i % 7) for i in range(2000)]
    flat = K.fusion_pack(ts)
    assert torch.equal(flat, torch.cat([t.flatten() for t in ts]))
    outs = [torch.empty_like(t) for t in ts]
    K.fusion_unpack(flat, outs, scale=0.5)
    for o, t in zip(outs, ts):
        assert torch.equal(o, t * 0.5)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 100000), min_size=1, max_size=12), seed=st.integers(0, 2 ** 31),
       dtype=st.sampled_from(DTYPES), threads=st.sampled_from([1, 2]))
def test_property(sizes, seed, dtype, threads):
    old = K.cpu_threads()
    K.set_cpu_threads(threads)
    try:
        ts = make(sizes, dtype, "cpu", seed)
        flat = K.fusion_pack(ts)
        assert torch.equal(bits(flat), bits(torch.cat(ts)))
        outs = [torch.empty_like(t) for t in ts]
        K.fusion_unpack(flat, outs)
        assert all(torch.equal(bits(o), bits(t)) for o, t in zip(outs, ts))
    finally:
        K.set_cpu_threads(old)


@pytest.mark.skipif(NO_CUDA is not None, reason=str(NO_CUDA))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cuda_matches_cpu(dtype):
    sizes = [1, 3, 1 << 20, 4099, 0, 77, 2 ** 16 + 1]
    ts = make(sizes, dtype, "cpu", 3)
    flat_c = K.fusion_pack(ts)
    flat_g = K.fusion_pack([t.cuda() for t in ts])
    assert torch.equal(bits(flat_g), bits(flat_c))
    if dtype.is_floating_point:
        oc = [torch.empty_like(t) for t in ts]
        og = [torch.empty_like(t).cuda() for t in ts]
        K.fusion_unpack(flat_c, oc, 0.125)
        K.fusion_unpack(flat_g, og, 0.125)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(oc, og))


def test_errors():
    with pytest.raises(TypeError, match="tensor 1 is Double, the flat buffer is Float; fuse one dtype at a time"):
        K.fusion_pack([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="flat buffer has 3 elements, the tensors need 4"):
        K.fusion_pack([torch.ones(2), torch.ones(2)], out=torch.empty(3))
    with pytest.raises(ValueError, match="tensor 0 is not contiguous"):
        K.fusion_pack([torch.ones(3, 3).t()])
    with pytest.raises(TypeError, match="integer tensors take scale 1 only"):
        K.fusion_unpack(torch.ones(2, dtype=torch.int32), [torch.ones(2, dtype=torch.int32)], scale=0.5)
