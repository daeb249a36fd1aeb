"""Top-k / threshold selection and scatter kernels (csrc/kernels/sparse.h) against numpy.

acc = x + e is float32 (one rounding), so the selection, the values sent and
the new residual are compared exactly; the scatter's rank-order float32 sum
within (rows + 1) 2^-24 sum |v| of the float64 sum.
"""
import numpy as np
import pytest
import torch

from kernel_targets import DEVICES
from pycomm import kernels as K

SIZES = [0, 1, 2, 7, 31, 257, 1000, 4099, 65536 + 13]


def ref_select(acc, k):
    order = np.lexsort((np.arange(acc.size), -np.abs(acc.astype(np.float64))))
    return np.sort(order[:k])


def draw(n, seed, ties=False):
    g = np.random.default_rng([seed, n])
    x = g.integers(-4, 5, size=n).astype(np.float32) if ties else g.normal(size=n).astype(np.float32)
    e = g.integers(-2, 3, size=n).astype(np.float32) if ties else g.normal(scale=0.5, size=n).astype(np.float32)
    return x, e


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.37, 1.0])
@pytest.mark.parametrize("ties", [False, True])
def test_select_matches_numpy(device, n, frac, ties):
    x, e = draw(n, 1, ties)
    k = int(round(frac * n))
    acc = (x + e).astype(np.float32)
    xt, et = torch.from_numpy(x).to(device), torch.from_numpy(e.copy()).to(device)
    idx, val = K.sparse_select(xt, et, k)
    want = ref_select(acc, k)
    np.testing.assert_array_equal(idx.cpu().numpy(), want)
    np.testing.assert_array_equal(val.cpu().numpy(), acc[want])
    res = acc.copy()
    res[want] = 0
    np.testing.assert_array_equal(et.cpu().numpy(), res)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_are_selected_first(device):
    x = np.array([1.0, np.nan, -np.inf, 3.0, -0.0, 2.0], np.float32)
    xt, et = torch.from_numpy(x).to(device), torch.zeros(6, device=device)
    idx, val = K.sparse_select(xt, et, 2)
    assert idx.cpu().tolist() == [1, 2]
    assert np.isnan(val.cpu().numpy()[0]) and val.cpu().numpy()[1] == -np.inf
    assert K.sparse_count_above(xt, torch.zeros(6, device=device), 2.0) == 4  # nan, -inf, 3, 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("t", [0.0, 0.5, 1.7, 100.0])
def test_count_above_matches_numpy(device, n, t):
    x, e = draw(n, 2)
    acc = (x + e).astype(np.float32)
    got = K.sparse_count_above(torch.from_numpy(x).to(device), torch.from_numpy(e).to(device), t)
    assert got == int(np.sum(np.abs(acc) >= np.float32(t)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,rows,k", [(0, 3, 0), (1, 1, 1), (13, 4, 5), (1001, 3, 100), (65537, 2, 4099)])
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_scatter_matches_numpy(device, n, rows, k, scale):
    g = np.random.default_rng([n, rows, k])
    idx = np.stack([np.sort(g.choice(n, k, replace=False)) for _ in range(rows)]).astype(np.int32) if n else \
        np.zeros((rows, 0), np.int32)
    val = g.normal(size=(rows, k)).astype(np.float32)
    ref = np.zeros(n)
    for r in range(rows):
        np.add.at(ref, idx[r], val[r].astype(np.float64))
    ref *= scale
    out = K.sparse_scatter(torch.from_numpy(idx).to(device), torch.from_numpy(val).to(device), n, scale)
    mag = np.zeros(n)
    for r in range(rows):
        np.add.at(mag, idx[r], np.abs(val[r].astype(np.float64)))
    err = np.abs(out.cpu().numpy().astype(np.float64) - ref)
    assert np.all(err <= (rows + 1) * 2.0 ** -24 * mag + 1e-30)


def test_refusals():
    x = torch.ones(10)
    with pytest.raises(TypeError, match="sparse_select: input must be Float, got Double"):
        K.sparse_select(x.double(), torch.zeros(10), 1)
    with pytest.raises(ValueError, match=r"sparse_select: k must be in \[0, 10\], got 11"):
        K.sparse_select(x, torch.zeros(10), 11)
    with pytest.raises(ValueError, match="sparse_select: residual has 9 elements, expected 10"):
        K.sparse_select(x, torch.zeros(9), 1)
    with pytest.raises(ValueError, match="input and residual must be different tensors"):
        K.sparse_select(x, x, 1)
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        K.sparse_count_above(x, torch.zeros(10), -1.0)
    with pytest.raises(TypeError, match="sparse_scatter: indices must be Int, got Long"):
        K.sparse_scatter(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), 10)
    with pytest.raises(ValueError, match=r"indices \(2, 3\) and values \(2, 2\) differ in shape"):
        K.sparse_scatter(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 2), 10)
