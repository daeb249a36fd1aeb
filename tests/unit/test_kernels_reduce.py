"""dst = dst op src (the ring allreduce's kernel) against numpy float64 / float32."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import pycomm
from kernel_targets import DEVICES, ISAS, NO_CUDA, TARGETS, select_target  # noqa: F401
from pycomm import kernels as K



@pytest.fixture(params=TARGETS)
def target(request):
    yield from select_target(request)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.uint8, torch.int8, torch.int16, torch.bool]
SIZES = [0, 1, 7, 8, 9, 31, 33, 1000, 4099, (1 << 19) + 3]


def data(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 10).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).bool()
    # narrow integers take the low bits: the full range, so sums wrap (numpy's fixed-width arithmetic)
    return torch.randint(-2 ** 20, 2 ** 20, (n,), generator=g, dtype=torch.int64).to(dtype)


def reference(a, b, op):
    """numpy: float32 for fp16/bf16 (combined in fp32, rounded once), native otherwise (integers wrap;
    numpy's add / minimum / maximum on bool are or / and / or, pycomm's bool semantics)."""
    fn = {"sum": np.add, "min": np.minimum, "max": np.maximum}[op]
    if a.dtype in (torch.float16, torch.bfloat16):
        return torch.from_numpy(fn(a.float().numpy(), b.float().numpy())).to(a.dtype)
    return torch.from_numpy(fn(a.numpy(), b.numpy()))


def same(a, b):
    if a.dtype.is_floating_point:
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)])
    return torch.equal(a, b)


@pytest.mark.parametrize("op", ["sum", "min", "max"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("n", SIZES)
def test_reduce(target, dtype, op, n):
    device = target
    a, b = data(n, dtype, n), data(n, dtype, n + 1)
    if dtype.is_floating_point and n > 3:
        a[1], b[2] = float("nan"), float("nan")
    buf = torch.full((n + 9,), 42, dtype=dtype)
    buf[:n] = a
    buf = buf.to(device)
    K.reduce_(buf[:n], b.to(device), op)
    assert same(buf[:n].cpu(), reference(a, b, op))
    assert (buf[n:].cpu() == torch.full((9,), 42, dtype=dtype)).all()  # untouched past n


@pytest.mark.parametrize("n", [0, 1, 15, 17, 5000, (1 << 19) + 1])
@pytest.mark.parametrize("dtype", DTYPES[:4], ids=lambda d: str(d).replace("torch.", ""))
def test_scale(target, dtype, n):
    device = target
    a = data(n, dtype, 1)
    t = a.clone().to(device)
    K.scale_(t, 0.25)
    if dtype in (torch.float16, torch.bfloat16):
        want = (a.float() * 0.25).to(dtype)
    else:
        want = a * 0.25
    assert torch.equal(t.cpu(), want)
    with pytest.raises((TypeError, ValueError), match="integer tensors cannot be scaled"):
        K.scale_(torch.ones(3, dtype=torch.int32, device=device), 0.5)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 100000), dtype=st.sampled_from(DTYPES), op=st.sampled_from(["sum", "min", "max"]),
       seed=st.integers(0, 2 ** 31), isa=st.sampled_from(ISAS), threads=st.sampled_from([1, 2]))
def test_reduce_property(n, dtype, op, seed, isa, threads):
    a, b = data(n, dtype, seed), data(n, dtype, seed + 1)
    d = a.clone()
    K.set_cpu_isa(isa)
    K.set_cpu_threads(threads)
    try:
        K.reduce_(d, b, op)
    finally:
        K.set_cpu_isa("avx512")
        K.set_cpu_threads(0)
    assert same(d, reference(a, b, op))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_half_special_values(target, dtype):
    """Signed zeros, infinities, NaN and fp16 overflow behave as in the float32 reference."""
    vals = [0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), 60000.0, -3.0, 0.0, -0.0, 5.0]
    a = torch.tensor(vals * 3, dtype=dtype)
    b = torch.tensor(list(reversed(vals)) * 3, dtype=dtype)
    for op in ("sum", "min", "max"):
        d = a.clone().to(target)
        K.reduce_(d, b.to(target), op)
        want = reference(a, b, op)
        assert same(d.cpu(), want), op
        nz = ~torch.isnan(want)
        assert torch.equal(d.cpu()[nz].view(torch.int16), want[nz].view(torch.int16)), op
