"""--algorithm ec_dnn against a float64 replay of its rounds (every rank's local steps, the
ensemble of the exchanged models, the distillation loss), written from the formula."""
import numpy as np
import pytest
import torch

import pycomm
from pycomm import training

TAU, LR, LAM, T = 2, 0.1, 0.3, 2.0


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()


def batch(step, rank):
    g = np.random.default_rng([step, rank, 17])
    return torch.from_numpy(g.normal(size=(7, 5))), torch.from_numpy(g.integers(0, 3, size=7))


def f(params, x):
    w1, b1, w2, b2 = params
    return torch.tanh(x @ w1.T + b1) @ w2.T + b2


def log_softmax(z):
    m = z.max(-1, keepdim=True).values
    return z - m - torch.log(torch.exp(z - m).sum(-1, keepdim=True))


def ref_loss(params, x, y, teachers):
    out = f(params, x)
    hard = -log_softmax(out)[torch.arange(len(y)), y].mean()
    if teachers is None:
        return hard
    with torch.no_grad():
        ens = torch.stack([torch.exp(log_softmax(f(t, x) / T)) for t in teachers]).mean(0)
    soft = -(ens * log_softmax(out / T)).sum(-1).mean() * T * T
    return (1 - LAM) * hard + LAM * soft


def replay(world, steps, distill_steps):
    """Every rank's parameters after `steps` local SGD steps, and the last exchanged models."""
    init = [p.detach().clone() for p in make_model().parameters()]
    params = [[p.clone() for p in init] for _ in range(world)]
    teachers, left, last = None, 0, [[p.clone() for p in init] for _ in range(world)]
    for s in range(steps):
        for k in range(world):
            x, y = batch(s, k)
            ps = [p.clone().requires_grad_(True) for p in params[k]]
            grads = torch.autograd.grad(ref_loss(ps, x, y, teachers if left > 0 else None), ps)
            params[k] = [p.detach() - LR * g for p, g in zip(ps, grads)]
        left -= 1
        if (s + 1) % TAU == 0:  # the exchange: every rank's model, as it is now
            teachers = [[p.clone() for p in params[k]] for k in range(world)]
            last = teachers
            left = distill_steps
    return params, last


@pytest.mark.parametrize("distill_steps", [None, 1, 0])
def test_rounds_match_float64_replay(distill_steps):
    world, rank = pycomm.size(), pycomm.rank()
    model = make_model()
    algo = training.create("ec_dnn", model, torch.optim.SGD(model.parameters(), lr=LR), sync_period=TAU,
                             distill_weight=LAM, temperature=T, distill_steps=distill_steps)
    steps = 5  # two exchanges and one step after
    for s in range(steps):
        x, y = batch(s, rank)
        algo.zero_grad()
        algo.training_loss(model(x), x, y).backward()
        algo.step()
    want, last = replay(world, steps, TAU if distill_steps is None else distill_steps)
    # float64 against the float64 replay: measured at 1 and 4 ranks, at most 1.1e-16 absolute (4e-12
    # relative only on elements near zero, which atol covers); bounds 1e-12 relative, 1e-13 absolute
    for got, ref in zip(model.parameters(), want[rank]):
        np.testing.assert_allclose(got.detach().numpy(), ref.numpy(), rtol=1e-12, atol=1e-13)
    for got, ref in zip(algo.eval_parameters(), last[0]):  # rank 0's model of the last exchange
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-12, atol=1e-13)
    s_bytes = sum(p.numel() for p in model.parameters()) * 8
    assert algo.num_syncs == 2 and algo.bytes_sent == 2 * (world - 1) * s_bytes
    ens = algo.ensemble_model()
    x, _ = batch(99, 0)
    want_ens = torch.stack([torch.exp(log_softmax(f(t, x) / T)) for t in last]).mean(0)
    np.testing.assert_allclose(ens(x).detach().numpy(), want_ens.numpy(), rtol=1e-12, atol=1e-14)


def test_state_dict_resumes_exactly():
    rank = pycomm.rank()
    runs = []
    for resume in (False, True):
        model = make_model()
        algo = training.create("ec_dnn", model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                 sync_period=TAU, distill_weight=LAM, temperature=T)
        for s in range(7):
            if resume and s == 3:  # mid-round, while distilling: rebuild from the checkpoint
                sd = algo.state_dict()
                model = make_model()
                algo = training.create("ec_dnn", model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                         sync_period=TAU, distill_weight=LAM, temperature=T)
                algo.load_state_dict(sd)
            x, y = batch(s, rank)
            algo.zero_grad()
            algo.training_loss(model(x), x, y).backward()
            algo.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_bad_config():
    with pytest.raises(ValueError, match=r"distill_weight must be in \[0, 1\], got 1.5"):
        training.make_config("ec_dnn", distill_weight=1.5)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        training.make_config("ec_dnn", temperature=0)
    with pytest.raises(ValueError, match="sync_period must be >= 1, got 0"):
        training.make_config("ec_dnn", sync_period=0)
