"""asgd, ssp, dcasgd (both forms), adadelay against a float64 numpy replay.

Under a seeded random order of turns (algo.set_schedule) every worker's step
happens alone, so the asynchronous run is replayed exactly in numpy: worker k's
s-th step computes the toy gradient of algo_refs at the weights it last pulled,
pushes it, and pulls. SSP with s = 0 is checked against plain BSP without any
schedule, and a very large s against the ASGD replay.
"""
import numpy as np
import pytest
import torch

import pycomm
from pycomm import training

from algo_refs import Toy, data, flat, grad, theta0
from ps_ref import NpServer

# The model computes in float32, the replay in float64: with the tolerance set to 1e-12 the first failing
# comparison at 3 ranks read 1.4e-7 to 3.4e-7 relative; 5e-6 leaves margin and still catches any wrong
# staleness, backup or step size (those change results by 1e-3 or more).
TOL = 5e-6


class Toy32(Toy):
    """The toy in float32 (the parameter server holds float32)."""

    def __init__(self):
        super().__init__()
        self.float()

    def loss(self, k, s):
        a, b = (torch.from_numpy(x).float() for x in data(k, s))
        r = a @ self.theta() - b
        return (r * r).sum() / (2 * a.shape[0])


def make(name, lr=0.05, momentum=0.0, weight_decay=0.0, **cfg):
    model = Toy32()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    return model, training.create(name, model, opt, **cfg)


def split(theta):
    return {"w": theta[:3], "v": theta[3:].reshape(2, 2)}


def replay(order, W, rule):
    ref = NpServer(W, **rule)
    t0 = theta0()
    for n, v in split(t0).items():
        ref.init(n, v)
    local = [t0.copy() for _ in range(W)]
    for k in range(W):
        for n in ("w", "v"):
            ref.pull(k, n)
    steps = [0] * W
    for who in order:
        g = grad(local[who], who, steps[who])
        gs = split(g)
        for n in ("w", "v"):
            ref.push(who, n, gs[n])
        local[who] = np.concatenate([ref.pull(who, n).reshape(-1) for n in ("w", "v")])
        steps[who] += 1
    final = np.concatenate([ref.t[n]["w"].reshape(-1) for n in ("w", "v")])
    return local, final, ref


def run(model, algo, k, turns):
    for s in range(turns):
        algo.zero_grad()
        model.loss(k, s).backward()
        algo.step()


def order_for(W, turns, seed=3):
    return np.random.default_rng(seed).integers(0, W, size=turns).tolist()


CASES = {
    "asgd": (dict(momentum=0.9, weight_decay=1e-3), {}, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    "ssp_large_s": (dict(), dict(staleness=10_000), dict(lr=0.05)),
    "dcasgd": (dict(), dict(dc_lambda=0.5), dict(lr=0.05, compensation="constant", dc_lambda=0.5)),
    "dcasgd_adaptive": (dict(momentum=0.5), dict(adaptive=True, lambda0=2.0),
                        dict(lr=0.05, momentum=0.5, compensation="adaptive", dc_lambda=2.0)),
    "adadelay": (dict(), dict(delay_scale=0.3), dict(adadelay=True, adadelay_L=1 / 0.05, adadelay_c=0.3 / 0.05)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_numpy_replay(case):
    opt_kw, cfg, rule = CASES[case]
    name = case.split("_")[0]
    W, k = pycomm.size(), pycomm.rank()
    order = order_for(W, 8 * W + 1)
    model, algo = make(name, **opt_kw, **cfg)
    algo.set_schedule(order)
    run(model, algo, k, order.count(k))
    local, final, ref = replay(order, W, rule)
    scale = 1 + np.abs(final).max()
    err = np.abs(flat(model.parameters()) - local[k]).max() / scale
    assert err < TOL, f"rank {k}/{W} {case}: local model off the replay by {err:.3g}"
    algo.finalize()
    err = np.abs(flat(algo.eval_parameters()) - final).max() / scale
    assert err < TOL, f"rank {k}/{W} {case}: final model off the replay by {err:.3g}"
    st = algo.staleness()
    # every (push, tensor) counted once per server holding a shard: w (3 elements), v (4)
    shards = min(3, W) + min(4, W)
    assert np.array_equal(np.asarray(st["histogram"]), ref.hist // 2 * shards)


def test_ssp_zero_is_bsp():
    """s = 0 without a schedule: theta_{c+1} = theta_c - lr sum_k g_k(theta_c), whatever the timing."""
    W, k = pycomm.size(), pycomm.rank()
    model, algo = make("ssp", lr=0.05, staleness=0)
    steps = 6
    run(model, algo, k, steps)
    theta = theta0()
    for s in range(steps):
        theta = theta - 0.05 * sum(grad(theta, j, s) for j in range(W))
    # float32 sums of W gradients in an arrival order that varies: same float32 error scale as above
    err = np.abs(flat(model.parameters()) - theta).max() / (1 + np.abs(theta).max())
    assert err < TOL, f"rank {k}/{W}: SSP s=0 differs from BSP by {err:.3g}"
    algo.finalize()


def test_state_dict_resumes_exactly():
    W, k = pycomm.size(), pycomm.rank()
    order = order_for(W, 6 * W, seed=5)
    half = len(order) // 2
    model, algo = make("dcasgd", momentum=0.9, adaptive=True)
    algo.set_schedule(order)
    mine_first = order[:half].count(k)
    run(model, algo, k, mine_first)
    state = algo.state_dict()
    def rest():
        for s in range(mine_first, order.count(k)):
            algo.zero_grad()
            model.loss(k, s).backward()
            algo.step()
        algo.ps.barrier()
        out = [p.detach().clone() for p in model.parameters()]
        algo.pull()
        return out, [p.detach().clone() for p in model.parameters()]
    a_local, a_server = rest()
    algo.ps.barrier()
    algo.load_state_dict(state)
    b_local, b_server = rest()
    for x, y in zip(a_local + a_server, b_local + b_server):
        assert torch.equal(x, y), "resumed run differs"
    assert algo.steps == order.count(k)
    algo.finalize()


def test_wrong_local_optimizer():
    model = Toy32()
    with pytest.raises(TypeError, match="asgd: the servers apply SGD; pass torch.optim.SGD .* got Adam"):
        training.create("asgd", model, torch.optim.Adam(model.parameters()))


def test_hogwild_updates_of_every_rank_land():
    """Rank k's gradient touches only elements k, k+N, ...: no two ranks race, so after S steps of
    every rank each element holds exactly w0 - lr S c (float32 of small dyadic numbers: exact)."""
    W, k = pycomm.size(), pycomm.rank()
    if pycomm.num_nodes() != 1:
        pytest.skip("hogwild is one node")
    n, steps, lr = 4 * W + 3, 25, 0.125
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(n))
    algo = training.create("hogwild", model, torch.optim.SGD(model.parameters(), lr=lr))
    c = torch.zeros(n)
    c[k::W] = float(k + 1)
    for _ in range(steps):
        algo.zero_grad()
        (model.w * c).sum().backward()
        algo.step()
    algo.finalize()
    expect = torch.zeros(n)
    for j in range(W):
        expect[j::W] = -lr * steps * (j + 1)
    assert torch.equal(model.w.detach(), expect), f"rank {k}: {model.w.detach()} != {expect}"
    assert algo.num_syncs == 0 and algo.bytes_sent == 0


def test_hybrid_matches_numpy_replay():
    """Groups of 2 ranks (1 at odd sizes) average their gradients, their leaders push and pull in a seeded
    turn order; the replay treats each group as one ASGD worker whose gradient is its members' mean."""
    N, r = pycomm.size(), pycomm.rank()
    gsize = 2 if N % 2 == 0 else 1
    G, g = N // gsize, r // gsize
    order = order_for(G, 6 * G + 1, seed=9)
    model, algo = make("hybrid", momentum=0.9, group_size=gsize)
    algo.set_schedule(order)
    run(model, algo, r, order.count(g))
    rule = dict(lr=0.05, momentum=0.9)
    ref = NpServer(G, **rule)
    t0 = theta0()
    for n, v in split(t0).items():
        ref.init(n, v)
    local = [t0.copy() for _ in range(G)]
    for j in range(G):
        for n in ("w", "v"):
            ref.pull(j, n)
    steps = [0] * G
    for who in order:
        gr = np.mean([grad(local[who], m, steps[who]) for m in range(who * gsize, (who + 1) * gsize)], axis=0)
        for n, v in split(gr).items():
            ref.push(who, n, v)
        local[who] = np.concatenate([ref.pull(who, n).reshape(-1) for n in ("w", "v")])
        steps[who] += 1
    final = np.concatenate([ref.t[n]["w"].reshape(-1) for n in ("w", "v")])
    scale = 1 + np.abs(final).max()
    err = np.abs(flat(model.parameters()) - local[g]).max() / scale
    assert err < TOL, f"rank {r} (group {g}): off the replay by {err:.3g}"
    algo.finalize()
    err = np.abs(flat(algo.eval_parameters()) - final).max() / scale
    assert err < TOL, f"rank {r}: final model off the replay by {err:.3g}"
    assert np.array_equal(np.asarray(algo.staleness()["histogram"]), ref.hist // 2 * (min(3, N) + min(4, N)))
