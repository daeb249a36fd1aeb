"""1-bit Adam (Tang et al. 2021) with DeepSpeed's semantics (docs/algorithms.md §3).

The optimizer is the whole data-parallel step; do not wrap it in
DistributedOptimizer (that raises) and do not reduce gradients yourself.

    opt = pycomm.optim.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=400)
    for x, y in data:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

Steps t = 1 .. freeze_step (warm-up), with g the full-precision average of
the ranks' gradients (one float32 allreduce):

    m <- b1 m + (1-b1) g        v <- b2 v + (1-b2) g^2
    w <- w (1 - lr wd) - lr (m / c1) / (sqrt(v / c2) + eps)

c1 = 1 - b1^t, c2 = 1 - b2^t with bias_correction=True (then the warm-up is
exactly torch.optim.AdamW, and torch.optim.Adam for wd = 0), 1 otherwise
(DeepSpeed's form). Steps t > freeze_step (compression stage): v is frozen;
every rank updates its own momentum with its local gradient,
m_k = b1 m + (1-b1) g_k, and m becomes the two-phase 1-bit compressed
average of the m_k with worker and server error feedback (identical on every
rank afterwards); then w <- w (1 - lr wd) - lr (m / c1) / (sqrt(v / c2') + eps)
with c2' = 1 - b2^freeze_step. The compressed average spreads +-scale onto
every element, so two guards apply to the frozen v (docs/training-defaults.md):
where v is 0 (the gradient was exactly 0 at every warm-up step, e.g. the
weights of an input that is always 0) m is held at 0, so w gets no Adam step
instead of m / eps; positive v below variance_floor [0.01] times the tensor's
mean v is raised to that floor (0 turns the floor off). Only the momentum crosses the wire: about
1/32 of a float32 gradient allreduce per step (pycomm's onebit wire format).

Checkpoints: ``state_dict()`` holds m, v, the step count and this rank's
residuals; save it per rank. Weight decay is decoupled (DeepSpeed adds
wd w to the update, which is AdamW's form).
"""
from __future__ import annotations

import math

import torch

from ._common import check_betas, check_positive
from ._onebit import OneBitBase


class OneBitAdam(OneBitBase):
    """1-bit Adam: lr, betas, eps, weight_decay (decoupled), freeze_step (warm-up steps of full-precision Adam),
    bias_correction, algorithm (the warm-up allreduce's algorithm), variance_floor (the frozen v's floor as a
    fraction of each tensor's mean v)."""

    _momentum_name = "OneBitAdam.exp_avg"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 freeze_step: int = 100000, bias_correction: bool = True, algorithm: str = "auto",
                 variance_floor: float = 0.01):
        check_positive("lr", lr, allow_zero=False)
        check_betas(betas)
        check_positive("eps", eps)
        check_positive("weight_decay", weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction))
        super().__init__(params, defaults, freeze_step, algorithm, variance_floor)

    @property
    def frozen(self) -> bool:
        """True once the variance is frozen (the next step compresses)."""
        return self._steps_done() >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.frozen
        if not compress:
            self._average_gradients()
        params, momenta = [], []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].lerp_(g, 1 - b1)  # b1 m + (1-b1) g, as torch.optim.Adam computes it
                if not compress:
                    state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                params.append((group, p))
                momenta.append(state["exp_avg"])
        if compress:
            self._average_momentum(momenta)
            for _, p in params:  # elements never updated in the warm-up stay frozen (docs/training-defaults.md)
                self.hold_dead(self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"])
        for group, p in params:
            state = self.state[p]
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            t = int(state["step"])
            tv = min(t, self.freeze_step) if compress else t
            c1 = 1 - b1 ** t if group["bias_correction"] else 1.0
            c2 = 1 - b2 ** tv if group["bias_correction"] else 1.0
            if wd != 0:
                p.mul_(1 - lr * wd)
            v = self.frozen_variance(state["exp_avg_sq"]) if compress else state["exp_avg_sq"]
            denom = (v.sqrt() / math.sqrt(c2)).add_(eps)
            p.addcdiv_(state["exp_avg"], denom, value=-lr / c1)
        return loss
