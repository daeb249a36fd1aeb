"""A deterministic toy problem and plain-numpy references of the synchronous algorithms.

Rank k's loss at step s is l_k(theta) = ||A theta - b||^2 / (2 m) with (A, b)
drawn from (k, s); its gradient is A^T (A theta - b) / m. The references
simulate all N workers in float64 and implement docs/algorithms.md §4 directly.
"""
import numpy as np
import torch
from torch import nn

DIM, M = 7, 4


def theta0():
    return np.random.default_rng(7).normal(size=DIM)


def data(k, s):
    rng = np.random.default_rng([11, k, s])
    return rng.normal(size=(M, DIM)), rng.normal(size=M)


def grad(theta, k, s):
    a, b = data(k, s)
    return a.T @ (a @ theta - b) / M


class Toy(nn.Module):
    """theta split over two parameters (a vector and a matrix) so that flattening is exercised."""

    def __init__(self):
        super().__init__()
        t = torch.from_numpy(theta0())
        self.w = nn.Parameter(t[:3].clone())
        self.v = nn.Parameter(t[3:].reshape(2, 2).clone())

    def theta(self):
        return torch.cat([self.w.reshape(-1), self.v.reshape(-1)])

    def loss(self, k, s):
        a, b = (torch.from_numpy(x) for x in data(k, s))
        r = a @ self.theta() - b
        return (r * r).sum() / (2 * M)


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()


class NpSGD:
    """torch.optim.SGD (dampening 0, no weight decay)."""

    def __init__(self, lr, momentum=0.0, nesterov=False):
        self.lr, self.mu, self.nesterov, self.buf = lr, momentum, nesterov, None

    def step(self, theta, g):
        if self.mu:
            self.buf = g.copy() if self.buf is None else self.mu * self.buf + g
            g = g + self.mu * self.buf if self.nesterov else self.buf
        return theta - self.lr * g

    def momentum_buffers(self):
        return [] if self.buf is None else [self.buf]


class NpAdam:
    """torch.optim.Adam (no amsgrad, no weight decay)."""

    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8):
        self.lr, (self.b1, self.b2), self.eps = lr, betas, eps
        self.m = self.v = None
        self.t = 0

    def step(self, theta, g):
        if self.m is None:
            self.m, self.v = np.zeros_like(g), np.zeros_like(g)
        self.t += 1
        self.m = self.b1 * self.m + (1 - self.b1) * g
        self.v = self.b2 * self.v + (1 - self.b2) * g * g
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        return theta - (self.lr / c1) * self.m / (np.sqrt(self.v) / np.sqrt(c2) + self.eps)


def run_ssgd(n, steps, make_opt):
    theta, opt = theta0(), make_opt()
    for s in range(steps):
        theta = opt.step(theta, np.mean([grad(theta, k, s) for k in range(n)], 0))
    return {"local": [theta] * n, "eval": theta, "syncs": steps}


def local_steps_with_periodic_sync(th, opts, steps, tau, sync):
    """Every worker steps on its own gradient; sync() after every tau steps and once at the end."""
    n = len(th)
    for s in range(steps):
        th[:] = [opts[k].step(th[k], grad(th[k], k, s)) for k in range(n)]
        if (s + 1) % tau == 0:
            sync()
    if steps % tau:
        sync()


def run_ma(n, steps, make_opt, tau):
    th = [theta0() for _ in range(n)]
    opts = [make_opt() for _ in range(n)]
    glob, syncs = theta0(), 0

    def sync():
        nonlocal glob, syncs
        glob = np.mean(th, 0)
        th[:] = [glob.copy() for _ in range(n)]
        syncs += 1

    local_steps_with_periodic_sync(th, opts, steps, tau, sync)
    return {"local": th, "eval": glob, "syncs": syncs}


def run_bmuf(n, steps, make_opt, tau, block_momentum=None, block_lr=1.0, nesterov=True,
             reset_local_momentum=True, warmup_steps=0, moment_sync="average"):
    bm = 1 - 1 / n if block_momentum is None else block_momentum
    th = [theta0() for _ in range(n)]
    opts = [make_opt() for _ in range(n)]
    syncs = 0
    w = wg = delta = None

    def sync():
        nonlocal w, wg, delta, syncs
        wbar = np.mean(th, 0)
        if moment_sync == "average" and isinstance(opts[0], NpAdam):
            m, v = np.mean([o.m for o in opts], 0), np.mean([o.v for o in opts], 0)
            for o in opts:
                o.m, o.v = m.copy(), v.copy()
        if moment_sync == "reset" and isinstance(opts[0], NpAdam):
            for o in opts:
                o.m, o.v = np.zeros_like(o.m), np.zeros_like(o.v)
        if reset_local_momentum:
            for o in opts:
                if isinstance(o, NpSGD) and o.buf is not None:
                    o.buf = np.zeros_like(o.buf)
        g = wbar - wg
        delta = bm * delta + block_lr * g
        w = w + delta
        wg = w + bm * delta if nesterov else w.copy()
        th[:] = [wg.copy() for _ in range(n)]
        syncs += 1

    for s in range(steps):
        if s < warmup_steps:
            g = np.mean([grad(th[0], k, s) for k in range(n)], 0)
            th[:] = [opts[k].step(th[k], g) for k in range(n)]
            syncs += 1
            if s + 1 == warmup_steps:
                w, wg, delta = th[0].copy(), th[0].copy(), np.zeros(DIM)
            continue
        if w is None:
            w, wg, delta = th[0].copy(), th[0].copy(), np.zeros(DIM)
        th[:] = [opts[k].step(th[k], grad(th[k], k, s)) for k in range(n)]
        if (s + 1 - warmup_steps) % tau == 0:
            sync()
    if w is not None and (steps - warmup_steps) % tau:
        sync()
    return {"local": th, "eval": th[0] if w is None else w, "syncs": syncs}


def run_easgd(n, steps, make_opt, tau, beta=0.9, alpha=None):
    alpha = beta / n if alpha is None else alpha
    th = [theta0() for _ in range(n)]
    opts = [make_opt() for _ in range(n)]
    c, syncs = theta0(), 0

    def sync():
        nonlocal c, syncs
        avg = np.mean(th, 0)
        th[:] = [t - alpha * (t - c) for t in th]
        c = (1 - beta) * c + beta * avg
        syncs += 1

    local_steps_with_periodic_sync(th, opts, steps, tau, sync)
    return {"local": th, "eval": c, "syncs": syncs}


def run_admm(n, steps, make_opt, rho, local_steps):
    th = [theta0() for _ in range(n)]
    opts = [make_opt() for _ in range(n)]
    lam = [np.zeros(DIM) for _ in range(n)]
    z, syncs = theta0(), 0

    def sync():
        nonlocal z, syncs
        z = np.mean([th[k] + lam[k] / rho for k in range(n)], 0)
        syncs += 1

    for s in range(steps):
        if s % local_steps == 0:
            lam[:] = [lam[k] + rho * (th[k] - z) for k in range(n)]
        th[:] = [opts[k].step(th[k], grad(th[k], k, s) + lam[k] + rho * (th[k] - z)) for k in range(n)]
        if (s + 1) % local_steps == 0:
            sync()
    if steps % local_steps:
        sync()
    return {"local": th, "eval": z, "syncs": syncs}
