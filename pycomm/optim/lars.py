"""LARS: layer-wise adaptive rate scaling (You et al. 2017), with Jia et al.'s exclusions.

Per parameter tensor w with gradient g (docs/algorithms.md §3):

    local_lr = eta * ||w|| / (||g|| + beta ||w|| + eps)     (1 if ||w|| or ||g|| is 0)
    v <- m v + lr * local_lr * (g + beta w)
    w <- w - v

Excluded tensors (by default the 1-D ones: biases, BatchNorm/LayerNorm
weights and offsets; Jia et al. 2018) get neither the LARS scaling nor the
weight decay: v <- m v + lr g. Choose the exclusion by a predicate
(``exclude=``) or per parameter group (``{"params": ..., "exclude": True}``,
which wins over the predicate).

With DistributedOptimizer the norms are taken of the averaged gradient, so
every rank computes the same local_lr. ``fused=True`` runs the norms and the
update of a float32 CPU tensor in pycomm's C++ kernel (one read of w and g
for the norms, one pass for the update) instead of about ten torch ops.
"""
from __future__ import annotations

import torch

from ._common import check_positive, is_excluded, resolve_exclude
from . import _fused


class LARS(torch.optim.Optimizer):
    """LARS with momentum.

    lr: global learning rate. momentum: m. weight_decay: beta.
    trust_coefficient: eta (0.001 in You et al.). eps: added to the
    denominator of local_lr. exclude: None (exclude nothing), True/"1d"
    (default: tensors of dimension <= 1) or callable(param) -> bool.
    fused: use pycomm's fused kernel for float32 CPU tensors.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 0.0, exclude="1d", fused: bool = False):
        check_positive("lr", lr, allow_zero=False)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        check_positive("weight_decay", weight_decay)
        check_positive("trust_coefficient", trust_coefficient, allow_zero=False)
        check_positive("eps", eps)
        self._exclude = resolve_exclude(exclude)
        self.fused = bool(fused)
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, exclude=None)
        super().__init__(params, defaults)

    def excluded(self, group: dict, p: torch.Tensor) -> bool:
        """True if `p` (in `group`) is excluded from LARS scaling and weight decay."""
        return is_excluded(group, p, self._exclude)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
            eta, eps = group["trust_coefficient"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise TypeError("LARS does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                excluded = self.excluded(group, p)
                if self.fused and _fused.applies(self, p, g, buf):
                    _fused.lars_(p, g, buf, lr, m, 0.0 if excluded else wd, eta, eps, not excluded)
                    continue
                if excluded:
                    buf.mul_(m).add_(g, alpha=lr)
                else:
                    w_norm = torch.linalg.vector_norm(p)
                    g_norm = torch.linalg.vector_norm(g)
                    local = torch.where((w_norm > 0) & (g_norm > 0),
                                        eta * w_norm / (g_norm + wd * w_norm + eps), torch.ones_like(w_norm))
                    d = g.add(p, alpha=wd) if wd != 0 else g
                    buf.mul_(m).add_(d * (lr * local))
                p.sub_(buf)
        return loss
