"""1-bit quantization with error feedback (docs/algorithms.md §2) against numpy.

For c = x + e (float32): the sign bits are exact, the scales are within 1e-6
(relative) of the float64 norm ||c_j|| / sqrt(n_j), the new residual is
exactly float32(c - q) with q = s*(2 bit - 1) (so c = q + e up to that one
rounding; exactly whenever c - q is representable), decompress gives q
exactly, and masked elements stay exactly zero. Over many steps the running
sum of the dequantized outputs tracks the running sum of the inputs because
the residual stays bounded.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import pycomm
from kernel_targets import DEVICES, ISAS, NO_CUDA, TARGETS, select_target  # noqa: F401
from pycomm import kernels as K

SIZES = [0, 1, 5, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 1000, 4099, 65536 + 13]
CHUNKS = [8, 16, 24, 64, 264, 4096, None]


@pytest.fixture(params=TARGETS)
def device(request):
    yield from select_target(request)


def whole(n):
    return max(8, (n + 7) // 8 * 8)


def reference(x, e, chunk, mask):
    """numpy: bits (packed), float64 scales, float32 c, kept mask."""
    n = x.size
    c = (x + e).astype(np.float32)
    kept = np.ones(n, bool) if mask is None else mask.astype(bool)
    pos = (c >= 0) & kept
    bits = np.packbits(pos, bitorder="little")
    nc = (n + chunk - 1) // chunk
    scales = np.zeros(nc, np.float64)
    for j in range(nc):
        sl = slice(j * chunk, min(n, (j + 1) * chunk))
        k = kept[sl]
        if k.sum():
            cj = c[sl][k].astype(np.float64)
            scales[j] = np.sqrt(np.sum(cj * cj) / k.sum())
    return bits, scales, c, kept, pos


def expand(scales, n, chunk):
    return np.repeat(np.asarray(scales, np.float32), chunk)[:n]


def run_and_check(x, e0, chunk, mask, device, check_tail=True):
    n = x.size
    ch = whole(n) if chunk is None else chunk
    nb, nc = K.onebit_packed_bytes(n), K.onebit_num_chunks(n, ch)
    # poisoned outputs, views of larger buffers
    ebuf = torch.full((n + 19,), float("nan"), device=device)
    ebuf[:n] = torch.from_numpy(e0).to(device)
    bbuf = torch.full((nb + 9,), 0xFF, dtype=torch.uint8, device=device)
    sbuf = torch.full((nc + 5,), float("nan"), device=device)
    xt = torch.from_numpy(x).to(device)
    mt = None if mask is None else torch.from_numpy(mask).to(device)
    bits, scales = K.onebit_compress(xt, ebuf[:n], chunk, mask=mt, bits=bbuf[:nb], scales=sbuf[:nc])
    bits, scales, e1 = bits.cpu().numpy(), scales.cpu().numpy(), ebuf[:n].cpu().numpy()
    if check_tail:
        assert torch.isnan(ebuf[n:]).all() and (bbuf[nb:] == 0xFF).all() and torch.isnan(sbuf[nc:]).all()

    rbits, rscales, c, kept, pos = reference(x, e0, ch, mask)
    np.testing.assert_array_equal(bits, rbits)  # signs exact, unused bits of the last byte 0
    np.testing.assert_allclose(scales.astype(np.float64), rscales, rtol=1e-6, atol=0)
    q = np.where(pos, 1.0, -1.0).astype(np.float32) * expand(scales, n, ch)
    q[~kept] = 0
    want_e = (c - q).astype(np.float32)  # float32 subtraction, one rounding
    want_e[~kept] = 0
    assert np.array_equal(e1.view(np.uint32), want_e.view(np.uint32)), "residual != float32(c - q)"
    assert np.all(e1.view(np.uint32)[~kept] == 0), "masked residual not exactly +0"
    # c == q + e up to the rounding of e (exact where c - q is representable)
    err = np.abs(q.astype(np.float64) + e1.astype(np.float64) - c.astype(np.float64))
    assert np.all(err[kept] <= np.abs(e1[kept]).astype(np.float64) * 2.0 ** -24)
    # decompress gives q exactly, accumulate adds it
    out = torch.full((n + 7,), float("nan"), device=device)
    K.onebit_decompress(torch.from_numpy(bits).to(device), torch.from_numpy(scales).to(device), n, chunk,
                        mask=mt, out=out[:n])
    assert np.array_equal(out[:n].cpu().numpy(), q) and torch.isnan(out[n:]).all()
    acc0 = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    acc = torch.full((n + 7,), 5.0, device=device)
    acc[:n] = torch.from_numpy(acc0).to(device)
    K.onebit_decompress_accumulate_(acc[:n], torch.from_numpy(bits).to(device), torch.from_numpy(scales).to(device),
                                    chunk, mask=mt)
    assert np.array_equal(acc[:n].cpu().numpy(), acc0 + q) and (acc[n:] == 5.0).all()
    return bits, scales, e1


def data(n, seed):
    r = np.random.default_rng(seed)
    return (r.standard_normal(n) * 2).astype(np.float32), (r.standard_normal(n) * 0.3).astype(np.float32)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("n", SIZES)
def test_compress_matches_reference(device, n, chunk):
    x, e = data(n, 7 * n + (chunk or 0))
    run_and_check(x, e, chunk, None, device)


@pytest.mark.parametrize("chunk", [8, 40, 256, None])
@pytest.mark.parametrize("n", [0, 1, 9, 33, 100, 1000, 20001])
def test_mask_keeps_zeros(device, n, chunk):
    x, e = data(n, n + 3)
    r = np.random.default_rng(n)
    mask = (r.random(n) < 0.6).astype(np.uint8)
    if n > 40:
        mask[:40] = 0  # whole chunks masked out: scale 0
    run_and_check(x, e, chunk, mask, device)
    # bool masks work the same
    xt, et = torch.from_numpy(x).to(device), torch.from_numpy(e.copy()).to(device)
    K.onebit_compress(xt, et, chunk, mask=torch.from_numpy(mask.astype(bool)).to(device))
    assert (et.cpu()[torch.from_numpy(mask) == 0] == 0).all()


def test_zero_and_negative_zero_map_to_plus_one(device):
    x = np.array([0.0, -0.0, 1.0, -1.0, 0.0, 0.0, -0.0, 2.0, -0.0], np.float32)
    e = np.zeros_like(x)
    bits, scales, e1 = run_and_check(x, e, 8, None, device)
    assert bits[0] == 0b11110111 and bits[1] == 1  # element i is bit i; only -1.0 is negative


def test_all_zero_chunk_gives_zero_scale(device):
    x = np.zeros(24, np.float32)
    x[16:] = 3.0
    bits, scales, e1 = run_and_check(x, np.zeros_like(x), 8, None, device)
    assert list(scales) == [0.0, 0.0, 3.0] and np.all(e1 == 0)


def test_error_feedback_tracks_running_sum(device):
    """sum_t q_t = sum_t x_t + e_0 - e_T: the gap is the residual, which stays bounded."""
    n, chunk, steps = 5000, 512, 300
    r = np.random.default_rng(1)
    mean = r.standard_normal(n).astype(np.float32)
    e = torch.zeros(n, device=device)
    sum_x = np.zeros(n)
    sum_q = np.zeros(n)
    worst = 0.0
    for t in range(steps):
        x = (mean + r.standard_normal(n).astype(np.float32)).astype(np.float32)
        bits, scales = K.onebit_compress(torch.from_numpy(x).to(device), e, chunk)
        q = K.onebit_decompress(bits, scales, n, chunk).cpu().numpy()
        sum_x += x
        sum_q += q
        worst = max(worst, float(np.linalg.norm(e.cpu().numpy())))
    gap = sum_q - sum_x
    np.testing.assert_allclose(gap, -e.cpu().numpy(), atol=1e-3 * steps ** 0.5)
    xnorm = np.sqrt(n * 2.0)  # ||x_t|| ~ sqrt(n (1 + 1))
    assert worst < 3 * xnorm, (worst, xnorm)  # bounded, does not grow with t
    assert np.linalg.norm(gap) / np.linalg.norm(sum_x) < 0.02


@settings(max_examples=14, deadline=None)  # per ISA (40 over the three before they were split)
@given(n=st.integers(0, 100000), seed=st.integers(0, 2 ** 31), chunk=st.sampled_from([8, 24, 128, 1000, 4096, None]),
       masked=st.booleans())
def _compress_property(n, seed, chunk, masked):
    x, e = data(n, seed)
    mask = (np.random.default_rng(seed).random(n) < 0.8).astype(np.uint8) if masked else None
    run_and_check(x, e, chunk, mask, "cpu")


@pytest.mark.parametrize("isa", ISAS)
def test_compress_property(isa):
    # A CPU without this ISA reports a skip (never a silent pass).
    if K.set_cpu_isa(isa) != isa:
        K.set_cpu_isa("avx512")
        pytest.skip(f"this CPU has no {isa}")
    try:
        _compress_property()
    finally:
        K.set_cpu_isa("avx512")


@pytest.mark.parametrize("chunk", [8, 1 << 12, 1 << 19, None])
def test_multithreaded_matches_single(chunk):
    """Above the parallel threshold, chunks split between threads sum the same."""
    n = (1 << 20) + 9
    x, e = data(n, 11)
    old = K.cpu_threads()
    results = []
    try:
        for threads in (1, 2):
            K.set_cpu_threads(threads)
            et = torch.from_numpy(e.copy())
            bits, scales = K.onebit_compress(torch.from_numpy(x), et, chunk)
            q = K.onebit_decompress(bits, scales, n, chunk)
            results.append((bits, scales, et, q))
    finally:
        K.set_cpu_threads(old)
    (b1, s1, e1, q1), (b2, s2, e2, q2) = results
    assert torch.equal(b1, b2) and torch.equal(q1, q2)
    np.testing.assert_allclose(s1.numpy(), s2.numpy(), rtol=1e-6)
    run_and_check(x, e, chunk, None, "cpu", check_tail=False)


@pytest.mark.skipif(NO_CUDA is not None, reason=str(NO_CUDA))
@pytest.mark.parametrize("n", [0, 1, 33, 1000, 65536 + 13, (1 << 22) + 5])
@pytest.mark.parametrize("chunk", [8, 96, 1 << 16, None])
def test_cuda_matches_cpu(n, chunk):
    x, e = data(n, n)
    mask = (np.random.default_rng(n).random(n) < 0.9).astype(np.uint8)
    outs = []
    for dev in ("cpu", "cuda"):
        # e.copy(): on the CPU .to() returns the alias, and the CUDA pass would start from the CPU pass's residual
        et = torch.from_numpy(e.copy()).to(dev)
        bits, scales = K.onebit_compress(torch.from_numpy(x).to(dev), et, chunk, mask=torch.from_numpy(mask).to(dev))
        outs.append((bits.cpu(), scales.cpu(), et.cpu()))
    assert torch.equal(outs[0][0], outs[1][0])
    np.testing.assert_allclose(outs[1][1].numpy(), outs[0][1].numpy(), rtol=1e-6)
    np.testing.assert_allclose(outs[1][2].numpy(), outs[0][2].numpy(), rtol=1e-5, atol=1e-5)


def test_errors():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 8, got 12"):
        K.onebit_compress(x, torch.zeros(10), 12)
    with pytest.raises(ValueError, match="residual has 9 elements, expected 10"):
        K.onebit_compress(x, torch.zeros(9), 8)
    with pytest.raises(ValueError, match="bits has 1 elements, expected at least 2"):
        K.onebit_compress(x, torch.zeros(10), 8, bits=torch.empty(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales has 1 elements, expected at least 2"):
        K.onebit_compress(x, torch.zeros(10), 8, scales=torch.empty(1))
    with pytest.raises(ValueError, match="mask has 3 elements, expected 10"):
        K.onebit_compress(x, torch.zeros(10), 8, mask=torch.ones(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="mask must be uint8 or bool"):
        K.onebit_compress(x, torch.zeros(10), 8, mask=torch.ones(10))
    with pytest.raises(TypeError, match="residual must be Float"):
        K.onebit_compress(x, torch.zeros(10, dtype=torch.float64), 8)
    with pytest.raises(ValueError, match="input and residual must be different tensors"):
        K.onebit_compress(x, x, 8)
    with pytest.raises(ValueError, match="bits has 1 elements, expected at least 2"):
        K.onebit_decompress(torch.zeros(1, dtype=torch.uint8), torch.ones(2), 10, 8)


@pytest.mark.parametrize("offset", [1, 2, 3])
@pytest.mark.parametrize("chunk", [16, 8192, None])
def test_unaligned_views(device, offset, chunk):
    """Views that start off a 16-byte boundary take the element-wise paths (CUDA) and give the same results."""
    n = 20000 + offset
    x, e = data(n, offset)
    mask = (np.random.default_rng(offset).random(n) < 0.7).astype(np.uint8)
    ch = whole(n) if chunk is None else chunk
    xb = torch.zeros(n + offset, device=device)
    eb = torch.zeros(n + offset, device=device)
    mb = torch.zeros(n + offset, dtype=torch.uint8, device=device)
    xb[offset:] = torch.from_numpy(x).to(device)
    eb[offset:] = torch.from_numpy(e).to(device)
    mb[offset:] = torch.from_numpy(mask).to(device)
    bb = torch.zeros(K.onebit_packed_bytes(n) + offset, dtype=torch.uint8, device=device)
    bits, scales = K.onebit_compress(xb[offset:], eb[offset:], chunk, mask=mb[offset:],
                                     bits=bb[offset:])
    rbits, rscales, c, kept, pos = reference(x, e, ch, mask)
    assert np.array_equal(bits.cpu().numpy(), rbits)
    np.testing.assert_allclose(scales.cpu().numpy().astype(np.float64), rscales, rtol=1e-6)
    q = np.where(pos, 1.0, -1.0).astype(np.float32) * expand(scales.cpu().numpy(), n, ch)
    q[~kept] = 0
    want_e = (c - q).astype(np.float32)
    want_e[~kept] = 0
    assert np.array_equal(eb[offset:].cpu().numpy(), want_e)
    ob = torch.full((n + offset,), 9.0, device=device)
    K.onebit_decompress_accumulate_(ob[offset:], bits, scales, chunk, mask=mb[offset:])
    want = np.float32(9.0) + q
    want[~kept] = 9.0
    assert np.array_equal(ob[offset:].cpu().numpy(), want) and (ob[:offset].cpu() == 9.0).all()
