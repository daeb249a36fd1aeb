"""Configs of the asynchronous algorithms, the parameter server's update rule and its C++ kernel (one process)."""
import numpy as np
import pytest
import torch

import pycomm
from pycomm import training
from pycomm.ps import UpdateRule


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    pycomm.init()
    yield


@pytest.mark.parametrize("name,cfg,msg", [
    ("ssp", dict(staleness=-1), r"staleness must be an integer >= 0 \(0 is BSP\), got -1"),
    ("ssp", dict(staleness=1.5), r"staleness must be an integer >= 0"),
    ("dcasgd", dict(ms_decay=1.0), r"ms_decay must be in \[0, 1\), got 1.0"),
    ("dcasgd", dict(dc_lambda=-0.1), r"dc_lambda and lambda0 must be >= 0"),
    ("dcasgd", dict(eps=0.0), r"eps must be positive"),
    ("adadelay", dict(delay_scale=-1.0), r"delay_scale must be >= 0"),
    ("asgd", dict(stall_report_s=-1.0), r"stall_report_s must be >= 0"),
    ("asgd", dict(staleness=2), r"option\(s\) staleness do not apply to algorithm 'asgd'"),
    ("hybrid", dict(group_size=-2), r"group_size must be an integer >= 0 \(0: one group per node\)"),
])
def test_config_errors(name, cfg, msg):
    with pytest.raises(ValueError, match=msg):
        training.make_config(name, **cfg)


def test_defaults_from_the_papers():
    d = training.DCASGDConfig()
    assert (d.dc_lambda, d.adaptive, d.lambda0, d.ms_decay, d.eps) == (0.04, False, 2.0, 0.95, 1e-7)
    assert training.SSPConfig().staleness == 3


def test_local_optimizer_checks():
    m = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="no nesterov, dampening or maximize"):
        training.create("asgd", m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True))
    with pytest.raises(TypeError, match=r"float32; parameters \['weight', 'bias'\] are not"):
        md = torch.nn.Linear(3, 2).double()
        training.create("dcasgd", md, torch.optim.SGD(md.parameters(), lr=0.1))


@pytest.mark.parametrize("kw,msg", [
    (dict(compensation="quadratic"), "compensation must be one of none, constant, adaptive"),
    (dict(lr=0.0), "lr must be positive"),
    (dict(momentum=1.0), r"momentum must be in \[0, 1\)"),
    (dict(lr=float("nan")), "lr must be a finite number"),
    (dict(adadelay=True, adadelay_L=0.0), "AdaDelay needs L > 0"),
])
def test_update_rule_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        UpdateRule(**kw)


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 300_001])
@pytest.mark.parametrize("comp", ["none", "constant", "adaptive"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_kernel_against_numpy(n, comp, momentum):
    rng = np.random.default_rng(n + 17)
    w, g, bak, v, ms = (rng.standard_normal(n).astype(np.float32) for _ in range(5))
    ms = np.abs(ms)
    rule = UpdateRule(lr=0.05, momentum=momentum, weight_decay=1e-3, compensation=comp, dc_lambda=0.5)
    tw, tv, tms = torch.from_numpy(w.copy()), torch.from_numpy(v.copy()), torch.from_numpy(ms.copy())
    pycomm._C.ps_update(tw, tv if momentum else None, tms if comp == "adaptive" else None, torch.from_numpy(g),
                        torch.from_numpy(bak) if comp != "none" else None, rule.native())
    W, G, B, V, M = (x.astype(np.float64) for x in (w, g, bak, v, ms))
    d = G + 1e-3 * W
    if comp == "constant":
        d = d + 0.5 * G * G * (W - B)
    elif comp == "adaptive":
        M = 0.95 * M + 0.05 * G * G
        d = d + 0.5 / np.sqrt(M + 1e-7) * G * G * (W - B)
    if momentum:
        V = momentum * V + d
        d = V
    W = W - 0.05 * d
    # one float32 evaluation of a few terms per element: a few ulps (< 1e-6 relative); 2e-6 keeps margin,
    # a wrong term would be off by 1e-3 or more
    assert np.allclose(tw.numpy(), W, rtol=2e-6, atol=2e-6)
    if momentum:
        assert np.allclose(tv.numpy(), V, rtol=2e-6, atol=2e-6)
    if comp == "adaptive":
        assert np.allclose(tms.numpy(), M, rtol=2e-6, atol=2e-6)


def test_kernel_checks_buffers():
    w = torch.zeros(4)
    with pytest.raises(ValueError, match="momentum needs a buffer v"):
        pycomm._C.ps_update(w, None, None, torch.zeros(4), None, UpdateRule(momentum=0.5).native())
    with pytest.raises(TypeError, match="holds float32"):
        pycomm._C.ps_update(w.double(), None, None, torch.zeros(4), None, UpdateRule().native())


def test_adadelay_step():
    assert pycomm._C.adadelay_alpha(20.0, 0.5, 96, 4) == pytest.approx(1 / (20 + 0.5 * 10))
