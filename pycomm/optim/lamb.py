"""LAMB: layer-wise adaptive moments (You et al. 2019).

Per parameter tensor w with gradient g at step t (docs/algorithms.md §3):

    m <- b1 m + (1 - b1) g            v <- b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t)            v_hat = v / (1 - b2^t)      (bias_correction=True)
    r = m_hat / (sqrt(v_hat) + eps) + lambda w
    trust = phi(||w||) / ||r||        (1 if either norm is 0);  phi(z) = min(max(z, c_lo), c_hi)
    w <- w - lr * trust * r

Excluded tensors (default: the 1-D ones, biases and normalisation
parameters) get no weight decay and trust = 1 (a plain Adam step), as
in the reference implementation's exclude_from_weight_decay and
exclude_from_layer_adaptation. ``{"params": ..., "exclude": bool}`` in a
parameter group wins over the predicate.
"""
from __future__ import annotations

import math

import torch

from ._common import check_betas, check_positive, is_excluded, resolve_exclude
from . import _fused


def phi(norm: torch.Tensor, clamp) -> torch.Tensor:
    lo, hi = clamp
    return norm.clamp(min=lo, max=hi)


def trust_ratio(w_norm: torch.Tensor, r_norm: torch.Tensor, clamp) -> torch.Tensor:
    """phi(||w||)/||r||, or 1 where either norm is zero."""
    ok = (w_norm > 0) & (r_norm > 0)
    return torch.where(ok, phi(w_norm, clamp) / torch.where(ok, r_norm, torch.ones_like(r_norm)),
                       torch.ones_like(w_norm))


class LAMB(torch.optim.Optimizer):
    """LAMB.

    lr, betas=(b1, b2), eps, weight_decay (lambda, decoupled: added to r),
    bias_correction, clamp=(c_lo, c_hi) for phi (default (0, 10)),
    exclude: None, True/"1d" (default) or callable(param) -> bool;
    fused: pycomm's fused kernel for float32 CPU tensors.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 bias_correction: bool = True, clamp=(0.0, 10.0), exclude="1d", fused: bool = False):
        check_positive("lr", lr, allow_zero=False)
        check_betas(betas)
        check_positive("eps", eps)
        check_positive("weight_decay", weight_decay)
        if not (isinstance(clamp, (tuple, list)) and len(clamp) == 2 and 0 <= clamp[0] < clamp[1]):
            raise ValueError(f"clamp must be (lo, hi) with 0 <= lo < hi, got {clamp!r}")
        self._exclude = resolve_exclude(exclude)
        self.fused = bool(fused)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction), clamp=tuple(float(c) for c in clamp), exclude=None)
        super().__init__(params, defaults)

    def excluded(self, group: dict, p: torch.Tensor) -> bool:
        return is_excluded(group, p, self._exclude)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            clamp = group["clamp"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise TypeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = int(state["step"].item())
                c1 = 1.0 - b1 ** t if group["bias_correction"] else 1.0
                c2 = 1.0 - b2 ** t if group["bias_correction"] else 1.0
                m, v = state["exp_avg"], state["exp_avg_sq"]
                excluded = self.excluded(group, p)
                if self.fused and _fused.applies(self, p, g, m, v):
                    _fused.lamb_(p, g, m, v, lr, b1, b2, eps, 0.0 if excluded else wd, c1, c2,
                                 clamp[0], clamp[1], not excluded)
                    continue
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                r = (m / c1) / ((v / c2).sqrt_().add_(eps))
                if excluded:
                    p.sub_(r, alpha=lr)
                    continue
                if wd != 0:
                    r.add_(p, alpha=wd)
                trust = trust_ratio(torch.linalg.vector_norm(p), torch.linalg.vector_norm(r), clamp)
                p.sub_(r * (lr * trust))
        return loss
