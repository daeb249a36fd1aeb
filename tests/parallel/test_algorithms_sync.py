"""The synchronous algorithms against plain-numpy references of their formulas, identities, state.

Every rank runs the algorithm on its own data of the toy problem in
algo_refs.py and compares its local model and the evaluated (global) model
with the float64 reference that simulates all N workers.
"""
import numpy as np
import pytest
import torch

import pycomm
from pycomm import training

from algo_refs import NpAdam, NpSGD, Toy, flat, run_admm, run_bmuf, run_easgd, run_ma, run_ssgd

TOL = 1e-10


def run_torch(name, make_opt, steps, finalize=True, **cfg):
    r = pycomm.rank()
    model = Toy().double()
    algo = training.create(name, model, make_opt(model.parameters()), **cfg)
    for s in range(steps):
        algo.zero_grad()
        model.loss(r, s).backward()
        algo.step()
    if finalize:
        algo.finalize()
    return model, algo


def check(name, make_opt, np_opt, ref_fn, steps, ref_kw, **cfg):
    n, r = pycomm.size(), pycomm.rank()
    model, algo = run_torch(name, make_opt, steps, **cfg)
    ref = ref_fn(n, steps, np_opt, **ref_kw)
    local, ev = flat(model.parameters()), flat(algo.eval_parameters())
    scale = 1 + np.abs(ref["eval"]).max()
    err_l = np.abs(local - ref["local"][r]).max() / scale
    err_e = np.abs(ev - ref["eval"]).max() / scale
    assert err_l < TOL, f"rank {r}/{n} {name} {cfg}: local model differs from the numpy reference by {err_l:.3g}"
    assert err_e < TOL, f"rank {r}/{n} {name} {cfg}: evaluated model differs from the reference by {err_e:.3g}"
    assert algo.num_syncs == ref["syncs"], f"{name}: {algo.num_syncs} syncs, reference {ref['syncs']}"
    return model, algo


def sgd(lr=0.1, momentum=0.0, nesterov=False):
    return (lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=nesterov),
            lambda: NpSGD(lr, momentum, nesterov))


def adam(lr=0.05):
    return lambda ps: torch.optim.Adam(ps, lr=lr), lambda: NpAdam(lr)


def test_ssgd():
    t, n = sgd(0.1, 0.9, nesterov=True)
    _, algo = check("ssgd", t, n, run_ssgd, 7, {})
    n = pycomm.size()
    assert algo.bytes_reduced == 7 * 7 * 8  # 7 steps of 7 float64 gradients
    assert algo.bytes_sent == 7 * ((2 * (n - 1) * 7 * 8) // n)  # ring: 2(N-1)/N of the payload per step


def test_model_averaging():
    t, n = sgd(0.1, 0.5)
    check("model_averaging", t, n, run_ma, 8, {"tau": 3}, sync_period=3)  # two blocks + a final partial one


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("reset", [False, True])
def test_bmuf_sgd(nesterov, reset):
    t, n = sgd(0.1, 0.7)
    kw = dict(block_momentum=0.5, block_lr=0.8, nesterov=nesterov, reset_local_momentum=reset, warmup_steps=2)
    check("bmuf", t, n, run_bmuf, 11, dict(tau=3, **kw), sync_period=3, **kw)


def test_bmuf_defaults_block_momentum():
    t, n = sgd(0.05, 0.9)
    _, algo = check("bmuf", t, n, run_bmuf, 9, {"tau": 4}, sync_period=4, warmup_steps=0)
    assert algo.block_momentum == pytest.approx(1 - 1 / pycomm.size())


@pytest.mark.parametrize("moment_sync", ["average", "keep", "reset"])
def test_bmuf_adam(moment_sync):
    t, n = adam()
    kw = dict(moment_sync=moment_sync, warmup_steps=1, nesterov=True)
    _, algo = check("bmuf", t, n, run_bmuf, 8, dict(tau=3, **kw), sync_period=3, **kw)
    steps = {int(s["step"]) for s in algo.local_optimizer.state.values()}
    assert steps == {8}, "Adam's step counter counts every local step"


def test_easgd():
    t, n = sgd(0.1, 0.5)
    check("easgd", t, n, run_easgd, 9, {"tau": 2}, sync_period=2)
    check("easgd", t, n, run_easgd, 5, {"tau": 1, "beta": 0.5, "alpha": 0.3}, sync_period=1, beta=0.5, alpha=0.3)


def test_admm():
    t, n = sgd(0.1, 0.0)
    check("admm", t, n, run_admm, 10, {"rho": 0.5, "local_steps": 3}, rho=0.5, local_steps=3)
    t, n = sgd(0.05, 0.9)
    check("admm", t, n, run_admm, 6, {"rho": 2.0, "local_steps": 2}, rho=2.0, local_steps=2)


# -- identities ----------------------------------------------------------------

def close(a, b, tol=1e-12):
    a, b = list(a), list(b)
    return np.abs(flat(a) - flat(b)).max() <= tol * (1 + np.abs(flat(b)).max())


def test_bmuf_without_momentum_is_model_averaging():
    t, _ = sgd(0.1, 0.5)
    for nesterov in (False, True):
        bm, ab = run_torch("bmuf", t, 10, sync_period=3, block_momentum=0.0, block_lr=1.0, nesterov=nesterov,
                           reset_local_momentum=False, warmup_steps=0)
        ma, am = run_torch("model_averaging", t, 10, sync_period=3)
        assert close(bm.parameters(), ma.parameters()) and close(ab.eval_parameters(), am.eval_parameters())


def test_model_averaging_every_step_with_sgd_is_ssgd():
    t, _ = sgd(0.2)
    ma, _ = run_torch("model_averaging", t, 6, sync_period=1)
    ss, _ = run_torch("ssgd", t, 6)
    assert close(ma.parameters(), ss.parameters())


@pytest.mark.skipif("pycomm.size() != 1", reason="one-rank identity")
@pytest.mark.parametrize("name,cfg", [
    ("ssgd", {}), ("model_averaging", {"sync_period": 1}),
    ("bmuf", {"sync_period": 1, "warmup_steps": 0, "reset_local_momentum": False}),
    ("easgd", {"sync_period": 1, "alpha": 0.0, "beta": 1.0}),  # on one rank the elastic pull must be off
    ("admm", {"local_steps": 1, "rho": 0.7}),
])
def test_one_rank_is_local_training(name, cfg):
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    model, algo = run_torch(name, make, 7, **cfg)
    ref = Toy().double()
    opt = make(ref.parameters())
    for s in range(7):
        opt.zero_grad()
        ref.loss(0, s).backward()
        opt.step()
    assert close(model.parameters(), ref.parameters()) and close(algo.eval_parameters(), ref.parameters())


# -- state ---------------------------------------------------------------------

@pytest.mark.parametrize("name,cfg,opt", [
    ("ssgd", {}, "sgd"), ("model_averaging", {"sync_period": 3}, "sgd"),
    ("bmuf", {"sync_period": 3, "warmup_steps": 2}, "sgd"), ("bmuf", {"sync_period": 2, "warmup_steps": 0}, "adam"),
    ("easgd", {"sync_period": 2}, "sgd"), ("admm", {"local_steps": 3}, "sgd"),
])
def test_state_dict_resume_is_exact(name, cfg, opt):
    make = sgd(0.1, 0.9)[0] if opt == "sgd" else adam()[0]
    r = pycomm.rank()
    whole, a_whole = run_torch(name, make, 9, finalize=False, **cfg)
    part, a_part = run_torch(name, make, 4, finalize=False, **cfg)  # stopped mid-block
    state = a_part.state_dict()
    model = Toy().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # state must overwrite everything
    algo = training.create(name, model, make(model.parameters()), **cfg)
    algo.load_state_dict(state)
    for s in range(4, 9):
        algo.zero_grad()
        model.loss(r, s).backward()
        algo.step()
    assert torch.equal(torch.from_numpy(flat(model.parameters())), torch.from_numpy(flat(whole.parameters())))
    assert torch.equal(torch.from_numpy(flat(algo.eval_parameters())), torch.from_numpy(flat(a_whole.eval_parameters())))
    assert (algo.num_syncs, algo.bytes_sent, algo.steps) == (a_whole.num_syncs, a_whole.bytes_sent, a_whole.steps)
    with pytest.raises(ValueError, match="cannot load"):
        other = "ssgd" if name != "ssgd" else "admm"
        m2 = Toy().double()
        training.create(other, m2, make(m2.parameters())).load_state_dict(state)
