"""LARS and LAMB under DistributedOptimizer against float64 numpy references, 20 steps.

Every rank trains a small model (2-D weights, biases and a LayerNorm) on its
slice of a global batch; the reference applies the numpy update rule to the
float64 gradient of the whole global batch (the union of the slices). Three
parameter groups with their own lr / weight decay, the default 1-D
exclusion, and a group that overrides it.
"""
import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

import pycomm
from pycomm.optim import LAMB, LARS

from optim_refs import LambRef, LarsRef

PER_RANK = 5
STEPS = 20


def make_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 3))


def batch(step, n):
    rng = np.random.default_rng([11, step, n])
    x = torch.from_numpy(rng.normal(size=(n * PER_RANK, 7)))
    y = torch.from_numpy(rng.integers(0, 3, size=n * PER_RANK))
    return x, y


def groups(model, **hp):
    l1, ln, _, l2 = model
    return [
        {"params": [l1.weight, l1.bias], "lr": hp["lr"] * 2},
        {"params": [ln.weight, ln.bias, l2.weight], "weight_decay": hp["weight_decay"] * 3},
        {"params": [l2.bias], "exclude": False},  # a bias that gets scaling and decay after all
    ]


def flat_groups(opt):
    """Per tensor: (parameter, its group's hyperparameters, excluded)."""
    return [(p, g, opt.excluded(g, p)) for g in opt.param_groups for p in g["params"]]


def run(make_opt, ref_cls, ref_hp, steps=STEPS):
    n, r = pycomm.size(), pycomm.rank()
    model = make_model()
    ref_model = copy.deepcopy(model).double()
    opt = make_opt(model)
    dopt = pycomm.DistributedOptimizer(opt, model.named_parameters())
    entries = flat_groups(opt)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    ref_params = list(ref_model.parameters())
    ref = ref_cls([ref_params[index[id(p)]].detach().numpy() for p, _, _ in entries],
                  [dict(ref_hp(g), excluded=ex) for _, g, ex in entries])
    for s in range(steps):
        x, y = batch(s, n)
        dopt.zero_grad()
        sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
        nn.functional.cross_entropy(model(x[sl].float()), y[sl]).backward()
        dopt.step()
        # reference: float64 gradient of the union batch at the reference's weights
        with torch.no_grad():
            for (p, _, _), w in zip(entries, ref.w):
                ref_params[index[id(p)]].copy_(torch.from_numpy(w))
        ref_model.zero_grad()
        nn.functional.cross_entropy(ref_model(x), y).backward()
        ref.step([ref_params[index[id(p)]].grad.numpy() for p, _, _ in entries])
    return model, entries, ref, dopt


def assert_close(entries, ref, tol):
    worst = 0.0
    for (p, _, _), w in zip(entries, ref.w):
        err = float(np.max(np.abs(p.detach().double().numpy() - w)))
        worst = max(worst, err)
    assert worst <= tol, f"rank {pycomm.rank()}: max deviation from the float64 reference {worst:.3g} > {tol}"
    flat = torch.cat([p.detach().reshape(-1) for p, _, _ in entries])
    lo, hi = flat.clone(), flat.clone()
    pycomm.allreduce(lo, op="min")
    pycomm.allreduce(hi, op="max")
    assert torch.equal(lo, hi), f"rank {pycomm.rank()}: ranks hold different parameters"
    return worst


LARS_HP = dict(lr=0.4, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02, eps=1e-9)
LAMB_HP = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, clamp=(0.0, 10.0))


@pytest.mark.parametrize("fused", [False, True])
def test_lars_matches_numpy(fused):
    model, entries, ref, _ = run(
        lambda m: LARS(groups(m, **LARS_HP), fused=fused, **LARS_HP), LarsRef,
        lambda g: dict(lr=g["lr"], momentum=g["momentum"], weight_decay=g["weight_decay"],
                       eta=g["trust_coefficient"], eps=g["eps"]))
    excluded = [ex for _, _, ex in entries]
    assert excluded == [False, True, True, True, False, False]  # 1-D excluded unless the group says otherwise
    # float32 training against float64: measured max deviation 3.3e-7..7.1e-7 over 20 steps at 1-4 ranks,
    # while the weights move by 0.005..3; bound 5e-6 (7x the largest measured).
    assert_close(entries, ref, 5e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_matches_numpy(fused, bias_correction):
    model, entries, ref, _ = run(
        lambda m: LAMB(groups(m, **LAMB_HP), fused=fused, bias_correction=bias_correction, **LAMB_HP), LambRef,
        lambda g: dict(lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"],
                       bias_correction=g["bias_correction"], clamp=g["clamp"]))
    # measured max deviation 1.6e-7..3.5e-7 over 20 steps at 1-4 ranks, while the weights move by
    # 0.003..0.34; bound 3e-6 (8x the largest measured).
    assert_close(entries, ref, 3e-6)


def test_exclusion_by_predicate_and_none():
    model = make_model()
    opt = LARS(model.parameters(), lr=0.1, exclude=lambda p: p.shape == (13,))
    assert [opt.excluded(opt.param_groups[0], p) for p in model.parameters()] == [False, True, True, True, False,
                                                                                    False]
    opt = LAMB(model.parameters(), exclude=None)
    assert not any(opt.excluded(opt.param_groups[0], p) for p in model.parameters())


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_resume_is_bitwise(name):
    """10 steps, save, 10 more; against load at 10 and 10 more: bitwise the same."""
    n, r = pycomm.size(), pycomm.rank()

    def make(model):
        return (LARS(groups(model, **LARS_HP), **LARS_HP) if name == "lars"
                else LAMB(groups(model, **LAMB_HP), **LAMB_HP))

    def train(model, dopt, steps):
        for s in steps:
            x, y = batch(s, n)
            dopt.zero_grad()
            sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
            nn.functional.cross_entropy(model(x[sl].float()), y[sl]).backward()
            dopt.step()

    model = make_model()
    dopt = pycomm.DistributedOptimizer(make(model), model.named_parameters())
    train(model, dopt, range(10))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": dopt.state_dict()}, buf)
    train(model, dopt, range(10, 20))
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    model2 = make_model()
    model2.load_state_dict(ck["model"])
    dopt2 = pycomm.DistributedOptimizer(make(model2), model2.named_parameters())
    dopt2.load_state_dict(ck["opt"])
    train(model2, dopt2, range(10, 20))
    for (k, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), f"rank {r}: {k} differs after resume"


def test_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError, match="lr must be positive"):
        LARS(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
        LARS(model.parameters(), lr=0.1, momentum=1.0)
    with pytest.raises(TypeError, match="exclude must be None, True, '1d' or a callable"):
        LARS(model.parameters(), lr=0.1, exclude="biases")
    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\)"):
        LAMB(model.parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="clamp must be"):
        LAMB(model.parameters(), clamp=(1.0, 0.5))
