"""The fused LARS/LAMB kernels against the torch-ops path of the same optimizers, and single-tensor edge cases."""
import numpy as np
import pytest
import torch

from pycomm import _C
from pycomm.optim import LAMB, LARS


def tensors(n, seed, zero_w=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.zeros(n) if zero_w else torch.randn(n, generator=g)
    return w, torch.randn(n, generator=g) * 0.1


# 1 element, odd sizes, and 2^19 + 3 floats (> 1 MiB: the OpenMP path)
SIZES = [1, 7, 1000, 262147, (1 << 19) + 3]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("excluded", [False, True])
def test_lars_fused_matches_torch_ops(n, excluded):
    outs = []
    for fused in (False, True):
        w, g = tensors(n, n)
        p = torch.nn.Parameter(w.clone())
        opt = LARS([{"params": [p], "exclude": excluded}], lr=0.3, momentum=0.9, weight_decay=1e-3,
                   trust_coefficient=0.01, eps=1e-9, fused=fused)
        for k in range(3):
            p.grad = g * (k + 1)
            opt.step()
        outs.append((p.detach().clone(), opt.state[p]["momentum_buffer"].clone()))
    (a, ma), (b, mb) = outs
    # float32 with norms in double (fused) against float32 norms (torch): measured deviation
    # <= 2.9e-7 of the largest element over 3 steps; bound 2e-6.
    scale = float(a.abs().max())
    assert float((a - b).abs().max()) <= 2e-6 * scale
    assert float((ma - mb).abs().max()) <= 2e-6 * max(float(ma.abs().max()), 1e-30)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("excluded", [False, True])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_fused_matches_torch_ops(n, excluded, bias_correction):
    outs = []
    for fused in (False, True):
        w, g = tensors(n, n + 1)
        p = torch.nn.Parameter(w.clone())
        opt = LAMB([{"params": [p], "exclude": excluded}], lr=0.01, weight_decay=0.01,
                   bias_correction=bias_correction, fused=fused)
        for k in range(3):
            p.grad = g * (1 - 0.3 * k)
            opt.step()
        outs.append((p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()))
    (a, ma, va), (b, mb, vb) = outs
    # measured over all cases here: weights 1.0e-7, m 1.9e-7, v 1.3e-7 of the largest element; bounds 10x.
    for x, y in ((a, b), (ma, mb), (va, vb)):
        assert float((x - y).abs().max()) <= 2e-6 * float(y.abs().max())


def test_zero_weight_and_zero_gradient_use_factor_one():
    w, g = torch.zeros(5), torch.ones(5)
    buf = torch.zeros(5)
    local = _C.lars_update_(w, g, buf, 0.5, 0.9, 0.0, 0.001, 0.0, True)
    assert local == 1.0 and torch.equal(w, torch.full((5,), -0.5))
    w, g, m, v = torch.ones(5), torch.zeros(5), torch.zeros(5), torch.zeros(5)
    trust = _C.lamb_update_(w, g, m, v, 0.1, 0.9, 0.999, 1e-6, 0.0, 0.1, 0.001, 0.0, 10.0, True)
    assert trust == 1.0 and torch.equal(w, torch.ones(5))


def test_lamb_trust_ratio_clamp():
    w = torch.full((4,), 100.0)  # ||w|| = 200 > clamp 10
    g = torch.ones(4)
    m, v = torch.zeros(4), torch.zeros(4)
    trust = _C.lamb_update_(w, g, m, v, 0.1, 0.9, 0.999, 0.0, 0.0, 0.1, 0.001, 0.0, 10.0, True)
    # r = m_hat / sqrt(v_hat) = 1 per element, ||r|| = 2: trust = min(200, 10) / 2
    assert trust == pytest.approx(5.0, rel=1e-6)
    assert torch.allclose(w, torch.full((4,), 100.0 - 0.1 * 5.0))


def test_bad_tensors():
    w = torch.zeros(5)
    with pytest.raises(TypeError, match="has dtype Double; the fused update takes float32"):
        _C.lars_update_(w.double(), w, w, 0.1, 0.9, 0.0, 0.001, 0.0, True)
    with pytest.raises(ValueError, match="momentum_buffer has 4 elements, the parameter 5"):
        _C.lars_update_(w, w, torch.zeros(4), 0.1, 0.9, 0.0, 0.001, 0.0, True)
    with pytest.raises(ValueError, match="grad is not contiguous"):
        _C.lamb_update_(w, torch.zeros(10)[::2], w, w, 0.1, 0.9, 0.999, 1e-6, 0.0, 1.0, 1.0, 0.0, 10.0, True)


def test_fused_on_unsupported_dtype_warns_once():
    p = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    opt = LARS([p], lr=0.1, fused=True)
    p.grad = torch.ones(6, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="the fused kernel takes contiguous float32 CPU tensors"):
        opt.step()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
