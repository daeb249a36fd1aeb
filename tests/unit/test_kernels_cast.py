"""fp32 <-> fp16/bf16 casts with a fused scale, the non-finite flag, fp32 accumulation.

References: numpy (float32 product, float16 rounding; float64 for the error
bound) and torch's own bfloat16 rounding. Every CPU variant (avx512, avx2,
scalar) runs on this machine; the CUDA parameters compare the device kernels
with the same references when a GPU is present.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import pycomm
from kernel_targets import DEVICES, ISAS, NO_CUDA, TARGETS, select_target  # noqa: F401
from pycomm import kernels as K

SIZES = [0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100, 1023, 4099, (1 << 18) + 5]
HALF = {torch.float16: np.float16, torch.bfloat16: None}


@pytest.fixture(params=TARGETS)
def device(request):
    yield from select_target(request)


def rng_data(n, seed, spread=3.0):
    r = np.random.default_rng(seed)
    return (r.standard_normal(n) * np.exp(r.uniform(-spread, spread, n))).astype(np.float32)


def ref_to_half(x32: np.ndarray, scale: float, dtype) -> np.ndarray:
    """Reference bits of half(float32(x * scale))."""
    v = (x32 * np.float32(scale)).astype(np.float32)
    if dtype == torch.float16:
        return v.astype(np.float16).view(np.uint16)
    return torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def poisoned(n, dtype, device, fill):
    """A view of the first n elements of a buffer filled with `fill`, and the whole buffer."""
    buf = torch.full((n + 37,), fill, dtype=dtype, device=device) if dtype.is_floating_point else \
        torch.full((n + 37,), fill, dtype=dtype, device=device)
    return buf[:n], buf


def half_bits(t):
    return t.cpu().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("n", SIZES)
def test_cast_to_half_exact_rounding(device, dtype, n):
    x = rng_data(n, n)
    scale = 0.25 if n % 2 else 1.0 / 3.0
    out, buf = poisoned(n, dtype, device, float("nan"))
    tail = half_bits(buf[n:]).copy()
    y, flag = K.cast_to_half(torch.from_numpy(x).to(device), dtype, scale, out=out)
    assert y.data_ptr() == out.data_ptr()
    np.testing.assert_array_equal(half_bits(y), ref_to_half(x, scale, dtype))
    np.testing.assert_array_equal(half_bits(buf[n:]), tail)  # nothing past the end
    assert int(flag) == 0
    # within half an ulp of the float64 value (x*scale stays in range here)
    v64 = x.astype(np.float64) * np.float32(scale).astype(np.float64)
    rel = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8
    got = y.cpu().double().numpy()
    tiny = 2.0 ** -24 if dtype == torch.float16 else 0.0
    big = np.abs(v64) < (60000 if dtype == torch.float16 else 3e38)
    assert np.all(np.abs(got - v64)[big] <= rel * np.abs(v64)[big] * 1.0001 + tiny)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_nonfinite_flag(device, dtype):
    n = 1000
    base = np.linspace(-1, 1, n, dtype=np.float32)
    for where in [0, 7, 8, 15, 16, 999]:
        for bad in [np.inf, -np.inf, np.nan, 7e4 if dtype == torch.float16 else 3.4e38]:
            x = base.copy()
            x[where] = bad
            scale = 1.0 if dtype == torch.float16 or np.isnan(bad) or np.isinf(bad) else 2.0
            _, flag = K.cast_to_half(torch.from_numpy(x).to(device), dtype, scale)
            assert int(flag) == 1, (where, bad)
    # overflow caused by the scale alone
    x = np.full(33, 1000.0, np.float32)
    _, flag = K.cast_to_half(torch.from_numpy(x).to(device), torch.float16, 100.0)
    assert int(flag) == 1
    _, flag = K.cast_to_half(torch.from_numpy(x).to(device), torch.float16, 0.01)
    assert int(flag) == 0
    # largest finite fp16 is fine; the first value that rounds to inf is not
    for v, want in [(65504.0, 0), (65519.0, 0), (65520.0, 1)]:
        _, flag = K.cast_to_half(torch.tensor([v] * 17, device=device), torch.float16)
        assert int(flag) == want, v
    _, flag = K.cast_to_half(torch.empty(0, device=device), torch.float16)
    assert int(flag) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("n", SIZES)
def test_cast_to_float_and_round_trip(device, dtype, n):
    x = rng_data(n, n + 1, spread=2.0)
    h, _ = K.cast_to_half(torch.from_numpy(x).to(device), dtype, 0.5)
    out, buf = poisoned(n, torch.float32, device, float("nan"))
    y = K.cast_to_float(h, 2.0, out=out)
    # widening is exact: float(h) * 2 equals torch's widening times 2
    np.testing.assert_array_equal(y.cpu().numpy(), h.cpu().float().numpy() * np.float32(2.0))
    assert torch.isnan(buf[n:]).all()
    # round trip within the half type's rounding
    rel = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8
    normal = np.abs(x) * 0.5 >= 2.0 ** -14  # fp16 normal range (bf16 has float32's)
    xs = x[normal]
    ys = y.cpu().numpy()[normal]
    assert np.all(np.abs(ys.astype(np.float64) - xs) <= rel * np.abs(xs) * 1.0001)


def test_cast_special_values(device):
    vals = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 6e-8, -6e-8, 1e-40, 65504, -65504, 1e5], np.float32)
    for dtype in (torch.float16, torch.bfloat16):
        y, _ = K.cast_to_half(torch.from_numpy(vals).to(device), dtype)
        want = torch.from_numpy(vals).to(dtype)
        np.testing.assert_array_equal(half_bits(y)[~np.isnan(vals)], half_bits(want)[~np.isnan(vals)])
        assert torch.isnan(y.cpu()[4].float())
        back = K.cast_to_float(y)
        np.testing.assert_array_equal(back.cpu().numpy(), y.cpu().float().numpy())
    # every fp16 bit pattern widens exactly (subnormals, inf, NaN)
    allh = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    got = K.cast_to_float(allh.to(device)).cpu()
    want = allh.float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("n", [0, 1, 9, 33, 1000, (1 << 18) + 3])
def test_accumulate(device, dtype, n):
    acc0 = rng_data(n, 3 * n + 1)
    h = torch.from_numpy(rng_data(n, 3 * n + 2)).to(dtype)
    buf = torch.full((n + 11,), 123.0, device=device)
    buf[:n] = torch.from_numpy(acc0).to(device)
    K.accumulate_(buf[:n], h.to(device))
    want = acc0 + h.float().numpy()  # float32 addition, one rounding
    np.testing.assert_array_equal(buf[:n].cpu().numpy(), want)
    assert (buf[n:].cpu() == 123.0).all()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 100000), seed=st.integers(0, 2 ** 31), scale=st.sampled_from([1.0, 0.125, 1 / 7, 3.0]),
       bf=st.booleans())
def test_cast_property(n, seed, scale, bf):
    dtype = torch.bfloat16 if bf else torch.float16
    x = rng_data(n, seed, spread=4.0)
    y, flag = K.cast_to_half(torch.from_numpy(x), dtype, scale)
    ref = ref_to_half(x, scale, dtype)
    np.testing.assert_array_equal(half_bits(y), ref)
    absbits = ref & 0x7FFF
    want_flag = bool(np.any(absbits >= (0x7C00 if dtype == torch.float16 else 0x7F80)))
    assert int(flag) == int(want_flag)


def test_multithreaded_matches_single(device):
    if device != "cpu":
        pytest.skip("OpenMP threads are a CPU matter")
    n = (1 << 20) + 77  # above the parallel threshold
    x = torch.from_numpy(rng_data(n, 5))
    old = K.cpu_threads()
    try:
        K.set_cpu_threads(1)
        a, fa = K.cast_to_half(x, torch.float16, 0.5)
        K.set_cpu_threads(2)
        b, fb = K.cast_to_half(x, torch.float16, 0.5)
        x2 = x.clone()
        x2[n - 1] = float("inf")
        _, fc = K.cast_to_half(x2, torch.float16, 0.5)
    finally:
        K.set_cpu_threads(old if old else 0)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert int(fa) == int(fb) == 0 and int(fc) == 1


def test_errors():
    with pytest.raises(TypeError, match="input must be Float"):
        K.cast_to_half(torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype must be torch.float16 or torch.bfloat16, got torch.float32"):
        K.cast_to_half(torch.ones(3), torch.float32)
    with pytest.raises(ValueError, match="out has 2 elements, expected 3"):
        K.cast_to_half(torch.ones(3), out=torch.empty(2, dtype=torch.float16))
    with pytest.raises(TypeError, match="input must be float16 or bfloat16"):
        K.cast_to_float(torch.ones(3))
    with pytest.raises(ValueError, match="not contiguous"):
        K.cast_to_half(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="input has 2 elements, expected 3"):
        K.accumulate_(torch.zeros(3), torch.ones(2, dtype=torch.float16))


@pytest.mark.parametrize("offset", [1, 3])
def test_unaligned_views(device, offset):
    n = 10007
    x = rng_data(n, offset)
    xb = torch.zeros(n + offset, device=device)
    xb[offset:] = torch.from_numpy(x).to(device)
    yb = torch.zeros(n + 2 * offset, dtype=torch.float16, device=device)
    y, flag = K.cast_to_half(xb[offset:], torch.float16, 0.5, out=yb[2 * offset:])
    np.testing.assert_array_equal(half_bits(y), ref_to_half(x, 0.5, torch.float16))
    assert (yb[:2 * offset].cpu() == 0).all()
    back = torch.zeros(n + offset, device=device)
    K.cast_to_float(y, 2.0, out=back[offset:])
    np.testing.assert_array_equal(back[offset:].cpu().numpy(), y.cpu().float().numpy() * 2)
    K.accumulate_(back[offset:], y)
    np.testing.assert_array_equal(back[offset:].cpu().numpy(), y.cpu().float().numpy() * 3)
