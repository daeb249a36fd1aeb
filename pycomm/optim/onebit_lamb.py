"""1-bit LAMB (Li et al. 2021) with DeepSpeed's procedure.

The optimizer is the whole data-parallel step, like OneBitAdam.

Warm-up, t = 1 .. freeze_step, g the full-precision average of the ranks'
gradients (one float32 allreduce), per tensor:

    m <- b1 m + (1-b1) g        v <- b2 v + (1-b2) g^2
    u = m / (sqrt(v) + eps) + wd w
    c = clamp(||w|| / ||u||, min_coeff, max_coeff)    (1 if either norm is 0)
    w <- w - lr c u
    c_frozen <- coeff_beta c_frozen + (1 - coeff_beta) c     (where c != 1)

and at t = freeze_step a second variance v_fresh = v is set aside.

Compression stage, t > freeze_step: v and c_frozen are frozen. At the first
such step every tensor gets a momentum scaling s_p = (mean over tensors of
rms(m)) / rms(m_p), so all tensors enter the one flat 1-bit buffer at a
similar magnitude. Then per step:

    m_k = s (b1 m + (1-b1) g_k) on every rank k;  m = (1-bit two-phase average of m_k) / s
    g~ = (m - b1 m_old) / (1-b1);  v_fresh <- b2 v_fresh + (1-b2) g~^2
    u = m / (sqrt(v) + eps) + wd w
    f = max_i (sqrt(v) + eps) / (sqrt(v_fresh) + eps);  with wd: f = f r + (1 - r),
        r = min(1, ||m / (sqrt(v)+eps)|| / ||u||)
    f clamped to [factor_min, factor_max] and to last_f (1 -/+ factor_threshold)
    w <- w - lr c_frozen f u

Where the frozen v is 0 (every warm-up gradient of that element was 0), m is
held at 0 after the average, so the element gets no step and u stays finite
(OneBitBase.hold_dead); positive v below variance_floor [0.01] times the
tensor's mean v is raised to that floor wherever v divides
(OneBitBase.frozen_variance; docs/training-defaults.md).

Simplifications against DeepSpeed: no bias correction (DeepSpeed accepts
the flag and ignores it; so does this class: bias_correction is not offered),
no exp_avg_mask, and the residuals are restored from the checkpoint
(DeepSpeed resets them on load).
"""
from __future__ import annotations

import math

import torch

from ._common import check_betas, check_positive
from ._onebit import OneBitBase


class OneBitLAMB(OneBitBase):
    """1-bit LAMB: lr, betas, eps, weight_decay, freeze_step, max_coeff/min_coeff (trust ratio clamp),
    coeff_beta (EMA of the warm-up trust ratios), factor_max/factor_min/factor_threshold (the
    compression-stage correction), algorithm (warm-up allreduce), variance_floor (the frozen v's floor as a
    fraction of each tensor's mean v)."""

    _momentum_name = "OneBitLAMB.exp_avg"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 freeze_step: int = 100000, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, algorithm: str = "auto", variance_floor: float = 0.01):
        check_positive("lr", lr, allow_zero=False)
        check_betas(betas)
        check_positive("eps", eps)
        check_positive("weight_decay", weight_decay)
        if not 0 < min_coeff <= max_coeff:
            raise ValueError(f"need 0 < min_coeff <= max_coeff, got {min_coeff!r}, {max_coeff!r}")
        if not 0 <= coeff_beta < 1:
            raise ValueError(f"coeff_beta must be in [0, 1), got {coeff_beta!r}")
        if not 0 < factor_min <= 1 <= factor_max:
            raise ValueError(f"need 0 < factor_min <= 1 <= factor_max, got {factor_min!r}, {factor_max!r}")
        check_positive("factor_threshold", factor_threshold)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        self.coeff_beta, self.factor_max, self.factor_min = coeff_beta, factor_max, factor_min
        self.factor_threshold = factor_threshold
        super().__init__(params, defaults, freeze_step, algorithm, variance_floor)
        #: The trust ratios (coefficients) of the last step, one per tensor, in parameter order.
        self.lamb_coeffs = []

    @property
    def frozen(self) -> bool:
        return self._steps_done() >= self.freeze_step

    def _init_state(self, p):
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            state["exp_avg_sq_fresh"] = torch.zeros_like(p)
            # Python floats: torch's load_state_dict would cast float tensors to the parameter's dtype
            state["lamb_coeff_freeze"] = 0.0
            state["last_factor"] = 1.0
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        if not self.frozen:
            self._warmup_step()
        else:
            self._compressed_step()
        return loss

    def _warmup_step(self) -> None:
        self._average_gradients()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state = self._init_state(p)
                g = p.grad
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                if int(state["step"]) == self.freeze_step:
                    state["exp_avg_sq_fresh"].copy_(v)
                u = m / (v.sqrt() + eps)
                if wd > 0:
                    u.add_(p, alpha=wd)
                w_norm, u_norm = float(torch.linalg.vector_norm(p)), float(torch.linalg.vector_norm(u))
                coeff = 1.0
                if w_norm != 0 and u_norm != 0:
                    coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
                if coeff != 1.0:
                    state["lamb_coeff_freeze"] = (self.coeff_beta * state["lamb_coeff_freeze"]
                                                  + (1 - self.coeff_beta) * coeff)
                self.lamb_coeffs.append(coeff)
                p.sub_(u, alpha=lr * coeff)

    def _compressed_step(self) -> None:
        entries = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    entries.append((group, p, self._init_state(p)))
        if entries and "scaling_coeff" not in entries[0][2]:
            # First compression step: bring every tensor's momentum to a common rms.
            rms = [float(torch.linalg.vector_norm(st["exp_avg"])) / math.sqrt(max(p.numel(), 1))
                   for _, p, st in entries]
            united = sum(rms) / len(rms)
            for (_, _, st), r in zip(entries, rms):
                st["scaling_coeff"] = united / r if r > 0 else 1.0
        last = []
        for group, p, st in entries:
            b1 = group["betas"][0]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            st["step"] += 1
            last.append(st["exp_avg"].clone())
            st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1).mul_(float(st["scaling_coeff"]))
        self._average_momentum([st["exp_avg"] for _, _, st in entries])
        for (group, p, st), m_old in zip(entries, last):
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            m = st["exp_avg"].div_(float(st["scaling_coeff"]))
            self.hold_dead(m, st["exp_avg_sq"])  # frozen v = 0: no step there (see OneBitBase.hold_dead)
            g_rec = (m - m_old * b1) / (1 - b1)
            st["exp_avg_sq_fresh"].mul_(b2).addcmul_(g_rec, g_rec, value=1 - b2)
            denom = self.frozen_variance(st["exp_avg_sq"]).sqrt() + eps
            prelim = m / denom
            u = prelim + p * wd if wd > 0 else prelim
            factor = float((denom / (st["exp_avg_sq_fresh"].sqrt() + eps)).max())
            if wd > 0:
                u_norm = float(torch.linalg.vector_norm(u))
                ratio = min(1.0, float(torch.linalg.vector_norm(prelim)) / u_norm) if u_norm > 0 else 1.0
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            lf = float(st["last_factor"])
            factor = min(max(factor, lf * (1.0 - self.factor_threshold)), lf * (1.0 + self.factor_threshold))
            st["last_factor"] = factor
            coeff = float(st["lamb_coeff_freeze"]) * factor
            self.lamb_coeffs.append(coeff)
            p.sub_(u, alpha=lr * coeff)
