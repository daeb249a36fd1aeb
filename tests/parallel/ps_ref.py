"""A float64 numpy model of one parameter server holding whole tensors (sharding does not change the math:
every shard sees the same pushes in the same order under a TurnSchedule)."""
import numpy as np

BINS = 64


class NpServer:
    def __init__(self, workers, lr=0.01, momentum=0.0, weight_decay=0.0, compensation="none", dc_lambda=0.04,
                 ms_decay=0.95, eps=1e-7, adadelay=False, adadelay_L=1.0, adadelay_c=0.0):
        self.W = workers
        self.lr, self.mu, self.wd = lr, momentum, weight_decay
        self.comp, self.lam, self.m, self.eps = compensation, dc_lambda, ms_decay, eps
        self.adadelay, self.L, self.c = adadelay, adadelay_L, adadelay_c
        self.t = {}
        self.hist = np.zeros((workers, BINS), dtype=np.int64)

    def init(self, name, w):
        w = np.asarray(w, dtype=np.float64).copy()
        self.t[name] = {"w": w, "v": np.zeros_like(w), "ms": np.zeros_like(w), "version": 0,
                        "pulled": [0] * self.W, "bak": [w.copy() for _ in range(self.W)]}

    def pull(self, k, name):
        s = self.t[name]
        s["pulled"][k] = s["version"]
        s["bak"][k] = s["w"].copy()
        return s["w"].copy()

    def push(self, k, name, g):
        s = self.t[name]
        g = np.asarray(g, dtype=np.float64)
        w = s["w"]
        tau = s["version"] - s["pulled"][k]
        self.hist[k, min(tau, BINS - 1)] += 1
        d = g + self.wd * w
        if self.comp == "constant":
            d = d + self.lam * g * g * (w - s["bak"][k])
        elif self.comp == "adaptive":
            s["ms"] = self.m * s["ms"] + (1 - self.m) * g * g
            d = d + self.lam / np.sqrt(s["ms"] + self.eps) * g * g * (w - s["bak"][k])
        if self.mu != 0:
            s["v"] = self.mu * s["v"] + d
            d = s["v"]
        alpha = 1.0 / (self.L + self.c * np.sqrt(s["version"] + tau)) if self.adadelay else self.lr
        s["w"] = w - alpha * d
        s["version"] += 1
        return tau
