"""numpy references of pycomm.optim's update rules, written from the formulas (docs/algorithms.md §3,
the DeepSpeed 1-bit Adam / 1-bit LAMB procedures), not from pycomm's code.

LARS and LAMB run in float64 on numpy arrays. The 1-bit optimizers are
modelled in float32 where pycomm computes in float32 (the compressed
allreduce comes from compression_ref.two_phase).
"""
from __future__ import annotations

import numpy as np

import compression_ref

F32 = np.float32


def norm(x) -> float:
    return float(np.sqrt(np.sum(np.asarray(x, np.float64) ** 2)))


class LarsRef:
    """groups: list of dicts with lr, momentum, weight_decay, eta, eps and per-tensor 'excluded' flags."""

    def __init__(self, params, groups):
        self.w = [np.array(p, np.float64) for p in params]
        self.groups = groups  # one dict per tensor
        self.v = [np.zeros_like(w) for w in self.w]

    def step(self, grads):
        for i, (w, g, hp) in enumerate(zip(self.w, grads, self.groups)):
            g = np.asarray(g, np.float64)
            if hp["excluded"]:
                d, local = g, 1.0
            else:
                wn, gn = norm(w), norm(g)
                local = hp["eta"] * wn / (gn + hp["weight_decay"] * wn + hp["eps"]) if wn > 0 and gn > 0 else 1.0
                d = g + hp["weight_decay"] * w
            self.v[i] = hp["momentum"] * self.v[i] + hp["lr"] * local * d
            self.w[i] = w - self.v[i]


class LambRef:
    def __init__(self, params, groups):
        self.w = [np.array(p, np.float64) for p in params]
        self.groups = groups
        self.m = [np.zeros_like(w) for w in self.w]
        self.v = [np.zeros_like(w) for w in self.w]
        self.t = 0

    def step(self, grads):
        self.t += 1
        for i, (g, hp) in enumerate(zip(grads, self.groups)):
            g = np.asarray(g, np.float64)
            b1, b2 = hp["betas"]
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            c1, c2 = (1 - b1 ** self.t, 1 - b2 ** self.t) if hp["bias_correction"] else (1.0, 1.0)
            r = (self.m[i] / c1) / (np.sqrt(self.v[i] / c2) + hp["eps"])
            w = self.w[i]
            if hp["excluded"]:
                self.w[i] = w - hp["lr"] * r
                continue
            r = r + hp["weight_decay"] * w
            wn, rn = norm(w), norm(r)
            lo, hi = hp["clamp"]
            trust = min(max(wn, lo), hi) / rn if wn > 0 and rn > 0 else 1.0
            self.w[i] = w - hp["lr"] * trust * r


def split(flat, shapes):
    out, off = [], 0
    for s in shapes:
        n = int(np.prod(s)) if len(s) else 1
        out.append(flat[off:off + n].reshape(s))
        off += n
    return out


def floored(v, fraction=0.01):
    """The frozen variance the compression stage divides by: positive entries below fraction * mean(v) raised to
    it, zeros kept (the optimizers' variance_floor; the mean in float64)."""
    v = np.asarray(v)
    floor = fraction * float(np.mean(v.astype(np.float64)))
    return np.where(v > 0, np.maximum(v, floor), v).astype(v.dtype)


def onebit_adam_step(w, m, v, local_grads, worker_res, server_res, t, freeze_step, hp):
    """One step of 1-bit Adam for flat float32 arrays (all tensors concatenated).

    local_grads[k]: rank k's gradient; worker_res[k], server_res[k]: rank k's residuals.
    Returns (w, m, v, worker_res, server_res). During warm-up (t <= freeze_step) the
    gradient is the float64 mean of the ranks' gradients rounded to float32.
    """
    b1, b2, eps, lr, wd = hp["b1"], hp["b2"], hp["eps"], hp["lr"], hp["wd"]
    n = len(local_grads)
    if t <= freeze_step:
        g = (np.sum([x.astype(np.float64) for x in local_grads], axis=0) / n).astype(F32)
        m = (F32(b1) * m + F32(1 - b1) * g).astype(F32)
        v = (F32(b2) * v + F32(1 - b2) * g * g).astype(F32)
        tv = t
    else:
        ms = [(F32(b1) * m + F32(1 - b1) * x).astype(F32) for x in local_grads]
        if n > 1:
            m, worker_res, server_res, _ = compression_ref.two_phase(ms, worker_res, server_res, average=True)
        else:
            m = ms[0]
        m = np.where(v == 0, F32(0), m).astype(F32)  # never-updated elements (frozen v = 0) take no step
        tv = freeze_step
    c1 = 1 - b1 ** t if hp["bias_correction"] else 1.0
    c2 = 1 - b2 ** tv if hp["bias_correction"] else 1.0
    w = w.astype(np.float64) * (1 - lr * wd)
    vd = v if t <= freeze_step else np.concatenate([floored(x).reshape(-1) for x in split(v, hp["shapes"])]) \
        if "shapes" in hp else floored(v)
    w = (w - lr * (m.astype(np.float64) / c1) / (np.sqrt(vd.astype(np.float64) / c2) + eps)).astype(F32)
    return w, m, v, worker_res, server_res


def onebit_lamb_step(ws, ms, vs, vfs, cfs, lfs, scs, local_grads, worker_res, server_res, t, freeze_step, hp):
    """One step of 1-bit LAMB (DeepSpeed's procedure) on per-tensor float64/float32 numpy arrays.

    ws, ms, vs, vfs: per tensor weight, momentum, variance, fresh variance; cfs: frozen coefficient EMA;
    lfs: last factor; scs: momentum scaling (None before the first compressed step).
    local_grads[k]: rank k's per-tensor gradients. Returns the new (ws, ms, vs, vfs, cfs, lfs, scs,
    worker_res, server_res, coeffs).
    """
    b1, b2, eps, lr, wd = hp["b1"], hp["b2"], hp["eps"], hp["lr"], hp["wd"]
    n = len(local_grads)
    T = len(ws)
    ws, ms, vs, vfs = [w.copy() for w in ws], [m.copy() for m in ms], [v.copy() for v in vs], [v.copy() for v in vfs]
    cfs, lfs = list(cfs), list(lfs)
    coeffs = []
    if t <= freeze_step:
        for i in range(T):
            g = np.sum([lg[i].astype(np.float64) for lg in local_grads], axis=0) / n
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            if t == freeze_step:
                vfs[i] = vs[i].copy()
            u = ms[i] / (np.sqrt(vs[i]) + eps) + wd * ws[i]
            wn, un = norm(ws[i]), norm(u)
            c = min(max(wn / un, hp["min_coeff"]), hp["max_coeff"]) if wn and un else 1.0
            if c != 1.0:
                cfs[i] = hp["coeff_beta"] * cfs[i] + (1 - hp["coeff_beta"]) * c
            coeffs.append(c)
            ws[i] = ws[i] - lr * c * u
        return ws, ms, vs, vfs, cfs, lfs, scs, worker_res, server_res, coeffs
    if scs is None:
        rms = [norm(m) / np.sqrt(m.size) for m in ms]
        united = sum(rms) / T
        scs = [united / r if r > 0 else 1.0 for r in rms]
    m_old = [m.copy() for m in ms]
    per_rank = [np.concatenate([((b1 * ms[i] + (1 - b1) * lg[i]) * scs[i]).reshape(-1) for i in range(T)]).astype(F32)
                for lg in local_grads]
    if n > 1:
        flat, worker_res, server_res, _ = compression_ref.two_phase(per_rank, worker_res, server_res, average=True)
    else:
        flat = per_rank[0]
    ms = [m / scs[i] for i, m in enumerate(split(flat.astype(np.float64), [m.shape for m in ms]))]
    ms = [np.where(vs[i] == 0, 0.0, m) for i, m in enumerate(ms)]  # frozen v = 0: no step
    for i in range(T):
        g_rec = (ms[i] - b1 * m_old[i]) / (1 - b1)
        vfs[i] = b2 * vfs[i] + (1 - b2) * g_rec * g_rec
        denom = np.sqrt(floored(vs[i])) + eps
        prelim = ms[i] / denom
        u = prelim + wd * ws[i]
        f = float(np.max(denom / (np.sqrt(vfs[i]) + eps)))
        if wd > 0:
            un = norm(u)
            ratio = min(1.0, norm(prelim) / un) if un > 0 else 1.0
            f = f * ratio + (1 - ratio)
        f = min(max(f, hp["factor_min"]), hp["factor_max"])
        f = min(max(f, lfs[i] * (1 - hp["factor_threshold"])), lfs[i] * (1 + hp["factor_threshold"]))
        lfs[i] = f
        c = cfs[i] * f
        coeffs.append(c)
        ws[i] = ws[i] - lr * c * u
    return ws, ms, vs, vfs, cfs, lfs, scs, worker_res, server_res, coeffs


def measured(label: str, value: float) -> float:
    """Return `value`; with PYCOMM_TEST_MEASURE=1 also print it (how the tolerances were measured:
    PYCOMM_TEST_MEASURE=1 pytest -s ...)."""
    import os

    if os.environ.get("PYCOMM_TEST_MEASURE"):
        import pycomm

        print(f"MEASURE {label} size={pycomm.size()} rank={pycomm.rank()}: {value:.3g}", flush=True)
    return value
